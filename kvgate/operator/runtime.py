"""The operator's long-lived parts: API clients, the reconciler and its pass runner.

Built once in ``on.startup`` and kept in kopf's memo; closed in ``on.cleanup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import aiohttp
import kopf

from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import KubeApi, Login, RawObject
from kvgate.operator.passes import PassRunner
from kvgate.operator.reconciler import Outcome, Reconciler

_MEMO_KEY = "kvgate_runtime"


def post_event(obj: RawObject, *, type: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event through kopf's poster (it needs the operator's context)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, obj)), type=type, reason=reason, message=message)


@dataclass
class Runtime:
    config: OperatorConfig
    kube: KubeApi
    admin_session: aiohttp.ClientSession
    passes: PassRunner[Outcome]

    @classmethod
    def start(cls, config: OperatorConfig, login: Login) -> Runtime:
        kube = KubeApi(login, timeout_s=config.request_timeout_s)
        admin_session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s),
            headers={"User-Agent": "kvgate-operator"},
        )
        reconciler = Reconciler(kube, admin_session, config, post_event)
        return cls(config, kube, admin_session, PassRunner(reconciler.reconcile))

    async def close(self) -> None:
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
