"""Workloads the tenant property run found, kept as cases.

Displacement across tenants once let a request evict a running request *ahead* of it in the
order (its tenant being under its share): the victim, restored, evicted it back by growth (which
evicts what is behind), and the two traded places every few steps with nothing finishing (84
preemptions, stalled). Displacement now takes only victims behind the requester, so the two
rules agree."""

from __future__ import annotations

from kvgate.scheduler.config import (
    AdmissionPricing,
    Fairness,
    Mode,
    Policy,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.sim.simulate import simulate
from kvgate.sim.workload import CacheSection, ExitMode, ModelSection, Workload, WorkloadRequest


def _traded_places() -> Workload:
    def request(rid: str, tenant: str | None, **fields: object) -> WorkloadRequest:
        return WorkloadRequest.model_validate({"id": rid, "tenant": tenant, **fields})

    zeros = [0] * 6
    return Workload(
        model=ModelSection(loops=4, min_loops=3, exit=ExitMode.FIXED, vocab_size=15, seed=7),
        cache=CacheSection(num_blocks=92, block_size=1, host_snapshot_blocks=8),
        scheduler=SchedulerConfig(
            max_num_seqs=3,
            max_num_batched_tokens=8,
            prefill_chunk_size=2,
            max_admission_bypasses=3,
            admission_scan_limit=6,
            policy=Policy.PRIORITY,
            mode=Mode.MIXED,
            admission_pricing=AdmissionPricing.FIRST_CHUNK,
            preemption=PreemptionMode.AUTO,
            watermark_ratio=0.05,
            min_residency_steps=2,
            growth_reserve_steps=0,
            stall_steps=128,
            fairness=Fairness.TOKENS,
            tenant_weights={"c": 0.5, "a": 0.5},
            default_tenant_weight=2.0,
            deadline_slack_s=1.0,
        ),
        requests=[
            request("r0", "c", prompt=zeros, max_tokens=1, deadline_step=3234),
            request("r1", "a", prompt_len=1, max_tokens=6, priority=3, ignore_eos=False),
            request("r2", "a", prompt=zeros, max_tokens=10),
            request("r3", "b", arrival_step=12, prompt_len=10, max_tokens=3, ignore_eos=False),
            request("r4", "c", prompt=[0, 0, 0, 12, 0, 11, 13, 0, 0, 0, 0, 0], max_tokens=7),
            request("r5", "a", arrival_step=3, prompt=[0, 0, 0, 0, 12, 7, 3], max_tokens=6, seed=1),
            request(
                "r6", None, arrival_step=4, prompt_len=12, max_tokens=6, seed=2, ignore_eos=False
            ),
        ],
        max_steps=2292,
    )


def test_displacement_and_growth_do_not_trade_places() -> None:
    report = simulate(_traded_places())
    assert report.finished == report.total == 7, report.to_text()
    assert not report.stalled
    assert report.invariant_violations == 0, report.violations
    assert report.outputs_match_reference, report.mismatched_requests
    assert report.preemptions < 30, report.preemptions
