"""A real single-node Kubernetes cluster for tests: real pods, real controllers, no registry.

Parts (built and cached by :mod:`tests.harness.kube_build`): the harness's kube-apiserver with
embedded etcd, kube-controller-manager, kube-scheduler, kubelet and kube-proxy of the same
Kubernetes version, Debian's containerd 1.6 and runc, Debian's CNI plugins, CoreDNS, and a
pause image compiled here.

Network: nothing may leave the machine. The whole cluster runs in a network namespace the
harness creates (:data:`NETNS`) which has **no default route**: its only links are loopback,
the pod bridge :data:`BRIDGE` (``10.244.0.1/24``: node IP, pod gateway, apiserver address) and
one veth pair to the host (``10.250.0.2`` inside, ``10.250.0.1`` on the host). The host routes
the pod range and the service range (``10.96.0.0/16``) into that veth before anything starts,
so tests on the host reach pods, Services and the apiserver directly, and a packet for any
other address has no route inside the namespace and is dropped there. kube-proxy's and the
kubelet's iptables rules and the network sysctls they set live in the namespace and vanish
with it. Processes enter only the network namespace (``nsenter --net``), never a mount
namespace, so kubelet, containerd and runc see the same mounts.

Host changes that are not per-namespace are recorded and restored on teardown: the kernel
sysctls the kubelet sets (``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``),
the ``kubepods`` cgroups, pod network namespaces under ``/run/netns``, mounts under the work
directory, ``/var/log/containers`` links, the host routes and veth. Containers are removed by
deleting their pods through the API (the kubelet tears them down), then through the same
containerd. One cluster runs per machine (``<cache>/kube-cluster/cluster.lock``); a cluster
left by a killed session is cleaned up by the next start from its recorded state.

Use::

    with KubeCluster(prepare()) as cluster:
        cluster.kubectl("get", "nodes")
        cluster.import_image_tar(path)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from tests.harness.kube_build import COREDNS_IMAGE, PAUSE_IMAGE, ClusterParts
from tests.harness.system import (
    HarnessError,
    Progress,
    cache_root,
    is_root,
    log_progress,
    log_tail,
    remove_tree,
)

NETNS = "kvgate-cluster"
BRIDGE = "kvgate0"
HOST_VETH = "kvgate-h"
NS_VETH = "kvgate-n"
HOST_LINK_IP = "10.250.0.1"
NS_LINK_IP = "10.250.0.2"
LINK_PREFIX = 30
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
DNS_SERVICE_IP = "10.96.0.10"
#: Source ranges of everything the cluster sends; the no-packet-out check counts these.
CLUSTER_SOURCE_RANGES = (POD_CIDR, SERVICE_CIDR, f"{NS_LINK_IP}/{LINK_PREFIX}")
API_PORT = 6443
NODE_NAME = "kvgate-node"
CLUSTER_DOMAIN = "cluster.local"
#: A fake GPU count the harness writes into the node's status, so ExecutorPools schedule.
FAKE_GPUS = 4
WORK_DIR = Path("/run/kvgate-cluster")
HOST_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
CONTAINER_LOGS_DIR = Path("/var/log/containers")
EGRESS_CHAIN = "KVGATE-CLUSTER-EGRESS"
K8S_NAMESPACE = "k8s.io"  # containerd namespace of the CRI

_READY_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Child-side: SIGTERM this process when the test process dies (survives exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _run(argv: Sequence[str], *, check: bool = True, input_bytes: bytes | None = None) -> str:
    completed = subprocess.run(
        list(argv), input=input_bytes, capture_output=True, timeout=300, check=False
    )
    if check and completed.returncode != 0:
        raise HarnessError(
            f"{' '.join(argv)} exited with {completed.returncode}: "
            f"{completed.stderr.decode(errors='replace').strip()}"
        )
    return completed.stdout.decode(errors="replace")


def _in_netns(argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{NETNS}", "--", *argv]


def _ns(*argv: str, check: bool = True) -> str:
    return _run(_in_netns(argv), check=check)


def _read_sysctls() -> dict[str, str]:
    return {name: (Path("/proc/sys") / name).read_text().strip() for name in HOST_SYSCTLS}


def _cgroup_dirs() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    candidates = [base / "kubepods", base / "kubepods.slice"]
    if base.is_dir():
        for hierarchy in base.iterdir():
            candidates += [hierarchy / "kubepods", hierarchy / "kubepods.slice"]
    return [path for path in candidates if path.is_dir()]


def _remove_cgroup_tree(root: Path) -> None:
    """Kill what still runs in a cgroup tree (a killed session's containers), then remove it,
    deepest first."""
    directories = sorted((Path(d) for d, _, _ in os.walk(root)), key=lambda p: -len(p.parts))
    for directory in directories:
        with contextlib.suppress(OSError):
            for pid in (directory / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    for directory in directories:
        while True:
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)


def _pod_netns_names() -> set[str]:
    directory = Path("/run/netns")
    if not directory.is_dir():
        return set()
    return {entry.name for entry in directory.iterdir() if entry.name.startswith("cni-")}


def _host_route_exists(cidr: str) -> bool:
    return bool(_run(["ip", "route", "show", cidr], check=False).strip())


def direct_opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """A urllib opener that never uses a proxy from the environment: cluster addresses are
    reached directly (a proxy would carry them off the machine)."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def http_get(url: str, *, timeout_s: float = 2.0) -> tuple[int, str]:
    """GET ``url`` directly (no proxy); (status, body), or (0, error text) when unreachable."""
    try:
        with direct_opener().open(url, timeout=timeout_s) as answer:
            return int(answer.status), answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, repr(exc)


def dns_query_a(server: str, name: str, *, timeout_s: float = 1.0) -> list[str]:
    """The A records ``server`` answers for ``name`` (UDP port 53); [] for none or no answer."""
    ident = random.randrange(1 << 16)
    question = b"".join(bytes([len(part)]) + part.encode() for part in name.split(".")) + b"\0"
    packet = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + b"\0\1\0\1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.sendto(packet, (server, 53))
            data = sock.recv(4096)
        except OSError:
            return []
    rid, _flags, qd, an, _ns_count, _ar = struct.unpack(">HHHHHH", data[:12])
    if rid != ident:
        return []
    offset = 12
    for _ in range(qd):
        while data[offset] != 0:
            offset += data[offset] + 1
        offset += 5
    found = []
    for _ in range(an):
        if data[offset] & 0xC0 == 0xC0:
            offset += 2
        else:
            while data[offset] != 0:
                offset += data[offset] + 1
            offset += 1
        rtype, _cls, _ttl, length = struct.unpack(">HHIH", data[offset : offset + 10])
        offset += 10
        if rtype == 1 and length == 4:
            found.append(socket.inet_ntoa(data[offset : offset + 4]))
        offset += length
    return found


class KubeCluster:
    """One running cluster (see the module docs); a context manager.

    Attributes for tests: :attr:`kubeconfig` (admin), :attr:`node_ip`, :meth:`kubectl`,
    :meth:`api`, :meth:`import_image_tar`, :meth:`import_docker_image`.
    """

    def __init__(self, parts: ClusterParts, *, progress: Progress = log_progress) -> None:
        if not is_root():
            raise HarnessError("the Kubernetes cluster tier needs root (netns, mounts, cgroups)")
        self.parts = parts
        self.progress = progress
        self.node_ip = NODE_IP
        self.node_name = NODE_NAME
        self.work = WORK_DIR
        self.kubeconfig = WORK_DIR / "admin.kubeconfig"
        self.kubectl_binary = Path()
        self._tokens: dict[str, str] = {}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._lock: IO[bytes] | None = None
        self.started_s = 0.0

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> KubeCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def state_file(self) -> Path:
        return cache_root() / "kube-cluster" / "host-state.json"

    def _take_lock(self) -> None:
        import fcntl

        path = cache_root() / "kube-cluster" / "cluster.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("ab")
        self.progress(f"waiting for the machine's cluster lock {path}")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        self._lock = handle

    def start(self) -> None:
        from tests.chart.helm import kubectl_binary

        self._take_lock()
        try:
            if self.state_file.exists():
                self.progress("a previous cluster was not torn down: cleaning up after it")
                self._restore_host()
            started = time.monotonic()
            self.kubectl_binary = kubectl_binary()
            self._record_host_state()
            self._write_files()
            self._egress_guard_up()
            self._network_up()
            self._start_apiserver()
            self._start("containerd", self._containerd_argv())
            self._wait(self._containerd_ready, "containerd", 30)
            self._import(self.parts.pause_image_tar)
            self._import(self.parts.coredns_image_tar)
            self._start("kube-controller-manager", self._controller_manager_argv())
            self._start("kube-scheduler", self._scheduler_argv())
            self._start("kube-proxy", self._kube_proxy_argv())
            self._start("kubelet", self._kubelet_argv())
            self._wait(self._node_ready, f"node {NODE_NAME} Ready", _READY_TIMEOUT_S)
            self._fake_gpus()
            self._install_coredns()
            self._wait(self._dns_answers, "CoreDNS answering", _READY_TIMEOUT_S)
            self.started_s = time.monotonic() - started
            self.progress(f"cluster up in {self.started_s:.1f} s (kubeconfig {self.kubeconfig})")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Delete every pod, stop every part, and put the host back as it was."""
        try:
            if self._processes.get("kubelet") is not None and self._alive("kube-apiserver"):
                self._drain_pods()
            for name in ("kubelet", "kube-proxy", "kube-scheduler", "kube-controller-manager"):
                self._stop_process(name)
            if self._alive("containerd"):
                self._remove_containers()
            for name in ("containerd", "kube-apiserver"):
                self._stop_process(name)
            for log in self._logs:
                log.close()
            self._logs.clear()
            if self.state_file.exists():
                self._restore_host()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def _alive(self, name: str) -> bool:
        process = self._processes.get(name)
        return process is not None and process.poll() is None

    # ---- host state ----------------------------------------------------------------------

    def _record_host_state(self) -> None:
        state = {
            "sysctls": _read_sysctls(),
            "pod_netns_before": sorted(_pod_netns_names()),
            "container_logs_dir_existed": CONTAINER_LOGS_DIR.exists(),
            "cgroups_before": [str(path) for path in _cgroup_dirs()],
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(state, indent=2))

    def _restore_host(self) -> None:
        """Undo every host change recorded in the state file (idempotent)."""
        state = json.loads(self.state_file.read_text())
        for name in (
            "kubelet",
            "kube-proxy",
            "kube-scheduler",
            "kube-controller-manager",
            "containerd",
            "containerd-shim-runc-v2",
            "kube-apiserver",
        ):
            self._kill_strays(name)
        for entry in sorted(_pod_netns_names() - set(state["pod_netns_before"])):
            _run(["umount", "-l", f"/run/netns/{entry}"], check=False)
            with contextlib.suppress(OSError):
                (Path("/run/netns") / entry).unlink()
        if WORK_DIR.exists():
            remove_tree(WORK_DIR)
        for cidr in (POD_CIDR, SERVICE_CIDR):
            if _host_route_exists(cidr):
                _run(["ip", "route", "del", cidr], check=False)
        _run(["ip", "link", "del", HOST_VETH], check=False)
        _run(["ip", "netns", "del", NETNS], check=False)
        self._egress_guard_down()
        before = set(state["cgroups_before"])
        for path in _cgroup_dirs():
            if str(path) not in before:
                _remove_cgroup_tree(path)
        if CONTAINER_LOGS_DIR.is_dir():
            for link in CONTAINER_LOGS_DIR.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(str(WORK_DIR)):
                    link.unlink()
            if not state["container_logs_dir_existed"]:
                with contextlib.suppress(OSError):
                    CONTAINER_LOGS_DIR.rmdir()
        for name, value in state["sysctls"].items():
            (Path("/proc/sys") / name).write_text(value)
        self.state_file.unlink()

    @staticmethod
    def _kill_strays(name: str) -> None:
        """End processes of a cluster part still running from our work directory."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                cmdline
                and cmdline[0].endswith(name.encode())
                and any(str(WORK_DIR).encode() in part for part in cmdline)
            ):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)

    # ---- configuration -------------------------------------------------------------------

    def _write_files(self) -> None:
        if WORK_DIR.exists():
            remove_tree(WORK_DIR)
        for sub in ("certs", "etcd", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "run"):
            (WORK_DIR / sub).mkdir(parents=True, exist_ok=True)
        WORK_DIR.chmod(0o700)
        self._tokens = {
            user: os.urandom(16).hex()
            for user in ("admin", "controller-manager", "scheduler", "kubelet", "kube-proxy")
        }
        groups = {
            "admin": ("kvgate-test-admin", "system:masters"),
            "controller-manager": ("system:kube-controller-manager", "system:masters"),
            "scheduler": ("system:kube-scheduler", ""),
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", "system:masters"),
        }
        lines = [
            f'{self._tokens[user]},{name},{user},"{group}"'
            for user, (name, group) in groups.items()
        ]
        tokens = WORK_DIR / "tokens.csv"
        tokens.write_text("\n".join(lines) + "\n")
        tokens.chmod(0o600)
        for user in self._tokens:
            self._write_kubeconfig(WORK_DIR / f"{user}.kubeconfig", self._tokens[user])
        (WORK_DIR / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        cni = {
            "cniVersion": "1.0.0",
            "name": "kvgate",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(WORK_DIR / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (WORK_DIR / "cni" / "net.d" / "10-kvgate.conflist").write_text(json.dumps(cni))
        (WORK_DIR / "containerd.toml").write_text(self._containerd_config())
        (WORK_DIR / "kubelet.yaml").write_text(json.dumps(self._kubelet_config()))
        (WORK_DIR / "kube-proxy.yaml").write_text(json.dumps(self._kube_proxy_config()))

    def _write_kubeconfig(self, path: Path, token: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kvgate-test",
                    "cluster": {
                        "server": f"https://{NODE_IP}:{API_PORT}",
                        "certificate-authority": str(self.ca_file),
                    },
                }
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [
                {"name": "kvgate-test", "context": {"cluster": "kvgate-test", "user": "user"}}
            ],
            "current-context": "kvgate-test",
        }
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)

    @property
    def ca_file(self) -> Path:
        return WORK_DIR / "certs" / "apiserver.crt"

    @property
    def containerd_socket(self) -> Path:
        return WORK_DIR / "run" / "containerd.sock"

    def _containerd_config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{WORK_DIR}/containerd/root"
state = "{WORK_DIR}/containerd/state"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{self.containerd_socket}"

[ttrpc]
  address = "{WORK_DIR}/run/containerd.ttrpc.sock"

[debug]
  address = ""

[metrics]
  address = ""

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: a negative oom_score_adj fails every sandbox.
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{self.parts.runc}"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{self.parts.cni_bin_dir}"
  conf_dir = "{WORK_DIR}/cni/net.d"
"""

    def _kubelet_config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This VM is cgroup v1 (hybrid): kubelet 1.37 refuses it unless told.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "address": NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {
                "anonymous": {"enabled": True},
                "webhook": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [DNS_SERVICE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(WORK_DIR / "resolv.conf"),
            # Images exist only locally (no registry): never collect or evict them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "failSwapOn": False,
            "podLogsDir": str(WORK_DIR / "pod-logs"),
            "serializeImagePulls": False,
            "maxPods": 60,
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
        }

    def _kube_proxy_config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "iptables",
            "clientConnection": {"kubeconfig": str(WORK_DIR / "kube-proxy.kubeconfig")},
            "hostnameOverride": NODE_NAME,
            "clusterCIDR": POD_CIDR,
            # Pods on the same bridge reach each other through Services only if replies come
            # back through the node (no br_netfilter assumption): masquerade Service traffic.
            "iptables": {"masqueradeAll": True, "syncPeriod": "5s", "minSyncPeriod": "0s"},
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # nf_conntrack_max is machine-wide: leave it and the timeouts alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }

    # ---- network -------------------------------------------------------------------------

    def _network_up(self) -> None:
        for cidr in (POD_CIDR, SERVICE_CIDR, f"{HOST_LINK_IP}/{LINK_PREFIX}"):
            if _host_route_exists(cidr):
                raise HarnessError(
                    f"the host already routes {cidr}: the test cluster's addresses would clash"
                )
        _run(["ip", "netns", "add", NETNS])
        _ns("ip", "link", "set", "lo", "up")
        _run(["ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NS_VETH])
        _run(["ip", "link", "set", NS_VETH, "netns", NETNS])
        _run(["ip", "addr", "add", f"{HOST_LINK_IP}/{LINK_PREFIX}", "dev", HOST_VETH])
        _run(["ip", "link", "set", HOST_VETH, "up"])
        _ns("ip", "addr", "add", f"{NS_LINK_IP}/{LINK_PREFIX}", "dev", NS_VETH)
        _ns("ip", "link", "set", NS_VETH, "up")
        _ns("ip", "link", "add", BRIDGE, "type", "bridge")
        _ns("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
        _ns("ip", "link", "set", BRIDGE, "up")
        # The pod range and the service range go into the namespace before anything starts.
        for cidr in (POD_CIDR, SERVICE_CIDR):
            _run(["ip", "route", "replace", cidr, "via", NS_LINK_IP, "dev", HOST_VETH])
        # Inside, the service range sits on the bridge: a Service kube-proxy has not
        # programmed yet goes nowhere instead of following some other route.
        _ns("ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE)
        _ns("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        if "default" in _ns("ip", "route", "show"):
            raise HarnessError(f"network namespace {NETNS} has a default route")

    def _egress_guard_up(self) -> None:
        """Count, on the host, every packet of the cluster's ranges that leaves by a link other
        than loopback and the cluster's veth (there should be none: :meth:`egress_packets`)."""
        _run(["iptables", "-w", "-N", EGRESS_CHAIN])
        _run(["iptables", "-w", "-A", EGRESS_CHAIN, "-o", "lo", "-j", "RETURN"])
        _run(["iptables", "-w", "-A", EGRESS_CHAIN, "-o", HOST_VETH, "-j", "RETURN"])
        for cidr in CLUSTER_SOURCE_RANGES:
            _run(["iptables", "-w", "-A", EGRESS_CHAIN, "-s", cidr, "-j", "RETURN"])
        for cidr in (POD_CIDR, SERVICE_CIDR):
            _run(["iptables", "-w", "-A", EGRESS_CHAIN, "-d", cidr, "-j", "RETURN"])
        for hook in ("OUTPUT", "FORWARD"):
            _run(["iptables", "-w", "-I", hook, "1", "-j", EGRESS_CHAIN])

    @staticmethod
    def _egress_guard_down() -> None:
        for hook in ("OUTPUT", "FORWARD"):
            while (
                subprocess.run(
                    ["iptables", "-w", "-D", hook, "-j", EGRESS_CHAIN],
                    capture_output=True,
                    check=False,
                ).returncode
                == 0
            ):
                pass
        _run(["iptables", "-w", "-F", EGRESS_CHAIN], check=False)
        _run(["iptables", "-w", "-X", EGRESS_CHAIN], check=False)

    def egress_packets(self) -> dict[str, int]:
        """Packets counted leaving the host, by rule (``src <cidr>`` / ``dst <cidr>``), since
        the cluster started: from or to a cluster range, by any link but lo and the veth."""
        listing = _run(["iptables", "-w", "-L", EGRESS_CHAIN, "-n", "-v", "-x"])
        counts: dict[str, int] = {}
        for line in listing.splitlines()[2:]:
            fields = line.split()
            # pkts bytes target prot opt in out source destination
            if len(fields) < 9 or fields[6] != "*":
                continue
            source, destination = fields[7], fields[8]
            key = f"src {source}" if destination == "0.0.0.0/0" else f"dst {destination}"
            counts[key] = int(fields[0])
        return counts

    def zero_egress_counters(self) -> None:
        """Zero the egress counters (after a test that made them count on purpose)."""
        _run(["iptables", "-w", "-Z", EGRESS_CHAIN])

    def namespace_routes(self) -> str:
        """``ip route show`` inside the cluster's network namespace."""
        return _ns("ip", "route", "show")

    # ---- processes -----------------------------------------------------------------------

    def _start(self, name: str, argv: Sequence[str]) -> None:
        log_path = WORK_DIR / f"{name}.log"
        log = log_path.open("ab")
        self._logs.append(log)
        self._processes[name] = subprocess.Popen(
            _in_netns(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - a plain prctl, no locks taken
        )

    def log_path(self, name: str) -> Path:
        return WORK_DIR / f"{name}.log"

    def _check_running(self) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise HarnessError(
                    f"{name} exited with {process.returncode}; log {self.log_path(name)}:\n"
                    f"{log_tail(self.log_path(name))}"
                )

    def _wait(self, condition: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_running()
            if condition():
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.2)

    def _stop_process(self, name: str) -> None:
        process = self._processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _start_apiserver(self) -> None:
        sa_key = WORK_DIR / "service-account.key"
        argv = [
            str(self.parts.apiserver),
            f"-etcd-dir={WORK_DIR / 'etcd'}",
            "-etcd-client-port=2379",
            "-etcd-peer-port=2380",
            f"-service-account-key={sa_key}",
            "--",
            "--bind-address=0.0.0.0",
            f"--advertise-address={NODE_IP}",
            f"--secure-port={API_PORT}",
            f"--cert-dir={WORK_DIR / 'certs'}",
            f"--token-auth-file={WORK_DIR / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The apiserver reaches the kubelet by its InternalIP (the bridge), never by a
            # host name resolved through the machine's resolver.
            "--kubelet-preferred-address-types=InternalIP",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--allow-privileged=true",
        ]
        self._start("kube-apiserver", argv)
        self._wait(self._apiserver_ready, "kube-apiserver /readyz", _READY_TIMEOUT_S)
        self._write_kubeconfig(self.kubeconfig, self._tokens["admin"])

    def _apiserver_ready(self) -> bool:
        if not self.ca_file.exists():
            return False
        try:
            status, _ = self.api("GET", "/readyz")
        except (OSError, ssl.SSLError):
            return False
        return status == 200

    def _containerd_argv(self) -> list[str]:
        return [self.parts.containerd, f"--config={WORK_DIR / 'containerd.toml'}"]

    def _containerd_ready(self) -> bool:
        return self.containerd_socket.exists() and (
            subprocess.run(
                self._ctr("version"), capture_output=True, timeout=10, check=False
            ).returncode
            == 0
        )

    def _ctr(self, *args: str) -> list[str]:
        return [self.parts.ctr, f"--address={self.containerd_socket}", "-n", K8S_NAMESPACE, *args]

    def _controller_manager_argv(self) -> list[str]:
        return [
            str(self.parts.controller_manager),
            f"--kubeconfig={WORK_DIR / 'controller-manager.kubeconfig'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--cert-dir={WORK_DIR / 'certs' / 'controller-manager'}",
            f"--root-ca-file={self.ca_file}",
            f"--service-account-private-key-file={WORK_DIR / 'service-account.key'}",
            "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--controllers=*,-nodeipam,-csrsigning,-csrapproving,-csrcleaner",
        ]

    def _scheduler_argv(self) -> list[str]:
        return [
            str(self.parts.scheduler),
            f"--kubeconfig={WORK_DIR / 'scheduler.kubeconfig'}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--cert-dir={WORK_DIR / 'certs' / 'scheduler'}",
        ]

    def _kube_proxy_argv(self) -> list[str]:
        return [str(self.parts.kube_proxy), f"--config={WORK_DIR / 'kube-proxy.yaml'}"]

    def _kubelet_argv(self) -> list[str]:
        return [
            str(self.parts.kubelet),
            f"--config={WORK_DIR / 'kubelet.yaml'}",
            f"--kubeconfig={WORK_DIR / 'kubelet.kubeconfig'}",
            f"--root-dir={WORK_DIR / 'kubelet'}",
            f"--cert-dir={WORK_DIR / 'kubelet' / 'pki'}",
            f"--node-ip={NODE_IP}",
            f"--hostname-override={NODE_NAME}",
        ]

    # ---- readiness -----------------------------------------------------------------------

    def _node_ready(self) -> bool:
        status, node = self.api("GET", f"/api/v1/nodes/{NODE_NAME}")
        if status != 200:
            return False
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _fake_gpus(self) -> None:
        patch = {
            "status": {
                "capacity": {"nvidia.com/gpu": str(FAKE_GPUS)},
                "allocatable": {"nvidia.com/gpu": str(FAKE_GPUS)},
            }
        }
        status, answer = self.api(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}/status",
            patch,
            content_type="application/merge-patch+json",
        )
        if status != 200:
            raise HarnessError(f"could not add nvidia.com/gpu to the node: {status} {answer}")

    def _install_coredns(self) -> None:
        manifest = _coredns_manifest()
        self.kubectl("apply", "-f", "-", input_text=manifest)

    def _dns_answers(self) -> bool:
        name = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"
        return dns_query_a(DNS_SERVICE_IP, name) == [KUBERNETES_SERVICE_IP]

    # ---- teardown ------------------------------------------------------------------------

    def _drain_pods(self) -> None:
        """Delete every pod and wait (bounded) for the kubelet to tear its sandboxes down."""
        for name in ("kube-controller-manager", "kube-scheduler"):
            self._stop_process(name)  # nothing re-creates what is being deleted
        self.kubectl(
            "delete", "pods", "--all", "--all-namespaces", "--grace-period=0", "--force",
            "--wait=false", check=False,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self._alive("kubelet"):
            if not _ctr_lines(self._ctr("tasks", "list", "-q")):
                return
            time.sleep(0.3)

    def _remove_containers(self) -> None:
        for task in _ctr_lines(self._ctr("tasks", "list", "-q")):
            subprocess.run(self._ctr("tasks", "kill", "-s", "SIGKILL", task), check=False,
                           capture_output=True, timeout=30)  # fmt: skip
            subprocess.run(self._ctr("tasks", "delete", "-f", task), check=False,
                           capture_output=True, timeout=30)  # fmt: skip
        for container in _ctr_lines(self._ctr("containers", "list", "-q")):
            subprocess.run(self._ctr("containers", "delete", container), check=False,
                           capture_output=True, timeout=30)  # fmt: skip

    # ---- for tests -----------------------------------------------------------------------

    def api(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        """One admin request to the apiserver; (HTTP status, decoded JSON or text)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        headers = {"Authorization": f"Bearer {self._tokens['admin']}", "Accept": "application/json"}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(
            f"https://{NODE_IP}:{API_PORT}{path}", data=data, headers=headers, method=method
        )
        try:
            with direct_opener(context).open(request, timeout=10) as response:
                text = response.read().decode(errors="replace")
                status = int(response.status)
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode(errors="replace")
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def kubectl(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster as the admin."""
        completed = subprocess.run(
            [str(self.kubectl_binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(WORK_DIR)},
        )
        if check and completed.returncode != 0:
            raise HarnessError(
                f"kubectl {' '.join(args)} exited with {completed.returncode}:\n"
                f"{completed.stdout}\n{completed.stderr}"
            )
        return completed

    def _import(self, tar: Path) -> None:
        with tar.open("rb") as handle:
            self._import_archive(handle, str(tar))

    def _import_archive(self, archive: IO[bytes], what: str) -> None:
        """``ctr images import -`` of a docker-archive read from ``archive``."""
        completed = subprocess.run(
            self._ctr("images", "import", "-"),
            stdin=archive,
            capture_output=True,
            timeout=600,
            check=False,
        )
        if completed.returncode != 0:
            raise HarnessError(
                f"ctr images import {what} failed: {completed.stderr.decode(errors='replace')}"
            )

    def import_image_tar(self, tar: Path) -> None:
        """Import a docker-archive tar into the cluster's runtime (``imagePullPolicy: Never``)."""
        self._import(tar)

    def import_docker_image(self, docker_host: str, reference: str) -> None:
        """``docker save reference | ctr images import -`` from the engine at ``docker_host``."""
        docker = shutil.which("docker")
        if docker is None:
            raise HarnessError("docker CLI not found (it comes with Debian's docker.io)")
        with tempfile.TemporaryFile(dir=cache_root()) as archive:
            save = subprocess.run(
                [docker, "-H", docker_host, "save", reference],
                stdout=archive,
                stderr=subprocess.PIPE,
                timeout=600,
                check=False,
            )
            if save.returncode != 0:
                raise HarnessError(f"docker save {reference}: {save.stderr.decode().strip()}")
            archive.seek(0)
            self._import_archive(archive, reference)

    def images(self) -> list[str]:
        """References of the images in the cluster's runtime."""
        return _ctr_lines(self._ctr("images", "list", "-q"))


def _ctr_lines(argv: list[str]) -> list[str]:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if completed.returncode != 0:
        return []
    return [line.strip() for line in completed.stdout.splitlines() if line.strip()]


def _coredns_manifest() -> str:
    corefile = (
        f".:53 {{\n    errors\n    health :8080\n    ready :8181\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"        pods insecure\n    }}\n    cache 5\n    loadbalance\n}}\n"
    )
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "kvgate-test:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kvgate-test:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "kvgate-test:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
            "data": {"Corefile": corefile},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
                "template": {
                    "metadata": {"labels": {"k8s-app": "kube-dns"}},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "dnsPolicy": "Default",
                        "containers": [
                            {
                                "name": "coredns",
                                "image": COREDNS_IMAGE,
                                "imagePullPolicy": "Never",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                "ports": [
                                    {"containerPort": 53, "protocol": "UDP", "name": "dns"},
                                    {"containerPort": 53, "protocol": "TCP", "name": "dns-tcp"},
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/ready", "port": 8181},
                                    "periodSeconds": 1,
                                },
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}],
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system"},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "selector": {"k8s-app": "kube-dns"},
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        },
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


@contextlib.contextmanager
def kube_cluster(progress: Progress = log_progress) -> Iterator[KubeCluster]:
    """Build what is missing, then run one cluster for the block."""
    from tests.harness.kube_build import prepare

    with KubeCluster(prepare(progress), progress=progress) as cluster:
        yield cluster
