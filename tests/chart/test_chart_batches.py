"""Batches as the chart deploys them: the gateway and the batch feeder read every batch setting
from the same flags (the S3 store, its credentials as files from a Secret, the class, the window,
the limits, the topics' layout), a feeder of its own needs no Kubernetes API and opens only its
health port, and what cannot be served is refused."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvgate.batch.settings import BatchSettings, StoreKind
from kvgate.gateway import batch_cli
from kvgate.gateway import cli as gateway_cli
from kvgate.gateway.batch_flags import batch_settings_from
from tests.chart.conftest import rendered_set
from tests.chart.helm import Helm
from tests.chart.manifests import CHART, Manifest, Rendered, render, selects, write_values
from tests.chart.value_sets import BY_NAME, ValueSet

FEEDER = "kvgate-gateway-batch-feeder"


def _pod(rendered: Rendered, kind: str, name: str) -> Manifest:
    return dict(rendered.one(kind, name)["spec"]["template"])


def _parse(container: Manifest, add_arguments: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _gateway(rendered: Rendered) -> tuple[Manifest, argparse.Namespace]:
    [container] = _pod(rendered, "StatefulSet", "kvgate-gateway")["spec"]["containers"]
    return container, _parse(container, gateway_cli.add_arguments)


def _feeder(rendered: Rendered) -> tuple[Manifest, argparse.Namespace]:
    [container] = _pod(rendered, "Deployment", FEEDER)["spec"]["containers"]
    assert container["args"][0] == "batch-feeder"
    return container, _parse(container, batch_cli.add_arguments)


def _settings(args: argparse.Namespace) -> BatchSettings:
    settings = batch_settings_from(args)
    assert settings is not None, "no --batch-store"
    return settings


def _mounted_files(pod: Manifest, container: Manifest, volume_name: str) -> dict[str, str]:
    """Paths of the files a Secret volume puts in the container: path -> the Secret's key."""
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == volume_name]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume_name]
    return {f"{mount['mountPath']}/{i['path']}": i["key"] for i in volume["secret"]["items"]}


def test_the_gateway_and_the_feeder_agree_on_every_batch_setting(
    rendered_sets: dict[str, Rendered],
) -> None:
    rendered = rendered_set(rendered_sets, "batches")
    _, gateway_args = _gateway(rendered)
    _, feeder_args = _feeder(rendered)
    gateway = _settings(gateway_args)
    assert gateway.feeder is False, "the Deployment feeds; the gateway only serves the API"
    assert _settings(feeder_args) == gateway.model_copy(update={"feeder": True})
    store = gateway.store
    assert store.kind is StoreKind.S3
    assert (store.endpoint, store.bucket, store.prefix) == (
        "http://s3.storage.svc:7070", "llm-batches", "prod/kvgate",
    )  # fmt: skip
    assert store.allow_http and not store.virtual_hosted_style
    assert (gateway.priority, gateway.window, gateway.partitions) == (50, 16, 12)
    assert (gateway.max_file_bytes, gateway.max_file_lines) == (100_000_000, 20_000)
    assert gateway.max_line_bytes == 1_048_576  # the default, from values.yaml
    # Both reach Kafka as the gateway does, and send the same model's lines.
    for name in ("bootstrap", "model", "request_topic", "result_topic", "abort_topic"):
        assert getattr(feeder_args, name) == getattr(gateway_args, name), name
    for name in vars(feeder_args):
        if name.startswith("kafka_"):
            assert getattr(feeder_args, name) == getattr(gateway_args, name), name
    assert gateway_args.kafka_security_protocol == "SASL_SSL"
    assert feeder_args.tokenizer == gateway_args.tokenizer


def test_the_store_credentials_are_files_from_the_secret(
    rendered_sets: dict[str, Rendered],
) -> None:
    rendered = rendered_set(rendered_sets, "batches")
    for kind, name, read in (
        ("StatefulSet", "kvgate-gateway", _gateway),
        ("Deployment", FEEDER, _feeder),
    ):
        pod = _pod(rendered, kind, name)
        container, args = read(rendered)
        store = _settings(args).store
        files = _mounted_files(pod, container, "s3-credentials")
        assert files == {
            str(store.access_key_id_file): "id",
            str(store.secret_access_key_file): "secret-access-key",
        }, name
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "s3-credentials"]
        assert volume["secret"]["secretName"] == "batch-s3"


def test_the_feeder_needs_no_kubernetes_api_and_opens_only_its_health_port(
    rendered_sets: dict[str, Rendered],
) -> None:
    rendered = rendered_set(rendered_sets, "batches")
    deployment = rendered.one("Deployment", FEEDER)
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod["spec"]  # no Role is bound to what it runs as
    container, args = _feeder(rendered)
    assert args.health_port == 9001 and args.replica_id == "$(POD_NAME)"
    assert [p["containerPort"] for p in container["ports"]] == [9001]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "health"
    labels = pod["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"], labels)
    policy = rendered.one("NetworkPolicy", FEEDER)
    assert selects(policy["spec"]["podSelector"], labels)
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9001, "protocol": "TCP"}]
    assert rule["from"] == BY_NAME["batches"].values["networkPolicy"]["metricsFrom"]
    # The gateway's policy (its API port open to clients) does not cover the feeder.
    gateway_policy = rendered.one("NetworkPolicy", "kvgate-gateway")
    assert not selects(gateway_policy["spec"]["podSelector"], labels)


GATEWAY_ON = {
    "kafka": {"bootstrapServers": "kafka:9092"},
    "gateway": {"enabled": True, "allowAnonymous": True},
}


def test_the_gateway_feeds_batches_itself_by_default(helm: Helm, scratch: Path) -> None:
    values = {**GATEWAY_ON, "batches": {"enabled": True, "s3": {"bucket": "batches"}}}
    rendered = render(helm, ValueSet("batches-in-gateway", values=values), scratch)
    container, args = _gateway(rendered)
    settings = _settings(args)
    assert settings.feeder is True
    store = settings.store
    assert (store.bucket, store.endpoint, store.region) == ("batches", None, "us-east-1")
    assert store.access_key_id_file is None and store.secret_access_key_file is None
    assert all(m["name"] != "s3-credentials" for m in container["volumeMounts"])
    assert all(d["metadata"]["name"] != FEEDER for d in rendered.of_kind("Deployment"))


def test_without_batches_the_gateway_serves_none(rendered_sets: dict[str, Rendered]) -> None:
    _, args = _gateway(rendered_set(rendered_sets, "gateway"))
    assert batch_settings_from(args) is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "kafka": {"bootstrapServers": "k:9092"},
                "batches": {"enabled": True, "s3": {"bucket": "b12"}},
            },
            "batches.enabled needs gateway.enabled",
        ),
        ({**GATEWAY_ON, "batches": {"enabled": True}}, "bucket"),
        ({**GATEWAY_ON, "batches": {"feeder": "sidecar"}}, "feeder"),
        ({**GATEWAY_ON, "batches": {"window": 0}}, "window"),
        ({**GATEWAY_ON, "batches": {"s3": {"endpoint": "s3.example.com"}}}, "endpoint"),
        ({**GATEWAY_ON, "batches": {"s3": {"credentialsSecret": {"name": "Bad_Name"}}}}, "name"),
    ],
    ids=["no-gateway", "no-bucket", "unknown-feeder", "no-window", "endpoint-no-scheme", "secret"],
)
def test_batch_values_it_cannot_serve_are_refused(
    helm: Helm, scratch: Path, values: dict[str, Any], message: str
) -> None:
    values_file = write_values(scratch, f"bad-batches-{message[:20]}", values)
    result = helm.run(
        "template", "kvgate", str(CHART), "--namespace", "kvgate", "--values", str(values_file),
        check=False,
    )  # fmt: skip
    assert result.returncode != 0, f"accepted: {values}"
    assert message in result.stderr, result.stderr
