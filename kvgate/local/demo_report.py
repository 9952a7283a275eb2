"""The demo's workload, its summary (pure), the summary table and the timeline plot."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.admission_service.engine import StepSample
from kvgate.protocol.records import InferenceResult, ResultStatus

_WORDS = [
    "kafka",
    "queue",
    "cache",
    "block",
    "page",
    "token",
    "prefill",
    "decode",
    "loop",
    "depth",
    "executor",
    "priority",
    "bypass",
    "preempt",
    "restore",
    "snapshot",
    "recompute",
    "admission",
    "schedule",
    "step",
    "plan",
    "result",
    "stream",
]


@dataclass(frozen=True)
class DemoRequest:
    request_id: str
    value: bytes
    expects_result: bool  # False for a record whose id cannot be read (only a dead letter)
    shown: str | None = None  # the prompt as the summary shows it (text workloads)


def demo_workload(count: int, *, seed: int = 7, with_bad_input: bool = True) -> list[DemoRequest]:
    """``count`` requests of three priorities, long and short, token ids and text; plus one
    request too large for the cache and one record that is not JSON when ``with_bad_input``
    (both are answered ``rejected``; the records are keyed by request id)."""
    rng = random.Random(seed)
    out: list[DemoRequest] = []
    for i in range(count):
        priority = (0, 1, 2)[i % 3]
        body: dict[str, Any] = {
            "request_id": f"demo-{i:03d}",
            "max_tokens": rng.randint(12, 40),
            "priority": priority,
            "sampling": {"ignore_eos": True, "seed": i, "temperature": 0.0 if i % 2 else 0.7},
        }
        if i % 4 == 3:
            body["prompt"] = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 20)))
        else:
            body["prompt"] = [rng.randint(1, 255) for _ in range(rng.randint(16, 120))]
        out.append(DemoRequest(body["request_id"], json.dumps(body).encode(), True))
    if with_bad_input:
        huge = {"request_id": "demo-too-large", "prompt": [7] * 900, "max_tokens": 16}
        out.append(DemoRequest("demo-too-large", json.dumps(huge).encode(), True))
        # Not JSON: dead-lettered; its key still names it, so it is answered "rejected" too.
        out.append(DemoRequest("demo-malformed", b'{"request_id": "demo-malformed", ', True))
    return out


_PLAIN_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
    "The three primary colours are",
    "Kafka is a distributed event streaming platform that",
    "A recipe for pancakes:\n1.",
    "The planets of the solar system, in order, are",
    "In a paged KV cache, each sequence",
]
_CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a queue is in one sentence.",
    "Write a haiku about autumn.",
    "What is 12 times 7?",
    "Name two planets that have rings.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a friendly robot.",
]


def demo_text_workload(
    count: int, *, seed: int = 7, with_bad_input: bool = True
) -> list[DemoRequest]:
    """``count`` text requests for a real model, three priorities: every other one is a chat
    (``messages`` through the model's template), the rest plain text prompts; half greedy, half
    sampled with a seed. Plus the same two bad records as :func:`demo_workload`."""
    rng = random.Random(seed)
    out: list[DemoRequest] = []
    for i in range(count):
        body: dict[str, Any] = {
            "request_id": f"demo-{i:03d}",
            "max_tokens": rng.randint(16, 40),
            "priority": (0, 1, 2)[i % 3],
            "sampling": {"seed": i, "temperature": 0.0 if i % 4 < 2 else 0.7, "top_p": 0.9},
        }
        if i % 2:
            question = _CHAT_PROMPTS[(i // 2) % len(_CHAT_PROMPTS)]
            body["messages"] = [{"role": "user", "content": question}]
            shown = f"(chat) {question}"
        else:
            body["prompt"] = _PLAIN_PROMPTS[(i // 2) % len(_PLAIN_PROMPTS)]
            shown = body["prompt"]
        out.append(DemoRequest(body["request_id"], json.dumps(body).encode(), True, shown))
    if with_bad_input:
        out += demo_workload(0, with_bad_input=True)
    return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class DemoSummary:
    expected: int
    completed: int = 0
    rejected: int = 0
    other: int = 0
    lost: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    preemptions: int = 0
    restores_by_mode: Counter[str] = field(default_factory=Counter)
    max_bypasses: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def summarize(
    expected_ids: set[str], results: dict[str, InferenceResult], wall_s: float
) -> DemoSummary:
    summary = DemoSummary(expected=len(expected_ids), wall_s=wall_s)
    ttfts: list[float] = []
    for rid in sorted(expected_ids):
        result = results.get(rid)
        if result is None:
            summary.lost.append(rid)
            continue
        if result.status is ResultStatus.COMPLETED:
            summary.completed += 1
        elif result.status is ResultStatus.REJECTED:
            summary.rejected += 1
        else:
            summary.other += 1
        summary.completion_tokens += result.usage.completion_tokens
        if result.timings.time_to_first_token_s is not None:
            ttfts.append(result.timings.time_to_first_token_s)
        scheduling = result.scheduling
        summary.preemptions += scheduling.preemptions
        summary.restores_by_mode.update(mode.value for mode in scheduling.restore_modes)
        summary.max_bypasses = max(summary.max_bypasses, scheduling.bypasses)
    summary.ttft_p50_s = _percentile(ttfts, 0.5)
    summary.ttft_p99_s = _percentile(ttfts, 0.99)
    return summary


def summary_rows(summary: DemoSummary) -> list[tuple[str, str]]:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    restores = ", ".join(f"{m} {n}" for m, n in sorted(summary.restores_by_mode.items())) or "0"
    return [
        ("requests completed", f"{summary.completed} / {summary.expected}"),
        ("requests rejected", str(summary.rejected)),
        ("requests lost", str(len(summary.lost))),
        ("output tokens / s", f"{summary.tokens_per_s:.1f}"),
        ("time to first token p50", seconds(summary.ttft_p50_s)),
        ("time to first token p99", seconds(summary.ttft_p99_s)),
        ("preemptions", str(summary.preemptions)),
        ("restores by mode", restores),
        ("max bypasses of one request", str(summary.max_bypasses)),
        ("wall time", f"{summary.wall_s:.1f} s"),
    ]


def plot_timeline(samples: Sequence[StepSample], kv_blocks_total: int, path: Path) -> None:
    """Queue depth, running requests, KV blocks used and preemptions over steps (PNG)."""
    import matplotlib  # noqa: PLC0415 — only the demo draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = list(range(len(samples)))
    figure, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    series = [
        ("queue depth", [s.waiting for s in samples], "tab:blue"),
        ("running requests", [s.running for s in samples], "tab:green"),
        ("KV blocks used", [s.kv_blocks_used for s in samples], "tab:orange"),
    ]
    for axis, (label, values, color) in zip(axes[:3], series, strict=True):
        axis.step(steps, values, where="post", color=color)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[2].axhline(kv_blocks_total, color="grey", linestyle="--", linewidth=1)
    axes[3].bar(steps, [s.preemptions for s in samples], color="tab:red", width=1.0)
    axes[3].set_ylabel("preemptions")
    axes[3].set_xlabel("step")
    figure.suptitle("kvgate demo: one executor under cache pressure")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
