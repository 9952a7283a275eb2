"""kopf handlers, deliberately thin: each runs a reconcile pass and turns its outcome into
kopf flow control.

    pool created / spec changed / operator resumed ──▶ pass ──▶ converged: done
                                                           ├─▶ waiting:  TemporaryError(delay)
                                                           ├─▶ invalid:  Event + PermanentError
                                                           └─▶ API failed: TemporaryError(backoff)
    a pool's generation is not yet observed      ──▶ pass (fast path)
    a pool's pod changed (created, ready, failed, deleted) ──▶ pass (fast path)

The change handler keeps retrying until the pool has converged, so drains (which no watch event
reports) are polled while any is in progress. While it waits out a retry delay, kopf holds new
changes of the same pool back; the fast paths act on them at once (a pass always reads the
latest spec), so a spec change never waits for an earlier change's retry.

No daemon or timer: those need a finalizer on every pool, and nothing outside Kubernetes needs
cleaning — the garbage collector removes the children through their owner references.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from pydantic import ValidationError

from kvgate.operator.admin import AdminRejected, AdminUnavailable
from kvgate.operator.config import OperatorConfig, configure_kopf
from kvgate.operator.kube import ApiError, default_login
from kvgate.operator.naming import GROUP, LABEL_POOL, PLURAL, VERSION
from kvgate.operator.reconciler import Outcome, OutcomeKind
from kvgate.operator.runtime import Runtime

_RETRYABLE = (ApiError, AdminUnavailable, AdminRejected)
_FAILURES = "kvgate_failures"  # in kopf's per-pool memo
# A pass started by a pod event retries itself this often at most (about five minutes at the
# default backoff); a pool that is still not converged then waits for the next event.
POD_EVENT_ATTEMPTS = 8


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    try:
        config = OperatorConfig()
        config.read_token_key()
    except ValidationError as error:  # bad settings: stop at once, do not retry
        raise kopf.PermanentError(f"invalid operator settings: {error}") from None
    except (OSError, ValueError) as error:
        raise kopf.PermanentError(f"cannot read the operator's token key: {error}") from None
    configure_kopf(settings, config)
    Runtime.start(config, default_login(settings)).store(memo)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await Runtime.of(memo).close()


@kopf.on.login()
async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return await default_login(settings)()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(
    *, namespace: str | None, name: str, body: kopf.Body, memo: Any, **_: Any
) -> None:
    assert namespace is not None  # ExecutorPool is a namespaced resource
    runtime = Runtime.of(memo)
    failures = int(memo.get(_FAILURES, 0))  # consecutive failed passes of this pool
    try:
        outcome = await runtime.passes.run(namespace, name)
    except _RETRYABLE as error:
        memo[_FAILURES] = failures + 1
        if failures == 0:  # one Event per streak of failures; every retry is in the log
            kopf.event(body, type="Warning", reason="ReconcileFailed", message=str(error))
        delay = runtime.config.retry_delay_s(failures)
        raise kopf.TemporaryError(str(error), delay=delay) from None
    memo[_FAILURES] = 0
    match outcome.kind:
        case OutcomeKind.INVALID:
            kopf.event(body, type="Warning", reason="InvalidSpec", message=outcome.message)
            raise kopf.PermanentError(f"invalid spec: {outcome.message}")
        case OutcomeKind.WAITING:
            raise kopf.TemporaryError(f"waiting: {outcome.message}", delay=outcome.delay_s)
        case OutcomeKind.CONVERGED | OutcomeKind.GONE:
            return


@kopf.on.event(GROUP, VERSION, PLURAL)
async def pool_changed(
    *,
    type: str | None,
    namespace: str | None,
    name: str,
    meta: kopf.Meta,
    status: kopf.Status,
    memo: Any,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    assert namespace is not None  # ExecutorPool is a namespaced resource
    if type == "DELETED" or meta.get("generation") == status.get("observedGeneration"):
        return  # nothing new in the spec (this also ignores the passes' own status writes)
    try:
        await Runtime.of(memo).passes.run(namespace, name)
    except _RETRYABLE as error:
        logger.warning(f"pass after a spec change failed; the change handler retries: {error}")


@kopf.on.event("v1", "pods", labels={LABEL_POOL: kopf.PRESENT})
async def pool_pod_changed(
    *, namespace: str | None, labels: kopf.Labels, memo: Any, logger: kopf.Logger, **_: Any
) -> None:
    assert namespace is not None  # pods are namespaced
    runtime = Runtime.of(memo)
    pool = str(labels[LABEL_POOL])
    for attempt in range(POD_EVENT_ATTEMPTS):
        try:
            outcome: Outcome = await runtime.passes.run(namespace, pool)
        except _RETRYABLE as error:
            logger.warning(f"pass over pool {pool} failed, will retry: {error}")
        else:
            if outcome.kind is not OutcomeKind.WAITING or not outcome.poll:
                return
        await asyncio.sleep(runtime.config.retry_delay_s(attempt))
