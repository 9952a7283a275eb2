"""Unit tests of the harness's pure parts and safety rules (no Docker, no Kafka needed)."""

from __future__ import annotations

import builtins
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import docker_engine, kafka_image
from tests.harness.docker_engine import EnginePaths, StorageDriver
from tests.harness.kafka import (
    OWNER_LABEL,
    BrokerPorts,
    ExternalKafka,
    FaultInjectionUnavailable,
    parse_bootstrap,
    reap_orphans,
    server_properties,
)
from tests.harness.kafka_client import unique_topic_name
from tests.harness.system import HarnessError, cache_root, remove_tree, run_logged
from tests.harness.tls import TlsMaterial

_MAX_UNIX_SOCKET_PATH = 107


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_server_properties_bind_and_advertise_the_chosen_loopback_ports() -> None:
    props = _properties(server_properties(BrokerPorts(kafka=19092, controller=19093)))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19093"
    assert props["process.roles"] == "broker,controller"
    assert props["log.dirs"] == "/var/lib/kafka/data"
    single_node = [key for key in props if key.endswith(("replication.factor", "min.isr"))]
    assert len(single_node) >= 5
    assert all(props[key] == "1" for key in single_node)


def test_picked_ports_are_distinct() -> None:
    ports = BrokerPorts.pick(with_tls=True)
    assert ports.tls is not None
    assert len({ports.kafka, ports.controller, ports.tls}) == 3
    assert BrokerPorts.pick().tls is None


def test_tls_listener_advertises_and_inlines_the_pem_material(tmp_path: Path) -> None:
    material = TlsMaterial(
        certificate_pem="-----BEGIN CERTIFICATE-----\nAAA\nBBB\n-----END CERTIFICATE-----\n",
        private_key_pem="-----BEGIN PRIVATE KEY-----\nCCC\n-----END PRIVATE KEY-----\n",
        ca_file=tmp_path / "ca.pem",
    )
    text = server_properties(BrokerPorts(kafka=1, controller=2, tls=3), material)
    props = _properties(text)
    assert props["listeners"].split(",")[-1] == "SSL://127.0.0.1:3"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:1,SSL://127.0.0.1:3"
    assert "SSL:SSL" in props["listener.security.protocol.map"]
    # One property per line: the PEM newlines are escaped for java.util.Properties.
    assert props["listener.name.ssl.ssl.keystore.key"] == (
        "-----BEGIN PRIVATE KEY-----\\nCCC\\n-----END PRIVATE KEY-----"
    )
    with pytest.raises(ValueError, match="TLS port and TLS material"):
        server_properties(BrokerPorts(kafka=1, controller=2, tls=3))


@pytest.mark.parametrize(
    "value", ["127.0.0.1:9092", "localhost:1,broker-2.example:65535", " [::1]:9092 "]
)
def test_valid_bootstrap_lists_are_accepted(value: str) -> None:
    assert parse_bootstrap(value) == ",".join(entry.strip() for entry in value.split(","))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("", "empty entry"),
        ("127.0.0.1:9092,,x:1", "empty entry"),
        ("localhost", "'localhost'"),
        ("localhost:port", "'localhost:port'"),
        ("localhost:70000", "'localhost:70000'"),
        ("localhost:0", "'localhost:0'"),
    ],
)
def test_bad_bootstrap_lists_name_the_bad_entry(value: str, named: str) -> None:
    with pytest.raises(HarnessError, match=named):
        parse_bootstrap(value)


def test_external_broker_refuses_fault_injection_with_the_reason() -> None:
    broker = ExternalKafka("127.0.0.1:9092")
    assert not broker.controllable
    for action in (broker.pause, broker.unpause, broker.restart):
        with pytest.raises(FaultInjectionUnavailable, match="KAFKA_BOOTSTRAP"):
            action()
    broker.stop()  # nothing to stop, and no error


def test_unique_topic_names_are_legal_and_distinct() -> None:
    first = unique_topic_name("test_x[sigkill-param/1]")
    second = unique_topic_name("test_x[sigkill-param/1]")
    assert first != second
    assert first.startswith("test_x-sigkill-param-1-")
    long_name = unique_topic_name("t" * 400)
    assert len(long_name) <= 249
    for name in (first, long_name, unique_topic_name("...")):
        assert all(c.isalnum() or c in "._-" for c in name), name


def test_recipe_hash_follows_every_recipe_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = tmp_path / "recipe"
    shutil.copytree(kafka_image.RECIPE_DIR, recipe)
    monkeypatch.setattr(kafka_image, "RECIPE_DIR", recipe)
    original = kafka_image.image_recipe_hash()
    assert kafka_image.image_recipe_hash() == original
    for name in ("Dockerfile", "entrypoint.sh", "log4j2.properties"):
        path = recipe / name
        saved = path.read_bytes()
        path.write_bytes(saved + b"\n# changed\n")
        assert kafka_image.image_recipe_hash() != original, name
        path.write_bytes(saved)
    assert kafka_image.image_recipe_hash() == original


def test_version_change_rebuilds_jars_and_image(monkeypatch: pytest.MonkeyPatch) -> None:
    jars, image, base = (
        kafka_image.jars_recipe_hash(),
        kafka_image.image_recipe_hash(),
        kafka_image.base_recipe_hash(),
    )
    monkeypatch.setattr(kafka_image, "KAFKA_VERSION", "4.4.1")
    assert kafka_image.jars_recipe_hash() != jars
    assert kafka_image.image_recipe_hash() != image
    # The Debian + Java layer does not depend on the Kafka version: it is not rebuilt.
    assert kafka_image.base_recipe_hash() == base


def test_maven_pom_is_xml_naming_kafka_and_a_logging_binding() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    root = ET.fromstring(kafka_image.maven_pom())
    deps = {
        (d.findtext("m:artifactId", namespaces=ns), d.findtext("m:version", namespaces=ns))
        for d in root.iterfind("m:dependencies/m:dependency", ns)
    }
    assert ("kafka_2.13", "4.4.0") in deps
    assert ("log4j-slf4j-impl", "2.25.5") in deps


def test_entrypoint_is_valid_posix_shell() -> None:
    script = kafka_image.RECIPE_DIR / "entrypoint.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["sh", "-n", str(script)], check=True)


def test_engine_paths_are_per_cache_and_socket_paths_fit(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 150) / "cache"
    a, b = EnginePaths.for_cache(tmp_path / "a"), EnginePaths.for_cache(deep)
    assert EnginePaths.for_cache(tmp_path / "a") == a
    assert a.run_dir != b.run_dir
    assert a.data_root == tmp_path / "a" / "docker" / "data-root"
    # containerd puts the longest socket names under the exec root.
    longest = b.exec_root / "containerd" / "containerd.sock.ttrpc"
    assert len(str(longest)) <= _MAX_UNIX_SOCKET_PATH
    assert len(str(b.socket)) <= _MAX_UNIX_SOCKET_PATH


def test_dockerd_is_isolated_from_other_engines_on_the_machine(tmp_path: Path) -> None:
    paths = EnginePaths.for_cache(tmp_path)
    argv = docker_engine.dockerd_argv("/usr/bin/dockerd", paths, StorageDriver.VFS)
    assert f"--data-root={paths.data_root}" in argv
    assert f"--exec-root={paths.exec_root}" in argv
    assert f"--pidfile={paths.pidfile}" in argv
    assert f"--host=unix://{paths.socket}" in argv
    assert f"--config-file={paths.config_file}" in argv
    assert "--storage-driver=vfs" in argv
    # No bridge and no firewall edits: nothing shared with other engines on this machine.
    assert {"--bridge=none", "--iptables=false", "--ip-masq=false"} <= set(argv)
    assert any(arg.startswith("--containerd-namespace=kvgate-") for arg in argv)


def test_explicit_docker_host_that_does_not_answer_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing-here.sock")
    with pytest.raises(HarnessError, match=r"DOCKER_HOST=.* does not answer"):
        docker_engine.find_running_engine(EnginePaths.for_cache(tmp_path))


@pytest.mark.skipif(os.geteuid() != 0, reason="the harness starts dockerd only as root")
def test_a_hung_harness_dockerd_is_never_joined_by_a_second_one(tmp_path: Path) -> None:
    paths = EnginePaths.for_cache(tmp_path)
    # Stands in for a dockerd that has our data root but no longer answers.
    hung = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
            f"--data-root={paths.data_root}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hung.stdout is not None
        assert hung.stdout.readline() == "up\n"  # exec'd: its cmdline is the one above
        paths.run_dir.mkdir(parents=True)
        paths.pidfile.write_text(f"{hung.pid}\n")
        assert docker_engine.running_managed_pid(paths) == hung.pid
        with pytest.raises(HarnessError, match=rf"dockerd \(pid {hung.pid}\) runs but does not"):
            docker_engine.start_dockerd(paths, progress=lambda _: None)
        assert hung.poll() is None  # reported, not killed behind the user's back
    finally:
        hung.kill()
        hung.wait()
        shutil.rmtree(paths.run_dir, ignore_errors=True)


def test_last_session_out_is_detected_by_the_users_lock(tmp_path: Path) -> None:
    import fcntl

    lock = tmp_path / "users.lock"
    with lock.open("ab") as mine, lock.open("ab") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        assert not docker_engine._sole_user(mine)
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
        assert docker_engine._sole_user(mine)


def test_run_logged_failure_carries_the_log_tail(tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "step.log"
    with pytest.raises(HarnessError, match=r"exited with 3[\s\S]*boom on stderr"):
        run_logged(["sh", "-c", "echo boom on stderr >&2; exit 3"], log_path, timeout_s=30)
    with pytest.raises(HarnessError, match="did not finish within 1 s"):
        run_logged(["sleep", "5"], log_path, timeout_s=1)


def test_cache_root_follows_kvgate_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()
    monkeypatch.setenv("KVGATE_CACHE", " ")
    with pytest.raises(HarnessError, match="KVGATE_CACHE is set but empty"):
        cache_root()


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_tree_removal_never_deletes_through_a_mount(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("must survive")
    rootfs = tmp_path / "rootfs"
    (rootfs / "proc").mkdir(parents=True)
    (rootfs / "etc").mkdir()
    (rootfs / "etc" / "hostname").write_text("x")
    bind = ["mount", "--bind", str(precious), str(rootfs / "proc")]
    if subprocess.run(bind, check=False).returncode:
        pytest.skip("this machine does not allow bind mounts")
    try:
        remove_tree(rootfs)
    finally:
        subprocess.run(["umount", "-l", str(rootfs / "proc")], capture_output=True, check=False)
    assert not rootfs.exists()
    assert (precious / "keep.txt").read_text() == "must survive"


# -- orphan reaping, against a stand-in for the docker client ---------------------------------


@dataclass
class _FakeVolume:
    name: str
    removed: list[str]

    def remove(self, force: bool) -> None:
        self.removed.append(self.name)


@dataclass
class _FakeContainer:
    name: str
    labels: dict[str, str]
    volume: str
    removed: list[str]

    @property
    def attrs(self) -> dict[str, list[dict[str, str]]]:
        return {"Mounts": [{"Name": self.volume}]}

    def remove(self, force: bool) -> None:
        self.removed.append(self.name)


@dataclass
class _FakeClient:
    all_containers: list[_FakeContainer]
    removed: list[str] = field(default_factory=list)

    @property
    def containers(self) -> _FakeClient:
        return self

    @property
    def volumes(self) -> _FakeClient:
        return self

    def list(self, all: bool, filters: dict[str, str]) -> builtins.list[_FakeContainer]:
        assert all and filters == {"label": OWNER_LABEL}
        return self.all_containers

    def get(self, name: str) -> _FakeVolume:
        return _FakeVolume(name, self.removed)


def test_reaping_removes_only_containers_whose_session_is_gone() -> None:
    from tests.harness.kafka import _process_identity

    me = _process_identity(os.getpid())
    assert me is not None
    dead_pid = 2**22 + 1  # above the kernel's pid_max ceiling: never a live process
    client = _FakeClient([])
    live = _FakeContainer("live", {OWNER_LABEL: me}, "live-data", client.removed)
    dead = _FakeContainer("dead", {OWNER_LABEL: f"{dead_pid}:1"}, "dead-data", client.removed)
    # Same pid as this process but another start time: the pid was reused.
    reused = _FakeContainer(
        "reused", {OWNER_LABEL: f"{os.getpid()}:0"}, "reused-data", client.removed
    )
    client.all_containers = [live, dead, reused]
    assert reap_orphans(client) == ["dead", "reused"]
    assert client.removed == ["dead", "dead-data", "reused", "reused-data"]
