"""A streamed request end to end, in one process: the OpenAI gateway, the embedded broker, the
admission service and simulated executors, with a word tokenizer so that every token is one
server-sent event.

- A token leaves as soon as it is made: with a commit interval no test waits out, the client
  reads its first token while nothing has been committed — not its request's offset, not any
  cycle at all — and no result exists yet; the result then comes without waiting for the
  interval (an answer somebody waits for starts a cycle).
- Tokens are at-least-once and idempotent by index: a request handed off mid-stream runs again
  on the next instance and streams its chunks from index 0 again, and the client still sees
  each token once, the text whole.

``Waiter.offer``'s own rules (copies, late chunks, a re-run that differs) are unit-tested at
the end.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.admission_service.service import AdmissionService
from kvgate.admission_service.settings import ServiceSettings, load_settings
from kvgate.gateway.replies import ReplyBridge, Waiter
from kvgate.gateway.server import Gateway
from kvgate.gateway.settings import GatewaySettings, ModelRoute
from kvgate.kafka_connection import KafkaConnection
from kvgate.local.embedded_broker import EmbeddedBroker
from kvgate.protocol.records import REPLY_KIND_TOKEN, REPLY_KIND_TOKENS, TokenChunk, TokenChunks
from kvgate.sim.backend import LocalConnector, SimExecutorConfig
from tests.admission_service.helpers import until
from tests.admission_service.kafka_helpers import Topics, committed_offsets, read_results
from tests.admission_service.word_tokenizers import word_tokenizer

pytestmark = pytest.mark.timeout(120)
SIM = SimExecutorConfig(num_blocks=64, block_size=4, host_snapshot_blocks=16)
MODEL = "sim"
# Every id of the simulated vocabulary (512) is a word: each token is a text event of its own.
WORDS = 509
# Long enough that no test ever waits one out: what happens, happens for another reason.
NEVER_MS = 60_000
# Each read of an event is bounded well below NEVER_MS: a token held for a commit cycle fails.
EVENT_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("words"), seed=3, words=WORDS)


@dataclass
class Pool:
    broker: EmbeddedBroker
    topics: Topics
    tokenizer: Path
    connector: LocalConnector

    def settings(self, **kafka: Any) -> ServiceSettings:
        overrides = {
            "kafka": self.topics.kafka_settings(
                self.broker.bootstrap, partitions=1, session_timeout_ms=2000,
                heartbeat_interval_ms=500, exactly_once="off", fetch_max_wait_ms=5, **kafka,
            ),
            "executors": {"members": [{"name": "a", "endpoint": "ws://local/a"}]},
            "admin": {"host": "127.0.0.1", "port": 0, "token": "t"},
            "limits": {"tokenizer_file": str(self.tokenizer)},
            "shutdown": {"grace_period_s": 0.0},
        }  # fmt: skip
        return load_settings(None, overrides)

    async def service(self, **kafka: Any) -> AdmissionService:
        service = AdmissionService(self.settings(**kafka), connector=self.connector)
        await service.start()
        await until(lambda: service.intake is not None and service.intake.assigned_once.is_set(),
                    what="the request partition assigned")  # fmt: skip
        return service

    def gateway(self) -> Gateway:
        route = ModelRoute(
            name=MODEL, request_topic=self.topics.requests, result_topic=self.topics.results,
            tokenizer_file=self.tokenizer,
        )  # fmt: skip
        return Gateway(
            GatewaySettings(
                kafka=KafkaConnection(bootstrap_servers=self.broker.bootstrap), port=0,
                replica_id=f"gw-{uuid.uuid4().hex[:8]}", abort_topic=self.topics.aborts,
                models=[route], allow_anonymous=True, reply_fetch_max_wait_ms=5,
            )
        )  # fmt: skip


@pytest.fixture
async def pool(broker: EmbeddedBroker, tokenizer: Path) -> AsyncIterator[Pool]:
    connector = LocalConnector()
    connector.add("a", SIM)
    yield Pool(broker, Topics.unique("stream"), tokenizer, connector)


@pytest.fixture
async def gateway(pool: Pool) -> AsyncIterator[Gateway]:
    running = pool.gateway()
    await running.start()
    yield running
    await running.close()


class Stream:
    """One streamed completion, read event by event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.request_id = ""
        self.texts: list[str] = []
        self.done = False

    async def next_text(self) -> str | None:
        """The next text event's text; None once the stream has ended."""
        while not self.done:
            line = await asyncio.wait_for(self._response.content.readline(), EVENT_TIMEOUT_S)
            data = line.decode().strip().removeprefix("data: ")
            if data == "[DONE]" or not line:
                self.done = True
            elif data.startswith("{"):
                event = json.loads(data)
                self.request_id = str(event["id"]).removeprefix("cmpl-")
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text"):
                    self.texts.append(choice["text"])
                    return str(choice["text"])
        return None

    async def rest(self) -> None:
        while await self.next_text() is not None:
            pass


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def stream(http: aiohttp.ClientSession, gateway: Gateway, max_tokens: int) -> Stream:
    body = {"model": MODEL, "prompt": "w1 w2 w3 w4", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = f"http://127.0.0.1:{gateway.port}/v1/completions"
    # The headers come with the first token: bounded like every other event.
    response = await asyncio.wait_for(http.post(url, json=body), EVENT_TIMEOUT_S)
    assert response.status == 200, await response.text()
    return Stream(response)


def committed_cycles(service: AdmissionService) -> float:
    return float(service.metrics.commits.labels(outcome="committed")._value.get())


@pytest.mark.parametrize("records", ["per_step", "per_token"])
async def test_the_first_token_reaches_the_client_before_any_commit_cycle(
    pool: Pool, gateway: Gateway, http: aiohttp.ClientSession, records: str
) -> None:
    """With either form of token records (``per_token``: a service writing as before the
    per-step records)."""
    backend = pool.connector.backends["a"]
    backend.hold_after(3)  # the request cannot finish before the test says so
    service = await pool.service(commit_interval_ms=NEVER_MS, token_records=records)
    try:
        answer = await stream(http, gateway, max_tokens=8)
        first = await answer.next_text()
        assert first, "a token arrived"
        # Causality: the token came out while its request's offset is not committed, before
        # any commit cycle has committed anything, and before a result exists.
        assert committed_cycles(service) == 0
        offsets = await committed_offsets(
            pool.broker.bootstrap, pool.topics.group, pool.topics.requests, 1
        )
        assert offsets == {0: -1}, "no offset committed"
        assert gateway.bridge.known_answer(answer.request_id) is None
        backend.release()
        # The result (and so the stream's end) does not wait for the 60 s interval either:
        # an answer with a reply address starts a cycle at once.
        await answer.rest()
        # Eight tokens, in at least two events: the first above, and the rest as their chunks
        # come, or whole with the result where it overtakes them (two topics; the count is not
        # fixed, the text is).
        assert len(answer.texts) >= 2
        results = await read_results(
            pool.broker.bootstrap, pool.topics.results, 1, read_committed=False
        )
        assert "".join(answer.texts) == results[0].text
        assert committed_cycles(service) >= 1
    finally:
        await service.shutdown()


async def test_a_hand_off_mid_stream_shows_the_client_each_token_once(
    pool: Pool, gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    backend = pool.connector.backends["a"]
    backend.hold_after(4)  # a few tokens out, then the first instance goes no further
    first_owner = await pool.service(commit_interval_ms=50)
    answer = await stream(http, gateway, max_tokens=12)
    for _ in range(2):
        assert await answer.next_text()
    assert await first_owner.shutdown() == 0  # grace 0: the request is handed off, uncommitted
    backend.release()
    # The next owner runs the request again from its first token: chunks 0, 1, ... arrive a
    # second time, on the same reply address.
    next_owner = await pool.service(commit_interval_ms=50)
    try:
        await answer.rest()
        results = await read_results(
            pool.broker.bootstrap, pool.topics.results, 1, read_committed=False
        )
        assert len(results) == 1 and results[0].usage.completion_tokens == 12
        # Each token once, in order: what the client was shown is the answer's text. The re-run's
        # chunks stream one by one, unless the first owner's held step completes after the
        # release and sends an index the re-run then answers differently: the gateway stops
        # streaming there and the result's text completes the stream (one event), so the count
        # of events is not fixed.
        assert "".join(answer.texts) == results[0].text, answer.texts
        assert len(answer.texts) >= 5, answer.texts  # tokens before the hand-off, then the rest
    finally:
        await next_owner.shutdown()


# ------------------------------------------------------------------------- Waiter.offer


def chunk(index: int, token_id: int | None = None, choice: int = 0) -> TokenChunk:
    return TokenChunk(
        request_id="r", index=index, token_id=100 + index if token_id is None else token_id,
        exit_depth=1, choice=choice,
    )  # fmt: skip


def passed_on(waiter: Waiter, choice: int = 0) -> list[int]:
    out = []
    while not waiter.tokens.empty():
        passed = waiter.tokens.get_nowait()
        if passed.choice == choice:
            out.append(passed.index)
    return out


async def test_a_replayed_stream_passes_each_index_once_in_order() -> None:
    waiter = Waiter("r")
    for index in [0, 1, 2, 0, 1, 2, 3, 1, 4]:  # a re-run from 0 after two copies, a late copy
        waiter.offer(chunk(index))
    assert passed_on(waiter) == [0, 1, 2, 3, 4]


async def test_a_chunk_ahead_of_a_missing_one_waits_for_it() -> None:
    waiter = Waiter("r")
    for index in [0, 2, 3]:
        waiter.offer(chunk(index))
    assert passed_on(waiter) == [0]
    waiter.offer(chunk(1))  # the retried one arrives late
    assert passed_on(waiter) == [1, 2, 3]


async def test_a_re_run_that_differs_stops_the_stream_at_the_difference() -> None:
    waiter = Waiter("r")
    for index in range(3):
        waiter.offer(chunk(index))
    waiter.offer(chunk(0))  # the same token again: a copy
    waiter.offer(chunk(1, token_id=7))  # the re-run sampled another token here
    waiter.offer(chunk(3))
    assert passed_on(waiter) == [0, 1, 2]
    assert waiter.diverged_at() == 1


async def test_the_choices_of_a_request_are_streams_of_their_own() -> None:
    waiter = Waiter("r")
    for index, choice in [(0, 0), (0, 1), (1, 1), (1, 0), (0, 1), (2, 1)]:
        waiter.offer(chunk(index, token_id=choice * 1000 + index, choice=choice))
    passed = [(c.choice, c.index) for c in [waiter.tokens.get_nowait() for _ in range(5)]]
    assert passed == [(0, 0), (1, 0), (1, 1), (0, 1), (1, 2)], "choice 1's copy of 0 dropped"
    assert waiter.tokens.empty() and waiter.diverged_at(0) is None and waiter.diverged_at(1) is None


async def test_the_bridge_reads_a_steps_records_and_single_chunks_and_skips_bad_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A service writes a step's chunks as one record (``tokens``), or a record per chunk
    (``token``: ``token_records: per_token``, or an older service): the bridge hands each chunk
    to its waiter; a record that does not parse is skipped with a warning, nothing else lost."""
    bridge = ReplyBridge(
        GatewaySettings(
            kafka=KafkaConnection(bootstrap_servers="127.0.0.1:1"), port=0, replica_id="gw-a",
            models=[ModelRoute(name=MODEL)], allow_anonymous=True,
        )
    )  # fmt: skip
    waiter, _ = bridge.join("r")
    other = TokenChunk(request_id="nobody-waits", index=0, token_id=1, exit_depth=1)
    step = TokenChunks(chunks=[chunk(0), other, chunk(1)])
    bridge._on_reply(REPLY_KIND_TOKENS, step.model_dump_json(exclude_none=True).encode())
    bridge._on_reply(REPLY_KIND_TOKENS, b'{"schema_version": 1, "chunks": [{"index": 2}]}')
    bridge._on_reply(REPLY_KIND_TOKEN, chunk(2).model_dump_json().encode())
    assert passed_on(waiter) == [0, 1, 2]
    assert "does not parse" in caplog.text
