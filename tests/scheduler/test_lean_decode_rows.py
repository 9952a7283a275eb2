"""The batch planner's lean decode paths plan exactly what its general path would.

``_visit_rows`` plans the common decode rows inline (a request whose last pass is resolved, and
under async scheduling one whose pass in flight surely ends its token) and leaves everything
else to ``next_decode_pass``. Here every planned step is checked against ``next_decode_pass``
itself, asked before the row is planned: the same position and depth, no row where it plans
none, and no more pages than the row's frontier needs.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.scheduler import batch
from kvgate.scheduler.config import Mode
from kvgate.scheduler.request import RequestStatus
from kvgate.sim.livelock_cases import LIVELOCK_SEEDS, livelock_case
from kvgate.sim.runner import run_once
from kvgate.sim.workload import ExitMode, Workload


def _plain(workload: Workload) -> Workload:
    """The same requests on a model of one loop (every pass ends its token)."""
    model = workload.model.model_copy(update={"loops": 1, "exit": ExitMode.FIXED})
    return workload.model_copy(update={"model": model})


@pytest.mark.parametrize("seed", LIVELOCK_SEEDS[:6])
@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_decode_row_is_what_next_decode_pass_plans(
    monkeypatch: pytest.MonkeyPatch, seed: int, plain: bool, async_scheduling: bool
) -> None:
    visit = batch._visit_rows
    checked = {"rows": 0, "in_flight": 0, "none": 0}

    def checking(
        state: Any, builder: Any, rooms: Any, requests: Any, budget: int, stage: Any
    ) -> int:
        # What the general path would plan for each decode-ready request, asked before any.
        expected = {}
        for request in requests:
            if (
                request.status is RequestStatus.RUNNING
                and request.fill is None
                and request.inflight_step != state.step
                and stage is not batch._Stage.FILL
            ):
                expected[request.request_id] = (
                    batch.next_decode_pass(state, request),
                    state.unresolved(request),
                    state.pool.num_pages(request.request_id),
                    request,
                )
        left = visit(state, builder, rooms, requests, budget, stage)
        rows = {
            rid: (position, depth)
            for rid, position, depth in zip(
                builder.decode_ids, builder.decode_positions, builder.decode_depths, strict=True
            )
        }
        for rid, (nxt, in_flight, pages_before, request) in expected.items():
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted by a later row's growth in this step
            if nxt is None:
                assert rid not in rows, f"{rid}: a row where the general path plans none"
                checked["none"] += 1
                continue
            if rid not in rows:
                continue  # no budget or no page left for it
            position, depth, frontier = nxt
            assert rows[rid] == (position, depth), f"{rid}: {rows[rid]} instead of {nxt[:2]}"
            needed = state.pool.pages_for(min(frontier, request.capacity_tokens))
            assert state.pool.num_pages(rid) <= max(pages_before, needed), rid
            checked["rows"] += 1
            checked["in_flight"] += in_flight
        return left

    monkeypatch.setattr(batch, "_visit_rows", checking)
    workload = livelock_case(
        seed, mode=Mode.MIXED, wavefront=False, async_scheduling=async_scheduling
    )
    result = run_once(_plain(workload) if plain else workload)
    assert not result.invariant_violations
    assert checked["rows"] > 50
    if async_scheduling:
        assert checked["in_flight"] > 10 and checked["none"] > 0
