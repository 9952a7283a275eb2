"""Workload families used by the tests, the benchmarks and the bundled examples."""

from __future__ import annotations

from kvgate.scheduler.config import AdmissionPricing, Fairness, Mode, SchedulerConfig
from kvgate.sim.hashing import mix
from kvgate.sim.workload import (
    CacheSection,
    ExitMode,
    ModelSection,
    Workload,
    WorkloadRequest,
)

LIVELOCK_SEEDS = (8, 21)


def livelock_case(
    seed: int,
    *,
    mode: Mode,
    wavefront: bool,
    async_scheduling: bool,
    pricing: AdmissionPricing = AdmissionPricing.FILL,
    max_steps: int = 500,
) -> Workload:
    """Ten requests of mixed priority arriving in a staggered burst onto a looped model whose
    cache holds only a few of them at once: preemption and restore are unavoidable.

    Shaped like the seed's ``test_priority_staged_prefill_drains_under_cache_pressure``: a tiny
    four-loop model, block size 2, short prompts, eight-ish outputs, priorities 0/5/10."""
    requests = []
    arrival = 0
    for index in range(10):
        h = mix(seed, index)
        arrival += (h >> 8) % 4
        requests.append(
            WorkloadRequest(
                id=f"r{index}",
                arrival_step=arrival,
                prompt_len=4 + (h >> 16) % 13,
                max_tokens=6 + (h >> 24) % 6,
                priority=(0, 5, 10)[(h >> 32) % 3],
                seed=index,
            )
        )
    return Workload(
        model=ModelSection(loops=4, min_loops=1, exit=ExitMode.HASH, vocab_size=64, seed=seed),
        cache=CacheSection(num_blocks=64, block_size=2, host_snapshot_blocks=48),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=8,
            prefill_chunk_size=2,
            max_admission_bypasses=2,
            admission_scan_limit=16,
            mode=mode,
            wavefront_prefill=wavefront,
            async_scheduling=async_scheduling,
            admission_pricing=pricing,
            watermark_ratio=0.0,
            min_residency_steps=2,
            stall_steps=64,
        ),
        requests=requests,
        max_steps=max_steps,
    )


def livelock_suite(
    pricings: tuple[AdmissionPricing, ...] = tuple(AdmissionPricing),
) -> list[tuple[str, Workload]]:
    """refill/mixed × wavefront on/off × async on/off × two arrival seeds, under each admission
    pricing: ``first_chunk`` over-commits the cache on purpose, so liveness cannot lean on
    conservative admission."""
    cases = []
    for pricing in pricings:
        for mode in (Mode.REFILL, Mode.MIXED):
            for wavefront in (False, True):
                for async_scheduling in (False, True):
                    for seed in LIVELOCK_SEEDS:
                        name = (
                            f"{pricing.value}-{mode.value}-"
                            f"{'wavefront' if wavefront else 'chunked'}-"
                            f"{'async' if async_scheduling else 'sync'}-seed{seed}"
                        )
                        workload = livelock_case(
                            seed,
                            mode=mode,
                            wavefront=wavefront,
                            async_scheduling=async_scheduling,
                            pricing=pricing,
                        )
                        cases.append((name, workload))
    return cases


TENANT_WEIGHTS = {"t0": 1.0, "t1": 2.0, "t2": 4.0}


def with_tenants(workload: Workload, seed: int) -> Workload:
    """The same case with three tenants of weights 1, 2 and 4 (by a hash of the request), fair
    sharing and deadline order on; a third of the requests carry a deadline past the step cap
    (ordering, not expiry: expiry would change outputs against the reference), the others are
    ordered by a short slack after their arrival."""
    requests = []
    for index, request in enumerate(workload.requests):
        h = mix(seed + 1, index)
        deadline = request.arrival_step + 600 + (h >> 12) % 300 if (h >> 8) % 3 == 0 else None
        requests.append(
            request.model_copy(update={"tenant": f"t{(h >> 4) % 3}", "deadline_step": deadline})
        )
    scheduler = workload.scheduler.model_copy(
        update={
            "fairness": Fairness.TOKENS,
            "tenant_weights": TENANT_WEIGHTS,
            "deadline_order": True,
            "deadline_slack_s": 40.0,
        }
    )
    return workload.model_copy(update={"scheduler": scheduler, "requests": requests})


def tenant_livelock_suite() -> list[tuple[str, Workload]]:
    """The livelock suite under ``fill`` pricing with tenants, weights and deadlines
    (``with_tenants``), plus the same under ``fcfs`` (one class for every priority)."""
    cases = []
    for name, workload in livelock_suite((AdmissionPricing.FILL,)):
        seed = int(name.rsplit("seed", 1)[1])
        cases.append((f"{name}-tenants", with_tenants(workload, seed)))
    for name, workload in cases[::4]:
        scheduler = workload.scheduler.model_copy(update={"policy": "fcfs"})
        cases.append((f"{name}-fcfs", workload.model_copy(update={"scheduler": scheduler})))
    return cases
