"""What the executor keeps per request between steps, and the rules that read it.

```
positions   0 ........ P-1 | P ...... P+k-2 | P+k-1
            [ prompt       | outputs[:-1]   )  outputs[-1]   <- recompute: fill, then the cursor
            [ prompt       )  output 0                       <- fresh: fill, then the cursor
required    R ............ R | exit_depths[1..k-1]
depth
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from opentelemetry.trace import SpanContext

from kvgate.grammar import GrammarMatcher
from kvgate.protocol.plan_check import RequestView
from kvgate.protocol.step import LoopParams, NewRequest, SamplingParams
from kvgate.protocol.stopping import StopRule


def is_finished(outputs: list[int], sampling: SamplingParams, eos_token_id: int | None) -> bool:
    """Whether ``outputs`` end the request, by the stop rule the scheduler applies too."""
    if not outputs:
        return False
    stop = StopRule.of(sampling, eos_token_id)
    return stop.finish_reason(len(outputs), outputs[-1]) is not None


@dataclass
class DecodeCursor:
    """The next decode pass: feed ``token_id`` at ``position``, ``passes_done`` passes already run.

    Between passes of one token, ``hidden [1, H]`` holds the last pass's output and ``remaining``
    the exit gate's unspent probability mass.
    """

    position: int
    token_id: int
    passes_done: int = 0
    hidden: torch.Tensor | None = None
    remaining: float = 1.0

    @property
    def depth(self) -> int:
        """The depth of the next pass (1-based)."""
        return self.passes_done + 1


@dataclass
class PendingHidden:
    """A wavefront chunk's output after one depth, waiting for the next depth's row.

    ``hidden [m, H]`` holds the chunk positions still active after that depth, in order.
    """

    token_end: int
    hidden: torch.Tensor


@dataclass
class RequestState:
    request_id: str
    prompt: list[int]
    outputs: list[int]
    exit_depths: list[int]
    sampling: SamplingParams
    loops: LoopParams
    num_loops: int
    span_context: SpanContext | None
    is_recompute: bool
    block_tables: list[list[int]]  # [plane][page] block ids; empty while swapped out
    # Per depth: fill positions [fill_start, frontier[d-1]) are done at plane d; None: no row yet.
    frontier: list[int | None]
    fill_start: int | None = None
    wavefront: dict[tuple[int, int], PendingHidden] = field(default_factory=dict)
    cursor: DecodeCursor | None = None
    finished: bool = False
    # Where its outputs stand in its grammar (SamplingParams.grammar); rebuilt from the outputs
    # whenever the state is (``StructuredOutputs.attach``).
    matcher: GrammarMatcher | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its fill reports prompt log-probabilities: asked for, and not a recompute (a request
        with outputs reported them during its first fill)."""
        return self.sampling.prompt_logprobs is not None and not self.is_recompute

    @classmethod
    def register(
        cls, request: NewRequest, num_loops: int, span_context: SpanContext | None
    ) -> RequestState:
        return cls(
            request_id=request.request_id,
            prompt=list(request.prompt_token_ids),
            outputs=list(request.output_token_ids),
            exit_depths=list(request.exit_depths),
            sampling=request.sampling,
            loops=request.loops,
            num_loops=num_loops,
            span_context=span_context,
            is_recompute=bool(request.output_token_ids),
            block_tables=[[] for _ in range(num_loops)],
            frontier=[None] * num_loops,
        )

    @property
    def fill_len(self) -> int:
        """``P`` for a fresh request, ``P + k - 1`` for a recompute with ``k`` outputs."""
        return len(self.prompt) + max(len(self.outputs) - 1, 0)

    @property
    def num_pages(self) -> int:
        return len(self.block_tables[0])

    def plan_view(self) -> RequestView:
        cursor = self.cursor
        return RequestView(
            fill_len=self.fill_len,
            prompt_len=len(self.prompt),
            frontier=self.frontier,
            fill_start=self.fill_start,
            wavefront={key: pending.token_end for key, pending in self.wavefront.items()},
            cursor=None if cursor is None else (cursor.position, cursor.depth),
            finished=self.finished,
            tables=self.block_tables,
        )

    def fill_token(self, position: int) -> int:
        prompt_len = len(self.prompt)
        return (
            self.prompt[position] if position < prompt_len else self.outputs[position - prompt_len]
        )

    def required_depth(self, position: int) -> int:
        """Passes a fill position runs: R for the prompt, the recorded exit depth after it."""
        prompt_len = len(self.prompt)
        if position < prompt_len:
            return self.num_loops
        return self.exit_depths[position - prompt_len + 1]

    def active_positions(self, start: int, end: int, depth: int) -> list[int]:
        """The fill positions of ``[start, end)`` that run a pass at ``depth``."""
        if end <= len(self.prompt):
            return list(range(start, end))
        return [p for p in range(start, end) if self.required_depth(p) >= depth]

    def finish_fill(self, eos_token_id: int | None) -> None:
        """Set the decode cursor after the fill; for a fresh request output 0 is already sampled."""
        position = len(self.prompt) + len(self.outputs) - 1
        self.cursor = DecodeCursor(position=position, token_id=self.outputs[-1])
        self.finished = is_finished(self.outputs, self.sampling, eos_token_id)
        self.wavefront.clear()


@dataclass
class Snapshot:
    """A swapped-out request: its state and every block's K/V on the host.

    ``keys``/``values`` are ``[R * num_pages, num_layers, block_size, Hkv, D]``, plane-major.
    """

    state: RequestState
    keys: torch.Tensor
    values: torch.Tensor
    num_pages: int

    @property
    def num_blocks(self) -> int:
        return self.state.num_loops * self.num_pages

    def plan_view(self) -> RequestView:
        return self.state.plan_view()
