"""The chart lints strictly, and what it renders is valid Kubernetes for every value set."""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate.operator.builders import PoolRef, build_admission_config
from kvgate.operator.builders.common import RUN_AS_USER
from kvgate.operator.cli import add_arguments
from kvgate.operator.config import OperatorConfig
from kvgate.operator.models import parse_spec
from tests.chart.conftest import rendered_set
from tests.chart.helm import Helm
from tests.chart.manifests import (
    CHART,
    KUBERNETES_VERSION,
    Manifest,
    Rendered,
    render,
    write_values,
)
from tests.chart.value_sets import BY_NAME, VALUE_SETS, ValueSet

# Kinds defined by CRDs: validated against their CRD's schema, or by what they select.
CUSTOM_KINDS = {"ExecutorPool", "KopfPeering", "ClusterKopfPeering", "ServiceMonitor"}
# The operator's token key (kvgate/operator/tokens.py), beside the operator, not a pool's.
TOKEN_KEY_SECRET = "kvgate-operator-token-key"
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}


def _crd(name: str) -> Manifest:
    return dict(yaml.safe_load((CHART / "crds" / f"{name}.yaml").read_text()))


def _schema_errors(crd: Manifest, resource: Manifest) -> list[str]:
    # A CRD's openAPIV3Schema is OpenAPI 3.0: JSON Schema draft 4 numerics.
    [version] = crd["spec"]["versions"]
    validator = jsonschema.Draft4Validator(version["schema"]["openAPIV3Schema"])
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(resource)]


def _operator_container(rendered: Rendered) -> Manifest:
    deployment = rendered.operator()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _operator_args(rendered: Rendered) -> argparse.Namespace:
    container = _operator_container(rendered)
    assert container["command"] == ["kvgate"]
    assert container["args"][0] == "operator"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _watched(rendered: Rendered) -> list[str]:
    values = rendered.value_set.values.get("operator", {}).get("watch", {})
    return values.get("namespaces") or [rendered.value_set.namespace]


def test_helm_is_the_pinned_version(helm: Helm) -> None:
    assert "v4.3.1" in helm.run("version").stdout


@pytest.mark.parametrize("value_set", VALUE_SETS, ids=lambda v: v.name)
def test_lint_strict(helm: Helm, scratch: Path, value_set: ValueSet) -> None:
    values_file = write_values(scratch, f"lint-{value_set.name}", value_set.values)
    result = helm.run("lint", "--strict", str(CHART), "--values", str(values_file))
    assert "0 chart(s) failed" in result.stdout


def test_every_rendered_manifest_is_valid_kubernetes(rendered: Rendered) -> None:
    assert kubernetes_validate.latest_version() == KUBERNETES_VERSION
    checked = set()
    for document in rendered.documents:
        if document["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        checked.add(document["kind"])
    assert "Deployment" in checked
    assert ("ClusterRole" in checked) != ("Role" in checked)


def test_the_validation_above_can_fail(rendered_sets: dict[str, Rendered]) -> None:
    deployment = copy.deepcopy(rendered_set(rendered_sets, "defaults").operator())
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUsr"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_crds_are_valid_apiextensions_objects(helm: Helm) -> None:
    shown = [doc for doc in yaml.safe_load_all(helm.run("show", "crds", str(CHART)).stdout) if doc]
    files = sorted(path.name for path in (CHART / "crds").glob("*.yaml"))
    assert sorted(f"{doc['metadata']['name']}.yaml" for doc in shown) == files
    for crd in shown:
        kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)
    assert files == [
        "clusterkopfpeerings.kopf.dev.yaml",
        "executorpools.kvgate.dev.yaml",
        "kopfpeerings.kopf.dev.yaml",
    ]


def test_one_executorpool_crd_shared_with_the_operator_tests() -> None:
    """The chart's CRD file is the file the operator tests load, and there is no other copy."""
    from tests.operator.conftest import CRD_PATH

    assert CRD_PATH.resolve() == (CHART / "crds" / "executorpools.kvgate.dev.yaml").resolve()
    root = CHART.parents[1]
    copies = []
    for directory, subdirectories, files in os.walk(root):
        # Not into .git, .venv, caches: only the project's own files.
        subdirectories[:] = [d for d in subdirectories if not d.startswith((".", "__"))]
        for name in files:
            if not name.endswith((".yaml", ".yml", ".json")):
                continue
            text = (Path(directory) / name).read_text(errors="replace")
            if "CustomResourceDefinition" in text and "executorpools.kvgate.dev" in text:
                copies.append((Path(directory) / name).relative_to(root))
    assert copies == [Path("charts/kvgate/crds/executorpools.kvgate.dev.yaml")]


# Fields added to v1alpha1 after pools existed. The API server fills schema defaults into every
# pool it returns, so a default here would show the field to an operator older than it (the
# one still running during an upgrade, or one rolled back to), which refuses unknown fields:
# every pool would turn InvalidSpec. The operator's model supplies the default instead.
ADDED_FIELDS = [("kafka", "createTopics"), ("kafka", "tokenRecords"), ("tenants",)]


def test_fields_added_later_have_no_schema_default() -> None:
    [version] = _crd("executorpools.kvgate.dev")["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for path in ADDED_FIELDS:
        node = spec
        for part in path:
            node = node["properties"][part]
        assert "default" not in node, path


def test_example_pool_is_valid_for_the_crd_and_the_operator(rendered: Rendered) -> None:
    pools = rendered.of_kind("ExecutorPool")
    enabled = rendered.value_set.values.get("examplePool", {}).get("enabled", False)
    assert len(pools) == (1 if enabled else 0)
    if not pools:
        return
    [pool] = pools
    assert _schema_errors(_crd("executorpools.kvgate.dev"), pool) == []
    spec = parse_spec(pool["metadata"]["name"], pool["spec"])  # the operator accepts it
    values_kafka = rendered.value_set.values["kafka"]
    assert spec.kafka.bootstrap_servers == values_kafka["bootstrapServers"]
    assert spec.kafka.create_topics == values_kafka.get("createTopics", False)
    config = build_admission_config(
        PoolRef(pool["metadata"]["name"], pool["metadata"]["namespace"], "uid"), spec
    )
    assert config["kafka"]["create_topics"] is spec.kafka.create_topics
    # Quotas set in the values reach the service's file by its own names.
    pool_values = rendered.value_set.values["examplePool"].get("spec", {})
    quotas = pool_values.get("tenants", {}).get("quotas", {})
    for tenant, quota in quotas.items():
        written = config["tenants"]["quotas"][tenant]
        assert written["tokens_per_minute"] == quota["tokensPerMinute"]
    assert pool["spec"]["image"].startswith(
        rendered.value_set.values.get("images", {}).get("registry", "kvgate-executor")
    )


def test_example_pool_token_secret(rendered: Rendered) -> None:
    pools = rendered.of_kind("ExecutorPool")
    secrets = [s for s in rendered.of_kind("Secret") if s["metadata"]["name"] != TOKEN_KEY_SECRET]
    if not pools or not rendered.value_set.values["examplePool"].get("createTokenSecret", True):
        assert secrets == []
        return
    [pool], [secret] = pools, secrets
    reference = pool["spec"]["tokenSecret"]
    assert secret["metadata"]["name"] == reference["name"]
    assert secret["metadata"]["namespace"] == pool["metadata"]["namespace"]
    assert len(secret["data"][reference.get("key", "token")]) >= 64  # 48 random chars, base64


def test_the_example_pool_check_can_fail() -> None:
    pool = {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ExecutorPool",
        "metadata": {"name": "p"},
        "spec": {"replicas": 2000, "model": {"family": "llama"}},
    }
    errors = _schema_errors(_crd("executorpools.kvgate.dev"), pool)
    assert any("2000 is greater than the maximum" in e for e in errors), errors
    assert any("'image' is a required property" in e for e in errors), errors


def test_peering_objects_are_the_ones_the_operator_uses(rendered: Rendered) -> None:
    args = _operator_args(rendered)
    namespaced = rendered.of_kind("KopfPeering")
    cluster = rendered.of_kind("ClusterKopfPeering")
    if args.standalone:
        assert namespaced == [] and cluster == []
        return
    if args.all_namespaces:
        assert namespaced == []
        assert [p["metadata"]["name"] for p in cluster] == [args.peering]
    else:
        assert cluster == []
        assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in namespaced} == {
            (namespace, args.peering) for namespace in args.namespaces
        }
    for peering in namespaced:
        assert _schema_errors(_crd("kopfpeerings.kopf.dev"), peering) == []
    for peering in cluster:
        assert _schema_errors(_crd("clusterkopfpeerings.kopf.dev"), peering) == []


def test_operator_command_line_and_settings(rendered: Rendered, monkeypatch: Any) -> None:
    args = _operator_args(rendered)
    values = rendered.value_set.values.get("operator", {})
    if values.get("watch", {}).get("allNamespaces"):
        assert args.all_namespaces and args.namespaces is None
    else:
        assert args.namespaces == _watched(rendered)
    assert args.liveness == "http://0.0.0.0:8081/healthz"
    assert args.verbose == values.get("verbose", False)
    container = _operator_container(rendered)
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    for name, item in env.items():
        if name.startswith("KVGATE_OPERATOR_"):
            monkeypatch.setenv(name, item["value"])
    config = OperatorConfig()  # the operator parses what the chart sets
    assert config.poll_interval_s == values.get("settings", {}).get("pollIntervalS", 5)
    assert config.request_timeout_s == values.get("settings", {}).get("requestTimeoutS", 10)
    registry = rendered.value_set.values.get("images", {}).get("registry")
    assert config.admission_image == (f"{registry}/" if registry else "") + "kvgate-admission:0.1.0"
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [{"name": "health", "containerPort": 8081, "protocol": "TCP"}]


def test_operator_runs_locked_down(rendered: Rendered) -> None:
    pod = rendered.operator()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = _operator_container(rendered)["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["privileged"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True
    mounts = {
        m["mountPath"]: m.get("readOnly", False)
        for m in _operator_container(rendered)["volumeMounts"]
    }
    # /tmp is the one writable place; the token key (tokens.py) is mounted read-only.
    assert mounts == {"/tmp": False, "/etc/kvgate/token-key": True}


def test_operator_deployment_never_runs_two(rendered: Rendered) -> None:
    deployment = rendered.operator()
    assert deployment["spec"]["replicas"] in (0, 1)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    budgets = [
        b
        for b in rendered.of_kind("PodDisruptionBudget")
        if b["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    if (
        rendered.value_set.values.get("operator", {})
        .get("podDisruptionBudget", {})
        .get("enabled", True)
    ):
        [budget] = budgets
        selector = budget["spec"]["selector"]["matchLabels"]
        assert selector == deployment["spec"]["selector"]["matchLabels"]
    else:
        assert budgets == []


def test_namespaces_follow_the_release_and_the_watch_list(rendered: Rendered) -> None:
    watched = set(_watched(rendered))
    pool_namespaces = {p["metadata"]["namespace"] for p in rendered.of_kind("ExecutorPool")}
    policy_namespaces = set(
        rendered.value_set.values.get("networkPolicy", {}).get("namespaces", []) or watched
    )
    for document in rendered.documents:
        kind, meta = document["kind"], document["metadata"]
        if kind in CLUSTER_SCOPED:
            assert "namespace" not in meta, (kind, meta)
        elif kind in ("Role", "RoleBinding", "KopfPeering"):
            assert meta["namespace"] in watched
        elif kind == "NetworkPolicy":
            assert meta["namespace"] in policy_namespaces
        elif kind == "ExecutorPool" or (kind == "Secret" and meta["name"] != TOKEN_KEY_SECRET):
            assert meta["namespace"] in pool_namespaces
        else:
            assert meta["namespace"] == rendered.value_set.namespace, (kind, meta["name"])


def test_names_do_not_depend_on_the_release_name(helm: Helm, scratch: Path) -> None:
    base = BY_NAME["everything"]
    other = ValueSet(
        "everything-renamed", release="another-name", namespace=base.namespace, values=base.values
    )

    def identities(value_set: ValueSet) -> set[tuple[str, str, str]]:
        return {
            (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
            for d in render(helm, value_set, scratch).documents
        }

    names = identities(base)
    assert names == identities(other)
    assert not any("another-name" in name for _, _, name in names)


def test_notes_tell_how_to_send_a_first_request(helm: Helm, scratch: Path) -> None:
    value_set = BY_NAME["everything"]
    values_file = write_values(scratch, "notes", value_set.values)
    notes = helm.run(
        "install",
        value_set.release,
        str(CHART),
        "--namespace",
        value_set.namespace,
        "--values",
        str(values_file),
        "--dry-run=client",
    ).stdout.split("NOTES:", 1)[1]
    kafka = value_set.values["kafka"]
    assert f"-t {kafka['topics']['requests']} -P" in notes
    assert f"-t {kafka['topics']['results']} -C" in notes
    assert kafka["bootstrapServers"] in notes
    assert "get executorpool ouro" in notes and "-n serving" in notes
    assert '"request_id": "hello-1"' in notes
