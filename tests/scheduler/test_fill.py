"""Wavefront readiness over (chunk, depth) and plain chunked prefill."""

from __future__ import annotations

from kvgate.scheduler.request import Fill


def _run(fill: Fill, budget_chunk: int) -> list[list[tuple[int, int, int]]]:
    """Schedule every ready task each step (completing them at once); returns the steps."""
    steps = []
    while not fill.done:
        tasks = fill.ready_tasks()
        assert tasks, "a fill with work must always have a ready task"
        rows = []
        for task in tasks:
            size = task.max_tokens if task.chunk is not None else min(task.max_tokens, budget_chunk)
            chunk, _ = fill.schedule(task, size)
            rows.append((chunk.start, chunk.end, task.depth_last))
        for start, _, depth in rows:
            fill.complete(start, depth)
        steps.append(rows)
    return steps


def test_wavefront_runs_different_chunks_at_different_depths_in_one_step() -> None:
    fill = Fill(length=6, start=0, num_loops=3, wavefront=True)
    steps = _run(fill, 2)
    assert steps[0] == [(0, 2, 1)]
    assert steps[1] == [(0, 2, 2), (2, 4, 1)]
    assert steps[2] == [(0, 2, 3), (2, 4, 2), (4, 6, 1)]
    assert len(steps) == 5  # chunks + depths - 1
    for rows in steps:  # a chunk never runs ahead of the chunk before it at the same depth
        depths = {start: depth for start, _, depth in rows}
        for start, depth in depths.items():
            if start - 2 in depths:
                assert depths[start - 2] > depth


def test_plain_chunked_prefill_runs_every_depth_per_row() -> None:
    fill = Fill(length=5, start=1, num_loops=2, wavefront=False)
    steps = _run(fill, 2)
    assert steps == [[(1, 3, 2)], [(3, 5, 2)]]
    assert fill.full_depth_frontier() == 5


def test_only_the_last_task_completes_the_fill() -> None:
    fill = Fill(length=4, start=0, num_loops=2, wavefront=True)
    completions = []
    while not fill.done:
        planned = []
        for task in fill.ready_tasks():
            size = task.max_tokens if task.chunk is not None else min(task.max_tokens, 2)
            chunk, completes = fill.schedule(task, size)
            completions.append(completes)
            planned.append((chunk.start, task.depth_last))
        for start, depth in planned:
            fill.complete(start, depth)
    assert completions.count(True) == 1 and completions[-1]
