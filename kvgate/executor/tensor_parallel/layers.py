"""The layers that talk across ranks: row-parallel linears, the vocabulary-sharded embedding and
LM head. Column-parallel layers need nothing: each rank's shard is a plain ``Linear``.

Every rank ends each of these layers with the same tensor: an all-reduce leaves one reduced
buffer on every rank (gloo and NCCL both compute each element once and share it), and the
gathered logits are the concatenation of the same shards everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvgate.executor.linear import Linear
from kvgate.executor.tensor_parallel.shards import ShardPlan


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group whose tensors it all-reduces and gathers."""

    plan: ShardPlan
    group: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


@dataclass(frozen=True)
class RowParallelLinear:
    """``x [n, in / N] -> [n, out]``: the partial products summed over ranks, then the bias
    (held whole by every rank, added once after the sum)."""

    local: Linear  # built without bias
    bias: torch.Tensor | None  # [out]
    parallel: TensorParallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True)
class VocabParallelEmbedding:
    """int64 ``[n] -> [n, H]``: each rank looks up the ids of its vocabulary shard, zeros for the
    others, and the all-reduce adds the one non-zero row per token."""

    weight: torch.Tensor  # [ceil(V / N), H], rows start at ``start``
    start: int
    parallel: TensorParallel

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


@dataclass(frozen=True)
class VocabParallelHead:
    """hidden ``[n, H] -> [n, V]``: every rank's logits shard, gathered on every rank, with the
    padding rows of the last shard cut off."""

    local: Linear  # [ceil(V / N), H]
    vocab_size: int
    parallel: TensorParallel

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        shard = self.local(hidden).contiguous()
        shards = [torch.empty_like(shard) for _ in range(self.parallel.plan.world_size)]
        dist.all_gather(shards, shard, group=self.parallel.group)
        return torch.cat(shards, dim=-1)[:, : self.vocab_size]
