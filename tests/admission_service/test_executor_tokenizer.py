"""The pool's tokenizer from its executors: real step servers on 127.0.0.1 serve their model's
tokenizer at /v1/tokenizer, and the service connects only executors that agree."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from tokenizers import Tokenizer

from kvgate.admission_service.executor_client import ConnectFailed, StepSession
from kvgate.admission_service.executor_tokenizer import (
    PoolTokenizer,
    TokenizerCheckingConnector,
    tokenizer_url,
)
from kvgate.admission_service.tokenizer import TokenizerError
from kvgate.protocol.records import ChatMessage
from kvgate.protocol.tokenizer_files import TokenizerFiles
from kvgate.sim.backend import SimBackend, SimExecutorConfig
from kvgate.sim.server import read_tokenizer_files, sim_step_server
from tests.admission_service.word_tokenizers import word_tokenizer

TOKEN = "step-token"
Start = Callable[[TokenizerFiles | None], Awaitable[str]]


class _Opened(Exception):
    """What the inner connector raises: the check passed and a session would open now."""


async def _inner(endpoint: str, epoch: int) -> StepSession:
    raise _Opened(endpoint)


@pytest.fixture
async def executors() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(files: TokenizerFiles | None) -> str:
        backend = SimBackend(SimExecutorConfig())
        backend.tokenizer_files = files
        server = sim_step_server(backend, TOKEN)
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        await server.wait_loaded()
        port = runner.addresses[0][1]
        return f"ws://127.0.0.1:{port}/v1/steps"

    yield start
    for runner in runners:
        await runner.cleanup()


def files(tmp_path: Path, seed: int) -> TokenizerFiles:
    return read_tokenizer_files(word_tokenizer(tmp_path / f"t{seed}", seed))


def test_the_tokenizer_url_is_beside_the_steps() -> None:
    assert tokenizer_url("ws://10.0.0.7:8000/v1/steps") == "http://10.0.0.7:8000/v1/tokenizer"
    assert tokenizer_url("wss://e.example:443/v1/steps") == "https://e.example:443/v1/tokenizer"


async def test_executors_that_agree_share_one_tokenizer_and_others_are_refused(
    executors: Start, tmp_path: Path
) -> None:
    start = executors
    first = await start(files(tmp_path, 1))
    same = await start(files(tmp_path, 1))
    other = await start(files(tmp_path, 2))
    bare = await start(None)
    pool = PoolTokenizer()
    async with aiohttp.ClientSession() as http:
        connector = TokenizerCheckingConnector(_inner, pool, http, TOKEN, timeout_s=5.0)
        with pytest.raises(TokenizerError, match="no executor of this pool has served"):
            pool.encode("w1")
        with pytest.raises(_Opened):
            await connector(first, 1)
        with pytest.raises(_Opened):
            await connector(same, 1)
        with pytest.raises(ConnectFailed, match=r"serves tokenizer .* but this pool's executors"):
            await connector(other, 1)
        with pytest.raises(ConnectFailed, match="serves no tokenizer"):
            await connector(bare, 1)
        wrong_token = TokenizerCheckingConnector(_inner, pool, http, "x", timeout_s=5.0)
        with pytest.raises(ConnectFailed, match="HTTP 401"):
            await wrong_token(first, 1)

    # The pool encodes and decodes as the first executor's tokenizer does, not as the other's.
    mine = Tokenizer.from_file(str(tmp_path / "t1" / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(tmp_path / "t2" / "tokenizer.json"))
    ids = pool.encode("w3 w14 w159")
    assert ids == mine.encode("w3 w14 w159", add_special_tokens=False).ids
    assert ids != theirs.encode("w3 w14 w159", add_special_tokens=False).ids
    assert pool.decode([7, 8, 9]) == mine.decode([7, 8, 9])
    # Its chat template came along with it.
    rendered = pool.render_chat([ChatMessage(role="user", content="w1 w2")])
    assert rendered == "<user> w1 w2 <assistant>"


async def test_a_pool_whose_model_has_no_tokenizer(executors: Start, tmp_path: Path) -> None:
    bare = await executors(None)
    served = await executors(files(tmp_path, 1))
    pool = PoolTokenizer()
    async with aiohttp.ClientSession() as http:
        connector = TokenizerCheckingConnector(_inner, pool, http, TOKEN, timeout_s=5.0)
        with pytest.raises(_Opened):
            await connector(bare, 1)
        with pytest.raises(ConnectFailed, match=r"serves tokenizer .* serve no tokenizer"):
            await connector(served, 1)
    assert pool.digest == "none"
    with pytest.raises(TokenizerError, match="this pool's model has no tokenizer"):
        pool.encode("w1")


def test_the_digest_covers_the_chat_template(tmp_path: Path) -> None:
    served = files(tmp_path, 1)
    changed = TokenizerFiles.of(served.tokenizer_json, {"chat_template": "{{ messages }}"})
    assert served.digest != changed.digest
    # Only the chat settings are served: the rest of tokenizer_config.json does not count.
    padded = TokenizerFiles.of(served.tokenizer_json, {**served.tokenizer_config, "x": 1})
    assert padded == served
