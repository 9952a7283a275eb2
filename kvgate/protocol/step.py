"""The step protocol between the admission service and a GPU executor.

This module imports only pydantic: the admission service imports it without pulling in torch.

One WebSocket session carries, in order:

```
admission service                         executor
  SessionOpen(epoch) ───────────────────▶  drops every request of older epochs
                     ◀─────────────────── SessionAccepted(ExecutorInfo) | ProtocolError
  StepPlan(step 1)   ───────────────────▶
  StepPlan(step 2)   ───────────────────▶  (async scheduling: one more plan may be in flight)
                     ◀─────────────────── StepResult(step 1)
                     ◀─────────────────── StepResult(step 2)
```

Versions: ``SessionOpen.protocol_version`` is the opener's; an executor speaks 1 and 2 and
answers in the opener's. In 2 a result's sampled tokens come as columns (``StepResult.sampled``,
a list per field: a step of 250 tokens parses about four times faster than 250 objects); in 1
as a list of objects (``StepResult.tokens``). Readers use ``StepResult.token_rows()``, which
reads either.

A plan carries a request's prompt and sampling parameters once (``new_requests``) and afterwards
only deltas: rows, appended block ids, and swap/free actions. The executor never decides who
runs; it follows the block tables it is sent. It validates a whole plan before touching any state,
so a bad plan is answered with a ``StepResult`` whose ``error`` names the problem and nothing else
changes.

Positions and depths
--------------------
A request's token sequence is ``prompt + outputs``. Position ``p`` is the index in that sequence.
Depths are 1-based loop passes through the shared core, ``1 ≤ d ≤ num_loops``; a plain model has
``num_loops == 1``. Prompt positions always run every depth. The output fed at position
``len(prompt) + i`` ran the depths ``1..exit_depths[i + 1]`` (``exit_depths[i]`` is the depth of the
pass that *produced* output ``i``; ``exit_depths[0] == num_loops`` because the first output comes
from the prompt's full-depth pass).

The **fill** of a request is the prefix of positions whose K/V must be computed before it can
decode: the prompt for a fresh request, ``prompt + outputs[:-1]`` for a recompute restore::

    fresh:      [ prompt ...................... ) -> samples output 0 from the last position
    recompute:  [ prompt ........ | outputs[:-1] ) -> next decode feeds outputs[-1]

Executed order inside a step: ``free`` → ``swap_out`` → ``export`` → ``adopt`` →
``new_requests`` → ``swap_in`` → ``block_appends`` → prefill rows and decode rows (one forward).

Migration (:mod:`kvgate.protocol.migration`): ``export`` moves a request's KV — resident or
already a host snapshot — out of the executor's accounting into an export area under a one-time
ticket, served at ``GET /v1/snapshots/{ticket}``; ``adopt`` turns a snapshot staged by
``POST /v1/snapshots/import`` into a host snapshot of this session (within the host budget),
which a later ``swap_in`` restores.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.protocol.stopping import DEFAULT_MAX_TOKENS
from kvgate.protocol.structured import GrammarSpec

PROTOCOL_VERSION = 2  # what the admission service opens with
SUPPORTED_PROTOCOL_VERSIONS = frozenset({1, 2})  # what an executor accepts

NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingParams(_Frozen):
    """How the next token is drawn. ``temperature == 0`` is greedy.

    Draws use a generator keyed by ``(seed, position)`` — or ``(request_id, position)`` when no
    seed is set — so a token never depends on batch composition, preemption or the restore
    mode, and a seeded request is reproducible under any request id.

    The logit processors (``grammar``, ``logit_bias``, ``min_tokens``, the penalties, ``min_p``)
    are the Kafka record's fields of the same names (``RequestSampling``); every one depends only
    on the request's prompt and outputs, so a recompute restore or a migration rebuilds it from
    them.
    """

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    # When generation ends on a token: ``kvgate.protocol.stopping.StopRule``.
    max_tokens: PositiveInt = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: dict[NonNegativeInt, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict
    )
    # The output stays inside this grammar (a token mask, ``kvgate.executor.structured``).
    grammar: GrammarSpec | None = None
    # Return each sampled token's log-probability and the top ``logprobs`` alternatives.
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Return each prompt token's log-probability (and this many alternatives) as its fill runs.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


class LoopParams(_Frozen):
    """Loop bounds of a looped (recurrent-depth) model; a plain model ignores them.

    ``exit_trace`` replays given exit depths (one per output, ``exit_trace[0]`` the full depth):
    the ``trace`` exit policy used by tests and by recompute on a different executor.
    """

    min_loops: PositiveInt = 1
    max_loops: PositiveInt | None = None
    exit_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    exit_trace: list[PositiveInt] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> LoopParams:
        if self.max_loops is not None and self.max_loops < self.min_loops:
            raise ValueError(f"max_loops ({self.max_loops}) < min_loops ({self.min_loops})")
        return self


class NewRequest(_Frozen):
    """Everything an executor needs about a request, sent once per (executor, admission).

    For a recompute restore ``output_token_ids``/``exit_depths`` hold what was generated before
    the preemption; the fill replays them at their recorded depths and does not sample again.
    """

    request_id: str
    prompt_token_ids: list[NonNegativeInt]
    output_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    exit_depths: list[PositiveInt] = Field(default_factory=list)
    sampling: SamplingParams = SamplingParams()
    loops: LoopParams = LoopParams()
    traceparent: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> NewRequest:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if len(self.exit_depths) != len(self.output_token_ids):
            raise ValueError(
                f"exit_depths has {len(self.exit_depths)} entries for "
                f"{len(self.output_token_ids)} output tokens"
            )
        return self


class BlockAppend(_Frozen):
    """New pages at the end of a request's block tables: ``new_block_ids[plane][i]``.

    Every plane (one per depth) grows by the same number of pages.
    """

    request_id: str
    new_block_ids: list[list[NonNegativeInt]]


class SwapIn(_Frozen):
    """Restore a request's host snapshot into fresh blocks (``block_ids[plane][page]``)."""

    request_id: str
    block_ids: list[list[NonNegativeInt]]


class SnapshotExport(_Frozen):
    """Hold the request's KV for one fetch under ``ticket`` for ``ttl_s``; the request leaves."""

    request_id: str
    ticket: Annotated[str, Field(min_length=16, max_length=128)]
    ttl_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 30.0


class SnapshotAdopt(_Frozen):
    """Make the snapshot staged under ``ticket`` this request's host snapshot."""

    request_id: str
    ticket: Annotated[str, Field(min_length=16, max_length=128)]


class PrefillRow(_Frozen):
    """Fill positions ``[token_start, token_end)`` at depths ``depth_first..depth_last``.

    ```
    depth_last  ▲  . . . . . . . .
                │  row covers this rectangle; a position whose required depth is lower than
    depth_first │  a pass skips it (its K/V at deeper planes is a copy of its exit plane)
                └──────────────────▶ positions [token_start, token_end)
    ```

    Non-wavefront prefill sends ``depth_first=1, depth_last=num_loops``; wavefront sends one depth
    per row. ``completes_fill`` marks the last row of the fill: for a fresh request the executor
    then samples output 0 from the last position; for a recompute it sets the decode cursor to
    feed the last known output.
    """

    request_id: str
    token_start: NonNegativeInt
    token_end: PositiveInt
    depth_first: PositiveInt
    depth_last: PositiveInt
    completes_fill: bool = False

    @model_validator(mode="after")
    def _ranges(self) -> PrefillRow:
        if self.token_end <= self.token_start:
            raise ValueError(f"empty token range [{self.token_start}, {self.token_end})")
        if self.depth_last < self.depth_first:
            raise ValueError(f"depth_last {self.depth_last} < depth_first {self.depth_first}")
        return self

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


class DecodeRows(_Frozen):
    """One core pass per listed request at its decode cursor (columnar for speed).

    ``positions[i]``/``depths[i]`` are what the scheduler expects the cursor to be, or ``None``
    when the outcome of the step still in flight decides it (async scheduling): then the executor
    feeds its own sampled token (position + 1, depth 1) or continues the same token one depth
    deeper. The executor checks the expectation when one is given.
    """

    request_ids: list[str] = Field(default_factory=list)
    positions: list[NonNegativeInt | None] = Field(default_factory=list)
    depths: list[PositiveInt | None] = Field(default_factory=list)

    @model_validator(mode="after")
    def _columns(self) -> DecodeRows:
        n = len(self.request_ids)
        if len(self.positions) != n or len(self.depths) != n:
            raise ValueError("decode columns have different lengths")
        return self


class StepPlan(_Frozen):
    """One executor step: actions, then one forward over every row."""

    type: Literal["plan"] = "plan"
    step_id: PositiveInt
    free: list[str] = Field(default_factory=list)
    swap_out: list[str] = Field(default_factory=list)
    export: list[SnapshotExport] = Field(default_factory=list)
    adopt: list[SnapshotAdopt] = Field(default_factory=list)
    new_requests: list[NewRequest] = Field(default_factory=list)
    swap_in: list[SwapIn] = Field(default_factory=list)
    block_appends: list[BlockAppend] = Field(default_factory=list)
    prefill_rows: list[PrefillRow] = Field(default_factory=list)
    decode: DecodeRows = DecodeRows()
    traceparent: str | None = None

    @property
    def num_rows(self) -> int:
        return len(self.prefill_rows) + len(self.decode.request_ids)

    @property
    def is_empty(self) -> bool:
        return not (
            self.free
            or self.swap_out
            or self.export
            or self.adopt
            or self.new_requests
            or self.swap_in
            or self.block_appends
            or self.num_rows
        )


class TokenLogprob(_Frozen):
    token_id: NonNegativeInt
    logprob: float


class SampledToken(_Frozen):
    """A token that finished its passes: sampled from the pass at ``exit_depth``.

    With ``SamplingParams.logprobs``: ``logprob`` of the sampled token and ``top_logprobs`` (the
    ``logprobs`` most likely tokens, most likely first) under the model's distribution, the
    log-softmax of the logits before temperature and filters (what vLLM reports by default).
    """

    request_id: str
    position: NonNegativeInt
    token_id: NonNegativeInt
    exit_depth: PositiveInt
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


# One sampled token as ``StepResult.token_rows`` yields it:
# (request_id, position, token_id, exit_depth, logprob, top_logprobs).
TokenRow = tuple[str, int, int, int, float | None, list[TokenLogprob] | None]


class SampledTokens(_Frozen):
    """A step's sampled tokens as columns (protocol 2): entry ``i`` of each list is token ``i``
    (fields as ``SampledToken``'s). ``logprobs`` and ``top_logprobs`` are present when some
    request of the step asked for them, ``None`` at the tokens of the others."""

    request_ids: list[str] = Field(default_factory=list)
    positions: list[NonNegativeInt] = Field(default_factory=list)
    token_ids: list[NonNegativeInt] = Field(default_factory=list)
    exit_depths: list[PositiveInt] = Field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[TokenLogprob] | None] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> Self:
        n = len(self.request_ids)
        lengths = [len(self.positions), len(self.token_ids), len(self.exit_depths)]
        lengths += [len(c) for c in (self.logprobs, self.top_logprobs) if c is not None]
        if any(length != n for length in lengths):
            raise ValueError(f"sampled token columns of different lengths: {[n, *lengths]}")
        return self

    @classmethod
    def of(cls, tokens: list[SampledToken]) -> SampledTokens:
        """``tokens`` as columns (built without validation: they are validated objects)."""
        asked = any(t.logprob is not None or t.top_logprobs is not None for t in tokens)
        return cls.model_construct(
            request_ids=[t.request_id for t in tokens],
            positions=[t.position for t in tokens],
            token_ids=[t.token_id for t in tokens],
            exit_depths=[t.exit_depth for t in tokens],
            logprobs=[t.logprob for t in tokens] if asked else None,
            top_logprobs=[t.top_logprobs for t in tokens] if asked else None,
        )


class PromptLogprobs(_Frozen):
    """Log-probabilities of prompt tokens ``[first_position, first_position + len(logprobs))``,
    each given the tokens before it, from one fill row (``SamplingParams.prompt_logprobs``).
    ``top_logprobs[i]``: the most likely tokens at that position, most likely first."""

    request_id: str
    first_position: PositiveInt
    token_ids: list[NonNegativeInt]
    logprobs: list[float]
    top_logprobs: list[list[TokenLogprob]] = Field(default_factory=list)


class DecodeOutcomes(_Frozen):
    """What each decode row did (columnar, in plan order, skipped rows left out)."""

    request_ids: list[str] = Field(default_factory=list)
    positions: list[NonNegativeInt] = Field(default_factory=list)
    depths: list[PositiveInt] = Field(default_factory=list)
    exited: list[bool] = Field(default_factory=list)


class StepTimings(_Frozen):
    execute_s: Annotated[float, Field(ge=0.0)] = 0.0
    kernel_s: Annotated[float, Field(ge=0.0)] | None = None


class ExecutorCounters(_Frozen):
    """What the executor holds after the step (leak checks read these)."""

    num_requests: NonNegativeInt = 0
    num_snapshots: NonNegativeInt = 0
    host_blocks_used: NonNegativeInt = 0
    num_exports: NonNegativeInt = 0  # snapshots held for a fetch (outside the host budget)
    num_staged: NonNegativeInt = 0  # imports fetched and not yet adopted


class ErrorCode(StrEnum):
    BAD_PLAN = "bad_plan"
    UNKNOWN_REQUEST = "unknown_request"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    MISSING_SNAPSHOT = "missing_snapshot"
    HOST_BUDGET_EXCEEDED = "host_budget_exceeded"
    STALE_EPOCH = "stale_epoch"
    UNAUTHORIZED = "unauthorized"
    PROTOCOL = "protocol"
    INTERNAL = "internal"


class StepError(_Frozen):
    code: ErrorCode
    message: str
    request_id: str | None = None


class StepResult(_Frozen):
    """The outcome of one plan; ``error`` set means the plan was rejected and nothing changed."""

    type: Literal["result"] = "result"
    step_id: PositiveInt
    tokens: list[SampledToken] = Field(default_factory=list)  # protocol 1 (and in-process)
    sampled: SampledTokens | None = None  # protocol 2: the tokens as columns
    prompt_logprobs: list[PromptLogprobs] = Field(default_factory=list)
    decode: DecodeOutcomes = DecodeOutcomes()
    skipped_request_ids: list[str] = Field(default_factory=list)
    timings: StepTimings = StepTimings()
    counters: ExecutorCounters = ExecutorCounters()
    error: StepError | None = None

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        if self.tokens and self.sampled is not None:
            raise ValueError("a result carries its tokens as objects or as columns, not both")
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) if self.sampled is None else len(self.sampled.request_ids)

    def token_rows(self) -> Iterator[TokenRow]:
        """Every sampled token, in order, whichever form the result carries."""
        columns = self.sampled
        if columns is None:
            for t in self.tokens:
                yield t.request_id, t.position, t.token_id, t.exit_depth, t.logprob, t.top_logprobs
            return
        n = len(columns.request_ids)
        logprobs = columns.logprobs if columns.logprobs is not None else [None] * n
        tops = columns.top_logprobs if columns.top_logprobs is not None else [None] * n
        yield from zip(
            columns.request_ids, columns.positions, columns.token_ids, columns.exit_depths,
            logprobs, tops, strict=True,
        )  # fmt: skip

    def sampled_tokens(self) -> list[SampledToken]:
        """The tokens as objects, whichever form the result carries (for readers off the hot
        path)."""
        if self.sampled is None:
            return self.tokens
        fields = ("request_id", "position", "token_id", "exit_depth", "logprob", "top_logprobs")
        return [SampledToken(**dict(zip(fields, row, strict=True))) for row in self.token_rows()]

    def to_json(self, version: int) -> str:
        """This result as a peer speaking protocol ``version`` reads it: from 2 on the tokens
        as columns; in 1 as objects, and without the ``sampled`` key (a version-1 reader
        refuses a key it does not know, even a null one)."""
        if version < 2:
            if self.sampled is not None:
                objects = self.model_copy(update={"tokens": self.sampled_tokens(), "sampled": None})
                return objects.model_dump_json(exclude={"sampled"})
            return self.model_dump_json(exclude={"sampled"})
        if self.sampled is not None or not self.tokens:
            return self.model_dump_json()
        columns = self.model_copy(update={"tokens": [], "sampled": SampledTokens.of(self.tokens)})
        return columns.model_dump_json()


class ExecutorInfo(_Frozen):
    """What an executor tells a new session: its cache geometry and cost figures."""

    executor_id: str
    model_family: str
    num_loops: PositiveInt
    block_size: PositiveInt
    num_blocks: PositiveInt
    host_snapshot_blocks: NonNegativeInt
    vocab_size: PositiveInt
    eos_token_id: NonNegativeInt | None
    max_model_len: PositiveInt
    kv_bytes_per_block: NonNegativeInt
    has_tokenizer: bool = False
    host_bandwidth_bytes_per_s: Annotated[float, Field(gt=0.0)] | None = None
    prefill_token_pass_s: Annotated[float, Field(gt=0.0)] | None = None
    # Serves and stages KV snapshots (plan ops export/adopt, /v1/snapshots): a drain may move
    # its requests here with their KV instead of recomputing them.
    snapshot_migration: bool = False
    # Masks logits by a grammar (SamplingParams.grammar): it has the model's tokenizer and EOS.
    structured_outputs: bool = False


class SessionOpen(_Frozen):
    """First message of a session. A newer epoch fences every older session out."""

    type: Literal["open"] = "open"
    protocol_version: int = PROTOCOL_VERSION
    epoch: Annotated[int, Field(ge=0, lt=2**63)]  # wall-clock ms of the opener (EpochFence)
    session_id: str


class SessionAccepted(_Frozen):
    type: Literal["accepted"] = "accepted"
    epoch: NonNegativeInt
    info: ExecutorInfo


class ProtocolError(_Frozen):
    """Sent before the executor closes a session (bad auth, stale epoch, unparseable message)."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str


ClientMessage = Annotated[SessionOpen | StepPlan, Field(discriminator="type")]
ServerMessage = Annotated[SessionAccepted | StepResult | ProtocolError, Field(discriminator="type")]
