"""The autoscaling ticker retries a failed pass after the operator's jittered backoff over the
pool's consecutive failures, and starts that count again once a pass succeeds."""

from __future__ import annotations

import asyncio

from kvgate.operator.reconciler import Outcome, OutcomeKind
from kvgate.operator.runtime import SyncTicker


async def test_failed_passes_back_off_by_their_count_and_success_resets_it() -> None:
    # Pass results in order: two failures, a success, a failure, a success that stops the sync.
    script: list[Exception | Outcome] = [
        RuntimeError("apiserver down"),
        RuntimeError("apiserver down"),
        Outcome(OutcomeKind.CONVERGED, sync_s=0.01),
        RuntimeError("apiserver down"),
        Outcome(OutcomeKind.CONVERGED, sync_s=None),
    ]
    retries: list[int] = []
    done = asyncio.Event()

    def retry_delay_s(failures: int) -> float:
        retries.append(failures)
        return 0.01

    async def run(namespace: str, name: str) -> Outcome:
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        ticker.saw(namespace, name, step)  # as the runtime's pass does
        if not script:
            done.set()
        return step

    ticker = SyncTicker(run, retry_delay_s)
    ticker.saw("serving", "pool-a", Outcome(OutcomeKind.CONVERGED, sync_s=0.01))
    try:
        await asyncio.wait_for(done.wait(), timeout=30)
    finally:
        await ticker.close()
    assert retries == [0, 1, 0]
