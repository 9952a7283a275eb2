"""A real kube-apiserver for tests, built from Go modules and run with an embedded etcd.

No kube-apiserver, k3s, kind or envtest binary can be installed on the test machines, so the
Go program in ``kube_apiserver/`` links ``k8s.io/kubernetes/cmd/kube-apiserver/app`` and
``go.etcd.io/etcd/server/v3/embed`` into one binary. It is built once per recipe into
``<cache>/kube-apiserver/bin-<hash>/kube-apiserver``, the hash covering ``go.mod``, ``go.sum``,
``main.go`` and the Go version; Go's module and build caches live under
``<cache>/kube-apiserver/go`` so a rebuild after a recipe change takes seconds, not the cold
build's many minutes. Builds run under ``<cache>/kube-apiserver/build.lock``.

:class:`KubeApiServer` runs it: etcd and the apiserver on free 127.0.0.1 ports, a self-signed
serving certificate, static bearer tokens for an admin (``system:masters``) and for one
ServiceAccount user (so the chart's RoleBindings apply to it unchanged), RBAC authorisation,
and no ServiceAccount admission plugin (pods need no token Secrets). There is no kubelet,
scheduler or controller-manager: pods stay Pending until a test patches their status, and
nothing garbage-collects.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from tests.harness.go_build import GoRecipe, build_recipe
from tests.harness.system import (
    HarnessError,
    Progress,
    free_port,
    log_progress,
    log_tail,
)

RECIPE_DIR = Path(__file__).with_name("kube_apiserver")
_RECIPE_FILES = ("go.mod", "go.sum", "main.go")
KUBERNETES_VERSION = "v1.37.2"  # k8s.io/kubernetes in go.mod
# Stamped at link time: an unstamped build reports v0.0.0-master+$Format:%H$, which kubectl
# cannot parse and which fails a chart's kubeVersion constraint. All Kubernetes binaries the
# harness builds carry it (tests/harness/kube_build.py).
_VERSION_PACKAGE = "k8s.io/component-base/version"
VERSION_LDFLAGS = " ".join(
    f"-X {_VERSION_PACKAGE}.{name}={value}"
    for name, value in (
        ("gitVersion", KUBERNETES_VERSION),
        ("gitMajor", KUBERNETES_VERSION.lstrip("v").split(".")[0]),
        ("gitMinor", KUBERNETES_VERSION.lstrip("v").split(".")[1]),
        ("gitTreeState", "clean"),
        ("gitCommit", "0" * 40),
        ("buildDate", "1970-01-01T00:00:00Z"),
    )
)
_BUILD_TIMEOUT_S = 3600
_READY_TIMEOUT_S = 120
_STOP_TIMEOUT_S = 30

ADMIN_USER = "kvgate-test-admin"


def recipe() -> GoRecipe:
    return GoRecipe(
        name="kube-apiserver",
        directory=RECIPE_DIR,
        files=_RECIPE_FILES,
        package=".",
        binary="kube-apiserver",
        ldflags=VERSION_LDFLAGS,
        # The cluster's components share these Go caches (kube_build.py); a change to any
        # flag here would recompile every package of the module family.
        trimpath=False,
    )


def recipe_hash(go_version: str) -> str:
    return recipe().hash(go_version)


def build(progress: Progress = log_progress) -> Path:
    """The apiserver binary for the current recipe, built on first use (see module docs)."""
    return build_recipe(
        recipe(),
        progress,
        cold_estimate="kube-apiserver with embedded etcd: many minutes",
    )


def _https(
    method: str,
    url: str,
    token: str,
    ca_file: Path,
    *,
    body: bytes | None = None,
    content_type: str = "application/json",
) -> tuple[int, str]:
    """One request; (HTTP status, body text) for every answer, errors included."""
    context = ssl.create_default_context(cafile=str(ca_file))
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class KubeApiServer:
    """One running apiserver (and etcd) in a private temporary directory; a context manager.

    ``operator_user`` is the ServiceAccount (``namespace/name``) whose token
    :attr:`operator_token` is: RBAC sees ``system:serviceaccount:<namespace>:<name>`` with the
    usual ServiceAccount groups, exactly as for a pod running under that account.
    """

    def __init__(
        self, binary: Path, *, operator_user: str, progress: Progress = log_progress
    ) -> None:
        self.binary = binary
        self.progress = progress
        namespace, _, name = operator_user.partition("/")
        if not namespace or not name:
            raise HarnessError(f"operator_user must be 'namespace/name', not {operator_user!r}")
        self.operator_username = f"system:serviceaccount:{namespace}:{name}"
        self._operator_groups = f"system:serviceaccounts,system:serviceaccounts:{namespace}"
        self.admin_token = secrets.token_hex(16)
        self.operator_token = secrets.token_hex(16)
        self.port = 0
        self.workdir = Path()
        self.log_path = Path()
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        """The self-signed serving certificate (with its CA) the apiserver wrote at start."""
        return self.workdir / "certs" / "apiserver.crt"

    def __enter__(self) -> KubeApiServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvgate-kube-apiserver-"))
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(
            f'{self.admin_token},{ADMIN_USER},admin,"system:masters"\n'
            f'{self.operator_token},{self.operator_username},operator,"{self._operator_groups}"\n'
        )
        tokens.chmod(0o600)
        sa_key = self.workdir / "service-account.key"
        self.port = free_port()
        argv = [
            str(self.binary),
            f"-etcd-dir={self.workdir / 'etcd'}",
            f"-etcd-client-port={free_port()}",
            f"-etcd-peer-port={free_port()}",
            f"-service-account-key={sa_key}",
            "-exit-on-stdin-eof",
            "--",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--disable-admission-plugins=ServiceAccount",
            "--service-cluster-ip-range=10.96.0.0/16",
            # No other apiserver shares this etcd and nothing routes to it: skip the
            # kubernetes Service endpoint reconciler and the request fairness machinery.
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
        ]
        self.log_path = self.workdir / "kube-apiserver.log"
        self._log = self.log_path.open("wb")
        self.progress(f"starting kube-apiserver on {self.url}; log: {self.log_path}")
        # stdin stays open for the server's lifetime: when this process dies, it closes and
        # the server shuts itself down (-exit-on-stdin-eof).
        self._process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self._process is not None
        started = time.monotonic()
        deadline = started + _READY_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise HarnessError(
                    f"kube-apiserver exited with {self._process.returncode} before it was "
                    f"ready; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self.ca_file.exists():
                try:
                    status, body = _https(
                        "GET", f"{self.url}/readyz", self.admin_token, self.ca_file
                    )
                except (OSError, ssl.SSLError) as exc:
                    last = repr(exc)
                else:
                    if status == 200:
                        self.progress(f"kube-apiserver ready in {time.monotonic() - started:.1f} s")
                        return
                    last = f"HTTP {status}: {body[-500:]}"
            time.sleep(0.2)
        raise HarnessError(
            f"kube-apiserver not ready after {_READY_TIMEOUT_S} s ({last}); log "
            f"{self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period); remove its files."""
        process, self._process = self._process, None
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.workdir != Path() and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """``method path`` with a JSON ``body``, as the admin unless ``token`` is given.

        Returns the HTTP status and the decoded JSON answer (a Status object on errors).
        """
        data = None if body is None else json.dumps(body).encode()
        status, text = _https(
            method,
            self.url + path,
            token or self.admin_token,
            self.ca_file,
            body=data,
            content_type=content_type,
        )
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def kubeconfig(
        self,
        path: Path,
        *,
        token: str | None = None,
        exec_plugin: list[str] | None = None,
        namespace: str = "default",
    ) -> Path:
        """Write a kubeconfig for this server with ``token``, or with an exec credential plugin
        (``exec_plugin``: the command and its arguments, client.authentication.k8s.io/v1);
        returns ``path``."""
        if (token is None) == (exec_plugin is None):
            raise HarnessError("a kubeconfig needs exactly one of token and exec_plugin")
        user: dict[str, Any] = (
            {"token": token}
            if exec_plugin is None
            else {
                "exec": {
                    "apiVersion": "client.authentication.k8s.io/v1",
                    "command": exec_plugin[0],
                    "args": exec_plugin[1:],
                    "interactiveMode": "Never",
                }
            }
        )
        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.ca_file),
                    },
                }
            ],
            "users": [{"name": "user", "user": user}],
            "contexts": [
                {
                    "name": "test",
                    "context": {"cluster": "test", "user": "user", "namespace": namespace},
                }
            ],
            "current-context": "test",
        }
        path.write_text(json.dumps(config, indent=2))
        os.chmod(path, 0o600)
        return path
