"""The ``kvgate sim`` report: what ran, what it cost, and whether it was correct."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvgate.sim.runner import RunResult


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class SimReport:
    strategy: str
    total: int
    finished: int
    rejected: int
    unfinished: int
    steps: int
    preemptions: int
    restores: int
    restore_modes: dict[str, int]
    max_bypasses: int
    max_counted_bypasses: int
    max_audited_bypasses: int
    stalled: bool
    leaked_blocks: int
    leaked_snapshots: int
    leaked_executor_requests: int
    invariant_violations: int
    kvgate_invariant_violations: int
    outputs_match_reference: bool
    recomputed_tokens: int
    queueing_steps_p50: float
    queueing_steps_p99: float
    mismatched_requests: list[str] = field(default_factory=list)
    unfinished_requests: list[str] = field(default_factory=list)
    rejections: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    kvgate_violations: list[str] = field(default_factory=list)
    stall_dump: str | None = None

    @property
    def passed(self) -> bool:
        return (
            self.unfinished == 0
            and not self.stalled
            and self.leaked_blocks == 0
            and self.leaked_snapshots == 0
            and self.leaked_executor_requests == 0
            and self.invariant_violations == 0
            and self.outputs_match_reference
        )

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["passed"] = self.passed
        return data

    def to_text(self) -> str:
        rows = [
            ("strategy", self.strategy),
            ("requests", f"{self.finished}/{self.total} finished, {self.rejected} rejected"),
            ("steps", self.steps),
            ("preemptions", self.preemptions),
            ("restores", f"{self.restores} {dict(sorted(self.restore_modes.items()))}"),
            ("recomputed tokens", self.recomputed_tokens),
            (
                "max bypasses (counted/audited)",
                f"{self.max_counted_bypasses}/{self.max_audited_bypasses}",
            ),
            (
                "queueing steps p50/p99",
                f"{self.queueing_steps_p50:.1f}/{self.queueing_steps_p99:.1f}",
            ),
            ("invariant violations", self.invariant_violations),
            ("kvgate invariants it does not promise, broken", self.kvgate_invariant_violations),
            (
                "leaks (blocks/snapshots/requests)",
                f"{self.leaked_blocks}/{self.leaked_snapshots}/{self.leaked_executor_requests}",
            ),
            ("outputs match reference", self.outputs_match_reference),
            ("stalled", self.stalled),
            ("verdict", "PASS" if self.passed else "FAIL"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        for request_id, reason in sorted(self.rejections.items()):
            lines.append(f"rejected {request_id}: {reason}")
        if self.mismatched_requests:
            lines.append(
                "outputs differ from the reference: " + ", ".join(self.mismatched_requests[:10])
            )
        if self.unfinished_requests:
            lines.append("unfinished: " + ", ".join(self.unfinished_requests[:10]))
        for violation in self.violations[:10]:
            lines.append(f"violation: {violation}")
        for violation in self.kvgate_violations[:10]:
            lines.append(f"kvgate invariant (not judged): {violation}")
        return "\n".join(lines)


def build_report(strategy: str, run: RunResult, reference: RunResult | None) -> SimReport:
    outcomes = run.outcomes
    finished = [o for o in outcomes.values() if o.status == "finished"]
    rejected = {o.request_id: o.reason or "" for o in outcomes.values() if o.status == "rejected"}
    unfinished = sorted(o.request_id for o in outcomes.values() if o.status == "unfinished")
    mismatched: list[str] = []
    if reference is not None:
        for outcome in finished:
            expected = reference.outcomes.get(outcome.request_id)
            if expected is None or (expected.output_token_ids, expected.exit_depths) != (
                outcome.output_token_ids,
                outcome.exit_depths,
            ):
                mismatched.append(outcome.request_id)
    stats = [o.event.stats for o in finished if o.event is not None]
    queueing = [
        s.first_admitted_step - s.arrival_step for s in stats if s.first_admitted_step is not None
    ]
    modes: Counter[str] = Counter()
    for s in stats:
        modes.update(mode.value for mode in s.restore_modes)
    counted = max([s.bypasses for s in stats] + [run.max_counted_bypasses])
    audited = max(run.audited_bypasses.values(), default=0)
    return SimReport(
        strategy=strategy,
        total=len(outcomes),
        finished=len(finished),
        rejected=len(rejected),
        unfinished=len(unfinished),
        steps=run.steps,
        preemptions=run.preemptions,
        restores=sum(run.restores.values()),
        restore_modes=dict(modes),
        max_bypasses=max(counted, audited),
        max_counted_bypasses=counted,
        max_audited_bypasses=audited,
        stalled=run.stalled is not None,
        leaked_blocks=run.leaked_blocks,
        leaked_snapshots=run.leaked_snapshots,
        leaked_executor_requests=run.leaked_executor_requests,
        invariant_violations=len(run.invariant_violations),
        kvgate_invariant_violations=len(run.kvgate_violations),
        outputs_match_reference=not mismatched,
        recomputed_tokens=sum(s.recomputed_tokens for s in stats),
        queueing_steps_p50=_percentile(queueing, 50),
        queueing_steps_p99=_percentile(queueing, 99),
        mismatched_requests=mismatched,
        unfinished_requests=unfinished,
        rejections=rejected,
        violations=run.invariant_violations[:20],
        kvgate_violations=run.kvgate_violations[:20],
        stall_dump=run.stalled,
    )
