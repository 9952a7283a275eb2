"""Executor throughput: the paged executor against a plain unpaged forward of the same model.

Decode steps (every row one decode token) and mixed steps (``batch - 1`` decode rows plus one
prefill chunk of another request) at batch 1/8/32, in tokens per second, for

- ``paged``: ``Executor.execute`` — plan validation, paged KV writes and attention through
  ``kvgate.kernels``, sampling, per-request state;
- ``dense``: the same weights and layer code with contiguous per-sequence K/V tensors and
  ``scaled_dot_product_attention`` (what a simple unpaged engine does), greedy argmax.

The ratio paged/dense is measured in the same run: trials of the two alternate, and the table
shows median rates and the median of per-trial ratios. On a GPU a 1B-class config (random weights,
bf16) is measured too, with the share of step time spent in the attention/KV kernels.

Decode steps also show the memory bandwidth they reach: the bytes a step must read (every
weight once, the K and V of every row's context, on average over the measured steps) over the
step time at the paged rate, and with ``--peak-gbs`` its share of that roofline.

    PYTHONPATH=. python benchmarks/bench_executor.py [--threads N] [--steps N] [--gpu-only]
        [--peak-gbs 4800]
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

from kvgate.executor.executor import Executor
from kvgate.executor.loader import load_model
from kvgate.executor.model import LayerAttention, Model
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import step as wire
from kvgate.protocol.enums import DType, ModelFamily

SMALL = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=4096, hidden_size=512, intermediate_size=1408,
    num_layers=4, num_heads=8, num_kv_heads=8, tokenizer=False, max_position_embeddings=8192,
)  # fmt: skip
ONE_B = TinyModelSpec(
    family=ModelFamily.LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, tokenizer=False, dtype="bfloat16",
    max_position_embeddings=8192,
)  # fmt: skip
PROMPT_LEN = 128
CHUNK = 64
BLOCK_SIZE = 16
TRIALS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(step: Callable[[], int], steps: int, device: torch.device) -> float:
    _sync(device)
    began = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    _sync(device)
    return tokens / (time.perf_counter() - began)


def _compare(
    paged: Callable[[], int],
    dense: Callable[[], int],
    *,
    steps: int,
    warmup: int,
    trials: int,
    device: torch.device,
) -> tuple[float, float, float]:
    """Median tokens/s of each, and the median of per-trial ratios. Trials alternate between
    the two so that load from other processes hits both alike."""  # fmt: skip
    for _ in range(warmup):
        paged()
        dense()
    paged_rates, dense_rates = [], []
    for _ in range(trials):
        paged_rates.append(_rate(paged, steps, device))
        dense_rates.append(_rate(dense, steps, device))
    ratios = [p / d for p, d in zip(paged_rates, dense_rates, strict=True)]
    return statistics.median(paged_rates), statistics.median(dense_rates), statistics.median(ratios)


# ------------------------------------------------------------------------------- paged


def _fill_row(rid: str, start: int, end: int, *, completes: bool) -> wire.PrefillRow:
    return wire.PrefillRow(
        request_id=rid, token_start=start, token_end=end, depth_first=1, depth_last=1,
        completes_fill=completes,
    )  # fmt: skip


class PagedRun:
    """Drives an Executor with hand-made plans: decoding requests, plus a prefill feeder whose
    long prompt supplies one chunk per mixed step."""

    def __init__(self, executor: Executor, batch: int, total_steps: int, *, mixed: bool):
        self.ex = executor
        self.step_id = 0
        self.kernel_s = 0.0
        self.execute_s = 0.0
        self.decoders = [f"d{i}" for i in range(batch - 1 if mixed else batch)]
        self.decode_steps = 0
        self.bytes_read = 0  # by the decode steps: weights once each, every row's K and V
        self._weight_bytes = weight_bytes(executor.model)
        cfg = executor.model.config
        element = executor.cache.keys.element_size()
        self._kv_bytes_per_position = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element
        self.mixed = mixed
        self.feeder_pos = 0
        self._free_blocks = iter(range(executor.info.num_blocks))
        vocab = executor.info.vocab_size
        requests, appends, rows = [], [], []
        for rid in self.decoders:
            prompt = [(7 * i + len(rid)) % vocab for i in range(PROMPT_LEN)]
            sampling = wire.SamplingParams(max_tokens=total_steps + 2, ignore_eos=True)
            requests.append(
                wire.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
            )
            appends.append(self._pages(rid, PROMPT_LEN + total_steps + 2))
            rows.append(_fill_row(rid, 0, PROMPT_LEN, completes=True))
        if mixed:
            feeder = [(3 * i) % vocab for i in range(CHUNK * (total_steps + 1))]
            sampling = wire.SamplingParams(max_tokens=1)
            requests.append(
                wire.NewRequest(request_id="feeder", prompt_token_ids=feeder, sampling=sampling)
            )
            appends.append(self._pages("feeder", len(feeder)))
        plan = wire.StepPlan(
            step_id=self._next(), new_requests=requests, block_appends=appends, prefill_rows=rows
        )
        self._run(plan)
        self.kernel_s = self.execute_s = 0.0  # count the measured steps only

    def _pages(self, rid: str, positions: int) -> wire.BlockAppend:
        count = -(-positions // BLOCK_SIZE)
        return wire.BlockAppend(
            request_id=rid, new_block_ids=[[next(self._free_blocks) for _ in range(count)]]
        )

    def _next(self) -> int:
        self.step_id += 1
        return self.step_id

    def _run(self, plan: wire.StepPlan) -> None:
        result = self.ex.execute(plan)
        if result.error is not None:
            raise RuntimeError(f"benchmark plan rejected: {result.error}")
        self.kernel_s += result.timings.kernel_s or 0.0
        self.execute_s += result.timings.execute_s

    def step(self) -> int:
        n = len(self.decoders)
        rows = []
        if self.mixed:
            rows = [_fill_row("feeder", self.feeder_pos, self.feeder_pos + CHUNK, completes=False)]
            self.feeder_pos += CHUNK
        decode = wire.DecodeRows(request_ids=self.decoders, positions=[None] * n, depths=[None] * n)
        self._run(wire.StepPlan(step_id=self._next(), prefill_rows=rows, decode=decode))
        # Each row attends over its prompt, the tokens decoded so far and this one.
        context = PROMPT_LEN + self.decode_steps + 1
        self.bytes_read += self._weight_bytes + n * context * self._kv_bytes_per_position
        self.decode_steps += 1
        return n + (CHUNK if self.mixed else 0)


def weight_bytes(model: Model) -> int:
    """Bytes of the weights one step reads: every layer's tensors, the final norm and the LM
    head (the embedding's rows are gathered, not read whole; a tied head is counted once)."""
    total = model.weights.norm.nbytes + model.weights.lm_head.nbytes
    for layer in model.weights.layers:
        total += sum(tensor.nbytes for tensor in layer.tensors())
    return int(total)


# ------------------------------------------------------------------------------- dense


@dataclass
class _Contiguous:
    """Per-layer K/V ``[B, capacity, Hkv, D]`` of sequences that all hold ``length`` positions."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, model: Model, batch: int, capacity: int) -> _Contiguous:
        cfg = model.config
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)

        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=model.dtype, device=model.device)

        return cls(
            [zeros() for _ in range(cfg.num_layers)], [zeros() for _ in range(cfg.num_layers)]
        )


class DenseRun:
    """The unpaged baseline: contiguous K/V, ``scaled_dot_product_attention``, argmax."""

    def __init__(self, model: Model, batch: int, total_steps: int, *, mixed: bool):
        self.model = model
        self.mixed = mixed
        self.batch = batch - 1 if mixed else batch
        self.decoding = _Contiguous.allocate(
            model, max(self.batch, 1), PROMPT_LEN + total_steps + 2
        )
        self.feeding = _Contiguous.allocate(model, 1, CHUNK * (total_steps + 1))
        self.tokens = torch.zeros(self.batch, dtype=torch.int64, device=model.device)
        if self.batch:
            prompt = torch.arange(PROMPT_LEN, device=model.device) % model.config.vocab_size
            self._forward(prompt.repeat(self.batch, 1), self.decoding)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, kv: _Contiguous) -> torch.Tensor:
        """``tokens [B, n]`` appended to every sequence of ``kv`` -> logits of the last ones."""
        model = self.model
        b, n = tokens.shape
        start = kv.length
        positions = torch.arange(start, start + n, device=model.device).repeat(b)
        mask = None
        if n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=model.device).tril(start)

        def attention(
            layer: int, settings: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            kv.keys[layer][:b, start : start + n] = k.view(b, n, *k.shape[1:])
            kv.values[layer][:b, start : start + n] = v.view(b, n, *v.shape[1:])
            out = F.scaled_dot_product_attention(
                q.view(b, n, *q.shape[1:]).transpose(1, 2),
                kv.keys[layer][:b, : start + n].transpose(1, 2),
                kv.values[layer][:b, : start + n].transpose(1, 2),
                attn_mask=mask,
                scale=settings.softmax_scale,
                enable_gqa=True,
            )
            return out.transpose(1, 2).reshape(b * n, *q.shape[1:])

        hidden = model.core_pass(
            model.embed(tokens.reshape(-1)), positions, start + n - 1, attention
        )
        kv.length += n
        return model.logits(hidden.view(b, n, -1)[:, -1])

    def step(self) -> int:
        produced = 0
        if self.batch:
            self.tokens = self._forward(self.tokens[:, None], self.decoding).argmax(dim=-1)
            produced += self.batch
        if self.mixed:
            chunk = (
                torch.arange(CHUNK, device=self.model.device)[None] % self.model.config.vocab_size
            )
            self._forward(chunk, self.feeding)
            produced += CHUNK
        return produced


# ------------------------------------------------------------------------------ driver


def measure(
    model_dir: Path,
    *,
    device: str,
    dtype: DType,
    batches: list[int],
    steps: int,
    warmup: int,
    peak_gbs: float | None = None,
) -> None:
    loaded = load_model(model_dir, device=device, dtype=dtype)
    torch_device = loaded.model.device
    total = warmup + TRIALS * steps
    print(
        "| step kind | batch | paged tok/s | dense tok/s | paged/dense | kernel share "
        "| decode GB/s | of peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mixed in (False, True):
        for batch in batches:
            per_request = -(-(PROMPT_LEN + total + 2) // BLOCK_SIZE)
            feeder = -(-(CHUNK * (total + 1)) // BLOCK_SIZE)
            executor = Executor(
                loaded, num_blocks=batch * per_request + feeder, block_size=BLOCK_SIZE
            )
            paged = PagedRun(executor, batch, total, mixed=mixed)
            dense = DenseRun(loaded.model, batch, total, mixed=mixed)
            paged_rate, dense_rate, ratio = _compare(
                paged.step, dense.step, steps=steps, warmup=warmup, trials=TRIALS,
                device=torch_device,
            )  # fmt: skip
            share = paged.kernel_s / paged.execute_s
            kind = "mixed" if mixed else "decode"
            bandwidth, of_peak = "—", "—"
            if not mixed:
                # tokens/s over tokens per step = steps/s; times the bytes a step reads.
                gbs = paged.bytes_read / paged.decode_steps * paged_rate / batch / 1e9
                bandwidth = f"{gbs:,.0f}"
                of_peak = f"{gbs / peak_gbs:.0%}" if peak_gbs else "—"
            print(
                f"| {kind} | {batch} | {paged_rate:,.0f} | {dense_rate:,.0f} | {ratio:.2f} | "
                f"{share:.0%} | {bandwidth} | {of_peak} |",
                flush=True,
            )
            del executor, paged, dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU measurement")
    parser.add_argument(
        "--peak-gbs", type=float, help="the GPU's peak memory bandwidth (H200: 4800)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = {"steps": args.steps, "warmup": args.warmup}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.gpu_only:
            print(f"# CPU: 4 layers, hidden 512, 8 heads, fp32, {torch.get_num_threads()} threads;")
            print(f"# prompts of {PROMPT_LEN} tokens; a mixed step adds one {CHUNK}-token chunk")
            make_tiny_model(Path(tmp) / "small", SMALL)
            small = Path(tmp) / "small"
            measure(small, device="cpu", dtype=DType.FLOAT32, batches=[1, 8, 32], **timing)
        if torch.cuda.is_available():
            print(f"# GPU {torch.cuda.get_device_name()}: 16 layers, hidden 2048, 32/8 heads, bf16")
            make_tiny_model(Path(tmp) / "1b", ONE_B)
            big = Path(tmp) / "1b"
            measure(
                big, device="cuda", dtype=DType.BFLOAT16, batches=[1, 8, 32, 128],
                peak_gbs=args.peak_gbs, **timing,
            )  # fmt: skip
        else:
            print("# no CUDA device: GPU figures not measured")


if __name__ == "__main__":
    main()
