"""Collects one step's actions and rows, then freezes them into a ``StepPlan``."""

from __future__ import annotations

from kvgate.protocol.step import (
    BlockAppend,
    DecodeRows,
    NewRequest,
    PrefillRow,
    SnapshotAdopt,
    SnapshotExport,
    StepPlan,
    SwapIn,
)
from kvgate.scheduler.events import StepReport
from kvgate.scheduler.kv import Page


def _by_plane(pages: list[Page], num_planes: int) -> list[list[int]]:
    return [[page[plane] for page in pages] for plane in range(num_planes)]


class PlanBuilder:
    def __init__(self, step_id: int, num_planes: int) -> None:
        self.step_id = step_id
        self.num_planes = num_planes
        self.free: list[str] = []
        self.swap_out: list[str] = []
        self.export: list[SnapshotExport] = []
        self.adopt: list[SnapshotAdopt] = []
        self.new_requests: list[NewRequest] = []
        self.swap_in: list[SwapIn] = []
        self._appends: dict[str, list[Page]] = {}
        self.prefill_rows: list[PrefillRow] = []
        self.decode_ids: list[str] = []
        self.decode_positions: list[int | None] = []
        self.decode_depths: list[int | None] = []
        self.selected: set[str] = set()  # requests with a row in this step
        self.started: set[str] = set()  # requests admitted or restored in this step
        # Host blocks that swap-ins of this step give back. The executor swaps out before it
        # swaps in, so a snapshot taken in this step cannot use them yet.
        self.host_blocks_restored = 0
        # A request more important than the background class was left waiting by this step's
        # admission (batch.select_rows caps the background's rows while one is).
        self.foreground_waiting = False
        self.report = StepReport(step_id)

    @property
    def num_rows(self) -> int:
        return len(self.prefill_rows) + len(self.decode_ids)

    def append_pages(self, request_id: str, pages: list[Page]) -> None:
        if pages:
            self._appends.setdefault(request_id, []).extend(pages)

    def swap_in_pages(self, request_id: str, pages: list[Page]) -> None:
        self.swap_in.append(
            SwapIn.model_construct(
                request_id=request_id, block_ids=_by_plane(pages, self.num_planes)
            )
        )

    def withdraw(self, request_id: str) -> None:
        """Take back this step's start of ``request_id``: its new-request or swap-in action and
        its page appends (a rule that may evict a request in the step it started needs this; the
        executor swaps out before it admits, so the start and the eviction cannot both be sent).
        """
        self.new_requests = [n for n in self.new_requests if n.request_id != request_id]
        self.swap_in = [s for s in self.swap_in if s.request_id != request_id]
        self._appends.pop(request_id, None)

    def add_prefill(
        self,
        request_id: str,
        token_start: int,
        token_end: int,
        depth_first: int,
        depth_last: int,
        completes_fill: bool,
    ) -> None:
        self.prefill_rows.append(
            PrefillRow.model_construct(
                request_id=request_id,
                token_start=token_start,
                token_end=token_end,
                depth_first=depth_first,
                depth_last=depth_last,
                completes_fill=completes_fill,
            )
        )
        self.selected.add(request_id)

    def add_decode(self, request_id: str, position: int | None, depth: int | None) -> None:
        self.decode_ids.append(request_id)
        self.decode_positions.append(position)
        self.decode_depths.append(depth)
        self.selected.add(request_id)

    def is_empty(self) -> bool:
        return not (
            self.free
            or self.swap_out
            or self.export
            or self.adopt
            or self.new_requests
            or self.swap_in
            or self._appends
            or self.num_rows
        )

    def build(self) -> StepPlan:
        appends = [
            BlockAppend.model_construct(
                request_id=request_id, new_block_ids=_by_plane(pages, self.num_planes)
            )
            for request_id, pages in self._appends.items()
        ]
        decode = DecodeRows.model_construct(
            request_ids=self.decode_ids,
            positions=self.decode_positions,
            depths=self.decode_depths,
        )
        return StepPlan.model_construct(
            type="plan",
            step_id=self.step_id,
            free=self.free,
            swap_out=self.swap_out,
            export=self.export,
            adopt=self.adopt,
            new_requests=self.new_requests,
            swap_in=self.swap_in,
            block_appends=appends,
            prefill_rows=self.prefill_rows,
            decode=decode,
            traceparent=None,
        )
