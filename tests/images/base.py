"""A registry-free base image for building kvgate's images in tests.

No registry is reachable here, so `python:3.11-slim-bookworm` and the CUDA images cannot be
pulled. The harness already makes a Debian bookworm image from a debootstrap root file system
(``tests/harness/kafka_image.py``: minbase plus a Java runtime, for the Kafka broker); it has no
Python, which is what the Dockerfiles' ``docker/python.sh`` is for: it installs Python with the
image's own apt, as it would on any Debian or Ubuntu base.

The one thing added here is the host's CA bundle: package registries may only be reachable
through a TLS-inspecting proxy whose CA the host trusts, and pip and uv inside the build must
trust it too. The layer is keyed by a hash of the base, the bundle and this recipe.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import docker
from docker.errors import ImageNotFound

from tests.harness.kafka_image import ensure_base_image
from tests.harness.system import Progress, file_lock

REPOSITORY = "kvgate-test-debian-ca"
CA_PATH_IN_IMAGE = "/usr/local/share/kvgate-test/ca-bundle.crt"
_DOCKERFILE = f"""ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
COPY ca-bundle.crt {CA_PATH_IN_IMAGE}
ENV SSL_CERT_FILE={CA_PATH_IN_IMAGE} \\
    PIP_CERT={CA_PATH_IN_IMAGE} \\
    REQUESTS_CA_BUNDLE={CA_PATH_IN_IMAGE}
"""
_HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def host_ca_bundle() -> bytes:
    """The CA bundle this machine's TLS clients use (what reaches PyPI from here)."""
    for variable in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"):
        configured = os.environ.get(variable)
        if configured and Path(configured).is_file():
            return Path(configured).read_bytes()
    for candidate in _HOST_BUNDLES:
        if Path(candidate).is_file():
            return Path(candidate).read_bytes()
    return b""


def _exists(client: docker.DockerClient, reference: str) -> bool:
    try:
        client.images.get(reference)
    except ImageNotFound:
        return False
    return True


def ensure_debian_base(client: docker.DockerClient, cache: Path, progress: Progress) -> str:
    """A Debian bookworm image without Python that trusts the host's CAs; its reference."""
    debian = ensure_base_image(client, cache, progress)
    bundle = host_ca_bundle()
    digest = hashlib.sha256(b"\0".join([debian.encode(), _DOCKERFILE.encode(), bundle]))
    reference = f"{REPOSITORY}:{digest.hexdigest()[:12]}"
    work = cache / "images"
    work.mkdir(parents=True, exist_ok=True)
    with file_lock(work / "build.lock"):
        if _exists(client, reference):
            return reference
        progress(f"building {reference} from {debian} (host CA bundle added)")
        with tempfile.TemporaryDirectory(dir=work) as context:
            (Path(context) / "Dockerfile").write_text(_DOCKERFILE)
            (Path(context) / "ca-bundle.crt").write_bytes(bundle)
            client.images.build(
                path=context,
                tag=reference,
                buildargs={"BASE_IMAGE": debian},
                pull=False,
                rm=True,
                forcerm=True,
                network_mode="host",
            )
    return reference
