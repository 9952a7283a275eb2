"""Tiny random checkpoints, written once per test session in the real Hugging Face layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate.executor.loader import LoadedModel, load_model
from kvgate.executor.tiny_model import TinyModelSpec, make_tiny_model
from kvgate.protocol.enums import ModelFamily
from tests.executor.family_cases import WrittenFamilies

# One intra-op thread: tiny matmuls gain nothing from more, and on a shared, oversubscribed
# machine OpenMP workers waiting for each other make every op milliseconds slow.
torch.set_num_threads(1)

LLAMA_SPEC = TinyModelSpec(family=ModelFamily.LLAMA, vocab_size=128, seed=1)
# A gate bias near zero gives hazards around one half: with an exit threshold of 0.5 tokens exit
# at every depth 1..3, so LAST_EXITED copies into deeper planes are exercised constantly.
LOOPED_SPEC = TinyModelSpec(
    family=ModelFamily.LOOPED, num_loops=3, vocab_size=128, exit_gate_bias=-0.3, seed=2
)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), LLAMA_SPEC)


@pytest.fixture(scope="session")
def looped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("looped"), LOOPED_SPEC)


@pytest.fixture(scope="session")
def llama(llama_dir: Path) -> LoadedModel:
    return load_model(llama_dir)


@pytest.fixture(scope="session")
def looped(looped_dir: Path) -> LoadedModel:
    return load_model(looped_dir)


@pytest.fixture(scope="session", params=["llama", "looped"])
def family_model(request: pytest.FixtureRequest) -> LoadedModel:
    loaded: LoadedModel = request.getfixturevalue(request.param)
    return loaded


@pytest.fixture(scope="session")
def written(tmp_path_factory: pytest.TempPathFactory) -> WrittenFamilies:
    """The dense families' checkpoints (family_cases.FAMILIES), each written once a session."""
    return WrittenFamilies(tmp_path_factory)
