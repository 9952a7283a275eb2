"""One reconcile pass for one pool: observe, plan, act, report.

A pass reads the pool afresh, so whatever triggered it (a spec change, a pod event, a retry)
acts on the latest spec. Its phases::

    read pool ──▶ parse spec ──▶ admin token, Services, ConfigMap, Deployment (create/patch)
              ──▶ list executor pods, read membership ──▶ plan ──▶ act ──▶ write status
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

import aiohttp
from pydantic import ValidationError

from kvgate.operator import autoscale, planner, shards
from kvgate.operator.admin import (
    AdminClient,
    AdminRejected,
    AdminUnavailable,
    admin_url,
    pod_admin_url,
)
from kvgate.operator.builders import (
    PoolRef,
    build_admin_token_secret,
    build_admission_configmap,
    build_admission_deployment,
    build_admission_service,
    build_executor_pod,
    build_executor_service,
    executor_revision,
)
from kvgate.operator.builders.common import selector_labels, with_spec_hash
from kvgate.operator.config import OperatorConfig
from kvgate.operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    EXECUTOR_POOLS,
    PODS,
    SECRETS,
    SERVICES,
    ApiError,
    ApiResource,
    KubeApi,
    RawObject,
)
from kvgate.operator.models import ExecutorPoolSpec, InvalidSpecError, parse_spec
from kvgate.operator.naming import (
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_SPEC_HASH,
    COMPONENT_ADMISSION,
)
from kvgate.operator.observe import (
    ObservedPod,
    ObservedPool,
    annotation,
    controller_uid,
    covers,
    observe_pod,
    observe_pool,
)
from kvgate.operator.report import (
    deletion_event,
    executor_selector,
    pool_status,
    problem_status_patch,
)
from kvgate.operator.status import (
    AutoscalingStatus,
    ConditionType,
    Phase,
    PoolStatus,
    RecommendationEntry,
)
from kvgate.protocol.admin import ExecutorMembership, ExecutorSet


class EventSink(Protocol):
    """Posts a Kubernetes Event about ``obj`` (kopf.event in the operator)."""

    def __call__(self, obj: RawObject, *, type: str, reason: str, message: str) -> None: ...


class OutcomeKind(StrEnum):
    CONVERGED = "converged"
    WAITING = "waiting"  # look again after delay_s
    INVALID = "invalid"  # the spec must change first
    GONE = "gone"  # the pool is deleted or being deleted


@dataclass(frozen=True)
class Outcome:
    kind: OutcomeKind
    message: str = ""
    delay_s: float = 0.0
    # Waiting for something no watch event reports (a drain, the admin API, a name conflict):
    # only looking again tells when it is over.
    poll: bool = False
    # An autoscaled pool: look again this soon whatever the outcome (its load is no event).
    sync_s: float | None = None


class Blocked(Exception):
    """Something the operator must not override is in the way (reason, message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class AdmissionCalls(Protocol):
    """What ``_act`` tells the pool's admission service: one, or several replicas."""

    async def drain(self, name: str) -> None: ...

    async def update(self, plan: planner.Plan) -> list[str]:
        """Send the membership the plan asks for; the messages of the Events to post."""
        ...


@dataclass(frozen=True)
class OneService:
    """One admission replica, reached through the pool's admission Service."""

    admin: AdminClient

    async def drain(self, name: str) -> None:
        await self.admin.drain(name)

    async def update(self, plan: planner.Plan) -> list[str]:
        if plan.membership is None:
            return []
        await self.admin.set_membership(ExecutorSet(executors=list(plan.membership)))
        return [f"executors: {', '.join(e.name for e in plan.membership) or 'none'}"]


@dataclass(frozen=True)
class Shards:
    """Several replicas, each on its pod IP: a drain goes to the replica that holds the
    executor; the membership is shared out by ``shard`` in two rounds (every release before
    any executor is given to another replica, ``shards.py``)."""

    shard: shards.ShardPlan
    replicas: Sequence[shards.Replica]
    admins: Mapping[str, AdminClient]

    async def drain(self, name: str) -> None:
        for replica in self.replicas:
            if replica.live and name in replica.held:
                await self.admins[replica.name].drain(name)

    async def update(self, plan: planner.Plan) -> list[str]:
        return await self.send()  # the shard was split from this plan's members

    async def send(self) -> list[str]:
        """Both rounds; the messages of the Events to post."""
        shard = self.shard
        for name, kept in shard.releases.items():
            await self.admins[name].set_membership(ExecutorSet(executors=list(kept)))
        messages = []
        for name in shard.pushes:
            members = shard.memberships[name]
            if shard.releases.get(name) != members:
                await self.admins[name].set_membership(ExecutorSet(executors=list(members)))
            messages.append(f"{name} drives: {', '.join(e.name for e in members) or 'none'}")
        return messages


class Reconciler:
    def __init__(
        self,
        kube: KubeApi,
        admin_session: aiohttp.ClientSession,
        config: OperatorConfig,
        events: EventSink,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._kube = kube
        self._admin_session = admin_session
        self._config = config
        self._events = events
        self._clock = clock
        self._token_key = config.read_token_key()
        self._token_written: set[str] = set()  # pool uids whose token Secret exists

    async def reconcile(self, namespace: str, name: str) -> Outcome:
        raw = await self._kube.get(EXECUTOR_POOLS, namespace, name)
        pool = observe_pool(raw) if raw is not None else None
        if raw is None or pool is None or pool.deleting:
            return Outcome(OutcomeKind.GONE)  # the garbage collector takes the children
        try:
            spec = parse_spec(pool.name, pool.spec)
            image = spec.admission.image or self._config.admission_image
            if image is None:
                raise InvalidSpecError(
                    "spec.admission.image: required, the operator has no default admission "
                    "image (KVGATE_OPERATOR_ADMISSION_IMAGE)"
                )
            return await self._converge(raw, pool, spec, image)
        except InvalidSpecError as error:
            await self._report_problem(pool, Phase.FAILED, "InvalidSpec", error.message)
            return Outcome(OutcomeKind.INVALID, error.message)
        except Blocked as error:
            await self._report_problem(pool, Phase.PENDING, error.reason, error.message)
            return Outcome(
                OutcomeKind.WAITING, error.message, self._config.max_backoff_s, poll=True
            )

    async def _converge(
        self, raw: RawObject, pool: ObservedPool, spec: ExecutorPoolSpec, image: str
    ) -> Outcome:
        ref = PoolRef(pool.name, pool.namespace, pool.uid)
        token = await self._admin_token(ref)
        await self._ensure_children(ref, spec, image, token)
        pods = await self._executor_pods(ref)
        admin = AdminClient(
            self._admin_session,
            admin_url(self._config.admin_url_template, pool=ref.name, namespace=ref.namespace),
            token,
        )
        paused = spec.admission.replicas == 0
        admissions: list[shards.Replica] | None = None
        if spec.admission.replicas > 1:
            # Several replicas: each is asked on its own; the pool's reading is their union.
            admissions = await self._admission_replicas(ref, token)
            reading = shards.merged(admissions)
            admin_problem = "; ".join(r.problem for r in admissions if r.problem)
            if reading is None and not admin_problem:
                admin_problem = "no admission replica is ready"
        elif paused:
            # No admission service, no work on any executor: nothing to drain or to tell.
            reading, admin_problem = None, ""
        else:
            reading, admin_problem = await self._membership(admin)
        membership = [] if paused else None if reading is None else reading.executors
        now = self._clock().replace(microsecond=0)
        revision = executor_revision(ref, spec)
        replicas, scaling = spec.replicas, None
        if spec.autoscaling is not None:
            replicas, scaling = await self._autoscale(raw, pool, spec, reading, now)
        plan = planner.plan(
            planner.PlanInput(
                pool=ref.name,
                replicas=replicas,
                revision=revision,
                pods=pods,
                membership=membership,
                now=now,
                drain_timeout=timedelta(seconds=spec.drain_timeout_seconds),
                admin_problem=admin_problem,
                admission_paused=paused,
            )
        )
        shard = None
        calls: AdmissionCalls = OneService(admin)
        if admissions is not None:
            shard = shards.split(plan.members, admissions)
            admins = {
                r.name: self._admin_client(r.url, token) for r in admissions if r.url is not None
            }
            calls = Shards(shard, admissions, admins)
        await self._act(plan, calls, raw=raw, ref=ref, spec=spec, now=now)
        status = pool_status(pool, plan, now, autoscaling=scaling, shard=shard)
        await self._write_status(pool, status)
        sync_s = None if spec.autoscaling is None else float(spec.autoscaling.sync_period_seconds)
        moving = shard is not None and bool(shard.moving)
        if plan.converged and not moving:
            return Outcome(OutcomeKind.CONVERGED, sync_s=sync_s)
        ready = next(c for c in status.conditions if c.type is ConditionType.READY)
        poll = plan.draining or membership is None or moving
        # Pod changes arrive as events; the slower resync only guards against missed ones.
        delay_s = self._config.poll_interval_s if poll else self._config.resync_interval_s
        return Outcome(OutcomeKind.WAITING, ready.message, delay_s, poll=poll, sync_s=sync_s)

    async def _autoscale(
        self,
        raw: RawObject,
        pool: ObservedPool,
        spec: ExecutorPoolSpec,
        reading: ExecutorMembership | None,
        now: datetime,
    ) -> tuple[int, AutoscalingStatus]:
        """Decide the executor count from the load (``autoscale.py``) and write it through
        the scale subresource: the replicas this pass plans for, and the status to keep."""
        assert spec.autoscaling is not None
        before = _autoscaling_status(pool.status)
        load = None
        if reading is not None and reading.queue is not None:
            load = autoscale.Load(reading.queue, reading.executors)
        history = [autoscale.Recommendation(r.time, r.replicas) for r in before.recommendations]
        decision = autoscale.decide(
            spec.autoscaling,
            current=spec.replicas,
            load=load,
            history=history,
            idle_since=before.idle_since,
            now=now,
        )
        last_scale_time = before.last_scale_time
        if decision.replicas != spec.replicas:
            scale = {"spec": {"replicas": decision.replicas}}
            await self._kube.merge_patch(
                EXECUTOR_POOLS, pool.namespace, pool.name, scale, subresource="scale"
            )
            last_scale_time = now
            verb = "ScaledUp" if decision.replicas > spec.replicas else "ScaledDown"
            message = f"{spec.replicas} -> {decision.replicas} executors: {decision.reason}"
            self._event(raw, "Normal", verb, message)
        status = AutoscalingStatus(
            desired_replicas=decision.replicas,
            reason=decision.reason[:1024],
            last_scale_time=last_scale_time,
            idle_since=decision.idle_since,
            recommendations=[
                RecommendationEntry(time=r.at, replicas=r.replicas) for r in decision.history
            ],
        )
        return decision.replicas, status

    async def _ensure_children(
        self, ref: PoolRef, spec: ExecutorPoolSpec, image: str, token: str
    ) -> None:
        deployment = build_admission_deployment(ref, spec, image=image, admin_token=token)
        for resource, manifest in (
            (SERVICES, build_executor_service(ref)),
            (SERVICES, build_admission_service(ref)),
            (CONFIGMAPS, build_admission_configmap(ref, spec)),
            (DEPLOYMENTS, deployment),
        ):
            await self._ensure(resource, ref, manifest)

    async def _executor_pods(self, ref: PoolRef) -> list[ObservedPod]:
        """This pool's executor pods (a same-named predecessor's pods are not ours)."""
        items = await self._kube.list(PODS, ref.namespace, executor_selector(ref.name))
        return [observe_pod(item) for item in items if controller_uid(item) == ref.uid]

    async def _admin_token(self, ref: PoolRef) -> str:
        """The pool's admin token, derived from the operator's key (``tokens.py``); written
        into its Secret once, never read back."""
        token = self._token_key.admin_token(ref.namespace, ref.name, ref.uid)
        if ref.uid not in self._token_written:
            # False: a Secret of that name exists — ours from an earlier pass or process. One
            # that holds another token shows as the admin API refusing the operator.
            await self._kube.create(SECRETS, ref.namespace, build_admin_token_secret(ref, token))
            self._token_written.add(ref.uid)
        return token

    async def _ensure(self, resource: ApiResource, ref: PoolRef, manifest: RawObject) -> None:
        """Create the child, or patch it when its spec hash differs from the built one."""
        desired = with_spec_hash(manifest)
        name = desired["metadata"]["name"]
        live = await self._kube.get(resource, ref.namespace, name)
        if live is None:
            if await self._write(self._kube.create(resource, ref.namespace, desired), desired):
                return
            live = await self._kube.get(resource, ref.namespace, name)
            if live is None:
                raise ApiError(409, "Conflict", f"{desired['kind']} {name} appears and disappears")
        if controller_uid(live) != ref.uid:
            raise Blocked(
                "NameConflict",
                f"{desired['kind']} {name} exists and does not belong to this pool; "
                "delete it or rename the pool",
            )
        # Patch when the spec changed (hash), or when someone changed what we set (drift).
        wanted = desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        if annotation(live, ANNOTATION_SPEC_HASH) != wanted or not covers(live, desired):
            await self._write(
                self._kube.merge_patch(resource, ref.namespace, name, desired), desired
            )

    @staticmethod
    async def _write(call: Awaitable[bool], manifest: RawObject) -> bool:
        """A create or patch of an object built from the spec. The API server refusing it
        (400, 422: e.g. a malformed affinity passed through) is a problem of the spec."""
        try:
            return await call
        except ApiError as error:
            if error.status in (400, 422):
                kind, name = manifest["kind"], manifest["metadata"]["name"]
                raise InvalidSpecError(
                    f"the API server refused {kind} {name}: {error.message}"
                ) from None
            raise

    def _admin_client(self, url: str, token: str) -> AdminClient:
        return AdminClient(self._admin_session, url, token)

    async def _admission_replicas(self, ref: PoolRef, token: str) -> list[shards.Replica]:
        """The pool's admission pods; each ready one is asked for its membership (at once)."""
        selector = selector_labels(ref, COMPONENT_ADMISSION)
        pods = [observe_pod(item) for item in await self._kube.list(PODS, ref.namespace, selector)]

        async def observe(pod: ObservedPod) -> shards.Replica:
            template = self._config.admin_pod_url_template
            url = None if pod.pod_ip is None else pod_admin_url(template, pod_ip=pod.pod_ip)
            ready = pod.ready and not pod.terminating
            if url is None or not ready:
                return shards.Replica(pod.name, url, ready=False)
            reading, problem = await self._membership(self._admin_client(url, token))
            return shards.Replica(pod.name, url, ready=True, reading=reading, problem=problem)

        return list(await asyncio.gather(*(observe(p) for p in sorted(pods, key=_by_name))))

    async def _membership(self, admin: AdminClient) -> tuple[ExecutorMembership | None, str]:
        try:
            return await admin.membership(), ""
        except (AdminUnavailable, AdminRejected) as error:
            return None, str(error)

    async def _act(
        self,
        plan: planner.Plan,
        admission: AdmissionCalls,
        *,
        raw: RawObject,
        ref: PoolRef,
        spec: ExecutorPoolSpec,
        now: datetime,
    ) -> None:
        """Drain, then update membership, then delete, then create: a pod leaves the
        membership before it goes, and joins it only once ready (a later pass)."""
        for drain in plan.drains:
            if drain.mark:
                mark = {"metadata": {"annotations": {ANNOTATION_DRAINING_SINCE: now.isoformat()}}}
                if not await self._kube.merge_patch(PODS, ref.namespace, drain.name, mark):
                    continue  # gone meanwhile: nothing to drain
            await admission.drain(drain.name)
            if drain.mark:
                self._event(raw, "Normal", "DrainStarted", f"draining {drain.name} ({drain.cause})")
        for message in await admission.update(plan):
            self._event(raw, "Normal", "MembershipUpdated", message)
        for deletion in plan.deletions:
            if await self._kube.delete(PODS, ref.namespace, deletion.name, uid=deletion.uid):
                self._event(raw, *deletion_event(deletion, spec))
        for slot in plan.creations:
            pod = build_executor_pod(ref, spec, slot)
            if await self._write(self._kube.create(PODS, ref.namespace, pod), pod):
                self._event(raw, "Normal", "ExecutorCreated", f"created {pod['metadata']['name']}")

    def _event(self, raw: RawObject, type: str, reason: str, message: str) -> None:
        self._events(raw, type=type, reason=reason, message=message)

    async def _write_status(self, pool: ObservedPool, status: PoolStatus) -> None:
        try:
            if PoolStatus.model_validate(pool.status) == status:
                return  # unchanged: no write, no watch event, no loop
        except ValidationError:
            pass  # absent or from another version: rewrite it
        await self._kube.merge_patch(
            EXECUTOR_POOLS, pool.namespace, pool.name, status.to_patch(), subresource="status"
        )

    async def _report_problem(
        self, pool: ObservedPool, phase: Phase, reason: str, message: str
    ) -> None:
        now = self._clock().replace(microsecond=0)
        patch = problem_status_patch(pool, phase, reason, message, now=now)
        if patch is not None:
            await self._kube.merge_patch(
                EXECUTOR_POOLS, pool.namespace, pool.name, patch, subresource="status"
            )


def _autoscaling_status(status: Mapping[str, Any]) -> AutoscalingStatus:
    """What the last pass decided (an absent or unreadable entry starts afresh)."""
    try:
        return AutoscalingStatus.model_validate(status.get("autoscaling"))
    except ValidationError:
        return AutoscalingStatus(desired_replicas=0, reason="")


def _by_name(pod: ObservedPod) -> str:
    return pod.name
