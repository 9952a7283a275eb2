"""A real S3-compatible object store for tests, built from Go modules: Versity's S3 gateway.

``versitygw/go.mod`` names ``github.com/versity/versitygw`` v1.8.0 (Apache-2.0) as a ``tool``;
the harness builds its ``cmd/versitygw`` — the program the project releases — once per recipe
into ``<cache>/versitygw/bin-<hash>/versitygw`` (``go_build.py``): about 2.5 CPU-minutes cold
(9.5 min wall on a busy 2-core machine), seconds warm; 45 MB. MinIO is AGPL-3.0 and not used.

:class:`S3Server` runs it on 127.0.0.1 with its POSIX backend (each bucket a directory of a
private temporary directory, each object a file), one root account, and a bucket made before it
starts (a directory under the backend is a bucket). It speaks S3's REST API with SigV4 and
multipart uploads: what kvgate's store (obstore) uses against AWS.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from tests.harness.daemon import Daemon
from tests.harness.go_build import GoRecipe, build_recipe
from tests.harness.system import Progress, free_port, log_progress, port_accepts

RECIPE_DIR = Path(__file__).with_name("versitygw")
VERSION = "1.8.0"
_PACKAGE = "github.com/versity/versitygw/cmd/versitygw"
_READY_TIMEOUT_S = 60
ACCESS_KEY = "kvgate-test-access"
SECRET_KEY = "kvgate-test-secret-0123456789"
REGION = "us-east-1"


def recipe() -> GoRecipe:
    return GoRecipe(
        name="versitygw",
        directory=RECIPE_DIR,
        files=("go.mod", "go.sum"),
        package=_PACKAGE,
        binary="versitygw",
    )


def build(progress: Progress = log_progress) -> Path:
    """The versitygw binary for the current recipe, built on first use."""
    return build_recipe(recipe(), progress, cold_estimate="about 2.5 CPU-minutes")


class S3Server:
    """One running S3 server (a context manager) with ``bucket`` made; :attr:`endpoint`."""

    def __init__(
        self, binary: Path, *, bucket: str = "kvgate", progress: Progress = log_progress
    ) -> None:
        self.binary = binary
        self.bucket = bucket
        self._daemon = Daemon("versitygw", progress)
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        """Where the POSIX backend keeps the buckets (a bucket is a directory)."""
        return self._daemon.workdir / "data"

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        (self.data_dir / self.bucket).mkdir(parents=True)
        self._daemon.progress(f"starting versitygw on {self.endpoint}; log {self._daemon.log_path}")
        self._daemon.start(
            [
                str(self.binary), "--access", ACCESS_KEY, "--secret", SECRET_KEY,
                "--region", REGION, "--port", f"127.0.0.1:{self.port}", "--quiet",
                "posix", str(self.data_dir),
            ]
        )  # fmt: skip
        try:
            self._daemon.wait_until(self._answers, timeout_s=_READY_TIMEOUT_S, what="S3 answering")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if not port_accepts("127.0.0.1", self.port):
            return False
        try:
            urllib.request.urlopen(self.endpoint, timeout=2).close()
        except urllib.error.HTTPError:
            return True  # an S3 error for an unsigned request: the server answers
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self._daemon.stop()

    def log(self) -> str:
        return self._daemon.log()

    def write_credentials(self, directory: Path) -> tuple[Path, Path]:
        """The access key id and secret as files (as a mounted Secret gives them)."""
        directory.mkdir(parents=True, exist_ok=True)
        key_id, secret = directory / "access-key-id", directory / "secret-access-key"
        key_id.write_text(ACCESS_KEY)
        secret.write_text(SECRET_KEY)
        return key_id, secret
