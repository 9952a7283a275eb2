"""The gateway as the chart deploys it: a command line the gateway itself accepts (Kafka TLS
and SASL from mounted Secrets, rate limits shared by the replicas), stable replica names, probes
and policies on the ports it serves, and clear refusals of what it cannot serve."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvgate.gateway.cli import add_arguments, settings_from
from tests.chart.conftest import rendered_set
from tests.chart.helm import Helm
from tests.chart.manifests import CHART, Manifest, Rendered, render, write_values
from tests.chart.value_sets import SASL_SSL_KAFKA, ValueSet


def _container(rendered: Rendered) -> Manifest:
    statefulset = rendered.one("StatefulSet", "kvgate-gateway")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_the_gateway_accepts_its_command_line(rendered_sets: dict[str, Rendered]) -> None:
    rendered = rendered_set(rendered_sets, "gateway")
    container = _container(rendered)
    assert container["command"] == ["kvgate"]
    assert container["args"][0] == "gateway"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.bootstrap == "kafka-0.kafka.data:9092"
    assert (args.host, args.port, args.health_port) == ("0.0.0.0", 8000, 8001)
    assert args.replica_id == "$(POD_NAME)"  # the kubelet expands it from the env below
    [pod_name] = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args.model == "smollm2"
    assert str(args.api_keys_file) == "/etc/kvgate/api-keys/keys.yaml"
    assert str(args.tokenizer) == "/models/smollm2/tokenizer.json"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/kvgate/api-keys"] == "api-keys"
    assert mounts["/models"] == "tokenizer"


def test_the_gateway_names_itself_in_its_telemetry(rendered_sets: dict[str, Rendered]) -> None:
    env = _container(rendered_set(rendered_sets, "gateway"))["env"]
    names = [e["name"] for e in env]
    # The kubelet expands $(VAR) only from variables defined earlier in the list.
    assert names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    values = {e["name"]: e.get("value") for e in env}
    assert values["OTEL_SERVICE_NAME"] == "kvgate-gateway"
    assert values["OTEL_RESOURCE_ATTRIBUTES"] == (
        "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"
    )
    assert values["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    [namespace] = [e for e in env if e["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_replicas_keep_their_names_and_the_autoscaler_owns_the_count(
    rendered_sets: dict[str, Rendered],
) -> None:
    rendered = rendered_set(rendered_sets, "gateway")
    statefulset = rendered.one("StatefulSet", "kvgate-gateway")
    assert "replicas" not in statefulset["spec"], "the HPA sets it"
    hpa = rendered.one("HorizontalPodAutoscaler", "kvgate-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", "kvgate-gateway")
    headless = rendered.one("Service", "kvgate-gateway-pods")
    assert headless["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == "kvgate-gateway-pods"
    selector = statefulset["spec"]["selector"]["matchLabels"]
    for name in ("kvgate-gateway", "kvgate-gateway-pods"):
        assert rendered.one("Service", name)["spec"]["selector"] == selector
    budget = rendered.one("PodDisruptionBudget", "kvgate-gateway")
    assert budget["spec"]["selector"]["matchLabels"] == selector


def test_probes_ingress_and_policy_use_the_ports_it_serves(
    rendered_sets: dict[str, Rendered],
) -> None:
    rendered = rendered_set(rendered_sets, "gateway")
    container = _container(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "health": 8001}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ingress = rendered.one("Ingress", "kvgate-gateway")
    [rule] = ingress["spec"]["rules"]
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "kvgate-gateway", "port": {"name": "http"}}
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    policy = rendered.one("NetworkPolicy", "kvgate-gateway")
    allowed = [[p["port"] for p in rule["ports"]] for rule in policy["spec"]["ingress"]]
    assert allowed == [[8000], [8001]]


def test_no_gateway_unless_enabled(rendered_sets: dict[str, Rendered]) -> None:
    rendered = rendered_set(rendered_sets, "everything")
    assert rendered.of_kind("StatefulSet") == []
    assert not [s for s in rendered.of_kind("Service") if "gateway" in s["metadata"]["name"]]


@pytest.mark.parametrize(
    ("gateway", "kafka", "message"),
    [
        ({"enabled": True}, {}, "gateway.enabled needs kafka.bootstrapServers"),
        (
            {
                "enabled": True,
                "allowAnonymous": True,
                "kafkaSecurity": {
                    "protocol": "SSL",
                    "tls": {"secretName": "gw-tls", "certificate": "tls.crt"},
                },
            },
            {"bootstrapServers": "k:9093"},
            "tls.certificate and tls.privateKey go together",
        ),
        ({"enabled": True}, {"bootstrapServers": "k:9092"}, "gateway.apiKeys.secretName"),
        (
            {"enabled": True, "allowAnonymous": True, "tokenizer": {"path": "t.json"}},
            {"bootstrapServers": "k:9092"},
            "gateway.tokenizer.path needs gateway.tokenizer.volume",
        ),
        (
            {"enabled": True, "allowAnonymous": True, "ingress": {"enabled": True}},
            {"bootstrapServers": "k:9092"},
            "gateway.ingress.enabled needs gateway.ingress.host",
        ),
        (
            {
                "enabled": True,
                "allowAnonymous": True,
                "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
            },
            {"bootstrapServers": "k:9092"},
            "gateway.autoscaling.minReplicas exceeds maxReplicas",
        ),
    ],
    ids=[
        "no kafka",
        "half a client key pair",
        "no keys",
        "tokenizer path",
        "ingress host",
        "hpa bounds",
    ],
)
def test_what_it_cannot_serve_is_refused_with_the_reason(
    helm: Helm, scratch: Path, gateway: dict[str, Any], kafka: dict[str, Any], message: str
) -> None:
    values = {"gateway": gateway, "kafka": kafka}
    values_file = write_values(scratch, f"gateway-{abs(hash(message))}", values)
    result = helm.run("template", "kvgate", str(CHART), "--values", str(values_file), check=False)
    assert result.returncode != 0, "accepted"
    assert message in result.stderr, result.stderr


def _gateway_args(rendered: Rendered) -> argparse.Namespace:
    container = _container(rendered)
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _secret_volumes(rendered: Rendered) -> dict[str, Manifest]:
    pod = rendered.one("StatefulSet", "kvgate-gateway")["spec"]["template"]["spec"]
    return {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}


def test_the_gateway_reaches_kafka_with_the_pool_s_tls_and_sasl(helm: Helm, scratch: Path) -> None:
    """No gateway.kafkaSecurity: the pool's kafka.security, its Secrets mounted as files."""
    values = {"kafka": SASL_SSL_KAFKA, "gateway": {"enabled": True, "allowAnonymous": True}}
    rendered = render(helm, ValueSet("gateway-pool-kafka", values=values), scratch)
    args = _gateway_args(rendered)
    assert args.kafka_security_protocol == "SASL_SSL"
    assert (args.kafka_sasl_mechanism, args.kafka_sasl_username) == ("SCRAM-SHA-512", "kvgate")
    assert str(args.kafka_sasl_password_file) == "/etc/kvgate/kafka-sasl/password"
    assert str(args.kafka_ssl_cafile) == "/etc/kvgate/kafka-tls/ca.crt"
    assert args.kafka_ssl_certfile is None and not args.kafka_no_hostname_check
    secrets = _secret_volumes(rendered)
    assert secrets["kafka-sasl"]["secretName"] == "kafka-user"
    assert secrets["kafka-sasl"]["items"] == [{"key": "password", "path": "password"}]
    assert secrets["kafka-tls"]["secretName"] == "kafka-ca"
    assert secrets["kafka-tls"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    mounts = {m["mountPath"]: m for m in _container(rendered)["volumeMounts"]}
    for name in ("kafka-sasl", "kafka-tls"):
        assert mounts[f"/etc/kvgate/{name}"] == {
            "name": name,
            "mountPath": f"/etc/kvgate/{name}",
            "readOnly": True,
        }


def test_the_gateway_s_own_mutual_tls_replaces_the_pool_s_security(
    rendered_sets: dict[str, Rendered], tmp_path: Path
) -> None:
    rendered = rendered_set(rendered_sets, "gateway-secure-kafka")
    args = _gateway_args(rendered)
    assert args.kafka_security_protocol == "SSL" and args.kafka_sasl_mechanism is None
    assert str(args.kafka_ssl_certfile) == "/etc/kvgate/kafka-tls/tls.crt"
    assert str(args.kafka_ssl_keyfile) == "/etc/kvgate/kafka-tls/tls.key"
    secrets = _secret_volumes(rendered)
    assert "kafka-sasl" not in secrets  # the pool's SASL user is not the gateway's
    assert secrets["kafka-tls"]["secretName"] == "gateway-kafka-tls"
    assert secrets["kafka-tls"]["items"] == [
        {"key": "ca.pem", "path": "ca.crt"},
        {"key": "client.pem", "path": "tls.crt"},
        {"key": "client-key.pem", "path": "tls.key"},
    ]
    # The gateway's own settings model takes the rendered command line (the kubelet expands
    # $(POD_NAME) first).
    args.replica_id = "kvgate-gateway-0"
    settings = settings_from(args)
    assert settings.kafka.ssl_certfile is not None and settings.kafka.uses_tls
    assert (settings.max_body_bytes, settings.head_timeout_s, settings.body_timeout_s) == (
        4194304,
        5.0,
        60.0,
    )


@pytest.mark.parametrize(
    ("gateway", "share"),
    [
        ({"replicas": 3}, 3),
        ({"replicas": 1}, 1),
        ({"replicas": 0}, 1),
        ({"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}}, 6),
    ],
    ids=["three replicas", "one", "none", "autoscaled to six"],
)
def test_a_key_s_rate_limit_is_divided_among_the_replicas_not_multiplied(
    helm: Helm, scratch: Path, gateway: dict[str, Any], share: int
) -> None:
    """Each replica counts a key's requests in its own memory: the chart tells each to allow
    1/N of the rate, N the most replicas that can run, so N replicas never allow N times it."""
    values = {
        "kafka": {"bootstrapServers": "k:9092"},
        "gateway": {"enabled": True, "allowAnonymous": True, **gateway},
    }
    rendered = render(
        helm, ValueSet(f"gateway-rate-{share}-{len(gateway)}", values=values), scratch
    )
    assert _gateway_args(rendered).rate_limit_replicas == share


@pytest.mark.parametrize(
    ("gateway", "where"),
    [
        ({"kafkaSecurity": {"protocol": "SASL_SSL"}}, "/gateway/kafkaSecurity"),
        ({"kafkaSecurity": {"tls": {"secretName": "ca"}}}, "/gateway/kafkaSecurity/tls"),
        ({"kafkaSecurity": {"protocol": "TLS"}}, "/gateway/kafkaSecurity/protocol"),
        ({"kafkaSecurity": {"password": "inline"}}, "/gateway/kafkaSecurity"),
        (
            {"kafkaSecurity": {"protocol": "SSL", "tls": {"secretName": "Not_A_Name"}}},
            "/gateway/kafkaSecurity/tls/secretName",
        ),
        (
            {"http": {"maxBodyBytes": 10, "headTimeoutS": 1, "bodyTimeoutS": 1}},
            "/gateway/http/maxBodyBytes",
        ),
        (
            {"http": {"maxBodyBytes": 2048, "headTimeoutS": 0, "bodyTimeoutS": 1}},
            "/gateway/http/headTimeoutS",
        ),
    ],
    ids=[
        "sasl protocol without sasl",
        "tls with plaintext",
        "protocol",
        "inline password",
        "secret name",
        "body limit",
        "head timeout",
    ],
)
def test_bad_gateway_kafka_and_http_values_are_refused(
    helm: Helm, scratch: Path, gateway: dict[str, Any], where: str
) -> None:
    values = {
        "kafka": {"bootstrapServers": "k:9092"},
        "gateway": {"enabled": True, "allowAnonymous": True, **gateway},
    }
    values_file = write_values(scratch, f"bad-gateway-{where.replace('/', '-')}", values)
    result = helm.run("template", "kvgate", str(CHART), "--values", str(values_file), check=False)
    assert result.returncode != 0, "accepted"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert f"- at '{where}'" in result.stderr, result.stderr
