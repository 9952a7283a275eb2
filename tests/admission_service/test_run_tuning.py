"""``kvgate run`` and ``kvgate demo`` tuning (``kvgate/local/tuning.py``): for every scheduler
limit a flag beats its ``KVGATE_SCHEDULER__*`` variable, which beats the stack's default; a
variable naming what the stack owns (its broker, its executor, their tokens) is refused before
anything starts; and the executor's threads come from ``--threads``, else ``OMP_NUM_THREADS``,
else the machine (physical cores, capped)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.admission_service.settings import load_settings
from kvgate.cli import build_parser
from kvgate.kafka_connection import SettingsError
from kvgate.local import demo, run
from kvgate.local.stack import (
    ExecutorProcess,
    StackOptions,
    local_gateway_settings,
    stack_settings,
)
from kvgate.local.tuning import (
    MAX_DEFAULT_THREADS,
    SchedulerLimits,
    executor_threads,
    refuse_owned_variables,
    scheduler_flags,
    usable_physical_cores,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=64)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVGATE_") or name == "OMP_NUM_THREADS":
            monkeypatch.delenv(name)


def _args(command: str, *argv: str) -> argparse.Namespace:
    return build_parser([command, *argv]).parse_args([command, *argv])


def _scheduler(tmp_path: Path, *flags: str, command: str = "run") -> dict[str, object]:
    """The scheduler section the stack would run with, for ``flags`` on the command line."""
    options = StackOptions(
        out_dir=tmp_path, scheduler_defaults=DEFAULTS, scheduler=scheduler_flags(_args(command,
        *flags)),
    )  # fmt: skip
    executor = ExecutorProcess(options, tmp_path / "model")
    settings = stack_settings("127.0.0.1:9", executor, options)
    return settings.scheduler.model_dump(mode="json")


@pytest.mark.parametrize(
    ("flag", "variable", "from_variable", "from_flag"),
    [
        ("--max-num-seqs", "KVGATE_SCHEDULER__MAX_NUM_SEQS", 5, 6),
        ("--max-num-batched-tokens", "KVGATE_SCHEDULER__MAX_NUM_BATCHED_TOKENS", 512, 1024),
        ("--prefill-chunk-size", "KVGATE_SCHEDULER__PREFILL_CHUNK_SIZE", 32, 16),
        ("--policy", "KVGATE_SCHEDULER__POLICY", "fcfs", "priority"),
        ("--preemption", "KVGATE_SCHEDULER__PREEMPTION", "recompute", "snapshot"),
    ],
)
def test_a_flag_beats_its_variable_which_beats_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, variable: str,
    from_variable: object, from_flag: object,
) -> None:  # fmt: skip
    key = flag.removeprefix("--").replace("-", "_")
    assert _scheduler(tmp_path)[key] != from_variable, "the default differs"
    monkeypatch.setenv(variable, str(from_variable))
    assert _scheduler(tmp_path)[key] == from_variable, "the variable beats the stack's default"
    assert _scheduler(tmp_path, flag, str(from_flag))[key] == from_flag, "the flag beats both"


def test_load_settings_ranks_defaults_beneath_the_file_the_environment_and_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "admission.yaml"
    config.write_text("kafka: {commit_interval_ms: 20, partitions: 3}\n")
    defaults = {"kafka": {"bootstrap_servers": "d:1", "commit_interval_ms": 10, "partitions": 2,
                          "session_timeout_ms": 2000, "heartbeat_interval_ms": 500}}  # fmt: skip
    monkeypatch.setenv("KVGATE_KAFKA__PARTITIONS", "4")
    kafka = load_settings(config, {"kafka": {"session_timeout_ms": 3000}}, defaults=defaults).kafka
    assert (kafka.bootstrap_servers, kafka.heartbeat_interval_ms) == ("d:1", 500), "defaults"
    assert kafka.commit_interval_ms == 20, "the file beats the defaults"
    assert kafka.partitions == 4, "the environment beats the file"
    assert kafka.session_timeout_ms == 3000, "overrides beat everything"


def test_the_stack_defaults_hold_without_flags_or_variables(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    assert (scheduler["max_num_seqs"], scheduler["max_num_batched_tokens"],
            scheduler["prefill_chunk_size"]) == (8, 256, 64)  # fmt: skip


def test_a_variable_the_stack_only_defaults_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_KAFKA__COMMIT_INTERVAL_MS", "200")
    monkeypatch.setenv("KVGATE_SHUTDOWN__GRACE_PERIOD_S", "9")
    options = StackOptions(out_dir=tmp_path)
    settings = stack_settings("127.0.0.1:9", ExecutorProcess(options, tmp_path / "m"), options)
    assert settings.kafka.commit_interval_ms == 200 and settings.shutdown.grace_period_s == 9
    assert settings.kafka.fetch_max_wait_ms == 5, "the stack's own default for Tansu"
    gateway = local_gateway_settings(settings, "127.0.0.1:9", 0)
    assert gateway.reply_fetch_max_wait_ms == 5, "Tansu holds the gateway's fetches too"


def test_a_larger_chunk_flag_grows_the_default_budget_but_not_a_chosen_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = _scheduler(tmp_path, "--prefill-chunk-size", "512")
    assert (scheduler["prefill_chunk_size"], scheduler["max_num_batched_tokens"]) == (512, 512)
    monkeypatch.setenv("KVGATE_SCHEDULER__MAX_NUM_BATCHED_TOKENS", "128")
    with pytest.raises(SettingsError, match="prefill_chunk_size"):
        _scheduler(tmp_path, "--prefill-chunk-size", "512")


def test_a_flag_over_a_variable_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVGATE_SCHEDULER__MAX_NUM_SEQS", "4")
    with caplog.at_level(logging.INFO, logger="kvgate.local.stack"):
        assert _scheduler(tmp_path, "--max-num-seqs", "9")["max_num_seqs"] == 9
    assert "KVGATE_SCHEDULER__MAX_NUM_SEQS=4 is overridden by a flag: max_num_seqs 9" in caplog.text


def test_demo_takes_the_same_flags_and_its_old_chunk_spelling(tmp_path: Path) -> None:
    flags = scheduler_flags(_args("demo", "--chunk-size", "16", "--max-num-seqs", "3",
                                  "--policy", "fcfs"))  # fmt: skip
    assert flags == SchedulerLimits(max_num_seqs=3, prefill_chunk_size=16,
                                    policy=flags.policy)  # fmt: skip
    assert flags.settings() == {"max_num_seqs": 3, "prefill_chunk_size": 16, "policy": "fcfs"}
    assert demo.TINY_LIMITS.scheduler.max_num_seqs == 8 and run.RUN_SCHEDULER.max_num_seqs == 32


@pytest.mark.parametrize(
    "variable",
    ["KVGATE_KAFKA__BOOTSTRAP_SERVERS", "KVGATE_EXECUTORS__TOKEN", "KVGATE_ADMIN__TOKEN_FILE"],
)
def test_a_variable_naming_what_the_stack_owns_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "kafka:9092")
    with pytest.raises(SettingsError, match=variable):
        refuse_owned_variables()


@pytest.mark.parametrize("command", ["run", "demo"])
def test_the_commands_refuse_it_before_starting_anything(tmp_path: Path, command: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "OTEL_"))}
    env |= {"PYTHONPATH": str(REPO), "KVGATE_KAFKA__BOOTSTRAP_SERVERS": "kafka:9092"}
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", command, "--tiny", "--out-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "KVGATE_KAFKA__BOOTSTRAP_SERVERS" in done.stderr
    assert not (tmp_path / "out" / "tansu.log").exists(), "no broker was started"


# ----------------------------------------------------------------------------------- threads


def test_threads_flag_beats_the_variable_which_beats_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def machine() -> int:
        return 4

    assert executor_threads(None, tiny=False, cores=machine).count == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert executor_threads(None, tiny=False, cores=machine).count == 3
    assert executor_threads(None, tiny=True, cores=machine).count == 3, "even for the tiny one"
    assert executor_threads(2, tiny=False, cores=machine).count == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(SettingsError, match="OMP_NUM_THREADS"):
        executor_threads(None, tiny=False, cores=machine)


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (8, 8), (64, MAX_DEFAULT_THREADS)])
def test_the_default_follows_the_machine_up_to_its_cap(cores: int, expected: int) -> None:
    choice = executor_threads(None, tiny=False, cores=lambda: cores)
    assert choice.count == expected and f"{cores} physical cores" in choice.source
    assert executor_threads(None, tiny=True, cores=lambda: cores).count == 1


def _topology(cpu_dir: Path, cpus: dict[int, tuple[str, str]]) -> None:
    for cpu, (package, core) in cpus.items():
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(package + "\n")
        (topology / "core_id").write_text(core + "\n")


def test_physical_cores_count_hyperthreads_once_and_respect_the_cpu_quota(
    tmp_path: Path,
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    smt = {cpu: ("0", "0") for cpu in allowed}  # every usable CPU a thread of one core
    _topology(tmp_path / "smt", smt)
    assert usable_physical_cores(tmp_path / "smt", tmp_path / "absent") == 1
    distinct = {cpu: ("0", str(cpu)) for cpu in allowed}
    _topology(tmp_path / "cores", distinct)
    unlimited = tmp_path / "cpu.max"
    unlimited.write_text("max 100000\n")
    assert usable_physical_cores(tmp_path / "cores", unlimited) == len(allowed)
    quota = tmp_path / "quota"
    quota.write_text("50000 100000\n")  # half a CPU: one thread
    assert usable_physical_cores(tmp_path / "cores", quota) == 1
