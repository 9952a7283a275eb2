"""Settings: file + environment, every bad setting named, secrets from files, and the files the
operator writes into the pool's ConfigMap.

The ConfigMap fixtures in ``fixtures/operator_*.yaml`` were written by the operator's own
``build_admission_configmap`` (the commit is in each file's header): they pin the format as this
service last saw it. The last test parses the builder's live output as well, so a change on
either side fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvgate.admission_service.settings import ExactlyOnce, load_settings
from kvgate.kafka_connection import SettingsError
from kvgate.protocol.enums import SaslMechanism, SecurityProtocol
from kvgate.protocol.records import BATCH_PRIORITY
from kvgate.scheduler.config import PreemptionMode

FIXTURES = Path(__file__).parent / "fixtures"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "admission.yaml"
    path.write_text(text)
    return path


def test_file_values_defaults_and_environment_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        "kafka:\n  bootstrap_servers: k1:9092\n  partitions: 3\n"
        "scheduler:\n  max_num_seqs: 12\nlimits:\n  max_waiting_requests: 100\n",
    )
    monkeypatch.setenv("KVGATE_KAFKA__PARTITIONS", "5")
    monkeypatch.setenv("KVGATE_ADMIN__PORT", "9999")
    settings = load_settings(path)
    assert settings.kafka.bootstrap_servers == "k1:9092"
    assert settings.kafka.partitions == 5  # the environment wins over the file
    assert settings.admin.port == 9999
    assert settings.scheduler.max_num_seqs == 12
    assert settings.scheduler.async_scheduling is True  # the service's default
    assert settings.limits.resume_mark == 75
    assert settings.kafka.exactly_once is ExactlyOnce.AUTO


def test_async_scheduling_can_be_switched_off(tmp_path: Path) -> None:
    path = write(tmp_path, "kafka: {bootstrap_servers: k:1}\nscheduler: {async_scheduling: false}")
    assert load_settings(path).scheduler.async_scheduling is False


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("{}", BATCH_PRIORITY),  # the batches' class is the background
        ("{background_priority: 50}", 50),
        ("{background_priority: null}", None),  # off
        ("{policy: fcfs}", None),  # one class: no background to speak of
    ],
)
def test_the_batches_class_is_the_background_by_default(
    tmp_path: Path, section: str, expected: int | None
) -> None:
    path = write(tmp_path, f"kafka: {{bootstrap_servers: k:1}}\nscheduler: {section}")
    assert load_settings(path).scheduler.background_priority == expected


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("scheduler: {}", "kafka: Field required"),
        ("kafka: {bootstrap_servers: 'a b'}", "kafka.bootstrap_servers"),
        ("kafka: {bootstrap_servers: k:1, partitions: 0}", "kafka.partitions"),
        (
            "kafka: {bootstrap_servers: k:1, session_timeout_ms: 2000,"
            " heartbeat_interval_ms: 2000}",
            "heartbeat_interval_ms (2000) must be below session_timeout_ms",
        ),
        ("kafka: {bootstrap_servers: k:1, security_protocol: SASL_SSL}", "needs sasl_mechanism"),
        (
            "kafka: {bootstrap_servers: k:1, sasl_mechanism: PLAIN}",
            "sasl_mechanism needs security_protocol",
        ),
        ("kafka: {bootstrap_servers: k:1, ssl_certfile: /c}", "ssl_certfile and ssl_keyfile"),
        ("kafka: {bootstrap_servers: k:1, result_topic: kvgate.requests}", "distinct"),
        ("kafka: {bootstrap_servers: k:1, exactly_once: maybe}", "kafka.exactly_once"),
        ("kafka: {bootstrap_servers: k:1, surprise: 1}", "kafka.surprise: Extra inputs"),
        ("kafka: {bootstrap_servers: k:1}\nsurprise: {}", "surprise: Extra inputs"),
        ("kafka: {bootstrap_servers: k:1}\nscheduler: {max_num_seqs: 0}", "scheduler.max_num_seqs"),
        (
            "kafka: {bootstrap_servers: k:1}\nlimits: {priority_min: 5, priority_max: 1}",
            "priority_min (5) exceeds priority_max (1)",
        ),
        (
            "kafka: {bootstrap_servers: k:1}\n"
            "limits: {max_waiting_requests: 10, resume_waiting_requests: 10}",
            "must be below max_waiting_requests",
        ),
        (
            "kafka: {bootstrap_servers: k:1}\nexecutors: {members: [{name: a, endpoint: 'http://x'}]}",
            "executors.members.0.endpoint",
        ),
        (
            "kafka: {bootstrap_servers: k:1}\nexecutors:\n  members:\n"
            "    - {name: a, endpoint: 'ws://x'}\n    - {name: a, endpoint: 'ws://y'}",
            "executor names must be unique",
        ),
        (
            "kafka: {bootstrap_servers: k:1}\ntelemetry: {otlp_endpoint: 'grpc://x'}",
            "otlp_endpoint",
        ),
        (
            "kafka: {bootstrap_servers: k:1}\nexecutors: {tokenizer_from_executors: true}\n"
            "limits: {tokenizer_file: /t/tokenizer.json}",
            "set at most one of limits.tokenizer_file and executors.tokenizer_from_executors",
        ),
    ],
)
def test_invalid_settings_name_the_setting(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(write(tmp_path, text))
    assert named in str(caught.value)


def test_invalid_environment_value_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_KAFKA__MAX_POLL_RECORDS", "lots")
    with pytest.raises(SettingsError, match=r"kafka\.max_poll_records"):
        load_settings(write(tmp_path, "kafka: {bootstrap_servers: k:1}"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kafka: [", "not valid YAML"),
        ("- a\n- b\n", "must hold a mapping of sections"),
    ],
)
def test_unreadable_files_fail_clearly(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(write(tmp_path, text))


def test_missing_file_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="No such file"):
        load_settings(tmp_path / "absent.yaml")


def test_secrets_come_from_files_and_empty_files_are_errors(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text("s3cret\n")
    (tmp_path / "empty").write_text("  \n")
    path = write(
        tmp_path,
        f"kafka: {{bootstrap_servers: k:1}}\nadmin: {{token_file: {tmp_path / 'admin'}}}\n"
        f"executors: {{token_file: {tmp_path / 'empty'}}}\n",
    )
    settings = load_settings(path)
    assert settings.admin.token_value() == "s3cret"
    with pytest.raises(SettingsError, match=r"executors\.token.*is empty"):
        settings.executors.token_value()
    assert "s3cret" not in repr(settings)


def test_the_operators_full_configmap_parses() -> None:
    settings = load_settings(FIXTURES / "operator_full.yaml")
    kafka = settings.kafka
    assert kafka.security_protocol is SecurityProtocol.SASL_SSL
    assert kafka.sasl_mechanism is SaslMechanism.SCRAM_SHA_512
    assert kafka.sasl_password_file == Path("/var/run/kvgate/kafka-sasl/password")
    assert kafka.token_topic == "kvgate.tokens"
    assert settings.scheduler.max_num_seqs == 128
    assert settings.scheduler.preemption is PreemptionMode.OFF
    assert settings.admin.port == 8080
    assert settings.executors.token_file == Path("/var/run/kvgate/executor-token/token")
    assert settings.telemetry.otlp_endpoint == "http://otel-collector:4318"


def test_the_operators_minimal_configmap_parses_with_service_defaults() -> None:
    settings = load_settings(FIXTURES / "operator_minimal.yaml")
    assert settings.kafka.group_id == "kvgate-serving-pool-a"
    assert settings.kafka.create_topics is False  # the pool's topics must exist already
    assert settings.scheduler.async_scheduling is True
    assert settings.executors.members == []  # the operator pushes membership via the admin API


@pytest.mark.skipif(
    importlib.util.find_spec("kvgate.operator.builders") is None,
    reason="the operator is not in this tree; the fixtures above stand in for it",
)
def test_the_operators_builder_output_parses_directly(tmp_path: Path) -> None:
    from kvgate.operator.builders.admission import render_admission_config  # type: ignore
    from kvgate.operator.builders.common import PoolRef  # type: ignore
    from kvgate.operator.models import parse_spec  # type: ignore

    raw = {
        "image": "registry.example/kvgate:1",
        "model": {"family": "llama", "path": "/models/m"},
        "kafka": {"bootstrapServers": "kafka:9092"},
        "tokenSecret": {"name": "executor-token"},
        "scheduler": {"maxNumSeqs": 32, "preemption": "recompute"},
    }
    text = render_admission_config(PoolRef("p", "ns", "uid"), parse_spec("p", raw))
    settings = load_settings(write(tmp_path, text))
    assert settings.scheduler.max_num_seqs == 32
    assert settings.scheduler.preemption is PreemptionMode.RECOMPUTE
    assert settings.executors.tokenizer_from_executors is True  # text through the executors
    assert settings.telemetry.model_name == "/models/m"


def test_exposure_defaults_are_closed() -> None:
    """Outside Kubernetes the admin API listens on loopback only, and a token that is set but
    empty is refused instead of accepted as a credential."""
    settings = load_settings(None, {"kafka": {"bootstrap_servers": "127.0.0.1:9092"}})
    assert settings.admin.host == "127.0.0.1"
    for section, key in [("admin", "token"), ("executors", "token")]:
        with pytest.raises(SettingsError, match=f"{section}.{key}"):
            load_settings(
                None, {"kafka": {"bootstrap_servers": "127.0.0.1:9092"}, section: {key: ""}}
            )
