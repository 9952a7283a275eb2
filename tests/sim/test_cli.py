"""``kvgate sim``: the report, exit codes, and clear errors for bad workload files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import main

EXAMPLE = Path("kvgate/sim/examples/livelock.json")


def test_bundled_workload_passes_and_reports_every_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sim", str(EXAMPLE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "total",
        "finished",
        "rejected",
        "steps",
        "preemptions",
        "restores",
        "restore_modes",
        "max_bypasses",
        "stalled",
        "leaked_blocks",
        "leaked_snapshots",
        "invariant_violations",
        "outputs_match_reference",
        "recomputed_tokens",
        "queueing_steps_p50",
        "queueing_steps_p99",
    ):
        assert key in report
    assert report["finished"] == report["total"] == 10
    assert report["preemptions"] > 0 and report["outputs_match_reference"]


def test_a_failing_strategy_exits_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", str(EXAMPLE), "--admission", "benchmarks.baselines:SeedPreFix"])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON at line 1"),
        (
            json.dumps({"cache": {"num_blocks": 8}, "requests": [{"id": "a", "prompt_len": 0}]}),
            "requests[0].prompt_len",
        ),
        (
            json.dumps({"cache": {"num_blocks": 8}, "requests": [], "scheduler": {"bogus": 1}}),
            "scheduler.bogus",
        ),
        (
            json.dumps(
                {
                    "cache": {"num_blocks": 8},
                    "requests": [{"id": "a", "prompt": [1], "prompt_len": 3}],
                }
            ),
            "exactly one of prompt",
        ),
        (json.dumps({"requests": []}), "cache: Field required"),
    ],
)
def test_bad_workload_files_name_the_field_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needle: str
) -> None:
    path = tmp_path / "w.json"
    path.write_text(content)
    assert main(["sim", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_bad_admission_target_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", str(EXAMPLE), "--admission", "benchmarks.baselines:Nope"]) == 2
    assert "no attribute 'Nope'" in capsys.readouterr().err


def test_the_command_runs_as_a_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "sim", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "verdict" in done.stdout and "PASS" in done.stdout
