"""A throw-away self-signed certificate for the broker's TLS listener, made at test time.

The certificate names ``IP:127.0.0.1`` as its subject alternative name, so clients verify the
broker's identity against exactly the address they dial (hostname checking stays on). It is
its own CA: clients trust it through ``ca_file``. The key is EC P-256 in unencrypted PKCS#8,
the form Kafka's PEM key store accepts without a key password.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.harness.system import Progress, ensure_command, log_progress, run_logged

TLS_HOST = "127.0.0.1"
_VALID_DAYS = 2


@dataclass(frozen=True)
class TlsMaterial:
    certificate_pem: str
    private_key_pem: str
    # The certificate again, as a file for clients' ssl contexts (it is its own CA).
    ca_file: Path


def self_signed_certificate(directory: Path, progress: Progress = log_progress) -> TlsMaterial:
    """Create a key and a self-signed certificate for 127.0.0.1 in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = ensure_command("openssl", "openssl", directory / "apt.log", progress)
    key, cert = directory / "broker-key.pem", directory / "broker-cert.pem"
    run_logged(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            str(_VALID_DAYS),
            "-subj",
            f"/CN={TLS_HOST}",
            "-addext",
            f"subjectAltName=IP:{TLS_HOST}",
        ],
        directory / "openssl.log",
        timeout_s=60,
    )
    return TlsMaterial(
        certificate_pem=cert.read_text(), private_key_pem=key.read_text(), ca_file=cert
    )


def properties_value(pem: str) -> str:
    """A PEM block as one Java-properties value (newlines escaped as ``\\n``)."""
    return pem.strip().replace("\n", "\\n")
