"""The plans the tensor-parallel tests drive, shared by the test and its rank processes."""

from __future__ import annotations

from pathlib import Path

from kvgate.executor.loader import LoadedModel
from kvgate.executor.model import Model
from kvgate.executor.tiny_model import TinyModelSpec
from kvgate.protocol import step as wire
from kvgate.protocol.enums import ModelFamily
from kvgate.protocol.structured import GrammarKind, GrammarSpec, StructuredOutput
from tests.executor.driver import DriverConfig
from tests.executor.workloads import mixed_requests

# Heads that divide by two; the llama one has a single KV head (replicated on both ranks), a
# tied LM head and a vocabulary of 127 (the second shard padded by a row); the bytes one has a
# tokenizer, so its requests include grammar-constrained ones (every rank runs the matchers).
TP_SPECS = {
    "llama": TinyModelSpec(
        family=ModelFamily.LLAMA, vocab_size=127, num_kv_heads=1, tie_word_embeddings=True, seed=5
    ),
    "looped": TinyModelSpec(
        family=ModelFamily.LOOPED, num_loops=3, vocab_size=128, exit_gate_bias=-0.3, seed=2
    ),
    "bytes": TinyModelSpec(family=ModelFamily.LLAMA, seed=7),
}
GRAMMARS = {
    "grammar-regex": GrammarSpec(kind=GrammarKind.REGEX, source=r"[0-9]{2,5}-[a-z]{1,4}"),
    "grammar-json": StructuredOutput(
        json_schema={"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                     "b": {"type": "boolean"}}, "required": ["n", "b"]}
    ).grammar_spec(),
}  # fmt: skip

SCENARIOS = {
    "chunked": DriverConfig(chunk_size=5),
    "async": DriverConfig(chunk_size=6, async_plans=True),
    "swap": DriverConfig(chunk_size=5, swap_after={"req-0-0": 2, "req-0-2": 4}),
    "recompute": DriverConfig(chunk_size=5, recompute_after={"req-0-1": 3, "req-0-3": 2}),
    "async-wavefront-swap-recompute": DriverConfig(
        chunk_size=4,
        wavefront=True,
        async_plans=True,
        swap_after={"req-0-0": 3, "req-0-5": 2},
        recompute_after={"req-0-1": 2, "req-0-4": 4},
    ),
}


def tp_requests(model: Model, structured_outputs: bool) -> list[tuple[wire.NewRequest, int]]:
    """The same six requests for the one-process and the two-rank run of a model, and two
    grammar-constrained ones where the executor enforces grammars (``ExecutorInfo``'s flag:
    a model with a tokenizer; a vocabulary alone says nothing, transformers' tiny checkpoints
    have none)."""
    requests = mixed_requests(LoadedModel(model, None, Path()), count=6, seed=0)
    if structured_outputs:
        for i, (rid, grammar) in enumerate(GRAMMARS.items()):
            sampling = wire.SamplingParams(temperature=1.0, seed=i, max_tokens=24, grammar=grammar)
            prompt = [72 + i, 105, 33]
            requests.append(
                (wire.NewRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling), 1 + i)
            )
    return requests
