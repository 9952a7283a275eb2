"""Workload families used by the tests, the benchmarks and the bundled examples."""

from __future__ import annotations

from kvgate.admission_service.scheduler.config import AdmissionPricing, Mode, SchedulerConfig
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
