"""Structured outputs' cost: decode throughput of JSON-schema requests against the same requests
unconstrained, on SmolLM2-135M (the packaged model) with 32 running, and the grammar mask's share
of a step.

Both runs are the same executor, prompts, seeds and step plans; the constrained run gives each
request the same JSON schema (an array of records with bounded fields and no item limit, so
requests keep decoding through the measured steps) and temperature 1 (the unconstrained one the
same temperature). A row whose request finished is skipped by the executor, so throughput is
tokens actually sampled per second of step time. Trials alternate between the two; the table
shows medians and the median of per-trial ratios.

The mask's share: ``fill`` is the time llguidance spent filling masks (on its worker, while the
forward runs), ``exposed`` the time steps waited for them after their forward, both over the
constrained run's step time.

    PYTHONPATH=. python benchmarks/bench_structured.py [--batch 32] [--steps 24] [--trials 3]
        [--threads N] [--model smollm2|tiny] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgate.executor.executor import Executor
from kvgate.executor.gguf_checkpoint import cached_conversion
from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.packaged import require_packaged_gguf
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol import step as wire
from kvgate.protocol.structured import StructuredOutput

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "score", "tags"],
    },
}
PROMPT = "List some people with a score and tags as JSON:"
BLOCK_SIZE = 16


@dataclass
class Trial:
    tokens: int
    step_s: float  # summed execute time of the measured decode steps
    fill_s: float
    exposed_s: float

    @property
    def rate(self) -> float:
        return self.tokens / self.step_s


def _model(name: str, device: str) -> LoadedModel:
    if name == "smollm2":
        return load_model(cached_conversion(require_packaged_gguf()), device=device)
    directory = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    return load_model(make_tiny_model(directory, TinyModelSpec(seed=3)), device=device)


def _trial(loaded: LoadedModel, *, batch: int, steps: int, constrained: bool, trial: int) -> Trial:
    executor = Executor(loaded, num_blocks=batch * 16, block_size=BLOCK_SIZE)
    assert loaded.tokenizer is not None
    prompt = loaded.tokenizer.encode(PROMPT)
    grammar = StructuredOutput(json_schema=SCHEMA).grammar_spec() if constrained else None
    ids = [f"r{i}" for i in range(batch)]
    pages = -(-(len(prompt) + steps + 2) // BLOCK_SIZE)
    free = iter(range(executor.info.num_blocks))
    requests, appends, rows = [], [], []
    for rid in ids:
        sampling = wire.SamplingParams(
            temperature=1.0, seed=1000 * trial + len(requests), max_tokens=steps + 2,
            grammar=grammar,
        )  # fmt: skip
        requests.append(wire.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
        appends.append(
            wire.BlockAppend(request_id=rid, new_block_ids=[[next(free) for _ in range(pages)]])
        )
        rows.append(
            wire.PrefillRow(request_id=rid, token_start=0, token_end=len(prompt), depth_first=1,
                            depth_last=1, completes_fill=True)
        )  # fmt: skip
    first = executor.execute(
        wire.StepPlan(step_id=1, new_requests=requests, block_appends=appends, prefill_rows=rows)
    )
    assert first.error is None, first.error
    executor.structured.fill_s = executor.structured.exposed_s = 0.0
    tokens, step_s = 0, 0.0
    for step in range(steps):
        decode = wire.DecodeRows(request_ids=ids, positions=[None] * batch, depths=[None] * batch)
        result = executor.execute(wire.StepPlan(step_id=step + 2, decode=decode))
        assert result.error is None, result.error
        tokens += len(result.sampled_tokens())
        step_s += result.timings.execute_s
    return Trial(tokens, step_s, executor.structured.fill_s, executor.structured.exposed_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = _model(args.model, args.device)
    free, constrained = [], []
    _trial(loaded, batch=args.batch, steps=2, constrained=True, trial=99)  # warm-up
    for trial in range(args.trials):
        free.append(
            _trial(loaded, batch=args.batch, steps=args.steps, constrained=False, trial=trial)
        )
        constrained.append(
            _trial(loaded, batch=args.batch, steps=args.steps, constrained=True, trial=trial)
        )
    ratio = statistics.median(c.rate / f.rate for c, f in zip(constrained, free, strict=True))
    fill = statistics.median(c.fill_s / c.step_s for c in constrained)
    exposed = statistics.median(c.exposed_s / c.step_s for c in constrained)
    print(f"structured outputs on {args.model} ({args.device}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}), {args.batch} running, "
          f"{args.steps} decode steps x {args.trials} trials")  # fmt: skip
    print(f"  unconstrained   {statistics.median(f.rate for f in free):8.1f} tokens/s")
    print(f"  JSON schema     {statistics.median(c.rate for c in constrained):8.1f} tokens/s")
    print(f"  ratio           {ratio:8.3f}  (goal >= 0.90)")
    print(f"  mask fill       {100 * fill:7.1f} % of a step (beside the forward)")
    print(f"  mask exposed    {100 * exposed:7.1f} % of a step (waited for after the forward)")
    started = time.strftime("%Y-%m-%d")
    print(f"  date            {started}")


if __name__ == "__main__":
    main()
