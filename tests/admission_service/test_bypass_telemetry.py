"""Bypass counts reach the metric, the step and request spans and the results, as admission made
them; the configured bound and the largest count seen are exported beside them.

The workload is worked out by hand (preemption off, so admission prices whole capacities; block
size 4, 7 blocks, limit 2)::

    a    priority 0, 8 tokens   2 blocks   starts             free 5
    big  priority 1, 24 tokens  6 blocks   deferred (6 > 5)
    c    priority 2, 8 tokens   2 blocks   starts: big 1      free 3
    d    priority 2, 8 tokens   2 blocks   starts: big 2      free 1; big is at the limit: stop
    e    priority 2, 8 tokens   2 blocks   waits behind big, which no one may pass any more

So the first step bypasses ``big`` twice and nothing is ever bypassed again: two increments in
all, ``big`` ends with 2 and every other request with 0.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvgate.scheduler.config import PreemptionMode
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import (
    CacheSection,
    ModelSection,
    Workload,
    WorkloadRequest,
)
from kvgate.telemetry import attributes as attr

from .helpers import make_rig, request_body, scheduler_config, settle

pytestmark = pytest.mark.timeout(60)
LIMIT = 2
REQUESTS = (("a", 0, 4), ("big", 1, 20), ("c", 2, 4), ("d", 2, 4), ("e", 2, 4))
EXPECTED = {"a": 0, "big": 2, "c": 0, "d": 0, "e": 0}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def test_bypass_counts_reach_metrics_spans_and_results() -> None:
    rig = make_rig(
        scheduler=scheduler_config(
            preemption=PreemptionMode.OFF,
            max_admission_bypasses=LIMIT,
            watermark_ratio=0.0,
            growth_reserve_steps=0,
        )
    )
    try:
        await rig.add_executors("a", num_blocks=7, block_size=4)
        for request_id, priority, prompt_len in REQUESTS:
            rig.submit(
                request_body(request_id, prompt_len=prompt_len, max_tokens=5, priority=priority)
            )
        await settle(rig, len(REQUESTS))

        results = {rid: r.scheduling.bypasses for rid, r in rig.sink.answers.items()}
        assert results == EXPECTED

        spans = rig.spans.get_finished_spans()
        request_spans = {
            (s.attributes or {})[attr.GEN_AI_RESPONSE_ID]: s
            for s in spans
            if s.name == "text_completion kvgate"
        }
        assert {
            rid: (s.attributes or {})[attr.REQUEST_BYPASSES] for rid, s in request_spans.items()
        } == EXPECTED

        steps = [dict(s.attributes or {}) for s in spans if s.name == attr.ADMISSION_STEP_SPAN]
        bypassing = [s for s in steps if s[attr.STEP_BYPASSES]]
        assert [(s[attr.STEP_BYPASSES], s[attr.STEP_MAX_BYPASSES]) for s in bypassing] == [(2, 2)]
        assert bypassing[0][attr.STEP_ADMISSIONS] == 3  # a, c and d
        assert all(s[attr.STEP_BYPASS_LIMIT] == LIMIT for s in steps)
        assert all(s[attr.STEP_MAX_BYPASSES] == 0 for s in steps if not s[attr.STEP_BYPASSES])

        text = generate_latest(rig.engine.metrics.registry).decode()
        assert _metric(text, "kvgate_admission_bypasses_total") == 2
        assert _metric(text, "kvgate_admission_bypass_limit") == LIMIT
        assert _metric(text, "kvgate_admission_max_bypasses_seen") == 2
    finally:
        await rig.engine.close()


def test_the_simulator_report_carries_the_same_counts() -> None:
    """``kvgate sim``'s report: the scheduler's own count and the independent audit agree."""
    workload = Workload(
        model=ModelSection(loops=1),
        cache=CacheSection(num_blocks=7, block_size=4, host_snapshot_blocks=0),
        scheduler=scheduler_config(
            preemption=PreemptionMode.OFF,
            max_admission_bypasses=LIMIT,
            watermark_ratio=0.0,
            growth_reserve_steps=0,
            async_scheduling=False,
        ),
        requests=[
            WorkloadRequest(id=rid, prompt_len=prompt_len, max_tokens=5, priority=priority)
            for rid, priority, prompt_len in REQUESTS
        ],
    )
    report = simulate(workload)
    assert report.passed, report.to_text()
    assert (report.max_counted_bypasses, report.max_audited_bypasses) == (2, 2)
    assert report.max_bypasses == 2
