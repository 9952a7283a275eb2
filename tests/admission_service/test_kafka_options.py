"""``kafka`` settings become the keyword arguments of every Kafka client of the service (and of
the gateway and the clients: ``kvgate.kafka_connection`` is shared): SASL credentials (inline or
from a mounted file) and a TLS context that trusts the configured CA, presents the client
certificate and checks the broker's host name unless told not to."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.admission_service.intake import request_consumer
from kvgate.admission_service.settings import KafkaSettings, load_settings
from kvgate.kafka_connection import KafkaConnection, SettingsError, client_options
from kvgate.protocol.enums import SaslMechanism, SecurityProtocol
from tests.harness.tls import TlsMaterial, self_signed_certificate


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def _options(**kafka: Any) -> dict[str, Any]:
    return client_options(KafkaSettings.model_validate({"bootstrap_servers": "k:9093", **kafka}))


def test_plaintext_carries_no_credentials_and_no_tls() -> None:
    options = _options(client_id="svc", request_timeout_ms=5000)
    assert options == {
        "bootstrap_servers": "k:9093",
        "client_id": "svc",
        "security_protocol": "PLAINTEXT",
        "request_timeout_ms": 5000,
    }


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_plaintext_passes_mechanism_and_credentials(mechanism: str) -> None:
    options = _options(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=mechanism,
        sasl_username="kvgate",
        sasl_password="s3cret",
    )
    assert options["security_protocol"] == "SASL_PLAINTEXT"
    assert options["sasl_mechanism"] == mechanism
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("kvgate", "s3cret")
    assert "ssl_context" not in options


def test_sasl_password_is_read_from_its_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-a-secret\n")
    options = _options(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="kvgate",
        sasl_password_file=str(secret),
    )
    assert options["sasl_plain_password"] == "from-a-secret"
    assert isinstance(options["ssl_context"], ssl.SSLContext)


def test_missing_password_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"kafka\.sasl_password: cannot read"):
        _options(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_username="kvgate",
            sasl_password_file=str(tmp_path / "absent"),
        )


def test_tls_context_trusts_the_ca_and_checks_host_names(tls: TlsMaterial) -> None:
    context = _options(security_protocol="SSL", ssl_cafile=str(tls.ca_file))["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    trusted = {cert["serialNumber"] for cert in context.get_ca_certs()}
    assert len(trusted) == 1  # exactly the configured CA, not the system store


def test_host_name_check_can_be_turned_off(tls: TlsMaterial) -> None:
    context = _options(
        security_protocol="SSL", ssl_cafile=str(tls.ca_file), ssl_check_hostname=False
    )["ssl_context"]
    assert not context.check_hostname


def test_client_certificate_is_loaded(tls: TlsMaterial, tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_text(tls.certificate_pem)
    key.write_text(tls.private_key_pem)
    options = _options(
        security_protocol="SSL",
        ssl_cafile=str(tls.ca_file),
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
    )
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    # A key that does not match the certificate is refused when the context is built.
    other = self_signed_certificate(tmp_path / "other")
    key.write_text(other.private_key_pem)
    with pytest.raises(ssl.SSLError):
        _options(
            security_protocol="SSL",
            ssl_cafile=str(tls.ca_file),
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
        )


@pytest.mark.parametrize(
    ("kafka", "message"),
    [
        ({"ssl_cafile": "ca.pem"}, "ssl_\\* files need security_protocol SSL or SASL_SSL"),
        ({"security_protocol": "SSL", "ssl_certfile": "c.pem"}, "go together"),
        ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, "needs sasl_mechanism"),
        ({"sasl_mechanism": "PLAIN"}, "needs security_protocol SASL_PLAINTEXT or SASL_SSL"),
    ],
    ids=["tls file without tls", "half a key pair", "sasl without mechanism", "sasl unused"],
)
def test_security_settings_that_would_be_ignored_or_fail_later_are_refused(
    kafka: dict[str, Any], message: str
) -> None:
    """One definition for every kvgate process (``kvgate.kafka_connection``): a TLS file under
    PLAINTEXT would be silently unused, so it is an error like the others."""
    with pytest.raises(ValidationError, match=message):
        KafkaConnection.model_validate({"bootstrap_servers": "k:9093", **kafka})


def test_the_connection_describes_itself_without_secrets(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("hunter2-hunter2")
    connection = KafkaConnection(
        bootstrap_servers="k:9093",
        security_protocol=SecurityProtocol.SASL_SSL,
        sasl_mechanism=SaslMechanism.SCRAM_SHA_512,
        sasl_username="gw",
        sasl_password_file=secret,
    )
    described = connection.describe()
    assert described == "k:9093 (SASL_SSL SCRAM-SHA-512 as gw, CA system trust store)"
    assert "hunter2" not in described


@pytest.mark.parametrize("wait_ms", [None, 5])
async def test_the_request_consumer_fetches_with_the_configured_wait(wait_ms: int | None) -> None:
    """Tansu holds an empty fetch for its whole wait, so the local stack shortens it; Kafka's
    own default stays for real brokers, which answer as soon as a request arrives."""
    kafka: dict[str, Any] = {"bootstrap_servers": "k:9093"}
    if wait_ms is not None:
        kafka["fetch_max_wait_ms"] = wait_ms
    consumer = request_consumer(load_settings(None, {"kafka": kafka}))
    assert consumer._fetch_max_wait_ms == (wait_ms or 500)
    assert consumer._fetch_min_bytes == 1
