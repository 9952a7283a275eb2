"""A Kubernetes API for the operator's behaviour tests: kmock's emulator plus the glue it lacks.

kmock 0.8 stores objects, serves list/watch/get/create/patch/delete and merge- and JSON-patches.
This adds what a real API server does and the operator (or kopf) relies on:

- discovery of the built-in resources used, and of a custom resource once its CRD is created;
- ``uid``, ``resourceVersion``, ``generation`` (bumped on spec changes), ``creationTimestamp``,
  ``generateName``; Secrets' ``stringData`` folded into ``data``;
- JSON-patch ``test`` operations answered 422 when they fail (kopf's optimistic concurrency);
- the status subresource: ``/status`` patches change only ``status``, others never do;
- label selectors on list and watch (equality, inequality, existence);
- delete preconditions (uid), and the garbage collector: deleting an object deletes every
  object whose ``ownerReferences`` name its uid (recursively);
- validators a test adds, refusing a create with 422 as the API server's validation would;
- a journal of every request with a global sequence number shared with the fake admin API, so
  tests can assert the order of calls across both servers;
- ``changed``: notified on every write, so tests wait for states without sleeping.

Still not emulated: schema validation, RBAC, conflicts on concurrent writes, graceful pod
termination (a deleted pod is gone at once), controllers (Deployments create no pods).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import rendering

VERBS = ["get", "list", "watch", "create", "patch", "delete"]
BUILTIN = {
    "v1/namespaces": ("Namespace", False),
    "v1/pods": ("Pod", True),
    "v1/services": ("Service", True),
    "v1/configmaps": ("ConfigMap", True),
    "v1/secrets": ("Secret", True),
    "v1/events": ("Event", True),
    "apps/v1/deployments": ("Deployment", True),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
}


@dataclass(frozen=True)
class Call:
    """One request the emulator served (or refused)."""

    seq: int
    method: str
    group: str
    plural: str
    subresource: str | None
    namespace: str | None
    name: str | None
    watch: bool
    user_agent: str
    status: int
    at: float = 0.0  # loop time


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, (part.strip() for part in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    sequence: Iterator[int] = attrs.field(factory=lambda: itertools.count(1))
    journal: list[Call] = attrs.field(factory=list)
    changed: asyncio.Condition = attrs.field(factory=asyncio.Condition)
    # Validation of created objects, as the API server does: (plural, body) -> refusal or None.
    validators: list[Callable[[str, Mapping[str, Any]], str | None]] = attrs.field(factory=list)
    _versions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1))
    _subresources: dict[kmock.resource, set[str]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced) in BUILTIN.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS)
        self.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1"},
        }

    # --- reading the state (for assertions) -------------------------------------------------

    def live(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Current objects of a resource (e.g. ``"v1/pods"``), sorted by name."""
        wanted = kmock.resource(resource)
        found = [
            obj.raw
            for (res, ns, _), obj in self.objects.items()
            if res == wanted and not obj.deleted and (namespace is None or ns == namespace)
        ]
        return sorted(found, key=lambda o: o["metadata"].get("name") or "")

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        for obj in self.live(resource, namespace):
            if obj["metadata"]["name"] == name:
                return obj
        return None

    # --- request handling -------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        status = 200
        try:
            if request.resource is not None and request.action is not None:
                self._admit(request)
            response = await super()._handle(request)
            status = response.status
        except kmock.KubernetesError as error:
            status = error.status
            raise
        except Exception:
            status = 500
            raise
        finally:
            self._record(request, status)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
            await self._collect_garbage()
            async with self.changed:
                self.changed.notify_all()
        return response

    def _record(self, request: rendering.Request, status: int) -> None:
        resource = request.resource
        name = request.name
        if (
            name is None
            and request.action == kmock.action.CREATE
            and isinstance(request.data, dict)
        ):
            name = request.data.get("metadata", {}).get("name")  # created objects: from the body
        self.journal.append(
            Call(
                seq=next(self.sequence),
                method=str(request.method.value if request.method else ""),
                group=resource.group if resource is not None and resource.group else "",
                plural=resource.plural if resource is not None and resource.plural else "",
                subresource=request.subresource,
                namespace=request.namespace,
                name=name,
                watch=request.params.get("watch") == "true",
                user_agent=request.headers.get("User-Agent", ""),
                status=status,
                at=asyncio.get_running_loop().time(),
            )
        )

    def _stored(self, request: rendering.Request) -> dict[str, Any] | None:
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name or "")
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _admit(self, request: rendering.Request) -> None:
        """What the API server does to a write before storing it (mutating the body)."""
        assert request.resource is not None
        if request.action == kmock.action.CREATE:
            self._admit_create(request)
        elif request.action == kmock.action.UPDATE:
            self._admit_patch(request)
        elif request.action == kmock.action.DELETE and isinstance(request.data, dict):
            wanted = request.data.get("preconditions", {}).get("uid")
            stored = self._stored(request)
            if wanted and stored is not None and stored["metadata"].get("uid") != wanted:
                raise kmock.KubernetesError(409, "Conflict", "precondition failed: uid")

    def _admit_create(self, request: rendering.Request) -> None:
        body = request.data
        assert request.resource is not None
        for validator in self.validators:
            refusal = validator(request.resource.plural or "", body)
            if refusal is not None:
                raise kmock.KubernetesError(422, "Invalid", refusal)
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace is not None:
            meta["namespace"] = request.namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self._versions)),
            generation=1,
            creationTimestamp=_now(),
        )
        if body.get("kind") == "Secret" and "stringData" in body:
            data = body.setdefault("data", {})
            for key, value in body.pop("stringData").items():
                data[key] = base64.b64encode(value.encode()).decode()
        if body.get("kind") == "CustomResourceDefinition":
            self._register_crd(body)

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            subresources = set(version.get("subresources", {}))
            self.resources[resource] = kmock.ResourceInfo(
                kind=spec["names"]["kind"],
                singular=spec["names"].get("singular"),
                namespaced=spec["scope"] == "Namespaced",
                verbs=VERBS,
                subresources=subresources,
                shortnames=spec["names"].get("shortNames", []),
                categories=spec["names"].get("categories", []),
            )
            self._subresources[resource] = subresources

    def _admit_patch(self, request: rendering.Request) -> None:
        stored = self._stored(request)
        if stored is None:
            raise kmock.KubernetesObjectNotFoundError()
        version = str(next(self._versions))
        if isinstance(request.data, list):  # JSON patch
            try:
                patched = jsonpatch.apply_patch(stored, request.data)
            except jsonpatch.JsonPatchTestFailed as error:
                raise kmock.KubernetesError(
                    422, "Invalid", f"the test operation failed: {error}"
                ) from error
            request.data.append(
                {"op": "replace", "path": "/metadata/resourceVersion", "value": version}
            )
            if patched.get("spec") != stored.get("spec"):
                generation = stored["metadata"].get("generation", 0) + 1
                request.data.append(
                    {"op": "add", "path": "/metadata/generation", "value": generation}
                )
            return
        patch = request.data
        assert request.resource is not None
        if "status" in self._subresources.get(request.resource, set()):
            if request.subresource == "status":
                for key in list(patch):
                    if key not in ("status", "metadata"):
                        del patch[key]
            else:
                patch.pop("status", None)
        meta = patch.setdefault("metadata", {})
        meta["resourceVersion"] = version
        if "spec" in patch and request.subresource is None:
            merged = kmock.Object(stored)
            merged.patch({"spec": patch["spec"]})
            if merged.raw.get("spec") != stored.get("spec"):
                meta["generation"] = stored["metadata"].get("generation", 0) + 1

    async def _collect_garbage(self) -> None:
        """Delete objects all of whose owners are gone (background propagation)."""
        while True:
            alive_uids = {
                obj.raw["metadata"].get("uid") for _, obj in self.objects.items() if not obj.deleted
            }
            orphans = []
            for key, obj in self.objects.items():
                refs = [] if obj.deleted else obj.raw["metadata"].get("ownerReferences") or []
                if refs and all(ref.get("uid") not in alive_uids for ref in refs):
                    orphans.append((key, obj))
            if not orphans:
                return
            for (resource, _, _), obj in orphans:
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})

    # --- label selectors ----------------------------------------------------------------------

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload: Any = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            payload["items"] = [
                item
                for item in payload["items"]
                if _selector_matches(selector, item.get("metadata", {}).get("labels") or {})
            ]
        payload["metadata"]["resourceVersion"] = str(next(self._versions))
        return payload

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if selector and isinstance(event, dict):
                labels = event.get("object", {}).get("metadata", {}).get("labels") or {}
                if not _selector_matches(selector, labels):
                    continue
            yield event

    # --- waiting ----------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], object], *, within_s: float = 10.0) -> None:
        """Until ``predicate()`` is true, re-checked after every write; fails on timeout."""
        await until(self.changed, predicate, within_s=within_s)


async def until(
    condition: asyncio.Condition, predicate: Callable[[], object], *, within_s: float
) -> None:
    async def wait() -> None:
        async with condition:
            await condition.wait_for(lambda: bool(predicate()))

    try:
        await asyncio.wait_for(wait(), within_s)
    except TimeoutError:
        raise AssertionError(f"not reached within {within_s}s: {predicate!r}") from None
