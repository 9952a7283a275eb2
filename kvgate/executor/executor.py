"""The in-process executor: follows step plans over a paged KV cache (the server and the
simulator's ``--executor real`` both drive this class).

``execute(plan)`` validates the whole plan first; a bad plan gets a result with ``error`` set and
changes nothing. Then, in the order of the step protocol: free → swap_out → new_requests →
swap_in → block_appends → one forward over every prefill and decode row.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from kvgate import kernels
from kvgate.executor.calibration import measure_costs, profile_forward
from kvgate.executor.config import DEFAULT_BLOCK_SIZE
from kvgate.executor.kv_cache import KVCache, blocks_for_memory_fraction
from kvgate.executor.loader import DTypeChoice, LoadedModel, load_model
from kvgate.executor.model import Model
from kvgate.executor.quantized import fingerprint_bytes
from kvgate.executor.requests import DecodeCursor, RequestState, Snapshot
from kvgate.executor.runner import StepRunner
from kvgate.executor.step_span import kv_attributes, plan_attributes, result_attributes
from kvgate.executor.structured import StructuredOutputs
from kvgate.protocol import migration
from kvgate.protocol import step as wire
from kvgate.protocol.enums import AUTO_DTYPE, ExitPolicy, QuantActivations
from kvgate.protocol.plan_check import Geometry, PlanError, PlanValidator
from kvgate.telemetry import attributes as attr
from kvgate.telemetry.context import context_from_traceparent, span_context_from_traceparent

log = logging.getLogger(__name__)

PROFILE_TOKENS = 2048


class Executor:
    """Weights and KV tensors of one model on one device; follows the plans it is given.

    ``model`` is a loaded model or a directory (then ``device``, ``dtype`` and, for a GGUF
    model on CPU, ``activations`` apply). The cache
    holds ``num_blocks`` blocks, or on a GPU as many as ``memory_fraction`` of its memory allows
    after a profiling forward of ``profile_tokens`` tokens. ``counters.num_requests`` counts
    every request held, resident or swapped out.
    """

    def __init__(
        self,
        model: LoadedModel | str | Path,
        *,
        num_blocks: int | None,
        device: torch.device | str = "cpu",
        dtype: DTypeChoice = AUTO_DTYPE,
        host_snapshot_blocks: int = 0,
        memory_fraction: float | None = None,
        executor_id: str = "executor-0",
        block_size: int = DEFAULT_BLOCK_SIZE,
        exit_policy: ExitPolicy | None = None,
        tracer: trace.Tracer | None = None,
        profile_tokens: int = PROFILE_TOKENS,
        model_name: str | None = None,
        batch_invariant: bool = False,
        activations: QuantActivations = QuantActivations.FLOAT32,
    ):
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model,
                device=device,
                dtype=dtype,
                batch_invariant=batch_invariant,
                activations=activations,
            )
        )
        if loaded.model.batch_invariant != batch_invariant:
            raise ValueError(
                f"batch_invariant={batch_invariant}, but the model was loaded with "
                f"batch_invariant={loaded.model.batch_invariant}"
            )
        self.model: Model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.tokenizer_files = loaded.tokenizer_files  # served at GET /v1/tokenizer
        config = self.model.config
        if num_blocks is None:
            if memory_fraction is None:
                raise ValueError("give num_blocks, or memory_fraction on a CUDA device")
            num_blocks = blocks_for_memory_fraction(
                config,
                block_size=block_size,
                dtype=self.model.dtype,
                device=self.model.device,
                memory_fraction=memory_fraction,
                profile=lambda: profile_forward(self.model, profile_tokens),
            )
        self.cache = KVCache(
            config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.model.dtype,
            device=self.model.device,
        )
        self.exit_policy = exit_policy or ExitPolicy.GATE
        self.structured = StructuredOutputs(
            self.tokenizer,
            vocab_size=config.vocab_size,
            eos_token_id=config.eos_token_id,
            device=self.model.device,
        )
        self._runner = StepRunner(
            self.model, self.cache, self.exit_policy, config.eos_token_id, self.structured
        )
        self._tracer = tracer or trace.get_tracer(__name__)
        # gen_ai.request.model of the step spans: what the model is called where it is served
        # (the executor CLI passes its --model, as the operator names it to the admission service).
        self._model_attributes = (
            {} if model_name is None else {attr.GEN_AI_REQUEST_MODEL: model_name}
        )
        self._requests: dict[str, RequestState] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self._exports: dict[str, tuple[migration.SnapshotHeader, bytes]] = {}  # ticket -> fetch
        self._staged: dict[str, Snapshot] = {}  # ticket -> fetched, waiting for its adopt
        self._block_refs: Counter[int] = Counter()
        self._host_blocks = 0
        self._geometry = Geometry(
            num_blocks=num_blocks,
            block_size=block_size,
            num_loops=config.num_loops,
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
            host_snapshot_blocks=host_snapshot_blocks,
            structured_outputs=self.structured.available,
        )
        self.info = wire.ExecutorInfo(
            executor_id=executor_id,
            model_family=config.family.value,
            num_loops=config.num_loops,
            block_size=block_size,
            num_blocks=num_blocks,
            host_snapshot_blocks=host_snapshot_blocks,
            vocab_size=config.vocab_size,
            eos_token_id=config.eos_token_id,
            max_model_len=config.max_model_len,
            kv_bytes_per_block=self.cache.bytes_per_block,
            has_tokenizer=self.tokenizer is not None,
            snapshot_migration=True,
            structured_outputs=self.structured.available,
        )

    # ------------------------------------------------------------------------ public API

    @property
    def counters(self) -> wire.ExecutorCounters:
        return wire.ExecutorCounters(
            num_requests=len(self._requests) + len(self._snapshots),
            num_snapshots=len(self._snapshots),
            host_blocks_used=self._host_blocks,
            num_exports=len(self._exports),
            num_staged=len(self._staged),
        )

    @property
    def blocks_used(self) -> int:
        """Distinct blocks in the tables of resident requests (shared prefix blocks count once)."""
        return len(self._block_refs)

    def reset(self) -> None:
        """Forget every request and snapshot (a new session epoch)."""
        self._requests.clear()
        self._snapshots.clear()
        self._exports.clear()
        self._staged.clear()
        self._block_refs.clear()
        self._host_blocks = 0

    # ------------------------------------------------------------------------- migration

    @cached_property
    def snapshot_layout(self) -> migration.SnapshotLayout:
        """The model's identity (its shape, dtype and embedding bytes) and the cache's geometry:
        another executor's KV bytes mean the same here only when all of it matches."""
        config = self.model.config
        digest = hashlib.sha256(config.model_dump_json().encode())
        digest.update(str(self.model.dtype).encode())
        digest.update(fingerprint_bytes(self.model.weights.embed))
        return migration.SnapshotLayout(
            model_fingerprint=f"{config.family.value}:{digest.hexdigest()}",
            block_size=self.cache.block_size,
            num_planes=config.num_loops,
            dtype=str(self.model.dtype).removeprefix("torch."),
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )

    def take_export(self, ticket: str) -> tuple[migration.SnapshotHeader, bytes] | None:
        """The exported snapshot under ``ticket``, once (None: unknown, taken or expired)."""
        return self._exports.pop(ticket, None)

    def drop_export(self, ticket: str) -> None:
        self._exports.pop(ticket, None)

    def stage_import(self, ticket: str, header: migration.SnapshotHeader, payload: bytes) -> None:
        """Keep a fetched snapshot on the host until a plan adopts it; ValueError when its
        layout or size does not match this executor."""
        problem = header.layout.mismatch(self.snapshot_layout)
        if problem is not None:
            raise ValueError(problem)
        config = self.model.config
        shape = (
            config.num_loops * header.num_pages,
            config.num_layers,
            self.cache.block_size,
            config.num_kv_heads,
            config.head_dim,
        )
        element = torch.empty((), dtype=self.model.dtype).element_size()
        half = len(payload) // 2
        if len(payload) != 2 * element * _numel(shape):
            raise ValueError(
                f"{len(payload)} B of KV for {header.num_pages} pages; expected "
                f"{2 * element * _numel(shape)} B"
            )
        try:
            state = _state_from(header.state, config.num_loops)
            # Its grammar matcher re-driven by the outputs it carries.
            self.structured.attach(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"unreadable request state: {exc}") from exc
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        keys = raw[:half].view(self.model.dtype).reshape(shape)
        values = raw[half:].view(self.model.dtype).reshape(shape)
        self._staged[ticket] = Snapshot(
            state=state, keys=keys, values=values, num_pages=header.num_pages
        )

    def drop_staged(self, ticket: str) -> None:
        self._staged.pop(ticket, None)

    def _export(self, export: wire.SnapshotExport) -> None:
        rid = export.request_id
        if rid not in self._snapshots:
            self._swap_out(rid)
        snapshot = self._snapshots.pop(rid)
        self._host_blocks -= snapshot.num_blocks
        keys = snapshot.keys.contiguous().view(torch.uint8).flatten()
        values = snapshot.values.contiguous().view(torch.uint8).flatten()
        payload = keys.numpy().tobytes() + values.numpy().tobytes()
        state = _state_of(snapshot.state)
        self._exports[export.ticket] = (
            migration.header(self.snapshot_layout, rid, snapshot.num_pages, state, payload),
            payload,
        )

    def _adopt(self, adopt: wire.SnapshotAdopt) -> None:
        snapshot = self._staged.pop(adopt.ticket)
        self._snapshots[adopt.request_id] = snapshot
        self._host_blocks += snapshot.num_blocks

    def execute(self, plan: wire.StepPlan) -> wire.StepResult:
        began = time.perf_counter()
        error: wire.StepError | None = None
        try:
            PlanValidator(self._geometry, self._requests, self._snapshots, self._staged).validate(
                plan
            )
        except PlanError as exc:
            error = exc.error
        with self._tracer.start_as_current_span(
            attr.STEP_SPAN,
            context=context_from_traceparent(plan.traceparent),
            links=self._links(plan) if error is None else [],
            attributes=plan_attributes(plan, self.info) | self._model_attributes,
        ) as span:
            if error is None:
                try:
                    return self._run(plan, span, began)
                except Exception as exc:  # a bug, not a bad plan: report it, keep serving
                    log.exception("step %d failed", plan.step_id)
                    error = wire.StepError(code=wire.ErrorCode.INTERNAL, message=repr(exc))
            span.set_status(Status(StatusCode.ERROR, error.message))
            span.set_attribute(attr.STEP_ERROR_CODE, error.code.value)
            return wire.StepResult(
                step_id=plan.step_id,
                error=error,
                counters=self.counters,
                timings=wire.StepTimings(execute_s=time.perf_counter() - began),
            )

    # --------------------------------------------------------------------------- actions

    def _run(self, plan: wire.StepPlan, span: Span, began: float) -> wire.StepResult:
        for rid in plan.free:
            self._free(rid)
        for rid in plan.swap_out:
            self._swap_out(rid)
        for export in plan.export:
            self._export(export)
        for adopt in plan.adopt:
            self._adopt(adopt)
        for request in plan.new_requests:
            span_context = span_context_from_traceparent(request.traceparent)
            state = RequestState.register(request, self.model.num_loops, span_context)
            self.structured.attach(state)
            self._requests[request.request_id] = state
        for swap in plan.swap_in:
            self._swap_in(swap)
        for append in plan.block_appends:
            state = self._requests[append.request_id]
            for table, new_ids in zip(state.block_tables, append.new_block_ids, strict=True):
                table.extend(new_ids)
                self._block_refs.update(new_ids)
        prefill = [(self._requests[row.request_id], row) for row in plan.prefill_rows]
        decode: list[RequestState] = []
        skipped: list[str] = []
        for rid in plan.decode.request_ids:
            state = self._requests[rid]
            if state.finished:
                skipped.append(rid)
            else:
                decode.append(state)
        outcome = self._runner.run(prefill, decode)
        result = wire.StepResult(
            step_id=plan.step_id,
            tokens=outcome.tokens,
            prompt_logprobs=outcome.prompt_logprobs,
            decode=wire.DecodeOutcomes(
                request_ids=[s.request_id for s in decode],
                positions=outcome.decode_positions,
                depths=outcome.decode_depths,
                exited=outcome.decode_exited,
            ),
            skipped_request_ids=skipped,
            timings=wire.StepTimings(
                execute_s=time.perf_counter() - began, kernel_s=outcome.kernel_s
            ),
            counters=self.counters,
        )
        span.set_attributes(
            result_attributes(result, outcome.token_passes_per_depth)
            | kv_attributes(
                blocks_total=self.info.num_blocks,
                blocks_used=self.blocks_used,
                host_blocks_used=self._host_blocks,
                snapshots=len(self._snapshots),
                requests=len(self._requests) + len(self._snapshots),
            )
        )
        return result

    def _release_blocks(self, state: RequestState) -> None:
        for table in state.block_tables:
            self._block_refs.subtract(table)
        self._block_refs = +self._block_refs  # drop ids whose count reached zero

    def _free(self, rid: str) -> None:
        if rid in self._requests:
            self._release_blocks(self._requests.pop(rid))
        else:
            self._host_blocks -= self._snapshots.pop(rid).num_blocks

    def _swap_out(self, rid: str) -> None:
        state = self._requests.pop(rid)
        num_pages = state.num_pages
        block_ids = torch.tensor(
            [b for table in state.block_tables for b in table], dtype=torch.int64
        )
        keys, values = kernels.gather_blocks(self.cache.keys, self.cache.values, block_ids)
        self._release_blocks(state)
        state.block_tables = [[] for _ in state.block_tables]
        _move_hidden(state, torch.device("cpu"))
        snapshot = Snapshot(state=state, keys=keys, values=values, num_pages=num_pages)
        self._snapshots[rid] = snapshot
        self._host_blocks += snapshot.num_blocks

    def _swap_in(self, swap: wire.SwapIn) -> None:
        snapshot = self._snapshots.pop(swap.request_id)
        state = snapshot.state
        block_ids = torch.tensor([b for table in swap.block_ids for b in table], dtype=torch.int64)
        kernels.scatter_blocks(
            self.cache.keys, self.cache.values, block_ids, snapshot.keys, snapshot.values
        )
        state.block_tables = [list(table) for table in swap.block_ids]
        for table in state.block_tables:
            self._block_refs.update(table)
        _move_hidden(state, self.model.device)
        self._host_blocks -= snapshot.num_blocks
        self._requests[swap.request_id] = state

    # ------------------------------------------------------------------------- telemetry

    def _links(self, plan: wire.StepPlan) -> list[Link]:
        """Links to the spans of every request the step serves (context from its traceparent)."""
        registering = {
            r.request_id: span_context_from_traceparent(r.traceparent) for r in plan.new_requests
        }
        served = dict.fromkeys(
            [row.request_id for row in plan.prefill_rows] + plan.decode.request_ids
        )
        links = []
        for rid in served:
            if rid in registering:
                context = registering[rid]
            elif rid in self._requests:
                context = self._requests[rid].span_context
            elif rid in self._snapshots:
                context = self._snapshots[rid].state.span_context
            else:
                context = None
            if context is not None:
                links.append(Link(context))
        return links

    # ----------------------------------------------------------------------- calibration

    def calibrate(self) -> wire.ExecutorInfo:
        """Measure the restore-cost figures the scheduler's ``auto`` mode weighs (host bandwidth,
        prefill time per token and pass) on an idle executor; updates and returns ``info``."""
        if self._requests or self._snapshots:
            raise RuntimeError("calibrate an idle executor (it borrows KV blocks)")
        costs = measure_costs(self.model, self.cache)
        self.info = self.info.model_copy(
            update={
                "host_bandwidth_bytes_per_s": costs.host_bandwidth_bytes_per_s,
                "prefill_token_pass_s": costs.prefill_token_pass_s,
            }
        )
        return self.info


def _move_hidden(state: RequestState, device: torch.device) -> None:
    """Carry a request's in-flight hidden states with its snapshot (host) or back (device)."""
    if state.cursor is not None and state.cursor.hidden is not None:
        state.cursor.hidden = state.cursor.hidden.to(device)
    for pending in state.wavefront.values():
        pending.hidden = pending.hidden.to(device)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _state_of(state: RequestState) -> dict[str, Any]:
    """A request's state at a token boundary as JSON (no hidden states: none are pending)."""
    cursor = state.cursor
    assert cursor is not None and cursor.hidden is None and not state.wavefront
    return {
        "request_id": state.request_id,
        "prompt": state.prompt,
        "outputs": state.outputs,
        "exit_depths": state.exit_depths,
        "sampling": state.sampling.model_dump(mode="json"),
        "loops": state.loops.model_dump(mode="json"),
        "is_recompute": state.is_recompute,
        "frontier": state.frontier,
        "fill_start": state.fill_start,
        "cursor": {
            "position": cursor.position,
            "token_id": cursor.token_id,
            "passes_done": cursor.passes_done,
            "remaining": cursor.remaining,
        },
        "finished": state.finished,
    }


def _state_from(raw: dict[str, Any], num_loops: int) -> RequestState:
    frontier = list(raw["frontier"])
    if len(frontier) != num_loops:
        raise ValueError(f"{len(frontier)} planes in the state, the model has {num_loops}")
    cursor = raw["cursor"]
    if int(cursor["passes_done"]) != 0:
        raise ValueError("a snapshot moves only at a token boundary")
    return RequestState(
        request_id=str(raw["request_id"]),
        prompt=[int(t) for t in raw["prompt"]],
        outputs=[int(t) for t in raw["outputs"]],
        exit_depths=[int(d) for d in raw["exit_depths"]],
        sampling=wire.SamplingParams.model_validate(raw["sampling"]),
        loops=wire.LoopParams.model_validate(raw["loops"]),
        num_loops=num_loops,
        span_context=None,
        is_recompute=bool(raw["is_recompute"]),
        block_tables=[[] for _ in range(num_loops)],
        frontier=frontier,
        fill_start=raw["fill_start"],
        cursor=DecodeCursor(
            position=int(cursor["position"]),
            token_id=int(cursor["token_id"]),
            remaining=float(cursor["remaining"]),
        ),
        finished=bool(raw["finished"]),
    )
