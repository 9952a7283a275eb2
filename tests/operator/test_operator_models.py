"""Parsing at the boundary: specs, stored status, pods, settings. Bad input gets a clear error."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.operator.config import OperatorConfig
from kvgate.operator.models import InvalidSpecError, parse_spec
from kvgate.operator.observe import PodPhase, covers, observe_pod, observe_pool
from kvgate.operator.status import (
    ConditionStatus,
    ConditionType,
    ConditionUpdate,
    merge_conditions,
    parse_conditions,
)
from kvgate.protocol.enums import DType, ModelFamily, SecurityProtocol
from tests.operator.cluster import pool_manifest


def base(**changes: Any) -> dict[str, Any]:
    return {**pool_manifest()["spec"], **changes}


def refusal(pool: str = "pool", **changes: Any) -> str:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(pool, base(**changes))
    return caught.value.message


def test_defaults() -> None:
    spec = parse_spec(
        "pool",
        {
            "image": "i",
            "model": {"family": "llama", "path": "/m"},
            "kafka": {"bootstrapServers": "k:9092"},
            "tokenSecret": {"name": "t"},
        },
    )
    assert spec.replicas == 1 and spec.gpus_per_executor == 1
    assert spec.model.family is ModelFamily.LLAMA and spec.model.dtype is DType.BFLOAT16
    assert spec.model.loops == 1
    assert spec.token_secret.key == "token"
    assert spec.kafka.security.protocol is SecurityProtocol.PLAINTEXT
    assert spec.kafka.topics.requests == "kvgate.requests"
    assert spec.admission.replicas == 1
    assert spec.drain_timeout_seconds == 300
    assert spec.scheduler.model_fields_set == set()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model": {"family": "llama", "path": "/m", "loops": 2}}, "spec.model: family llama runs"),
        ({"model": {"family": "llama", "path": "/m", "exitPolicy": "gate"}}, "looped models only"),
        ({"model": {"family": "looped"}}, "spec.model: set exactly one of path"),
        (
            {
                "model": {
                    "family": "looped",
                    "volume": {"hostPath": {"path": "/a"}, "subPath": "../x"},
                }
            },
            "spec.model.volume: subPath must not contain '..'",
        ),
        (
            {"model": {"family": "looped", "volume": {}}},
            "spec.model.volume: set exactly one of persistentVolumeClaim and hostPath",
        ),
        (
            {"model": {"family": "looped", "packaged": "SmolLM2-135M-Instruct"}},
            "spec.model: the packaged SmolLM2-135M-Instruct is a llama model, not looped",
        ),
        (
            {"model": {"family": "llama", "path": "/m", "packaged": "SmolLM2-135M-Instruct"}},
            "spec.model: set exactly one of path (in the image), volume and packaged",
        ),
        (
            {"model": {"family": "llama", "packaged": "SmolLM2-1.7B"}},
            "spec.model.packaged: Input should be 'SmolLM2-135M-Instruct'",
        ),
        ({"kvCache": {"numBlocks": 8, "memoryFraction": 0.5}}, "spec.kvCache: set at most one"),
        (
            {"scheduler": {"prefillChunkSize": 1024}},
            "spec.scheduler: prefill_chunk_size (1024) exceeds max_num_batched_tokens (512)",
        ),
        ({"scheduler": {"maxNumSeqs": 0}}, "spec.scheduler.maxNumSeqs: Input should be greater"),
        ({"scheduler": {"max_num_seqs": 8}}, "unknown scheduler setting 'max_num_seqs'"),
        ({"scheduler": {"preemption": "never"}}, "spec.scheduler.preemption: Input should be"),
        (
            {"tenants": {"quotas": {"a": {"tokensPerMinute": 0}}}},
            "spec.tenants.quotas.a.tokensPerMinute: Input should be greater than or equal to 1",
        ),
        ({"tenants": {"limits": {}}}, "spec.tenants.limits: Extra inputs are not permitted"),
        # camelCase only, as everywhere in the resource
        ({"tenants": {"default_quota": {"tokensPerMinute": 5}}}, "spec.tenants.default_quota"),
        ({"tenants": {"quotas": {"a b": {"tokensPerMinute": 5}}}}, "spec.tenants.quotas.a b"),
        (
            {"kafka": {"bootstrapServers": "k:1", "security": {"protocol": "SASL_SSL"}}},
            "spec.kafka.security: protocol SASL_SSL needs sasl settings",
        ),
        (
            {"kafka": {"bootstrapServers": "k:1", "security": {"tls": {"secretName": "ca"}}}},
            "tls settings need protocol SSL or SASL_SSL",
        ),
        (
            {
                "kafka": {
                    "bootstrapServers": "k:1",
                    "security": {
                        "protocol": "SSL",
                        "tls": {"secretName": "ca", "certificate": "c.crt"},
                    },
                }
            },
            "certificate and privateKey go together",
        ),
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "sets it from gpusPerExecutor"),
        ({"resources": {"requests": {"memory": "1 GB"}}}, "'1 GB' is not a Kubernetes quantity"),
        ({"gpus_per_executor": 2}, "spec.gpus_per_executor: Extra inputs are not permitted"),
        ({"tolerations": [{"operator": "Maybe"}]}, "spec.tolerations[0].operator: Input should"),
        ({"tokenSecret": {"name": "Bad_Name"}}, "spec.tokenSecret.name: String should match"),
        ({"admission": {"replicas": 65}}, "spec.admission.replicas: Input should be less"),
    ],
)
def test_refused_specs_say_where_and_why(changes: dict[str, Any], expected: str) -> None:
    assert expected in refusal(**changes)


def test_every_problem_is_reported_at_once() -> None:
    message = refusal(replicas=-1, image="", drainTimeoutSeconds=0)
    assert "spec.replicas" in message and "spec.image" in message
    assert "spec.drainTimeoutSeconds" in message
    assert message.count(";") == 2


@pytest.mark.parametrize(
    ("name", "expected"),
    [("9pool", "must start with a lower-case letter"), ("p" * 49, "must be at most 48 characters")],
)
def test_pool_names_that_cannot_name_children(name: str, expected: str) -> None:
    assert refusal(pool=name).startswith(f"metadata.name: {expected}")


def test_missing_spec() -> None:
    with pytest.raises(InvalidSpecError, match="spec: missing"):
        parse_spec("pool", None)


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    ready = ConditionUpdate(type=ConditionType.READY, status=ConditionStatus.FALSE, reason="A")
    first = merge_conditions([], [ready], now=t0, generation=1)
    again = ready.model_copy(update={"reason": "B", "message": "still"})
    second = merge_conditions(first, [again], now=t0 + timedelta(minutes=5), generation=2)
    assert second[0].last_transition_time == t0 and second[0].reason == "B"
    assert second[0].observed_generation == 2
    flipped = ready.model_copy(update={"status": ConditionStatus.TRUE})
    third = merge_conditions(second, [flipped], now=t0 + timedelta(minutes=9), generation=2)
    assert third[0].last_transition_time == t0 + timedelta(minutes=9)


def test_stored_conditions_of_unknown_types_or_shapes_are_dropped() -> None:
    raw = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "X",
            "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
        {"type": "SomethingElse", "status": "True"},
        {"type": "Progressing", "status": "Maybe"},
        "garbage",
    ]
    assert [c.type for c in parse_conditions(raw)] == [ConditionType.READY]
    assert parse_conditions(None) == []


def test_observe_pod() -> None:
    raw = {
        "metadata": {
            "name": "pool-3",
            "uid": "u",
            "labels": {"kvgate.dev/slot": "3", "kvgate.dev/revision": "r"},
            "annotations": {"kvgate.dev/draining-since": "2026-01-01T00:00:00+00:00"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    pod = observe_pod(raw)
    assert (pod.name, pod.slot, pod.revision, pod.phase) == ("pool-3", 3, "r", PodPhase.RUNNING)
    assert pod.ready and pod.pod_ip == "10.0.0.3" and not pod.terminating
    assert pod.draining_since == datetime(2026, 1, 1, tzinfo=UTC)
    odd = observe_pod(
        {
            "metadata": {
                "name": "x",
                "labels": {"kvgate.dev/slot": "two"},
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "status": {"phase": "Exploded"},
        }
    )
    assert odd.slot is None and odd.phase is PodPhase.UNKNOWN and odd.terminating
    assert not odd.ready and odd.draining_since is None
    pending_but_ready = observe_pod(
        {"metadata": {"name": "p"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    assert not pending_but_ready.ready  # only a Running pod can serve


def test_observe_pool() -> None:
    pool = observe_pool(
        {
            **pool_manifest(),
            "metadata": {"name": "p", "namespace": "n", "uid": "u", "generation": 3},
        }
    )
    assert (pool.name, pool.namespace, pool.uid, pool.generation) == ("p", "n", "u", 3)
    assert not pool.deleting and pool.conditions == [] and pool.spec is not None


def test_operator_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_OPERATOR_POLL_INTERVAL_S", "2")
    monkeypatch.setenv("KVGATE_OPERATOR_MAX_BACKOFF_S", "30")
    config = OperatorConfig()
    assert config.admin_url_template == "http://{pool}-admission.{namespace}.svc:8080"
    ceilings = [config.retry_delay_s(n, uniform=lambda low, high: high) for n in range(6)]
    assert ceilings == [2, 4, 8, 16, 30, 30]
    floors = [config.retry_delay_s(n, uniform=lambda low, high: low) for n in range(6)]
    assert floors == [1, 2, 4, 8, 15, 15]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("http://{pool}.{cluster}:8080", "may use only {pool} and {namespace}"),
        ("{pool}-admission:8080", "must start with http:// or https://"),
    ],
)
def test_bad_admin_url_templates_are_refused(
    template: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_OPERATOR_ADMIN_URL_TEMPLATE", template)
    with pytest.raises(ValidationError, match=expected):
        OperatorConfig()


def test_covers_ignores_additions_but_not_changes() -> None:
    desired = {"a": 1, "b": {"c": [{"d": 2}]}, "resources": {"cpu": "0.5"}}
    assert covers(
        {"a": 1, "b": {"c": [{"d": 2, "e": 3}], "f": 4}, "g": 5, "resources": {"cpu": "500m"}},
        desired,
    )
    assert not covers({"a": 2, "b": {"c": [{"d": 2}]}}, desired)
    assert not covers({"a": 1, "b": {"c": [{"d": 2}, {"d": 3}]}}, desired)
    assert not covers({"a": 1}, desired)
