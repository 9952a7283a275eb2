"""Pods that run as real processes: the pool's admission service and its executors.

``AdmissionPod`` plays the admission Deployment's one pod. Once the operator has written the
Deployment, its ConfigMap and the admin-token Secret, it mounts the pod's volumes into a
directory (each ConfigMap or Secret key a file, as the kubelet would) and runs the Deployment's
own command, ``kvgate admission-service --config /etc/kvgate/admission.yaml``, as a process.
The one liberty taken: paths under a mount in the arguments, the environment and the mounted
files are rewritten to where the mount is on this machine. Test-only settings (a free admin
port on 127.0.0.1, the group timings the embedded broker needs) come through ``KVGATE_*``
variables, which the service reads over its file. Once ``/readyz`` answers 200 the proxy in
front of it (``admin_proxy``) starts forwarding, as a Service starts routing to a ready pod.
A change of the pod template after that start is not acted on: the tests using this pod do not
change the admission settings.

``ProcessKubelet`` starts each executor pod as a ``kvgate sim-executor`` on a loopback address
of its own (Linux routes all of 127/8 to ``lo``), port ``EXECUTOR_PORT``, with the executor
token from the pod's Secret volume; the pod turns Running and Ready when the executor's
``/readyz`` answers. The simulated executor stands in for the GPU executor the pod would run
(same step protocol, emulated compute time). A pod that is deleted has its process stopped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.operator.naming import EXECUTOR_PORT, EXECUTOR_TOKEN_DIR, admission_name
from tests.operator.admin_proxy import JournalingProxy
from tests.operator.cluster import NAMESPACE, Kubelet
from tests.operator.kube_emulator import KubeEmulator, until

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ChildProcess:
    """A ``python -m kvgate ...`` child with its log file."""

    name: str
    process: asyncio.subprocess.Process
    log_path: Path

    @classmethod
    async def spawn(
        cls, name: str, argv: list[str], log_dir: Path, env: dict[str, str]
    ) -> ChildProcess:
        log_path = log_dir / f"{name}.log"
        # The test's own KVGATE_* settings (the operator's) are not the child's.
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        base |= {"PYTHONPATH": str(REPO), "OTEL_SDK_DISABLED": "true", "PYTHONUNBUFFERED": "1"}
        with log_path.open("ab") as sink:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvgate",
                *argv,
                cwd=REPO,
                env=base | env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=sink,
                stderr=asyncio.subprocess.STDOUT,
            )
        return cls(name, process, log_path)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    async def wait_http(self, url: str, *, within_s: float) -> None:
        """Until ``url`` answers 200; fails at once (with the log) if the process exits."""
        deadline = time.monotonic() + within_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                if not self.alive:
                    raise AssertionError(
                        f"{self.name} exited ({self.process.returncode}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.get(url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise AssertionError(f"{url} not ready in {within_s:.0f} s:\n{self.log_tail()}")
                await asyncio.sleep(0.1)

    async def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


def _volume_source(volume: dict[str, Any]) -> tuple[str, str] | None:
    """(resource, name) of the ConfigMap or Secret a volume shows; None for other kinds."""
    if "configMap" in volume:
        return "v1/configmaps", volume["configMap"]["name"]
    if "secret" in volume:
        return "v1/secrets", volume["secret"]["secretName"]
    return None


def _mount_volumes(
    api: KubeEmulator, pod_spec: dict[str, Any], container: dict[str, Any], root: Path
) -> dict[str, Path]:
    """Write the container's ConfigMap, Secret and emptyDir volumes under ``root``; returns
    mount path -> local directory. A missing ConfigMap or Secret is an error (the kubelet
    would not start the pod either)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = root / mount["mountPath"].lstrip("/")
        local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
        source = _volume_source(volume)
        if source is None:
            continue  # an emptyDir (or the model volume): an empty directory here
        obj = api.get(source[0], NAMESPACE, source[1])
        if obj is None:
            raise AssertionError(f"volume {mount['name']}: {source} does not exist")
        data = dict(obj.get("data", {}))
        if "secret" in volume:
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        items = (volume.get("secret") or volume["configMap"]).get("items")
        items = items or [{"key": k, "path": k} for k in data]
        for item in items:
            (local / item["path"]).write_text(data[item["key"]])
    return mounts


def _relocate(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with every path under a mount moved to the mount's local directory (one pass:
    a relocated path, itself perhaps under /tmp, is never relocated again)."""
    local = {path.rstrip("/"): str(directory) for path, directory in mounts.items()}
    alternatives = "|".join(re.escape(path) for path in sorted(local, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])")
    return pattern.sub(lambda match: local[match.group(1)], text)


@dataclass
class AdmissionPod:
    api: KubeEmulator
    proxy: JournalingProxy
    root: Path
    pool: str = "pool"
    overrides: dict[str, str] = field(default_factory=dict)  # test-only KVGATE_* settings
    child: ChildProcess | None = None
    error: Exception | None = None  # why the pod could not start
    _task: asyncio.Task[None] | None = None

    def _objects(self) -> dict[str, Any] | None:
        """The Deployment once it and every object its pod mounts exist, else None."""
        deployment = self.api.get("apps/v1/deployments", NAMESPACE, admission_name(self.pool))
        if deployment is None or deployment["spec"].get("replicas", 1) < 1:
            return None
        for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
            source = _volume_source(volume)
            if source is not None and self.api.get(source[0], NAMESPACE, source[1]) is None:
                return None
        return deployment

    async def _run(self) -> None:
        try:
            await until(self.api.changed, self._objects, within_s=60)
            deployment = self._objects()
            assert deployment is not None
            pod_spec = deployment["spec"]["template"]["spec"]
            [container] = pod_spec["containers"]
            mounts = _mount_volumes(self.api, pod_spec, container, self.root / "admission")
            for local in mounts.values():
                for file in local.iterdir():
                    file.write_text(_relocate(file.read_text(), mounts))
            assert container["command"] == ["kvgate"], container["command"]
            argv = [_relocate(arg, mounts) for arg in container["args"]]
            fields = {"metadata.name": "admission-0", "metadata.namespace": NAMESPACE}
            env: dict[str, str] = {}
            for entry in container.get("env", []):  # as the kubelet fills them, in order
                if "valueFrom" in entry:
                    env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
                    continue
                value = _relocate(entry["value"], mounts)
                for name, known in env.items():
                    value = value.replace(f"$({name})", known)
                env[entry["name"]] = value
            port = free_port()
            env |= {"KVGATE_ADMIN__HOST": "127.0.0.1", "KVGATE_ADMIN__PORT": str(port)}
            env |= self.overrides
            self.child = await ChildProcess.spawn("admission", argv, self.root, env)
            url = f"http://127.0.0.1:{port}"
            await self.child.wait_http(f"{url}/readyz", within_s=60)
            self.proxy.upstream = url
        except Exception as error:  # reported by the fixture at teardown
            self.error = error
            raise

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self.proxy.upstream = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.child is not None:
            await self.child.stop()


def _on_this_machine(args: list[str], ip: str, token_file: Path, name: str) -> list[str]:
    """The pod's ``kvgate executor`` command with what differs here: the CPU in float32, the
    pod's loopback address, the token file where its Secret volume was written."""
    overrides = {
        "--device": "cpu",
        "--dtype": "float32",
        "--host": ip,
        "--token-file": str(token_file),
    }
    argv = list(args)
    for flag, value in overrides.items():
        argv[argv.index(flag) + 1] = value
    return [*argv, "--executor-id", name]


def _loopback_prefix() -> str:
    """A /24 of 127/8 for this test process's executors: parallel runs do not collide."""
    pid = os.getpid()
    return f"127.{100 + pid % 100}.{(pid // 100) % 250 + 1}"


@dataclass
class ProcessKubelet(Kubelet):
    """A kubelet whose executor pods are ``kvgate sim-executor`` processes (see module doc)."""

    log_dir: Path = Path()
    executor_args: list[str] = field(default_factory=list)
    # Run each pod's own `kvgate executor` command (a real model, on the CPU) instead.
    real_executors: bool = False
    executors: dict[str, tuple[str, ChildProcess]] = field(default_factory=dict)  # pod: uid, proc
    failures: list[str] = field(default_factory=list)
    _prefix: str = field(default_factory=_loopback_prefix)
    _next_host: int = 1

    def gone(self) -> list[str]:
        """Pods with a running executor that no longer exist (or were replaced)."""
        live = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.api.live("v1/pods")}
        return [name for name, (uid, _) in self.executors.items() if live.get(name) != uid]

    async def start_pod(self, name: str) -> str:
        pod = self.api.get("v1/pods", NAMESPACE, name)
        assert pod is not None
        ip = f"{self._prefix}.{self._next_host}"
        self._next_host += 1
        [container] = pod["spec"]["containers"]
        mounts = _mount_volumes(self.api, pod["spec"], container, self.log_dir / name)
        token_file = mounts[EXECUTOR_TOKEN_DIR] / "token"
        if self.real_executors:
            argv = _on_this_machine(container["args"], ip, token_file, name)
        else:
            argv = ["sim-executor", "--host", ip, "--port", str(EXECUTOR_PORT)]
            argv += ["--executor-id", name, "--token-file", str(token_file), *self.executor_args]
        uid = pod["metadata"]["uid"]
        child = await ChildProcess.spawn(name, argv, self.log_dir, {})
        self.executors[name] = (uid, child)
        try:
            await child.wait_http(f"http://{ip}:{EXECUTOR_PORT}/readyz", within_s=60)
        except AssertionError as error:
            self.failures.append(str(error))
            ready = False
        else:
            ready = True
        # Deleted (and perhaps re-created under its name) while it started: not this pod's
        # status to write; the loop stops the process as gone and starts the new pod.
        live = self.api.get("v1/pods", NAMESPACE, name)
        if live is not None and live["metadata"]["uid"] == uid:
            phase = "Running" if ready else "Failed"
            await self.set_status(name, phase=phase, ready=ready, ip=ip)
        return ip

    async def _run(self) -> None:
        while True:
            async with self.api.changed:
                await self.api.changed.wait_for(lambda: bool(self.pending() or self.gone()))
            for name in self.gone():
                _, child = self.executors.pop(name)
                await child.stop()
            for pod in self.pending():
                await self.start_pod(pod["metadata"]["name"])

    async def stop(self) -> None:
        await super().stop()
        for _, child in self.executors.values():
            await child.stop()
        self.executors.clear()
