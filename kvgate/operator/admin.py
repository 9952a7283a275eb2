"""Every call the operator makes to a pool's admission admin API (bodies: ``admin_api``).

The base URL comes from a template with ``{pool}`` and ``{namespace}`` (default: the pool's
admission Service); tests point it at a local server. Mutations carry the pool's admin token.

Errors: ``AdminUnavailable`` when the service cannot be reached or is not ready (connection
failures, timeouts, 5xx) — normal while the admission pod starts; ``AdminRejected`` when it
answered and refused (bad token, bad body), with its ``AdminError`` text.
"""

from __future__ import annotations

from typing import Final, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ValidationError

from kvgate.protocol.admin import (
    AdminError,
    ExecutorMembership,
    ExecutorSet,
    ExecutorStatus,
)

DEFAULT_URL_TEMPLATE: Final = "http://{pool}-admission.{namespace}.svc:8080"
# One admission pod's own admin API, for pools of several replicas (each is told its shard).
DEFAULT_POD_URL_TEMPLATE: Final = "http://{pod_ip}:8080"
_Body = TypeVar("_Body", bound=BaseModel)


class AdminUnavailable(Exception):
    """The admin API did not answer usefully; retry later."""


class AdminRejected(Exception):
    """The admin API refused the request."""


def admin_url(template: str, *, pool: str, namespace: str) -> str:
    return template.format(pool=pool, namespace=namespace).rstrip("/")


def check_url_template(template: str) -> None:
    """Raise ValueError unless ``template`` formats with exactly {pool} and {namespace}."""
    try:
        url = admin_url(template, pool="p", namespace="n")
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"admin URL template {template!r} may use only {{pool}} and {{namespace}}: {error!r}"
        ) from None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"admin URL template {template!r} must start with http:// or https://")


def pod_admin_url(template: str, *, pod_ip: str) -> str:
    """``template`` with the pod's IP (an IPv6 address in brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return template.format(pod_ip=host).rstrip("/")


def check_pod_url_template(template: str) -> None:
    """Raise ValueError unless ``template`` formats with exactly {pod_ip}."""
    try:
        url = pod_admin_url(template, pod_ip="10.0.0.1")
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"admin pod URL template {template!r} may use only {{pod_ip}}: {error!r}"
        ) from None
    if "{pod_ip}" not in template or not url.startswith(("http://", "https://")):
        raise ValueError(
            f"admin pod URL template {template!r} must start with http:// or https:// and "
            "use {pod_ip}"
        )


class AdminClient:
    """One pool's admin API, over a session shared by all pools."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str) -> None:
        self._session = session
        self._base_url = base_url
        self._auth = {"Authorization": f"Bearer {token}"}

    async def _send(self, method: str, path: str, body: BaseModel | None = None) -> str:
        """The response text of a 2xx answer; the errors above otherwise."""
        url = self._base_url + path
        headers = dict(self._auth)
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(
                method,
                url,
                headers=headers,
                data=None if body is None else body.model_dump_json(),
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise AdminUnavailable(f"{method} {url}: {error!r}") from error
        if status >= 500:
            raise AdminUnavailable(f"{method} {url}: HTTP {status}: {text[:200]}")
        if status >= 400:
            try:
                detail = AdminError.model_validate_json(text)
                reason = detail.error + (f": {detail.detail}" if detail.detail else "")
            except ValidationError:
                reason = text[:200]
            if status == 401:
                reason += (
                    " — the admin token Secret does not hold the operator's token (made by "
                    "hand, or by an operator with another key): delete it and the operator "
                    "writes it again"
                )
            raise AdminRejected(f"{method} {url}: HTTP {status}: {reason}")
        return text

    async def _call(
        self, method: str, path: str, answer: type[_Body], body: BaseModel | None = None
    ) -> _Body:
        text = await self._send(method, path, body)
        try:
            return answer.model_validate_json(text)
        except ValidationError as error:
            raise AdminRejected(f"{method} {path}: unexpected answer: {error}") from None

    async def membership(self) -> ExecutorMembership:
        return await self._call("GET", "/v1/executors", ExecutorMembership)

    async def set_membership(self, executors: ExecutorSet) -> None:
        # The answer's body is not part of the contract: any 2xx means replaced.
        await self._send("PUT", "/v1/executors", executors)

    async def drain(self, name: str) -> ExecutorStatus:
        return await self._call(
            "POST", f"/v1/executors/{quote(name, safe='')}/drain", ExecutorStatus
        )
