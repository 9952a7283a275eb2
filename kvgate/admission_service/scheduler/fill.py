"""Chunked and wavefront prefill as a task graph over (chunk, depth).

A fill computes K/V for positions ``[0, length)``; ``[0, start)`` came from the prefix cache.
Positions are cut into chunks as they are first scheduled; every chunk runs depths ``1..R``
(positions whose required depth is lower are skipped by the executor's passes and receive copies).

Wavefront readiness, for chunk ``c`` at depth ``d``::

    depth  R |  .    .    .
           d |  ✓ ──▶(c,d)          (c, d) needs (c, d-1): its hidden state
         d-1 |  .   (c,d-1)         and (c-1, d): causal K/V at plane d
             +------------------
               c-1    c

"Done" here means put into an *earlier* step: the executor runs steps in order, so with async
scheduling a dependency may still be in flight. Readiness is computed from the state at the start
of a step, before anything of that step is selected.

Non-wavefront prefill schedules one chunk per step as a single row over depths ``1..R``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Chunk:
    start: int
    end: int
    scheduled_depth: int = 0  # deepest depth put into a plan
    done_depth: int = 0  # deepest depth whose result was applied

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class FillTask:
    """One row to schedule over depths ``depth_first..depth_last``: ``chunk`` indexes
    ``Fill.chunks``, or is ``None`` for a new chunk of at most ``max_tokens`` from ``start``."""

    chunk: int | None
    start: int
    max_tokens: int
    depth_first: int
    depth_last: int

    @property
    def cost_per_token(self) -> int:
        return self.depth_last - self.depth_first + 1


@dataclass(slots=True)
class Fill:
    length: int
    start: int
    num_loops: int
    wavefront: bool
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def next_start(self) -> int:
        return self.chunks[-1].end if self.chunks else self.start

    @property
    def done(self) -> bool:
        return (
            bool(self.chunks)
            and self.chunks[-1].end == self.length
            and all(c.done_depth == self.num_loops for c in self.chunks)
        )

    def ready_tasks(self) -> list[FillTask]:
        """Tasks whose dependencies were scheduled in earlier steps, in position order."""
        r = self.num_loops
        if not self.wavefront:
            if self.next_start < self.length:
                return [FillTask(None, self.next_start, self.length - self.next_start, 1, r)]
            return []
        tasks: list[FillTask] = []
        for index, chunk in enumerate(self.chunks):
            depth = chunk.scheduled_depth + 1
            if depth > r:
                continue
            if index > 0 and self.chunks[index - 1].scheduled_depth < depth:
                continue
            tasks.append(FillTask(index, chunk.start, chunk.num_tokens, depth, depth))
        last_started = not self.chunks or self.chunks[-1].scheduled_depth >= 1
        if self.next_start < self.length and last_started:
            tasks.append(FillTask(None, self.next_start, self.length - self.next_start, 1, 1))
        return tasks

    def schedule(self, task: FillTask, num_tokens: int) -> tuple[Chunk, bool]:
        """Record ``task`` as planned with ``num_tokens`` tokens (a new chunk's size);
        returns the chunk and whether this row completes the fill."""
        if task.chunk is None:
            chunk = Chunk(task.start, task.start + num_tokens)
            self.chunks.append(chunk)
        else:
            chunk = self.chunks[task.chunk]
        chunk.scheduled_depth = task.depth_last
        completes = chunk.end == self.length and task.depth_last == self.num_loops
        return chunk, completes

    def complete(self, token_start: int, depth_last: int) -> None:
        """Apply the result of the row that started at ``token_start``."""
        for chunk in reversed(self.chunks):
            if chunk.start == token_start:
                chunk.done_depth = max(chunk.done_depth, depth_last)
                return
        raise KeyError(f"no fill chunk starts at position {token_start}")

    def full_depth_frontier(self) -> int:
        """End of the contiguous prefix whose K/V is complete at every depth."""
        frontier = self.start
        for chunk in self.chunks:
            if chunk.done_depth < self.num_loops:
                break
            frontier = chunk.end
        return frontier
