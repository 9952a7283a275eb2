"""Property-based scheduling: thousands of random configurations and request mixes.

Every run must drain within a bound, never violate an invariant (checked after every step, with
the bypass bound audited independently), and match the reference outputs. Derandomized so CI is
reproducible; ``KVGATE_PROPERTY_EXAMPLES`` raises the count for longer local runs.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.scheduler.config import (
    AdmissionPricing,
    Fairness,
    Mode,
    Policy,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import (
    CacheSection,
    ExitMode,
    ModelSection,
    Workload,
    WorkloadRequest,
)

EXAMPLES = int(os.environ.get("KVGATE_PROPERTY_EXAMPLES", "2000"))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    loops = draw(st.integers(1, 4))
    min_loops = draw(st.integers(1, loops))
    exit_mode = draw(st.sampled_from(list(ExitMode)))
    vocab = draw(st.integers(8, 40))
    eos = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    block_size = draw(st.sampled_from([1, 2, 4]))
    shared_prefix = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=9))
    requests = []
    for index in range(draw(st.integers(1, 8))):
        max_tokens = draw(st.integers(1, 10))
        if draw(st.booleans()):
            tail = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
            prompt, prompt_len = [*shared_prefix, *tail], None
        else:
            prompt, prompt_len = None, draw(st.integers(1, 18))
        trace = None
        if exit_mode is ExitMode.TRACE:
            tail_depths = st.lists(
                st.integers(min_loops, loops), min_size=max_tokens - 1, max_size=max_tokens - 1
            )
            trace = [loops, *draw(tail_depths)]
        requests.append(
            WorkloadRequest(
                id=f"r{index}",
                arrival_step=draw(st.integers(0, 12)),
                prompt=prompt,
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                priority=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 3)),
                exit_depths=trace,
                ignore_eos=draw(st.booleans()),
            )
        )
    largest = (
        max(
            -(-(len(r.prompt or ()) + (r.prompt_len or 0) + r.max_tokens - 1) // block_size)
            for r in requests
        )
        * loops
    )
    num_blocks = draw(st.integers(largest, largest * 3))
    wavefront = draw(st.booleans())
    budget = draw(st.integers(1 if wavefront else loops, 24))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget,
        prefill_chunk_size=draw(st.integers(1, budget)),
        max_admission_bypasses=draw(st.integers(0, 4)),
        admission_scan_limit=draw(st.integers(1, 8)),
        policy=draw(st.sampled_from(list(Policy))),
        mode=draw(st.sampled_from(list(Mode))),
        wavefront_prefill=wavefront,
        incremental_allocation=draw(st.booleans()),
        preemption=draw(st.sampled_from(list(PreemptionMode))),
        async_scheduling=draw(st.booleans()),
        watermark_ratio=draw(st.sampled_from([0.0, 0.05, 0.2])),
        min_residency_steps=draw(st.integers(0, 4)),
        growth_reserve_steps=draw(st.sampled_from([0, 1, 8])),
        admission_pricing=draw(st.sampled_from(list(AdmissionPricing))),
        stall_steps=128,
    )
    work = sum(
        ((len(r.prompt or ()) + (r.prompt_len or 0)) + r.max_tokens) * loops for r in requests
    )
    return Workload(
        model=ModelSection(
            loops=loops,
            min_loops=min_loops,
            exit=exit_mode,
            vocab_size=vocab,
            seed=7,
            eos_token_id=eos,
        ),
        cache=CacheSection(
            num_blocks=num_blocks,
            block_size=block_size,
            host_snapshot_blocks=draw(st.integers(0, num_blocks)),
            enable_prefix_caching=draw(st.booleans()),
        ),
        scheduler=config,
        requests=requests,
        # The stated bound: generous in the total token-passes, far below a livelock's runaway.
        max_steps=60 + 6 * work,
    )


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workloads_drain_with_invariants_and_reference_outputs(workload: Workload) -> None:
    _assert_drains(workload)


def _assert_drains(workload: Workload) -> None:
    report = simulate(workload)
    assert report.rejected == 0, report.rejections
    assert report.finished == report.total, report.to_text()
    assert not report.stalled, report.stall_dump
    assert report.invariant_violations == 0, report.violations
    assert report.max_bypasses <= workload.scheduler.max_admission_bypasses
    assert report.outputs_match_reference, report.mismatched_requests
    assert report.leaked_blocks == report.leaked_snapshots == report.leaked_executor_requests == 0


TENANT_EXAMPLES = int(os.environ.get("KVGATE_PROPERTY_EXAMPLES_TENANTS", "600"))


@st.composite
def tenant_workloads(draw: st.DrawFn) -> Workload:
    """A random workload with tenants, weights, fair sharing and deadline order: each request
    of one of three tenants, some with a deadline (late enough to be met: this orders, the
    expiry is tested elsewhere), the others ordered by a random slack after their arrival."""
    workload = draw(workloads())
    requests = [
        request.model_copy(
            update={
                "tenant": draw(st.sampled_from(["a", "b", "c", None])),
                "deadline_step": draw(
                    st.one_of(st.none(), st.integers(workload.max_steps, 2 * workload.max_steps))
                ),
            }
        )
        for request in workload.requests
    ]
    weights = draw(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 3.0]))
    )
    scheduler = workload.scheduler.model_copy(
        update={
            "fairness": draw(st.sampled_from(list(Fairness))),
            "tenant_weights": weights,
            "default_tenant_weight": draw(st.sampled_from([1.0, 2.0])),
            "deadline_order": draw(st.booleans()),
            "deadline_slack_s": draw(st.sampled_from([1.0, 20.0, 600.0])),
        }
    )
    return workload.model_copy(update={"scheduler": scheduler, "requests": requests})


@settings(
    max_examples=TENANT_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(tenant_workloads())
def test_random_tenant_mixes_drain_with_invariants_and_reference_outputs(
    workload: Workload,
) -> None:
    """Liveness under any tenant mix: every request finishes within the same bound, with the
    fair-order invariant and the bypass bound checked after every step."""
    _assert_drains(workload)


BACKGROUND_EXAMPLES = int(os.environ.get("KVGATE_PROPERTY_EXAMPLES_BACKGROUND", "300"))


@st.composite
def background_workloads(draw: st.DrawFn) -> Workload:
    """A random workload under priority order whose least important classes are the background
    class, with a random cap (the scheduler raises it to the loop count without wavefront)."""
    workload = draw(workloads())
    scheduler = workload.scheduler.model_copy(
        update={
            "policy": Policy.PRIORITY,
            "background_priority": draw(st.integers(1, 3)),
            "background_step_tokens": draw(st.integers(1, 5)),
        }
    )
    return workload.model_copy(update={"scheduler": scheduler})


@settings(
    max_examples=BACKGROUND_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(background_workloads())
def test_random_background_mixes_drain_with_invariants_and_reference_outputs(
    workload: Workload,
) -> None:
    """Liveness with a background class: every request finishes within the same bound."""
    _assert_drains(workload)
