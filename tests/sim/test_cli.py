"""``kvgate sim``: the report, exit codes, and clear errors for bad workload files."""

from __future__ import annotations

import json
import os
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


REPO = Path(__file__).resolve().parents[2]
# What the `kvgate` console script runs. Started as a file, its own folder (not the current
# directory) is first on sys.path, as for the installed script; kvgate is loaded from this
# checkout by path so that neither PYTHONPATH nor the repository is on sys.path.
CONSOLE_SCRIPT = f"""
import importlib.util, os, sys
assert {str(REPO)!r} not in sys.path and os.getcwd() not in sys.path, sys.path
spec = importlib.util.spec_from_file_location(
    "kvgate", {str(REPO / "kvgate" / "__init__.py")!r},
    submodule_search_locations=[{str(REPO / "kvgate")!r}],
)
kvgate = importlib.util.module_from_spec(spec)
sys.modules["kvgate"] = kvgate
spec.loader.exec_module(kvgate)
from kvgate.cli import main
sys.exit(main())
"""


def _kvgate_script(tmp_path: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "bin" / "kvgate_script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(CONSOLE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_admission_module_is_found_from_the_repository_root(tmp_path: Path) -> None:
    done = _kvgate_script(
        tmp_path, "sim", str(EXAMPLE), "--admission", "benchmarks.baselines:SeedPreFix", cwd=REPO
    )
    assert done.returncode == 1, done.stderr  # runs, and the strategy fails the livelock workload
    assert "FAIL" in done.stdout


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("benchmarks.baselines:SeedPreFix", "no module named 'benchmarks'"),
        ("json:Nope", "json has no attribute 'Nope'"),
    ],
)
def test_a_missing_admission_module_or_name_is_one_line(
    tmp_path: Path, target: str, message: str
) -> None:
    # From a directory without benchmarks/, the module is not found.
    done = _kvgate_script(tmp_path, "sim", str(REPO / EXAMPLE), "--admission", target, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert message in done.stderr
