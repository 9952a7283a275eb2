"""The pure builders: the objects built for a given spec, security settings included.

Every built object is also checked against the Kubernetes 1.31 schemas (kubernetes-validate,
strict: unknown fields fail), so a typo in a field name cannot pass.
"""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest
import yaml
from opentelemetry.sdk.resources import OTELResourceDetector

from kvgate.admission_service.settings import load_settings
from kvgate.operator.builders import (
    PoolRef,
    build_admin_token_secret,
    build_admission_config,
    build_admission_configmap,
    build_admission_deployment,
    build_admission_service,
    build_executor_pod,
    build_executor_service,
    executor_args,
    executor_revision,
)
from kvgate.operator.builders.admission import config_hash
from kvgate.operator.models import ExecutorPoolSpec, parse_spec
from kvgate.operator.naming import (
    ANNOTATION_CONFIG_HASH,
    CONFIG_FILE,
    CONFIG_KEY,
    EXECUTOR_TOKEN_FILE,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_SLOT,
)
from kvgate.protocol.records import TokenRecords
from kvgate.telemetry.setup import exporter_names
from tests.operator.cluster import pool_manifest
from tests.operator.examples import FULL_SPEC

POOL = PoolRef(name="pool", namespace="serving", uid="0b9f5c1e-uid")


def spec(**changes: Any) -> ExecutorPoolSpec:
    return parse_spec(POOL.name, {**pool_manifest()["spec"], **changes})


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    pod_spec = (
        manifest["spec"] if manifest["kind"] == "Pod" else manifest["spec"]["template"]["spec"]
    )
    [only] = pod_spec["containers"]
    return dict(only)


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_every_built_object_is_a_valid_kubernetes_object() -> None:
    full = parse_spec(POOL.name, FULL_SPEC)
    for built in [
        build_executor_pod(POOL, full, 3),
        build_executor_pod(POOL, spec(), 0),
        build_executor_service(POOL),
        build_admission_service(POOL),
        build_admission_configmap(POOL, full),
        build_admission_deployment(POOL, full, image="adm:1", admin_token="t"),
        build_admin_token_secret(POOL, "t"),
    ]:
        assert kubernetes_validate.validate(built, "1.31", strict=True), built["kind"]


def test_executor_pod_identity_and_ownership() -> None:
    pod = build_executor_pod(POOL, spec(), 1)
    meta = pod["metadata"]
    assert (meta["name"], meta["namespace"]) == ("pool-1", "serving")
    assert meta["labels"][LABEL_POOL] == "pool"
    assert meta["labels"][LABEL_SLOT] == "1"
    assert meta["labels"][LABEL_REVISION] == executor_revision(POOL, spec())
    [owner] = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ExecutorPool",
        "name": "pool",
        "uid": POOL.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert meta["annotations"] == {
        "kvgate.dev/model-family": "looped",
        "kvgate.dev/model-loops": "4",
    }
    assert pod["spec"]["hostname"] == "pool-1"
    assert pod["spec"]["subdomain"] == "pool-executors"


def test_executor_pod_requests_and_limits_gpus() -> None:
    pod = build_executor_pod(POOL, spec(gpusPerExecutor=4, resources={"requests": {"cpu": 8}}), 0)
    resources = container(pod)["resources"]
    assert resources["requests"] == {"cpu": "8", "nvidia.com/gpu": "4"}
    assert resources["limits"] == {"nvidia.com/gpu": "4"}


def test_multi_gpu_executor_runs_its_ranks_in_one_pod() -> None:
    pod = build_executor_pod(POOL, spec(gpusPerExecutor=4), 0)
    c = container(pod)
    assert arg(c["args"], "--tensor-parallel-size") == "4"
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "lo"} in c["env"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert kubernetes_validate.validate(pod, "1.31", strict=True)
    single = container(build_executor_pod(POOL, spec(), 0))
    assert "--tensor-parallel-size" not in single["args"]
    assert not any(e["name"].startswith(("NCCL_", "TORCH_NCCL_")) for e in single["env"])


def test_executor_pod_security() -> None:
    pod = build_executor_pod(POOL, spec(), 0)
    pod_security = pod["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] > 0
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(pod)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["automountServiceAccountToken"] is False
    # The read-only root needs a writable /tmp, and HOME points there (library caches).
    mounts = {m["name"]: m for m in container(pod)["volumeMounts"]}
    assert mounts["tmp"]["mountPath"] == "/tmp"
    assert {"name": "HOME", "value": "/tmp"} in container(pod)["env"]


def test_executor_token_is_mounted_from_its_secret() -> None:
    pod = build_executor_pod(POOL, spec(tokenSecret={"name": "tokens", "key": "step"}), 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["executor-token"]["secret"]["secretName"] == "tokens"
    assert volumes["executor-token"]["secret"]["items"] == [{"key": "step", "path": "token"}]
    mounts = {m["name"]: m for m in container(pod)["volumeMounts"]}
    assert mounts["executor-token"]["readOnly"] is True
    assert arg(container(pod)["args"], "--token-file") == EXECUTOR_TOKEN_FILE
    assert EXECUTOR_TOKEN_FILE.startswith(mounts["executor-token"]["mountPath"] + "/")


def test_executor_probes_use_the_health_endpoints() -> None:
    c = container(build_executor_pod(POOL, spec(), 0))
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_executor_command_line() -> None:
    args = executor_args(spec(model={"family": "looped", "path": "/m/ouro", "dtype": "float16"}))
    assert args[:9] == [
        "executor",
        "--model",
        "/m/ouro",
        "--port",
        "8000",
        "--device",
        "cuda",
        "--dtype",
        "float16",
    ]
    assert arg(args, "--host-snapshot-blocks") == "0"
    assert arg(args, "--host") == "0.0.0.0", "explicit, so the executor's default can be loopback"
    assert "--num-blocks" not in args and "--memory-fraction" not in args
    assert arg(executor_args(spec(kvCache={"numBlocks": 2048})), "--num-blocks") == "2048"
    fraction = executor_args(spec(kvCache={"memoryFraction": 0.85, "hostSnapshotBlocks": 64}))
    assert arg(fraction, "--memory-fraction") == "0.85"
    assert arg(fraction, "--host-snapshot-blocks") == "64"
    looped = {"family": "looped", "path": "/m", "exitPolicy": "gate"}
    assert arg(executor_args(spec(model=looped)), "--exit-policy") == "gate"


def test_model_volume_is_mounted_read_only() -> None:
    model = {
        "family": "looped",
        "volume": {"persistentVolumeClaim": {"claimName": "m"}, "subPath": "o"},
    }
    pod = build_executor_pod(POOL, spec(model=model), 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}
    mounts = {m["name"]: m for m in container(pod)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert arg(container(pod)["args"], "--model") == "/models/o"
    in_image = build_executor_pod(POOL, spec(), 0)
    assert "model" not in {v["name"] for v in in_image["spec"]["volumes"]}


def test_scheduling_constraints_reach_the_pod() -> None:
    full = parse_spec(POOL.name, FULL_SPEC)
    pod_spec = build_executor_pod(POOL, full, 0)["spec"]
    assert pod_spec["nodeSelector"] == FULL_SPEC["nodeSelector"]
    assert pod_spec["tolerations"] == FULL_SPEC["tolerations"]
    assert pod_spec["affinity"] == FULL_SPEC["affinity"]
    assert pod_spec["imagePullSecrets"] == [{"name": "registry"}]
    assert container(build_executor_pod(POOL, full, 0))["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(
    "change",
    [
        {"image": "registry.example/kvgate-executor:2"},
        {"model": {"family": "looped", "path": "/models/other", "loops": 4}},
        {"model": {"family": "looped", "path": "/models/ouro", "loops": 8}},
        {"resources": {"limits": {"memory": "80Gi"}}},
        {"gpusPerExecutor": 2},
        {"kvCache": {"numBlocks": 100}},
        {"tokenSecret": {"name": "other-token"}},
    ],
    ids=["image", "model", "loops", "resources", "gpus", "cache", "token"],
)
def test_pod_template_changes_change_the_revision(change: dict[str, Any]) -> None:
    assert executor_revision(POOL, spec(**change)) != executor_revision(POOL, spec())


@pytest.mark.parametrize(
    "change",
    [
        {"replicas": 7},
        {"scheduler": {"maxNumSeqs": 8}},
        {"kafka": {"bootstrapServers": "other:9092"}},
        {"drainTimeoutSeconds": 5},
        {"admission": {"replicas": 0}},
    ],
    ids=["replicas", "scheduler", "kafka", "drain-timeout", "admission"],
)
def test_other_changes_keep_the_revision(change: dict[str, Any]) -> None:
    """Only what executors run with replaces them; admission settings do not."""
    assert executor_revision(POOL, spec(**change)) == executor_revision(POOL, spec())


def test_the_kubelet_waits_for_the_whole_admission_shutdown() -> None:
    """SIGTERM to SIGKILL must cover the service's grace period and its closing budget, as
    the service itself reads them from the ConfigMap: killed earlier, it never commits what it
    answered during the grace period."""
    full = parse_spec(POOL.name, FULL_SPEC)
    rendered = build_admission_configmap(POOL, full)["data"][CONFIG_KEY]
    settings = load_settings(None, yaml.safe_load(rendered))
    pod = build_admission_deployment(POOL, full, image="a", admin_token="t")["spec"]["template"]
    needed = settings.shutdown.grace_period_s + settings.shutdown.closing_timeout_s
    assert pod["spec"]["terminationGracePeriodSeconds"] > needed


def test_admission_config_file_contents() -> None:
    config = build_admission_config(POOL, parse_spec(POOL.name, FULL_SPEC))
    assert set(config) == {
        "kafka",
        "scheduler",
        "tenants",
        "admin",
        "executors",
        "telemetry",
        "shutdown",
    }
    assert config["kafka"] == {
        "bootstrap_servers": "kafka-0:9093,kafka-1:9093",
        "request_topic": "kvgate.requests",
        "result_topic": "kvgate.results",
        "token_topic": "kvgate.tokens",
        "abort_topic": "kvgate.aborts",
        "dlq_topic": "kvgate.requests.dlq",
        "group_id": "kvgate-prod",
        "security_protocol": "SASL_SSL",
        "create_topics": True,
        "token_records": "per_token",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "kvgate",
        "sasl_password_file": "/var/run/kvgate/kafka-sasl/password",
        "ssl_cafile": "/var/run/kvgate/kafka-tls/ca.crt",
    }
    # Only what the pool sets, by SchedulerConfig's names; the service defaults the rest.
    assert config["scheduler"] == {
        "max_num_seqs": 128,
        "max_num_batched_tokens": 4096,
        "prefill_chunk_size": 512,
        "policy": "priority",
        "mode": "mixed",
        "preemption": "off",
        "watermark_ratio": 0.05,
        "snapshot_block_cost_s": 1e-5,
    }
    # The quotas by the service's names, only what the pool sets.
    assert config["tenants"] == {
        "quotas": {"team-a": {"tokens_per_minute": 600000, "burst_tokens": 1200000}},
        "default_quota": {"tokens_per_minute": 60000},
    }
    assert config["admin"] == {
        "host": "0.0.0.0",  # reached by the pod IP (the service's own default is loopback)
        "port": 8080,
        "token_file": "/var/run/kvgate/admin-token/token",
    }
    # The tokenizer for text requests comes from the executors (only they read the model).
    assert config["executors"] == {
        "token_file": EXECUTOR_TOKEN_FILE,
        "tokenizer_from_executors": True,
    }
    assert config["telemetry"] == {
        "service_name": "prod-admission",
        "model_name": "/models/ouro-1.4b",
        "otlp_endpoint": "http://otel-collector:4318",
    }


def test_the_pools_quotas_reach_the_service_as_it_enforces_them() -> None:
    """The file the operator writes is read by the service's own settings into the quotas the
    pool set (not the service's defaults), and a quota change restarts the service."""
    full = parse_spec(POOL.name, FULL_SPEC)
    rendered = build_admission_configmap(POOL, full)["data"][CONFIG_KEY]
    tenants = load_settings(None, yaml.safe_load(rendered)).tenants
    assert tenants.quotas["team-a"].tokens_per_minute == 600000
    assert tenants.quotas["team-a"].capacity == 1200000
    assert tenants.default_quota is not None and tenants.default_quota.capacity == 60000
    quota = {"quotas": {"team-a": {"tokensPerMinute": 1000}}}
    assert config_hash(POOL, spec(), "t") != config_hash(POOL, spec(tenants=quota), "t")


def test_a_new_model_restarts_the_admission_service() -> None:
    """Its pool tokenizer is the first executor's: a new model needs a fresh service."""
    before = config_hash(POOL, spec(model={"family": "llama", "path": "/m/a.gguf"}), "t")
    after = config_hash(POOL, spec(model={"family": "llama", "path": "/m/b.gguf"}), "t")
    assert before != after


def test_packaged_and_gguf_models_on_the_command_line() -> None:
    packaged = spec(model={"family": "llama", "packaged": "SmolLM2-135M-Instruct"})
    pod = build_executor_pod(POOL, packaged, 0)
    assert arg(container(pod)["args"], "--model") == "packaged:SmolLM2-135M-Instruct"
    assert "model" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert build_admission_config(POOL, packaged)["telemetry"]["model_name"] == (
        "packaged:SmolLM2-135M-Instruct"
    )
    on_volume = {
        "family": "llama",
        "volume": {"hostPath": {"path": "/srv"}, "subPath": "smollm2/model-q8_0.gguf"},
    }
    args = container(build_executor_pod(POOL, spec(model=on_volume), 0))["args"]
    assert arg(args, "--model") == "/models/smollm2/model-q8_0.gguf"


def test_admission_config_defaults_and_no_secrets_inline() -> None:
    config = build_admission_config(POOL, spec())
    assert config["kafka"]["group_id"] == "kvgate-serving-pool"
    assert config["kafka"]["security_protocol"] == "PLAINTEXT"
    # Written even when off: the admission service's own default is to create topics.
    assert config["kafka"]["create_topics"] is False
    assert "token_topic" not in config["kafka"] and "sasl_username" not in config["kafka"]
    assert "token_records" not in config["kafka"], "the service's default, the file unchanged"
    assert config["scheduler"] == {}
    # No tenants section unless the pool sets one: a pool's file (and hash) stays as it was.
    assert "tenants" not in config
    text = build_admission_configmap(POOL, parse_spec(POOL.name, FULL_SPEC))["data"][
        "admission.yaml"
    ]
    assert yaml.safe_load(text) == build_admission_config(POOL, parse_spec(POOL.name, FULL_SPEC))
    assert "password:" not in text  # secrets are referenced by path only


def test_admission_deployment() -> None:
    full = parse_spec(POOL.name, FULL_SPEC)
    deployment = build_admission_deployment(POOL, full, image="adm:1", admin_token="secret-token")
    assert deployment["spec"]["replicas"] == 1
    # One replica: never two at once (the Service would send the membership to either).
    assert deployment["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][LABEL_POOL] == "pool"  # its pod events reach the operator
    c = container(deployment)
    assert c["image"] == "adm:1"
    assert c["command"] == ["kvgate"]
    assert c["args"] == ["admission-service", "--config", CONFIG_FILE]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "pool-admission"
    assert volumes["admin-token"]["secret"]["secretName"] == "pool-admin-token"
    assert volumes["executor-token"]["secret"]["secretName"] == "executor-token"
    assert volumes["kafka-sasl"]["secret"] == {
        "secretName": "kafka-user",
        "items": [{"key": "password", "path": "password"}],
        "defaultMode": 0o440,
    }
    assert volumes["kafka-tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {
        "/etc/kvgate",
        "/var/run/kvgate/admin-token",
        "/var/run/kvgate/executor-token",
        "/var/run/kvgate/kafka-sasl",
        "/var/run/kvgate/kafka-tls",
    } <= mounts
    assert "secret-token" not in str(deployment)  # the token itself never lands in the object


def test_admission_pod_restarts_when_config_or_token_change() -> None:
    def hash_of(**changes: Any) -> str:
        token = changes.pop("token", "t1")
        built = build_admission_deployment(POOL, spec(**changes), image="a", admin_token=token)
        return str(built["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH])

    assert hash_of() == config_hash(POOL, spec(), "t1")
    assert hash_of(scheduler={"maxNumSeqs": 4}) != hash_of()
    assert hash_of(token="t2") != hash_of()
    assert hash_of(replicas=9) == hash_of()


def test_services_select_their_pods() -> None:
    executors = build_executor_service(POOL)
    assert executors["spec"]["clusterIP"] == "None"
    pod_labels = build_executor_pod(POOL, spec(), 0)["metadata"]["labels"]
    assert executors["spec"]["selector"].items() <= pod_labels.items()
    admission = build_admission_service(POOL)
    admission_labels = build_admission_deployment(POOL, spec(), image="a", admin_token="t")["spec"][
        "template"
    ]["metadata"]["labels"]
    assert admission["spec"]["selector"].items() <= admission_labels.items()
    assert admission["spec"]["ports"][0]["port"] == 8080
    assert not (admission["spec"]["selector"].items() <= pod_labels.items())


def test_admin_token_secret() -> None:
    secret = build_admin_token_secret(POOL, "abc")
    assert base64.b64decode(secret["data"]["token"]) == b"abc"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == POOL.uid


def test_builders_are_pure() -> None:
    full = parse_spec(POOL.name, FULL_SPEC)
    assert build_executor_pod(POOL, full, 2) == build_executor_pod(POOL, full, 2)
    first = build_executor_pod(POOL, full, 2)
    first["spec"]["affinity"]["nodeAffinity"]["changed"] = True
    assert "changed" not in build_executor_pod(POOL, full, 2)["spec"]["affinity"]["nodeAffinity"]


def _kubelet_env(env: list[dict[str, Any]], pod: str, namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the Downward API fields filled and
    ``$(VAR)`` expanded from the variables defined earlier in the list (only those)."""
    fields = {"metadata.name": pod, "metadata.namespace": namespace}
    values: dict[str, str] = {}
    for entry in env:
        if "valueFrom" in entry:
            values[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            continue
        value = entry["value"]
        for name, known in values.items():
            value = value.replace(f"$({name})", known)
        values[entry["name"]] = value
    return values


@pytest.mark.parametrize("component", ["admission", "executor"])
def test_pods_name_themselves_in_their_telemetry_resource(
    component: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = "http://collector:4317"
    pool_spec = spec(
        telemetry={"otlpEndpoint": endpoint, "otlpProtocol": "grpc", "serviceName": "llm"}
    )
    if component == "admission":
        manifest = build_admission_deployment(POOL, pool_spec, image="img", admin_token="t")
    else:
        manifest = build_executor_pod(POOL, pool_spec, 0)
    env = _kubelet_env(container(manifest)["env"], f"{component}-pod-0", POOL.namespace)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.setenv(name, env[name])
    attributes = OTELResourceDetector().detect().attributes
    assert attributes["service.name"] == f"llm-{component}"
    assert attributes["k8s.pod.name"] == f"{component}-pod-0"
    assert attributes["k8s.namespace.name"] == POOL.namespace
    assert attributes["kvgate.pool"] == POOL.name
    # And the kvgate setup reading that environment picks the gRPC exporter.
    assert exporter_names(env) == ["otlp_proto_grpc"]


def test_the_pools_token_records_reach_the_service() -> None:
    """``spec.kafka.tokenRecords`` is read by the service's own settings as the pool set it;
    unset, the service's default (a record per step) holds and the file is as it was."""
    full = parse_spec(POOL.name, FULL_SPEC)
    rendered = build_admission_configmap(POOL, full)["data"][CONFIG_KEY]
    assert load_settings(None, yaml.safe_load(rendered)).kafka.token_records is (
        TokenRecords.PER_TOKEN
    )
    plain = build_admission_configmap(POOL, spec())["data"][CONFIG_KEY]
    assert load_settings(None, yaml.safe_load(plain)).kafka.token_records is TokenRecords.PER_STEP


def test_several_admission_replicas_roll_one_pod_at_a_time() -> None:
    spec = parse_spec(POOL.name, FULL_SPEC | {"admission": {"replicas": 3}})
    deployment = build_admission_deployment(POOL, spec, image="adm:1", admin_token="t")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
