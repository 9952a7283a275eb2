"""When ``kvgate run`` is serving: every part answers at its own door, polled to a deadline.

The broker (a metadata request) and the executor (its ``/readyz``: model loaded) have answered
before the stack is up (``embedded_broker.py``, ``stack.py``). What remains is seen over HTTP,
as a client would see it:

```
admission service   GET {admin}/readyz        200: it consumes Kafka
executor session    GET {admin}/v1/executors  every executor "ready": its step session is open
OpenAI API          GET {gateway}/readyz      200: the gateway's Kafka bridge is connected
                    GET {gateway}/v1/models   200, listing the model
```

A part that has answered is not asked again. A stack that stops on its own while waiting (the
service failed, the executor exited) ends the wait at once, with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from pydantic import BaseModel, ValidationError

from kvgate.protocol.admin import ExecutorMembership, ExecutorState

POLL_INTERVAL_S = 0.1
REQUEST_TIMEOUT_S = 2.0

# What an answer means: None when it is what serving looks like, else why not (for the error).
Verdict = Callable[[int, bytes], str | None]


class NotServing(RuntimeError):
    """The stack did not answer everywhere in time, or stopped; the message says which part."""


@dataclass(frozen=True)
class Probe:
    what: str  # the part, as the error names it
    url: str
    verdict: Verdict


def answers_ok(status: int, _body: bytes) -> str | None:
    return None if status == 200 else f"HTTP {status}"


def executors_ready(status: int, body: bytes) -> str | None:
    if status != 200:
        return f"HTTP {status}"
    try:
        membership = ExecutorMembership.model_validate_json(body)
    except ValidationError as exc:
        return f"unreadable membership ({exc.error_count()} errors)"
    if not membership.executors:
        return "no executors"
    waiting = [e.name for e in membership.executors if e.state is not ExecutorState.READY]
    return f"{', '.join(waiting)} not ready" if waiting else None


class _Model(BaseModel):
    id: str


class _ModelList(BaseModel):
    data: list[_Model]


def lists_model(name: str) -> Verdict:
    def verdict(status: int, body: bytes) -> str | None:
        if status != 200:
            return f"HTTP {status}"
        try:
            listed = [m.id for m in _ModelList.model_validate_json(body).data]
        except ValidationError:
            return "an unreadable model list"
        return None if name in listed else f"lists {listed}, not {name!r}"

    return verdict


def stack_probes(admin_url: str, gateway_url: str | None, model_name: str) -> list[Probe]:
    """What must answer before ``kvgate run`` says it serves (``gateway_url``: None, no door)."""
    probes = [
        Probe("admission service", f"{admin_url}/readyz", answers_ok),
        Probe("executor session", f"{admin_url}/v1/executors", executors_ready),
    ]
    if gateway_url is not None:
        probes += [
            Probe("OpenAI API", f"{gateway_url}/readyz", answers_ok),
            Probe("OpenAI API", f"{gateway_url}/v1/models", lists_model(model_name)),
        ]
    return probes


async def _ask(http: aiohttp.ClientSession, probe: Probe) -> str | None:
    try:
        async with http.get(probe.url) as response:
            return probe.verdict(response.status, await response.read())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def wait_until_answering(
    probes: Sequence[Probe], *, timeout_s: float, stopped: Callable[[], str | None]
) -> None:
    """Return once every probe has answered as serving; raise ``NotServing`` when ``stopped``
    gives a reason, or when ``timeout_s`` passes (naming what did not answer, and why)."""
    deadline = time.monotonic() + timeout_s
    pending = list(probes)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            reason = stopped()
            if reason is not None:
                raise NotServing(reason)
            why = {id(p): await _ask(http, p) for p in pending}
            still = [p for p in pending if why[id(p)] is not None]
            if not still:
                return
            if time.monotonic() >= deadline:
                parts = "; ".join(f"{p.what} ({p.url}): {why[id(p)]}" for p in still)
                raise NotServing(f"not serving after {timeout_s:g} s: {parts}")
            pending = still
            await asyncio.sleep(POLL_INTERVAL_S)
