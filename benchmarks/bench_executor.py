"""Executor throughput: the paged executor against a plain unpaged forward of the same model.

Decode steps (every row one decode token) and mixed steps (``batch - 1`` decode rows plus one
prefill chunk of another request) at batch 1/8/32, in tokens per second, for

- ``paged``: ``Executor.execute`` — plan validation, paged KV writes and attention through
  ``kvgate.kernels``, sampling, per-request state;
- ``dense``: the same weights and layer code with contiguous per-sequence K/V tensors and
  ``scaled_dot_product_attention`` (what a simple unpaged engine does), greedy argmax.

The ratio paged/dense is measured in the same run. On a GPU a 1B-class config (random weights,
bf16) is measured too, with the share of step time spent in the attention/KV kernels.

    PYTHONPATH=. python benchmarks/bench_executor.py [--threads N] [--steps N] [--gpu-only]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgate.gpu_executor import api
from kvgate.gpu_executor.config import ModelFamily
from kvgate.gpu_executor.executor import Executor
from kvgate.gpu_executor.loader import DType, load_model
from kvgate.gpu_executor.model import Model
from kvgate.gpu_executor.tiny_model import TinyModelSpec, make_tiny_model

SMALL = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=4096, hidden_size=512, intermediate_size=1408,
    num_layers=4, num_heads=8, num_kv_heads=8, tokenizer=False,
)  # fmt: skip
ONE_B = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, tokenizer=False, dtype="bfloat16",
    max_position_embeddings=8192,
)  # fmt: skip
PROMPT_LEN = 128
CHUNK = 64
BLOCK_SIZE = 16


@dataclass
class Figures:
    tokens_per_s: float
    kernel_share: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], int], steps: int, warmup: int, device: torch.device) -> float:
    """Tokens per second over ``steps`` calls (median of three trials) after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(3):
        _sync(device)
        began = time.perf_counter()
        tokens = sum(step() for _ in range(steps))
        _sync(device)
        rates.append(tokens / (time.perf_counter() - began))
    return statistics.median(rates)


# ------------------------------------------------------------------------------- paged


class PagedRun:
    """Drives an Executor with hand-made plans: ``batch`` decoding requests (+ a prefill feeder)."""

    def __init__(self, executor: Executor, batch: int, total_steps: int, mixed: bool):
        self.ex = executor
        self.step_id = 0
        self.kernel_s = 0.0
        self.execute_s = 0.0
        self.decoders = [f"d{i}" for i in range(batch - 1 if mixed else batch)]
        self.mixed = mixed
        pages = -(-(PROMPT_LEN + total_steps + 2) // BLOCK_SIZE)
        feeder_len = CHUNK * (total_steps + 1)
        next_block = iter(range(executor.info.num_blocks))
        requests, appends, rows = [], [], []
        vocab = executor.info.vocab_size
        for rid in self.decoders:
            prompt = [(7 * i + len(rid)) % vocab for i in range(PROMPT_LEN)]
            sampling = api.SamplingParams(max_tokens=total_steps + 2, ignore_eos=True)
            requests.append(
                api.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
            )
            appends.append(
                api.BlockAppend(
                    request_id=rid, new_block_ids=[[next(next_block) for _ in range(pages)]]
                )
            )
            rows.append(api.PrefillRow(request_id=rid, token_start=0, token_end=PROMPT_LEN,
                                       depth_first=1, depth_last=1, completes_fill=True))  # fmt: skip
        if mixed:
            feeder = [(3 * i) % vocab for i in range(feeder_len)]
            requests.append(api.NewRequest(request_id="feeder", prompt_token_ids=feeder,
                                           sampling=api.SamplingParams(max_tokens=1)))  # fmt: skip
            feeder_pages = -(-feeder_len // BLOCK_SIZE)
            appends.append(
                api.BlockAppend(
                    request_id="feeder",
                    new_block_ids=[[next(next_block) for _ in range(feeder_pages)]],
                )
            )
        self._run(
            api.StepPlan(
                step_id=self._next(),
                new_requests=requests,
                block_appends=appends,
                prefill_rows=rows,
            )
        )
        self.feeder_pos = 0

    def _next(self) -> int:
        self.step_id += 1
        return self.step_id

    def _run(self, plan: api.StepPlan) -> api.StepResult:
        result = self.ex.execute(plan)
        if result.error is not None:
            raise RuntimeError(f"benchmark plan rejected: {result.error}")
        self.kernel_s += result.timings.kernel_s or 0.0
        self.execute_s += result.timings.execute_s
        return result

    def step(self) -> int:
        n = len(self.decoders)
        rows = []
        if self.mixed:
            rows = [api.PrefillRow(request_id="feeder", token_start=self.feeder_pos,
                                   token_end=self.feeder_pos + CHUNK, depth_first=1, depth_last=1)]  # fmt: skip
            self.feeder_pos += CHUNK
        decode = api.DecodeRows(request_ids=self.decoders, positions=[None] * n, depths=[None] * n)
        self._run(api.StepPlan(step_id=self._next(), prefill_rows=rows, decode=decode))
        return n + (CHUNK if self.mixed else 0)


# ------------------------------------------------------------------------------- dense


class DenseRun:
    """The unpaged baseline: contiguous ``[B, capacity, Hkv, D]`` K/V per layer, SDPA, argmax."""

    def __init__(self, model: Model, batch: int, total_steps: int, mixed: bool):
        cfg = model.config
        self.model = model
        self.mixed = mixed
        self.batch = batch - 1 if mixed else batch
        capacity = PROMPT_LEN + total_steps + 2
        shape = (max(self.batch, 1), capacity, cfg.num_kv_heads, cfg.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=model.dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        feeder_cap = CHUNK * (total_steps + 1)
        fshape = (1, feeder_cap, cfg.num_kv_heads, cfg.head_dim)
        self.feeder_keys = [
            torch.zeros(fshape, dtype=model.dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.feeder_values = [torch.zeros_like(k) for k in self.feeder_keys]
        self.length = 0
        self.feeder_length = 0
        self.tokens = torch.zeros(self.batch, dtype=torch.int64, device=model.device)
        if self.batch:
            prompt = (
                torch.arange(PROMPT_LEN, device=model.device).repeat(self.batch) % cfg.vocab_size
            )
            self._forward(prompt.view(self.batch, PROMPT_LEN), self.keys, self.values, 0)
            self.length = PROMPT_LEN

    @torch.inference_mode()
    def _forward(
        self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int
    ) -> torch.Tensor:
        """``tokens [B, n]`` at positions start..start+n-1 of every sequence -> logits of the last."""
        model = self.model
        b, n = tokens.shape
        positions = torch.arange(start, start + n, device=model.device).repeat(b)
        group = model.config.num_heads // model.config.num_kv_heads

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            keys[layer][:b, start : start + n] = k.view(b, n, *k.shape[1:])
            values[layer][:b, start : start + n] = v.view(b, n, *v.shape[1:])
            kk = keys[layer][:b, : start + n].transpose(1, 2).repeat_interleave(group, dim=1)
            vv = values[layer][:b, : start + n].transpose(1, 2).repeat_interleave(group, dim=1)
            qq = q.view(b, n, *q.shape[1:]).transpose(1, 2)
            mask = None
            if n > 1:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
            out = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, scale=model.softmax_scale
            )
            return out.transpose(1, 2).reshape(b * n, *q.shape[1:])

        hidden = model.core_pass(
            model.embed(tokens.reshape(-1)), positions, start + n - 1, attention
        )
        return model.logits(hidden.view(b, n, -1)[:, -1])

    def step(self) -> int:
        produced = 0
        if self.batch:
            logits = self._forward(self.tokens[:, None], self.keys, self.values, self.length)
            self.tokens = logits.argmax(dim=-1)
            self.length += 1
            produced += self.batch
        if self.mixed:
            chunk = (
                torch.arange(CHUNK, device=self.model.device)[None] % self.model.config.vocab_size
            )
            self._forward(chunk, self.feeder_keys, self.feeder_values, self.feeder_length)
            self.feeder_length += CHUNK
            produced += CHUNK
        return produced


# ------------------------------------------------------------------------------ driver


def measure(
    model_dir: Path, device: str, dtype: DType, batches: list[int], steps: int, warmup: int
) -> list[str]:
    loaded = load_model(model_dir, device=device, dtype=dtype)
    torch_device = loaded.model.device
    total = warmup + 3 * steps
    lines = ["| step kind | batch | paged tok/s | dense tok/s | paged/dense | kernel share |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for mixed in (False, True):
        for batch in batches:
            pages_needed = (
                batch * (-(-(PROMPT_LEN + total + 2) // BLOCK_SIZE))
                + (total + 2) * CHUNK // BLOCK_SIZE
                + 2
            )
            executor = Executor(loaded, num_blocks=pages_needed, block_size=BLOCK_SIZE)
            paged = PagedRun(executor, batch, total, mixed)
            paged_rate = _timed(paged.step, steps, warmup, torch_device)
            share = paged.kernel_s / paged.execute_s if paged.execute_s else float("nan")
            dense = DenseRun(loaded.model, batch, total, mixed)
            dense_rate = _timed(dense.step, steps, warmup, torch_device)
            kind = "mixed" if mixed else "decode"
            lines.append(
                f"| {kind} | {batch} | {paged_rate:,.0f} | {dense_rate:,.0f} | "
                f"{paged_rate / dense_rate:.2f} | {share:.0%} |"
            )
            print(lines[-1], flush=True)
            del executor, paged, dense
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU measurement")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.gpu_only:
            print(
                f"# CPU, small model (4 layers, hidden 512, 8 heads), fp32, {torch.get_num_threads()} threads"
            )
            print(
                f"# prompt {PROMPT_LEN} tokens, mixed steps carry one {CHUNK}-token prefill chunk"
            )
            make_tiny_model(Path(tmp) / "small", SMALL)
            measure(Path(tmp) / "small", "cpu", DType.FLOAT32, [1, 8, 32], args.steps, args.warmup)
        if torch.cuda.is_available():
            print(
                f"# GPU {torch.cuda.get_device_name()}, 1B-class model (16 layers, hidden 2048, 32/8 heads), bf16"
            )
            make_tiny_model(Path(tmp) / "1b", ONE_B)
            measure(
                Path(tmp) / "1b", "cuda", DType.BFLOAT16, [1, 8, 32, 128], args.steps, args.warmup
            )
        else:
            print("# no CUDA device: GPU figures not measured")


if __name__ == "__main__":
    main()
