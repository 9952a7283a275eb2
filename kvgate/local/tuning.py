"""What a user tunes in ``kvgate run`` and ``kvgate demo``, and which source wins.

For every setting: **a flag > its environment variable > the stack's default.**

- Service settings: the stack's own values are *defaults*, beneath the environment's
  ``KVGATE_<SECTION>__<KEY>`` (``load_settings(defaults=...)``); flags are *overrides*, above
  it, and a flag that overrides a variable says so in the log (:func:`overridden`).
- Settings the stack owns — where its broker and its executor are, and their tokens — are not
  the user's: a ``KVGATE_*`` variable naming one is refused before anything starts
  (:func:`refuse_owned_variables`), never silently replaced.
- Executor threads: ``--threads`` > ``OMP_NUM_THREADS`` > the machine (:func:`executor_threads`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

from pydantic_settings import EnvSettingsSource

from kvgate.admission_service.settings import ENV_PREFIX, ServiceSettings
from kvgate.kafka_connection import SettingsError
from kvgate.scheduler.config import Policy, PreemptionMode, SchedulerConfig

# (section, key) of every setting the stack decides itself.
OWNED: Final = (
    ("kafka", "bootstrap_servers"),
    ("kafka", "security_protocol"),
    ("kafka", "sasl_mechanism"),
    ("kafka", "sasl_username"),
    ("kafka", "sasl_password"),
    ("kafka", "sasl_password_file"),
    ("kafka", "ssl_cafile"),
    ("kafka", "ssl_certfile"),
    ("kafka", "ssl_keyfile"),
    ("executors", "members"),
    ("executors", "token"),
    ("executors", "token_file"),
    ("admin", "token"),
    ("admin", "token_file"),
)
THREADS_ENV: Final = "OMP_NUM_THREADS"
# The default never takes more threads than this, however large the machine: the models the
# stack serves are small (135 M parameters) and the service, the broker and the gateway share
# the machine. Measured only on 2 cores so far (docs/benchmarks.md).
MAX_DEFAULT_THREADS: Final = 8


def variable(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}__{key.upper()}"


# ------------------------------------------------------------------------ scheduler limits


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler limits a user tunes from the command line, by the names of
    ``SchedulerConfig`` (None: not given)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int | None = None
    policy: Policy | None = None
    preemption: PreemptionMode | None = None

    def settings(self) -> dict[str, Any]:
        """The limits that are set, as the ``scheduler`` section's values."""
        return {
            k: v.value if isinstance(v, Policy | PreemptionMode) else v
            for k, v in asdict(self).items()
            if v is not None
        }


_FLAGS: Final = {
    "max_num_seqs": ("--max-num-seqs", "sequences running at once"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "tokens one step may compute"),
    "prefill_chunk_size": ("--prefill-chunk-size", "prompt tokens one step fills per request"),
    "policy": ("--policy", "admission order"),
    "preemption": ("--preemption", "how a preempted request keeps its work"),
}


def add_scheduler_arguments(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, str],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """The scheduler flags; ``defaults`` describes each one's default for the help text,
    ``aliases`` adds older spellings (name -> flag)."""
    group = parser.add_argument_group(
        "scheduler", "each flag beats its KVGATE_SCHEDULER__<NAME> variable, which beats the "
        "default",
    )  # fmt: skip
    for name, (flag, meaning) in _FLAGS.items():
        spellings = [flag, *([aliases[name]] if aliases and name in aliases else [])]
        default = defaults.get(name) or _scheduler_default(name)
        help_text = f"{meaning} (default {default})"
        if name == "policy":
            group.add_argument(*spellings, dest=name, choices=[p.value for p in Policy],
                               help=help_text)  # fmt: skip
        elif name == "preemption":
            choices = [p.value for p in PreemptionMode]
            group.add_argument(*spellings, dest=name, choices=choices, help=help_text)
        else:
            group.add_argument(*spellings, dest=name, type=_positive, metavar="N", help=help_text)


def scheduler_defaults(defaults: SchedulerLimits, flags: SchedulerLimits) -> SchedulerLimits:
    """``defaults`` with the token budget grown to hold a larger prefill chunk asked for by
    flag (a chunk must fit one step's budget: asking for one should not need a second flag)."""
    chunk, budget = flags.prefill_chunk_size, defaults.max_num_batched_tokens
    if chunk is not None and budget is not None and chunk > budget:
        return replace(defaults, max_num_batched_tokens=chunk)
    return defaults


def _scheduler_default(name: str) -> str:
    default = SchedulerConfig.model_fields[name].default
    return str(default.value if isinstance(default, Policy | PreemptionMode) else default)


def scheduler_flags(args: argparse.Namespace) -> SchedulerLimits:
    given = {f.name: getattr(args, f.name, None) for f in fields(SchedulerLimits)}
    return SchedulerLimits(
        max_num_seqs=given["max_num_seqs"],
        max_num_batched_tokens=given["max_num_batched_tokens"],
        prefill_chunk_size=given["prefill_chunk_size"],
        policy=None if given["policy"] is None else Policy(given["policy"]),
        preemption=None if given["preemption"] is None else PreemptionMode(given["preemption"]),
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ---------------------------------------------------------------- environment variables


def environment_settings() -> dict[str, Any]:
    """What ``KVGATE_*`` variables set, by section and key, read by the settings' own rule."""
    return EnvSettingsSource(ServiceSettings)()


def _set_keys(environment: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for section, values in environment.items():
        if isinstance(values, Mapping):
            yield from ((section, key) for key in values)


def refuse_owned_variables() -> None:
    """Raise ``SettingsError`` naming every ``KVGATE_*`` variable that sets what the stack
    owns (its own broker's address, its executor, their tokens)."""
    refused = sorted(
        variable(section, key) for section, key in _set_keys(environment_settings())
        if (section, key) in OWNED
    )  # fmt: skip
    if refused:
        raise SettingsError(
            f"{', '.join(refused)}: the local stack runs its own broker and executor and sets "
            "these itself; unset them (kvgate admission-service reads them)"
        )


def overridden(overrides: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per ``KVGATE_*`` variable that ``overrides`` (the flags) override."""
    environment = environment_settings()
    lines = []
    for section, key in _set_keys(environment):
        if key in overrides.get(section, {}):
            chosen = overrides[section][key]
            lines.append(
                f"{variable(section, key)}={environment[section][key]} is overridden by a flag: "
                f"{key} {chosen}"
            )
    return lines


# ------------------------------------------------------------------------ executor threads


@dataclass(frozen=True)
class ThreadChoice:
    count: int
    source: str  # why this count, for the banner


def executor_threads(
    flag: int | None, *, tiny: bool, cores: Callable[[], int] | None = None
) -> ThreadChoice:
    """``--threads``, else ``OMP_NUM_THREADS``, else the machine's rule: one thread for the
    tiny model (it is all overhead: more threads only contend), else the physical cores this
    process may use, at most ``MAX_DEFAULT_THREADS``."""
    if flag is not None:
        if flag < 1:
            raise SettingsError(f"--threads must be at least 1, got {flag}")
        return ThreadChoice(flag, "--threads")
    text = os.environ.get(THREADS_ENV)
    if text is not None:
        if not text.strip().isdigit() or int(text) < 1:
            raise SettingsError(f"{THREADS_ENV}={text!r} is not a thread count (1 or more)")
        return ThreadChoice(int(text), THREADS_ENV)
    if tiny:
        return ThreadChoice(1, "the tiny model")
    usable = (cores or usable_physical_cores)()
    count = min(usable, MAX_DEFAULT_THREADS)
    return ThreadChoice(count, f"{usable} physical cores usable, at most {MAX_DEFAULT_THREADS}")


_CPU_DIR: Final = Path("/sys/devices/system/cpu")
_CGROUP_CPU_MAX: Final = Path("/sys/fs/cgroup/cpu.max")


def usable_physical_cores(cpu_dir: Path = _CPU_DIR, cpu_max: Path = _CGROUP_CPU_MAX) -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core count
    once), and no more than the cgroup's CPU quota allows."""
    cores: set[tuple[str, str]] = set()
    for cpu in os.sched_getaffinity(0):
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            package, core = "cpu", str(cpu)  # no topology: each CPU counts as a core
        cores.add((package, core))
    count = len(cores)
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return max(1, count)
    if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
        count = min(count, math.ceil(int(quota) / int(period)))
    return max(1, count)
