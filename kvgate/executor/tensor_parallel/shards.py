"""Which slice of every checkpoint tensor a tensor-parallel rank holds (Megatron layout).

```
q_proj, k_proj, v_proj   rows by head           column-parallel: each rank its own heads
qkv_proj (Phi-3)         its q, k and v rows    three ranges, concatenated
gate_up_proj (Phi-3)     its gate and up rows   two ranges, concatenated
q_norm, k_norm over the  by head, as q and k    OLMo 2 (per-head norms are replicated)
whole projection
gate_proj, up_proj       rows by MLP column     column-parallel
o_proj, down_proj        columns (inputs)       row-parallel: partial sums, all-reduced
embed_tokens, lm_head    rows by vocabulary     padded to world_size * ceil(V / world_size)
norms, biases of the     replicated
row-parallel layers,
the exit gate
```
KV heads are split when ``num_kv_heads`` is a multiple of the world size, and replicated when the
world size is a multiple of ``num_kv_heads`` (rank ``r`` then holds KV head
``r // (world_size / num_kv_heads)``, the one its query heads read). Each rank's KV cache holds
its KV heads' K/V under the block tables every rank shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.executor.architecture import QkNorm
from kvgate.executor.config import CheckpointError, ModelConfig


class ShardError(CheckpointError):
    """A model that cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class RowRange:
    """Rows (``dim == 0``) or columns (``dim == 1``) ``[start, stop)`` of a tensor."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    def check(self, config: ModelConfig) -> None:
        """Raise ShardError, in one line, when ``config`` does not split over the world size."""
        n = self.world_size
        flag = f"--tensor-parallel-size {n}"
        if config.num_heads % n:
            raise ShardError(
                f"num_attention_heads {config.num_heads} is not divisible by {flag} "
                f"(choose a size that divides it)"
            )
        if config.num_kv_heads % n and n % config.num_kv_heads:
            raise ShardError(
                f"num_key_value_heads {config.num_kv_heads} and {flag} do not divide one another "
                f"(KV heads are split or replicated whole)"
            )
        if config.intermediate_size % n:
            raise ShardError(
                f"intermediate_size {config.intermediate_size} is not divisible by {flag}"
            )

        refusal = None if config.moe is None else config.moe.shard_refusal(n)
        if refusal is not None:
            raise ShardError(refusal)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shape one rank computes: its heads and MLP columns (the vocabulary stays whole)."""
        self.check(config)
        return config.model_copy(
            update={
                "num_heads": config.num_heads // self.world_size,
                "num_kv_heads": max(config.num_kv_heads // self.world_size, 1),
                "intermediate_size": config.intermediate_size // self.world_size,
                "moe": None if config.moe is None else config.moe.sharded(self.world_size),
            }
        )

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of every rank's vocabulary shard (the last one padded with zero rows)."""
        return -(-vocab_size // self.world_size)

    def vocab_start(self, vocab_size: int) -> int:
        return self.rank * self.vocab_rows(vocab_size)

    def slice_of(self, name: str, config: ModelConfig) -> RowRange | None:
        """This rank's part of tensor ``name`` (full shape per ``config``) when it is one range
        of rows or columns; None: all of it. ValueError for a fused tensor (see parts_of)."""
        parts = self.parts_of(name, config)
        if parts is not None and len(parts) > 1:
            raise ValueError(f"{name} is fused: this rank's part is {len(parts)} ranges")
        return None if parts is None else parts[0]

    def parts_of(self, name: str, config: ModelConfig) -> tuple[RowRange, ...] | None:
        """This rank's part of tensor ``name``: ranges of the same dimension, to be concatenated
        in order (a fused tensor has one per part); None: all of it."""
        kind = name.rsplit(".", 2)[-2]
        d = config.head_dim
        q_width, kv_width = config.num_heads * d, config.num_kv_heads * d
        if kind == "qkv_proj":
            q, kv = self._single("q_proj.weight", config), self._single("k_proj.weight", config)
            assert q is not None and kv is not None
            return (q, _shifted(kv, q_width), _shifted(kv, q_width + kv_width))
        if kind == "gate_up_proj":
            gate = self._single("gate_proj.weight", config)
            assert gate is not None
            return (gate, _shifted(gate, config.intermediate_size))
        whole = config.architecture.qk_norm is QkNorm.WHOLE_PROJECTION
        if kind in ("q_norm", "k_norm") and whole:  # one weight per q (k) row: cut as they are
            return self.parts_of(name.replace("_norm.", "_proj."), config)
        single = self._single(name, config)
        return None if single is None else (single,)

    def _single(self, name: str, config: ModelConfig) -> RowRange | None:
        kind = name.rsplit(".", 2)[-2]
        suffix = name.rsplit(".", 1)[-1]
        d, r = config.head_dim, self.rank
        q_heads = config.num_heads // self.world_size
        if kind == "q_proj":
            return RowRange(0, r * q_heads * d, (r + 1) * q_heads * d)
        if kind in ("k_proj", "v_proj"):
            first, count = self._kv_heads(config)
            return RowRange(0, first * d, (first + count) * d)
        if kind == "o_proj" and suffix == "weight":
            return RowRange(1, r * q_heads * d, (r + 1) * q_heads * d)
        expert_width = None if config.moe is None else config.moe.width_of(name)
        inter = (expert_width or config.intermediate_size) // self.world_size
        if kind in ("gate_proj", "up_proj", "w1", "w3"):  # w1, w3: Mixtral's experts' gate, up
            return RowRange(0, r * inter, (r + 1) * inter)
        if kind in ("down_proj", "w2"):
            return RowRange(1, r * inter, (r + 1) * inter)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            vocab = config.vocab_size
            start = min(self.vocab_start(vocab), vocab)
            return RowRange(0, start, min(start + self.vocab_rows(vocab), vocab))
        return None

    def padded_rows(self, name: str, config: ModelConfig) -> int | None:
        """Rows a vocabulary shard is padded to; None for every other tensor."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab_rows(config.vocab_size)
        return None

    def _kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first KV head, count) this rank holds."""
        n, kv = self.world_size, config.num_kv_heads
        if kv % n == 0:
            return self.rank * (kv // n), kv // n
        return self.rank // (n // kv), 1


def _shifted(part: RowRange, offset: int) -> RowRange:
    return RowRange(part.dim, part.start + offset, part.stop + offset)
