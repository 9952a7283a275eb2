"""The parts of the test cluster that are built or fetched: binaries, CNI plugins, two images.

Everything is cached under ``<cache>/kube-cluster/`` by recipe hash, beside the apiserver's
build (``tests/harness/kube_apiserver.py``), and shares its Go module and build caches
(``<cache>/kube-apiserver/go``): Go's build cache keys include the module cache path, so the
components below reuse the apiserver's compiled packages and a warm build takes about 90 s.

- kube-controller-manager, kube-scheduler, kubelet, kube-proxy: ``go build`` of
  ``k8s.io/kubernetes/cmd/<name>`` in ``kube_cluster/`` (the apiserver's go.mod plus the go.sum
  entries these commands need), version-stamped at link time: an unstamped build reports
  ``v0.0.0-master+$Format:%H$``, which kubectl cannot parse and the chart's ``kubeVersion``
  constraint refuses.
- CoreDNS: ``coredns/`` (a small main with the plugins a cluster's DNS needs, no forwarder).
- CNI plugins: Debian's ``containernetworking-plugins`` unpacked with ``dpkg -x`` (never
  installed).
- The pause image: ``build/pause/linux/pause.c`` from the kubernetes module, ``gcc -static``.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness.go_build import (
    GoRecipe,
    build_recipe,
    go_command,
    go_env,
    go_version,
    recipe_files,
)
from tests.harness.kube_apiserver import KUBERNETES_VERSION, VERSION_LDFLAGS
from tests.harness.kube_apiserver import build as build_apiserver
from tests.harness.oci_archive import image_tar_from_directory
from tests.harness.system import (
    HarnessError,
    Progress,
    cache_root,
    ensure_command,
    file_lock,
    log_progress,
    run_logged,
)

COMPONENTS = ("kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
COMPONENTS_RECIPE = Path(__file__).with_name("kube_cluster")
COREDNS_RECIPE = Path(__file__).with_name("coredns")
CNI_PACKAGE = "containernetworking-plugins"
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
#: The sandbox image the runtime is configured with; the harness's own pause build.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
COREDNS_IMAGE = "kvgate-test/coredns:1.15.0"
_BUILD_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ClusterParts:
    """Paths of everything a :class:`tests.harness.kube_cluster.KubeCluster` runs."""

    apiserver: Path
    controller_manager: Path
    scheduler: Path
    kubelet: Path
    kube_proxy: Path
    cni_bin_dir: Path
    pause_image_tar: Path
    coredns_image_tar: Path
    containerd: str
    runc: str
    ctr: str


def _root() -> Path:
    return cache_root() / "kube-cluster"


def _hash(*parts: bytes) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(len(part).to_bytes(8, "big"))
        sha.update(part)
    return sha.hexdigest()[:12]


def _recipe_bytes(directory: Path) -> list[bytes]:
    return [
        path.name.encode() + b"\0" + path.read_bytes()
        for path in sorted(directory.iterdir())
        if path.is_file() and path.suffix in {".mod", ".sum", ".go"}
    ]


def _built(name: str, directory: Path) -> bool:
    return (directory / ".complete").exists() and (directory / name).exists()


def build_components(progress: Progress = log_progress) -> Path:
    """The directory holding the four version-stamped component binaries (built on first use)."""
    go = go_command()
    recipe = _hash(
        go_version(go).encode(),
        VERSION_LDFLAGS.encode(),
        " ".join(COMPONENTS).encode(),
        *_recipe_bytes(COMPONENTS_RECIPE),
    )
    directory = _root() / f"components-{recipe}"
    if _built("kubelet", directory):
        return directory
    with file_lock(_root() / "build.lock"):
        if _built("kubelet", directory):
            return directory
        log_path = cache_root() / "logs" / "kube-cluster-build.log"
        progress(
            f"building {', '.join(COMPONENTS)} {KUBERNETES_VERSION} (about 90 s with the "
            f"apiserver's Go cache warm, many minutes cold); log: {log_path}"
        )
        started = time.monotonic()
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        run_logged(
            [
                go,
                "build",
                "-ldflags",
                VERSION_LDFLAGS,
                "-o",
                str(partial) + "/",
                *(f"k8s.io/kubernetes/cmd/{name}" for name in COMPONENTS),
            ],
            log_path,
            timeout_s=_BUILD_TIMEOUT_S,
            cwd=COMPONENTS_RECIPE,
            env=go_env(cache_root() / "kube-apiserver" / "go"),
        )
        (partial / ".complete").touch()
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        progress(f"built the cluster components in {time.monotonic() - started:.0f} s")
    return directory


def build_coredns(progress: Progress = log_progress) -> Path:
    """The CoreDNS binary of ``coredns/`` (built on first use, in the apiserver's Go caches)."""
    recipe = GoRecipe(
        name="coredns",
        directory=COREDNS_RECIPE,
        files=recipe_files(COREDNS_RECIPE),
        package=".",
        binary="coredns",
        trimpath=False,
        go_caches="kube-apiserver",
    )
    return build_recipe(recipe, progress, cold_estimate="about 2 minutes")


def cni_plugins(progress: Progress = log_progress) -> Path:
    """A directory with Debian's bridge, host-local, portmap and loopback CNI plugins."""
    directory = _root() / "cni"
    bin_dir = directory / "usr" / "lib" / "cni"
    if (directory / ".complete").exists():
        return bin_dir
    log_path = cache_root() / "logs" / "cni-plugins.log"
    with file_lock(_root() / "cni.lock"):
        if (directory / ".complete").exists():
            return bin_dir
        progress(f"fetching {CNI_PACKAGE} with apt-get download (not installed); log {log_path}")
        with tempfile.TemporaryDirectory(dir=_root()) as scratch:
            try:
                run_logged(
                    ["apt-get", "download", CNI_PACKAGE],
                    log_path,
                    timeout_s=300,
                    cwd=Path(scratch),
                )
            except HarnessError:
                run_logged(["apt-get", "update"], log_path, timeout_s=600)
                run_logged(
                    ["apt-get", "download", CNI_PACKAGE], log_path, timeout_s=300, cwd=Path(scratch)
                )
            debs = sorted(Path(scratch).glob(f"{CNI_PACKAGE}_*.deb"))
            if not debs:
                raise HarnessError(f"apt-get download left no {CNI_PACKAGE} package; {log_path}")
            shutil.rmtree(directory, ignore_errors=True)
            run_logged(["dpkg", "-x", str(debs[0]), str(directory)], log_path, timeout_s=120)
        missing = [name for name in CNI_PLUGINS if not (bin_dir / name).exists()]
        if missing:
            raise HarnessError(f"{CNI_PACKAGE} has no {', '.join(missing)} in {bin_dir}")
        (directory / ".complete").touch()
    return bin_dir


def _kubernetes_module_dir() -> Path:
    return (
        cache_root()
        / "kube-apiserver"
        / "go"
        / "mod"
        / "k8s.io"
        / f"kubernetes@{KUBERNETES_VERSION}"
    )


def pause_image(progress: Progress = log_progress) -> Path:
    """The pause image as a docker-archive tar named :data:`PAUSE_IMAGE`."""
    source = _kubernetes_module_dir() / "build" / "pause" / "linux" / "pause.c"
    if not source.exists():
        raise HarnessError(f"{source} is missing: build the cluster components first")
    tar = _root() / f"pause-{_hash(source.read_bytes(), PAUSE_IMAGE.encode())}.tar"
    if tar.exists():
        return tar
    gcc = ensure_command("gcc", "gcc", cache_root() / "logs" / "apt.log", progress)
    with file_lock(_root() / "images.lock"), tempfile.TemporaryDirectory(dir=_root()) as work:
        rootfs = Path(work) / "rootfs"
        rootfs.mkdir()
        run_logged(
            [gcc, "-Os", "-static", "-o", str(rootfs / "pause"), str(source)],
            cache_root() / "logs" / "pause-build.log",
            timeout_s=300,
        )
        image_tar_from_directory(rootfs, PAUSE_IMAGE, ["/pause"], tar)
    return tar


def coredns_image(progress: Progress = log_progress) -> Path:
    """CoreDNS as a docker-archive tar named :data:`COREDNS_IMAGE`."""
    binary = build_coredns(progress)
    tar = _root() / f"coredns-image-{binary.parent.name}.tar"
    if tar.exists():
        return tar
    with file_lock(_root() / "images.lock"), tempfile.TemporaryDirectory(dir=_root()) as work:
        rootfs = Path(work) / "rootfs"
        rootfs.mkdir()
        shutil.copy2(binary, rootfs / "coredns")
        image_tar_from_directory(rootfs, COREDNS_IMAGE, ["/coredns"], tar)
    return tar


def prepare(progress: Progress = log_progress) -> ClusterParts:
    """Build or find every part of the cluster (each cached; see the module docs)."""
    _root().mkdir(parents=True, exist_ok=True)
    log_path = cache_root() / "logs" / "apt.log"
    # docker.io brings Debian's containerd and runc; the harness installs it for its dockerd.
    containerd = ensure_command("containerd", "containerd", log_path, progress)
    ctr = ensure_command("ctr", "containerd", log_path, progress)
    runc = ensure_command("runc", "runc", log_path, progress)
    # kube-proxy's rules and the harness's egress counters; docker.io pulls it in too, but the
    # cluster tier may run before anything installed docker.io on a fresh machine.
    ensure_command("iptables", "iptables", log_path, progress)
    apiserver = build_apiserver(progress)
    components = build_components(progress)
    return ClusterParts(
        apiserver=apiserver,
        controller_manager=components / "kube-controller-manager",
        scheduler=components / "kube-scheduler",
        kubelet=components / "kubelet",
        kube_proxy=components / "kube-proxy",
        cni_bin_dir=cni_plugins(progress),
        pause_image_tar=pause_image(progress),
        coredns_image_tar=coredns_image(progress),
        containerd=containerd,
        runc=runc,
        ctr=ctr,
    )
