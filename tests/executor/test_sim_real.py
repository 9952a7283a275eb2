"""``kvgate sim --executor real``: the scheduler driving the real executor in-process.

Under cache pressure with preemption on, every request's tokens and exit depths must equal the
model's unpaged one-request-at-a-time reference, with no leaks and no invariant violations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.scheduler.config import (
    AdmissionPricing,
    Mode,
    PreemptionMode,
    SchedulerConfig,
)
from kvgate.sim.real import simulate_real
from kvgate.sim.workload import (
    CacheSection,
    ExitMode,
    ModelSection,
    Workload,
    WorkloadRequest,
)


def _workload(
    preemption: PreemptionMode,
    mode: Mode,
    wavefront: bool,
    exit_mode: ExitMode,
    async_scheduling: bool,
) -> Workload:
    requests = [
        WorkloadRequest(
            id=f"r{i}",
            arrival_step=2 * i,
            prompt_len=5 + 3 * i,
            max_tokens=7,
            priority=(5, 0, 9, 2)[i],
            seed=i,
        )
        for i in range(4)
    ]
    return Workload(
        model=ModelSection(exit=exit_mode),
        cache=CacheSection(num_blocks=30, block_size=2, host_snapshot_blocks=12),
        scheduler=SchedulerConfig(
            max_num_seqs=3,
            max_num_batched_tokens=12,
            prefill_chunk_size=4,
            mode=mode,
            wavefront_prefill=wavefront,
            preemption=preemption,
            min_residency_steps=1,
            admission_pricing=AdmissionPricing.FIRST_CHUNK,
            watermark_ratio=0.0,
            async_scheduling=async_scheduling,
        ),
        requests=requests,
        max_steps=400,
    )


@pytest.mark.parametrize(
    ("preemption", "mode", "wavefront", "exit_mode", "async_scheduling"),
    [
        (PreemptionMode.SNAPSHOT, Mode.MIXED, True, ExitMode.HASH, False),
        (PreemptionMode.RECOMPUTE, Mode.REFILL, False, ExitMode.HASH, True),
        (PreemptionMode.AUTO, Mode.MIXED, False, ExitMode.FIXED, False),
    ],
)
def test_looped_model_under_pressure_matches_the_unpaged_reference(
    looped_dir: Path,
    preemption: PreemptionMode,
    mode: Mode,
    wavefront: bool,
    exit_mode: ExitMode,
    async_scheduling: bool,
) -> None:
    report = simulate_real(
        _workload(preemption, mode, wavefront, exit_mode, async_scheduling), looped_dir
    )
    assert report.preemptions > 0, "the cache must force preemption"
    assert report.passed, report.to_text()


def test_llama_model_under_pressure_matches_the_unpaged_reference(llama_dir: Path) -> None:
    workload = _workload(PreemptionMode.AUTO, Mode.MIXED, False, ExitMode.FIXED, True)
    workload = workload.model_copy(
        update={"cache": CacheSection(num_blocks=10, block_size=2, host_snapshot_blocks=4)}
    )
    report = simulate_real(workload, llama_dir)
    assert report.preemptions > 0
    assert report.passed, report.to_text()


def test_the_cli_runs_a_workload_on_a_checkpoint(looped_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    workload = _workload(PreemptionMode.SNAPSHOT, Mode.MIXED, True, ExitMode.HASH, False)
    path.write_text(workload.model_dump_json())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate",
            "sim",
            str(path),
            "--json",
            "--executor",
            "real",
            "--model",
            str(looped_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["finished"] == 4 and report["outputs_match_reference"]
    missing = subprocess.run(
        [sys.executable, "-m", "kvgate", "sim", str(path), "--executor", "real"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 2 and "needs --model" in missing.stderr
