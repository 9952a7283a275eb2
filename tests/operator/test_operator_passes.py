"""Coalescing passes: one at a time per pool, each trigger answered by a pass begun after it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvgate.operator.passes import PassRunner


class Recorder:
    """A pass that records when it starts and waits until the test lets it finish."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str, int]] = []
        self.changed = asyncio.Condition()
        self.release = asyncio.Event()
        self.running = 0
        self.most_running = 0

    async def __call__(self, namespace: str, name: str) -> int:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        number = len(self.started)
        self.started.append((namespace, name, number))
        async with self.changed:
            self.changed.notify_all()
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return number


async def _until(recorder: Recorder, predicate: Callable[[], bool]) -> None:
    async def wait() -> None:
        async with recorder.changed:
            await recorder.changed.wait_for(predicate)

    await asyncio.wait_for(wait(), 5)


async def test_a_burst_costs_two_passes() -> None:
    recorder = Recorder()
    runner = PassRunner(recorder)
    first = asyncio.create_task(runner.run("ns", "pool"))
    await _until(recorder, lambda: bool(recorder.started))
    burst = [asyncio.create_task(runner.run("ns", "pool")) for _ in range(5)]
    await asyncio.sleep(0)
    recorder.release.set()
    results = await asyncio.gather(first, *burst)
    # The first trigger got its pass; the burst arrived during it and shares one more pass.
    assert results == [0, 1, 1, 1, 1, 1]
    assert len(recorder.started) == 2
    assert recorder.most_running == 1


async def test_pools_do_not_wait_for_each_other() -> None:
    recorder = Recorder()
    runner = PassRunner(recorder)
    tasks = [asyncio.create_task(runner.run("ns", name)) for name in ("a", "b")]
    await _until(recorder, lambda: len(recorder.started) == 2)
    assert recorder.most_running == 2
    recorder.release.set()
    await asyncio.gather(*tasks)


async def test_a_failed_pass_answers_nobody_else() -> None:
    calls = 0

    async def flaky(namespace: str, name: str) -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if calls == 1:
            raise RuntimeError("API down")
        return calls

    runner = PassRunner(flaky)
    results = await asyncio.gather(
        runner.run("ns", "p"), runner.run("ns", "p"), return_exceptions=True
    )
    assert isinstance(results[0], RuntimeError)
    assert results[1] == 2  # the waiting trigger ran its own pass instead of inheriting a failure
    assert runner._pools == {}  # idle pools keep no state


async def test_sequential_triggers_each_run_a_pass() -> None:
    count = 0

    async def counting(namespace: str, name: str) -> int:
        nonlocal count
        count += 1
        return count

    runner = PassRunner(counting)
    assert [await runner.run("ns", "p") for _ in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("waiters", [1, 3])
async def test_cancelled_waiters_leave_no_state(waiters: int) -> None:
    recorder = Recorder()
    runner = PassRunner(recorder)
    tasks = [asyncio.create_task(runner.run("ns", "p")) for _ in range(waiters)]
    await _until(recorder, lambda: bool(recorder.started))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert runner._pools == {}
