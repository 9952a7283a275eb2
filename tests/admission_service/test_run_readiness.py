"""``kvgate run`` says it serves only once every part answers (``kvgate/local/readiness.py``):
the admission service's readiness, the executor's session (the admin API's membership), and
the OpenAI door. Against a small HTTP server that plays those doors, counting the questions
instead of timing them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvgate.local.readiness import NotServing, stack_probes, wait_until_answering

pytestmark = pytest.mark.timeout(30)
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Doors:
    """The admin API and the gateway in one app; the executor connects at the N-th question."""

    connected_after: int | None  # None: never
    asked: dict[str, int] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/v1/executors", self.executors)
        app.router.add_get("/v1/models", self.models)
        return app

    def _count(self, route: str) -> int:
        self.asked[route] = self.asked.get(route, 0) + 1
        return self.asked[route]

    async def readyz(self, _request: web.Request) -> web.Response:
        self._count("readyz")
        return web.Response(text="ready\n")

    async def executors(self, _request: web.Request) -> web.Response:
        asked = self._count("executors")
        ready = self.connected_after is not None and asked >= self.connected_after
        state = "ready" if ready else "connecting"
        body = {
            "executors": [
                {"name": "executor-0", "endpoint": "ws://127.0.0.1:1/v1/steps", "state": state,
                 "running_requests": 0, "waiting_requests": 0, "kv_blocks_used": 0,
                 "kv_blocks_total": 16},
            ]
        }  # fmt: skip
        return web.json_response(body)

    async def models(self, _request: web.Request) -> web.Response:
        self._count("models")
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _serve(doors: Doors) -> AsyncIterator[str]:
    runner = web.AppRunner(doors.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def connecting() -> AsyncIterator[tuple[Doors, str]]:
    doors = Doors(connected_after=4)
    async for url in _serve(doors):
        yield doors, url


@pytest.fixture
async def never() -> AsyncIterator[tuple[Doors, str]]:
    doors = Doors(connected_after=None)
    async for url in _serve(doors):
        yield doors, url


async def test_it_waits_for_the_executor_session_and_asks_an_answered_door_once(
    connecting: tuple[Doors, str],
) -> None:
    doors, url = connecting
    await wait_until_answering(stack_probes(url, url, MODEL), timeout_s=20, stopped=lambda: None)
    assert doors.asked["executors"] == 4  # returned at the first "ready", not before
    assert doors.asked["readyz"] == 2  # the service's and the gateway's, once each
    assert doors.asked["models"] == 1


async def test_a_door_that_never_answers_is_named_when_time_is_up(
    never: tuple[Doors, str],
) -> None:
    _, url = never
    with pytest.raises(NotServing) as raised:
        await wait_until_answering(
            stack_probes(url, url, MODEL), timeout_s=0.5, stopped=lambda: None
        )
    assert str(raised.value) == (
        f"not serving after 0.5 s: executor session ({url}/v1/executors): executor-0 not ready"
    )


async def test_a_model_the_door_does_not_list_is_not_serving(
    connecting: tuple[Doors, str],
) -> None:
    _, url = connecting
    with pytest.raises(NotServing, match=r"OpenAI API .*/v1/models\): lists \['SmolLM2"):
        await wait_until_answering(
            stack_probes(url, url, "kvgate"), timeout_s=0.5, stopped=lambda: None
        )


async def test_a_stack_that_stops_ends_the_wait_with_its_reason(
    never: tuple[Doors, str],
) -> None:
    doors, url = never
    reason = "the executor exited with status 1; see out/executor.log"
    with pytest.raises(NotServing) as raised:
        await wait_until_answering(
            stack_probes(url, None, MODEL), timeout_s=20, stopped=lambda: reason
        )
    assert str(raised.value) == reason
    assert doors.asked == {}
