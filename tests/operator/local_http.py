"""What the operator tier's two admin API servers share: the fake one (``fake_admin``) and the
journaling proxy in front of a real admission service (``admin_proxy``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from aiohttp import web


class JournaledCall(Protocol):
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def status(self) -> int: ...


Call = TypeVar("Call", bound=JournaledCall)


def successful_calls(journal: Iterable[Call], method: str, path_prefix: str = "") -> list[Call]:
    """The journal's successful calls of one method (and path prefix), in order."""
    return [
        c
        for c in journal
        if c.method == method and c.path.startswith(path_prefix) and c.status < 400
    ]


async def serve_locally(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``host`` (a free port unless given): its runner (``cleanup()`` stops
    it) and URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"
