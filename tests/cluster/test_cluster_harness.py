"""The cluster itself: a Ready node of the expected version with fake GPUs, pods that run and
answer from the host, working cluster DNS, and no packet that left the machine."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.cluster.conftest import wait_for
from tests.harness.kube_build import COREDNS_IMAGE, KUBERNETES_VERSION
from tests.harness.kube_cluster import (
    CLUSTER_DOMAIN,
    DNS_SERVICE_IP,
    FAKE_GPUS,
    SERVICE_CIDR,
    KubeCluster,
    dns_query_a,
    http_get,
)

pytestmark = pytest.mark.cluster
LEAK_LINK = "kvgate-leak"
SINK_NETNS = "kvgate-sink"


def test_node_ready_with_version_and_fake_gpus(kube: KubeCluster) -> None:
    node = json.loads(kube.kubectl("get", "node", kube.node_name, "-o", "json").stdout)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == KUBERNETES_VERSION
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(FAKE_GPUS)
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == kube.node_ip
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION


def test_pod_runs_and_answers_from_the_host(kube: KubeCluster) -> None:
    """A pod of a harness-made image gets a pod IP on the bridge and serves the test process."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dns-probe", "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "coredns",
                    "image": COREDNS_IMAGE,
                    "imagePullPolicy": "Never",
                    "args": ["-conf", "/etc/coredns/Corefile"],
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}],
                }
            ],
            "volumes": [{"name": "config", "configMap": {"name": "dns-probe"}}],
        },
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "dns-probe", "namespace": "default"},
        "data": {"Corefile": ".:53 {\n    health :8080\n}\n"},
    }
    kube.kubectl(
        "apply",
        "-f",
        "-",
        input_text=json.dumps({"kind": "List", "apiVersion": "v1", "items": [config, pod]}),
    )
    try:

        def running_ip() -> str:
            got = json.loads(kube.kubectl("get", "pod", "dns-probe", "-o", "json").stdout)
            if got["status"].get("phase") == "Running":
                return str(got["status"].get("podIP", ""))
            return ""

        pod_ip = wait_for(running_ip, "the probe pod to run")
        assert pod_ip.startswith("10.244.0.")

        def health() -> str:
            status, body = http_get(f"http://{pod_ip}:8080/health", timeout_s=1)
            return body if status == 200 else ""

        assert wait_for(health, "the probe pod's health endpoint").strip() == "OK"
        # Cluster DNS through the kube-dns Service (kube-proxy's rules, CoreDNS's pod).
        name = f"kube-dns.kube-system.svc.{CLUSTER_DOMAIN}"
        assert dns_query_a(DNS_SERVICE_IP, name) == [DNS_SERVICE_IP]
    finally:
        kube.kubectl("delete", "pod,configmap", "dns-probe", "--wait=false", check=False)


def test_no_packet_left_the_machine(kube: KubeCluster) -> None:
    """The namespace has no default route, and the host counted no packet of the cluster's
    ranges leaving by any link but loopback and the cluster's veth since the cluster started."""
    routes = kube.namespace_routes()
    assert "default" not in routes, routes
    # Traffic that would take a default route if there were one: a Service address nothing
    # serves, and a DNS name outside the cluster (CoreDNS here has no forwarder).
    assert dns_query_a(DNS_SERVICE_IP, "example.com") == []
    assert dns_query_a("10.96.123.123", "example.com", timeout_s=0.3) == []
    counts = kube.egress_packets()
    assert counts, "the egress counters are missing"
    assert all(value == 0 for value in counts.values()), counts


def test_the_egress_counters_count_a_packet_on_another_link(kube: KubeCluster) -> None:
    """The guard itself: a packet for a Service address routed out by a link that is not the
    cluster's is counted. That link is a veth into a network namespace of its own with no
    routes and no forwarding, where the packet ends: nothing leaves. Counters are read as zero
    first and zeroed after, so no real leak is hidden."""
    assert not any(kube.egress_packets().values()), kube.egress_packets()
    target = "10.96.255.254"
    subprocess.run(["ip", "netns", "add", SINK_NETNS], check=True)
    try:
        subprocess.run(
            ["ip", "link", "add", LEAK_LINK, "type", "veth", "peer", "name", "sink",
             "netns", SINK_NETNS],
            check=True,
        )  # fmt: skip
        subprocess.run(["ip", "netns", "exec", SINK_NETNS, "ip", "link", "set", "sink", "up"],
                       check=True)  # fmt: skip
        subprocess.run(["ip", "link", "set", LEAK_LINK, "up"], check=True)
        subprocess.run(["ip", "route", "add", f"{target}/32", "dev", LEAK_LINK], check=True)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"counted, then dropped", (target, 9))
        counts = kube.egress_packets()
        assert counts[f"dst {SERVICE_CIDR}"] == 1, counts
    finally:
        subprocess.run(["ip", "link", "del", LEAK_LINK], check=False)
        subprocess.run(["ip", "netns", "del", SINK_NETNS], check=False)
        kube.zero_egress_counters()
