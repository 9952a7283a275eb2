"""The window of answered ids: kept for the window, at most ``max_ids``, oldest forgotten first."""

from __future__ import annotations

from kvgate.admission_service.idempotency import AnsweredIds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ids_are_kept_for_the_window_and_no_longer() -> None:
    clock = Clock()
    ids = AnsweredIds(window_s=60.0, max_ids=100, clock=clock)
    ids.add("a")
    clock.now += 59.0
    assert "a" in ids
    clock.now += 2.0
    assert "a" not in ids
    ids.add_all([("old", clock.now - 61.0), ("recent", clock.now - 1.0)])  # read back from Kafka
    assert "old" not in ids and "recent" in ids


def test_at_most_max_ids_the_oldest_go_first() -> None:
    clock = Clock()
    ids = AnsweredIds(window_s=600.0, max_ids=3, clock=clock)
    for n in range(5):
        clock.now += 1.0
        ids.add(f"r{n}")
    assert len(ids) == 3
    assert [f"r{n}" in ids for n in range(5)] == [False, False, True, True, True]
