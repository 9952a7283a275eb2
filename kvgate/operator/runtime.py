"""The operator's long-lived parts: API clients, the reconciler and its pass runner.

Built once in ``on.startup`` and kept in kopf's memo; closed in ``on.cleanup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import aiohttp
import kopf

from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import KubeApi, Login, RawObject
from kvgate.operator.passes import PassRunner
from kvgate.operator.reconciler import Outcome, Reconciler

_MEMO_KEY = "kvgate_runtime"
log = logging.getLogger(__name__)


def post_event(obj: RawObject, *, type: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event through kopf's poster (it needs the operator's context)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, obj)), type=type, reason=reason, message=message)


class SyncTicker:
    """Passes over autoscaled pools every ``sync_s`` their last pass asked for, whatever the
    watch events: load is no Kubernetes event. One task for the whole operator; a pool is known
    here once a pass has run over it (kopf's resume handler runs one for every pool at start),
    and forgotten when a pass says it is gone or no longer autoscaled. A pass that raises is
    retried after ``retry_delay_s(failures)``, the operator's jittered backoff over the pool's
    consecutive failed passes (``OperatorConfig.retry_delay_s``)."""

    def __init__(
        self,
        run: Callable[[str, str], Awaitable[Outcome]],
        retry_delay_s: Callable[[int], float],
    ) -> None:
        self._run = run
        self._retry_delay_s = retry_delay_s
        self._due: dict[tuple[str, str], float] = {}
        self._failures: dict[tuple[str, str], int] = {}  # consecutive failed passes per pool
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def saw(self, namespace: str, name: str, outcome: Outcome) -> None:
        key = (namespace, name)
        self._failures.pop(key, None)
        if outcome.sync_s is None:
            self._due.pop(key, None)
        else:
            self._due[key] = time.monotonic() + outcome.sync_s
            self._changed.set()
            if self._task is None:
                # Started from within a handler's pass: the task inherits kopf's context,
                # which posting Events needs.
                self._task = asyncio.create_task(self._loop(), name="kvgate-autoscale-sync")

    async def _loop(self) -> None:
        while True:
            self._changed.clear()
            now = time.monotonic()
            due = [key for key, at in self._due.items() if at <= now]
            for key in due:
                self._due.pop(key, None)
                try:
                    await self._run(*key)  # its outcome re-arms it (saw)
                except Exception as error:
                    failures = self._failures.get(key, 0)
                    self._failures[key] = failures + 1
                    delay_s = self._retry_delay_s(failures)
                    log.warning(
                        "autoscaling pass over %s/%s failed (%r); retrying in %.1f s",
                        *key,
                        error,
                        delay_s,
                    )
                    self._due[key] = time.monotonic() + delay_s
            wait_s = min(self._due.values(), default=now + 60.0) - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(wait_s, 0.05))


@dataclass
class Runtime:
    config: OperatorConfig
    kube: KubeApi
    admin_session: aiohttp.ClientSession
    passes: PassRunner[Outcome]
    ticker: SyncTicker

    @classmethod
    def start(cls, config: OperatorConfig, login: Login) -> Runtime:
        kube = KubeApi(login, timeout_s=config.request_timeout_s)
        admin_session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s),
            headers={"User-Agent": "kvgate-operator"},
        )
        reconciler = Reconciler(kube, admin_session, config, post_event)

        async def run_pass(namespace: str, name: str) -> Outcome:
            outcome = await reconciler.reconcile(namespace, name)
            ticker.saw(namespace, name, outcome)
            return outcome

        passes = PassRunner(run_pass)
        ticker = SyncTicker(passes.run, config.retry_delay_s)
        return cls(config, kube, admin_session, passes, ticker)

    async def close(self) -> None:
        await self.ticker.close()
        await self.admin_session.close()
        await self.kube.close()

    def store(self, memo: kopf.Memo) -> None:
        memo[_MEMO_KEY] = self

    @staticmethod
    def of(memo: kopf.Memo) -> Runtime:
        runtime = memo.get(_MEMO_KEY)
        if not isinstance(runtime, Runtime):
            raise RuntimeError("the operator runtime is missing: the startup handler did not run")
        return runtime
