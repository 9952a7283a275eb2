"""The promise that a batch's files are streamed: uploading, running and downloading a file
grows the serving process by a bound that does not depend on the file's size
(benchmarks/bench_batch_memory.py measures it; OpenAI's largest file in the full case)."""

from __future__ import annotations

import pytest

from benchmarks.bench_batch_memory import BOUND_MB, MB, measure_memory, peak_growth_mb


@pytest.mark.parametrize(
    ("lines", "file_mb"),
    [(10_000, 40), pytest.param(50_000, 200, marks=pytest.mark.slow, id="full")],
)
def test_a_file_is_never_held_whole(lines: int, file_mb: int) -> None:
    report = measure_memory(lines, file_mb * MB)
    assert report["output_mb"] > 0  # the run answered and its output came back
    # Holding the file (or the output) whole would add at least its size: more than the bound.
    assert file_mb > BOUND_MB
    assert peak_growth_mb(report) <= BOUND_MB, report
