"""Every Kubernetes API call the operator makes itself (kopf makes its own for watching,
handler bookkeeping and events). A thin asynchronous client over aiohttp.

Credentials come from the same login kopf uses for its watches (:func:`default_login`): the
in-cluster service account, else the kubeconfig as ``kubernetes_asyncio`` reads it (tokens,
token files, client certificates, exec plugins such as cloud providers' token helpers, and auth
providers). A 401 triggers one fresh login and one retry, so rotated service-account tokens and
expired exec-plugin credentials are replaced.

Errors: ``TransientApiError`` for what a retry can fix (connection failures, timeouts, 429,
5xx); ``ApiError`` for the rest, with the API server's reason and message. 404 on read and
delete, and 409 on create, are normal answers here, not errors (see each method).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import aiohttp
import kopf
from kubernetes_asyncio import client as kube_client
from kubernetes_asyncio import config as kube_config

from kvgate.operator.naming import GROUP, PLURAL, VERSION

RawObject = dict[str, Any]
USER_AGENT: Final = "kvgate-operator"
_MERGE_PATCH: Final = "application/merge-patch+json"


@dataclass(frozen=True)
class ApiResource:
    group: str  # "" for the core API
    version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        path = f"{root}/namespaces/{quote(namespace, safe='')}/{self.plural}"
        if name is not None:
            path += f"/{quote(name, safe='')}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


PODS: Final = ApiResource("", "v1", "pods")
SERVICES: Final = ApiResource("", "v1", "services")
CONFIGMAPS: Final = ApiResource("", "v1", "configmaps")
SECRETS: Final = ApiResource("", "v1", "secrets")
DEPLOYMENTS: Final = ApiResource("apps", "v1", "deployments")
EXECUTOR_POOLS: Final = ApiResource(GROUP, VERSION, PLURAL)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class TransientApiError(ApiError):
    """The request may succeed if repeated later."""


Login = Callable[[], Awaitable[kopf.ConnectionInfo | None]]
_DEFAULT_KUBECONFIG: Final = "~/.kube/config"


def default_login(settings: kopf.OperatorSettings) -> Login:
    """The service account inside a cluster, else the kubeconfig (``KUBECONFIG``, read at each
    login, or ``~/.kube/config``), both read by ``kubernetes_asyncio``'s loaders: tokens, token
    files, client certificates, auth providers, and exec plugins (run at every login). The
    kubeconfig is never written back. Raises ``kopf.LoginError`` with both reasons when
    neither gives credentials."""

    home_kubeconfig = os.path.expanduser(_DEFAULT_KUBECONFIG)

    async def login() -> kopf.ConnectionInfo:
        configuration = kube_client.Configuration()
        try:
            kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        except kube_config.ConfigException as not_in_cluster:
            path = os.environ.get("KUBECONFIG") or home_kubeconfig
            try:
                await kube_config.load_kube_config(
                    config_file=path, client_configuration=configuration, persist_config=False
                )
            except (kube_config.ConfigException, OSError) as error:
                raise kopf.LoginError(
                    f"no Kubernetes credentials: not in a cluster ({not_in_cluster}); "
                    f"kubeconfig {path}: {error}"
                ) from error
        if not configuration.host:
            raise kopf.LoginError("the Kubernetes credentials name no API server")
        # A bearer token (also a refreshed service-account or exec-plugin one) comes with its
        # scheme, e.g. "Bearer abc".
        header = await configuration.get_api_key_with_prefix("BearerToken")
        scheme, _, token = (header or "").rpartition(" ")
        return kopf.ConnectionInfo(
            server=configuration.host,
            ca_path=configuration.ssl_ca_cert,
            insecure=not configuration.verify_ssl,
            username=configuration.username or None,
            password=configuration.password or None,
            scheme=scheme or None,
            token=token or None,
            certificate_path=configuration.cert_file,
            private_key_path=configuration.key_file,
            proxy_url=configuration.proxy,
            trust_env=settings.networking.trust_env,
        )

    return login


class KubeApi:
    def __init__(self, login: Login, *, timeout_s: float) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _connect(self, stale: aiohttp.ClientSession | None) -> aiohttp.ClientSession:
        """The current session; a new one (fresh login) if there is none or it is ``stale``."""
        async with self._lock:
            if self._session is not None and self._session is not stale:
                return self._session
            try:
                info = await self._login()
            except kopf.LoginError as error:
                raise ApiError(401, "LoginFailed", str(error)) from error
            if info is None:
                raise ApiError(401, "NoCredentials", "no service account and no kubeconfig")
            if self._session is not None:
                await self._session.close()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers={**info.as_http_headers(), "User-Agent": USER_AGENT},
                timeout=self._timeout,
            )
            self._server = info.server.rstrip("/")
            return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        stale: aiohttp.ClientSession | None = None
        for attempt in (0, 1):
            session = await self._connect(stale)
            try:
                async with session.request(
                    method,
                    self._server + path,
                    params=params,
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": content_type},
                ) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as error:
                raise TransientApiError(
                    0, type(error).__name__, str(error) or repr(error)
                ) from error
            if status == 401 and attempt == 0:
                stale = session  # the token may have rotated: log in again, once
                continue
            try:
                payload: Any = json.loads(text) if text else None
            except ValueError:  # not JSON: e.g. a proxy's error page
                payload = None
            if status < 400:
                if payload is None and text:
                    raise TransientApiError(status, "NotJson", text[:200])
                return status, payload
            reason = payload.get("reason", "") if isinstance(payload, dict) else ""
            message = payload.get("message", text) if isinstance(payload, dict) else text
            error_type = TransientApiError if status == 429 or status >= 500 else ApiError
            raise error_type(status, reason or "Error", str(message))
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def get(self, resource: ApiResource, namespace: str, name: str) -> RawObject | None:
        """The object, or None if it does not exist."""
        try:
            _, payload = await self._request("GET", resource.path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return dict(payload)

    async def list(
        self, resource: ApiResource, namespace: str, labels: Mapping[str, str]
    ) -> list[RawObject]:
        """Objects whose labels include all of ``labels`` (a server-side label selector)."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        _, payload = await self._request(
            "GET", resource.path(namespace), params={"labelSelector": selector}
        )
        return [dict(item) for item in payload.get("items") or []]

    async def create(self, resource: ApiResource, namespace: str, body: RawObject) -> bool:
        """Create the object; False if one of that name already exists."""
        try:
            await self._request("POST", resource.path(namespace), body=body)
        except ApiError as error:
            if error.status == 409:
                return False
            raise
        return True

    async def merge_patch(
        self,
        resource: ApiResource,
        namespace: str,
        name: str,
        patch: RawObject,
        *,
        subresource: str | None = None,
    ) -> bool:
        """Apply a JSON merge patch; False if the object does not exist."""
        try:
            await self._request(
                "PATCH",
                resource.path(namespace, name, subresource),
                body=patch,
                content_type=_MERGE_PATCH,
            )
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def delete(self, resource: ApiResource, namespace: str, name: str, *, uid: str) -> bool:
        """Delete the object if it is still the one with ``uid``; False if it is gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        try:
            await self._request("DELETE", resource.path(namespace, name), body=body)
        except ApiError as error:
            # 409: the precondition failed, the name now belongs to a newer object.
            if error.status in (404, 409):
                return False
            raise
        return True
