"""Build the Kafka test image without any container registry, and cache every slow part.

Three layers, each cached under the harness cache and keyed by a hash of its recipe:

1. **Jars** — ``org.apache.kafka:kafka_2.13`` and an SLF4J binding (Kafka's tree has none, so
   without it the broker logs nothing) copied by Maven into ``<cache>/kafka/jars-<hash>``, with
   Maven's local repository at ``<cache>/maven-repo``.
2. **Base image** — Debian bookworm from ``debootstrap --variant=minbase`` with a headless Java
   17 runtime, packed into ``<cache>/kafka/rootfs-<hash>.tar`` (kept, so an engine with an
   empty data root re-imports it in seconds instead of running debootstrap again) and brought
   in with ``docker import`` as ``kvgate-test-debian-java17:<hash>``.
3. **Kafka image** — the Dockerfile in ``kafka_recipe/`` adds the jars, a log4j2
   configuration and the entrypoint: ``kvgate-test-kafka:4.4.0-<hash>``, also tagged
   ``kvgate-test-kafka:4.4.0``, labelled ``dev.kvgate.recipe=<hash>``.

Any change to a recipe (versions, Dockerfile, entrypoint, logging configuration, packages)
changes its hash and so rebuilds that layer and those above it; nothing else does. Builds run
under ``<cache>/kafka/build.lock`` so two sessions never build at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker
from docker.errors import ImageNotFound

from tests.harness.system import (
    HarnessError,
    Progress,
    ensure_command,
    file_lock,
    is_root,
    log_progress,
    remove_tree,
    run_logged,
)

KAFKA_VERSION = "4.4.0"
SCALA_VERSION = "2.13"
# Routes Kafka's SLF4J 1.7 calls to the log4j2 core already in Kafka's dependency tree; its
# version matches that tree's log4j-api.
SLF4J_BINDING = "org.apache.logging.log4j:log4j-slf4j-impl:2.25.5"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("KVGATE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
JAVA_PACKAGES = ("openjdk-17-jre-headless",)

IMAGE_REPOSITORY = "kvgate-test-kafka"
BASE_REPOSITORY = "kvgate-test-debian-java17"
RECIPE_LABEL = "dev.kvgate.recipe"
RECIPE_DIR = Path(__file__).with_name("kafka_recipe")
_RECIPE_FILES = ("Dockerfile", "entrypoint.sh", "log4j2.properties")

_MAVEN_TIMEOUT_S = 900
_DEBOOTSTRAP_TIMEOUT_S = 1800


def _digest(*parts: str | bytes) -> str:
    sha = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        sha.update(len(data).to_bytes(8, "big"))
        sha.update(data)
    return sha.hexdigest()[:12]


def maven_pom() -> str:
    """A pom whose only job is to declare the broker's runtime dependencies."""
    group, artifact, version = SLF4J_BINDING.split(":")
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.kvgate.test</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_{SCALA_VERSION}</artifactId>
      <version>{KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>{group}</groupId>
      <artifactId>{artifact}</artifactId>
      <version>{version}</version>
    </dependency>
  </dependencies>
</project>
"""


def base_recipe_hash() -> str:
    return _digest("debootstrap-minbase-v1", DEBIAN_SUITE, DEBIAN_MIRROR, *JAVA_PACKAGES)


def jars_recipe_hash() -> str:
    return _digest("maven-copy-dependencies-v1", maven_pom())


def image_recipe_hash() -> str:
    files = [(RECIPE_DIR / name).read_bytes() for name in _RECIPE_FILES]
    return _digest(base_recipe_hash(), jars_recipe_hash(), *_RECIPE_FILES, *files)


@dataclass(frozen=True)
class KafkaImage:
    """The reference to run (hash-tagged, so a stale image of the same name is never used)."""

    reference: str
    recipe_hash: str


def _image_exists(client: docker.DockerClient, reference: str) -> bool:
    try:
        client.images.get(reference)
    except ImageNotFound:
        return False
    return True


def ensure_kafka_image(
    client: docker.DockerClient, cache: Path, progress: Progress = log_progress
) -> KafkaImage:
    """Return the Kafka test image, building whatever layer is missing from the cache."""
    recipe_hash = image_recipe_hash()
    image = KafkaImage(f"{IMAGE_REPOSITORY}:{KAFKA_VERSION}-{recipe_hash}", recipe_hash)
    work = cache / "kafka"
    work.mkdir(parents=True, exist_ok=True)
    with file_lock(work / "build.lock"):
        if _image_exists(client, image.reference):
            return image
        progress(f"building {image.reference} (first run on this machine or a changed recipe)")
        jars = ensure_jars(cache, progress)
        base = ensure_base_image(client, cache, progress)
        _build_kafka_image(client, image, base, jars, work)
    return image


def ensure_jars(cache: Path, progress: Progress) -> Path:
    """Kafka's runtime jars in ``<cache>/kafka/jars-<hash>`` (complete, or fetched now)."""
    target = cache / "kafka" / f"jars-{jars_recipe_hash()}"
    if (target / ".complete").exists():
        return target
    log_path = cache / "logs" / "maven.log"
    mvn = ensure_command("mvn", "maven", cache / "logs" / "apt.log", progress)
    progress(f"fetching Kafka {KAFKA_VERSION} jars with Maven (log: {log_path})")
    with tempfile.TemporaryDirectory(dir=cache / "kafka") as scratch:
        scratch_dir = Path(scratch)
        (scratch_dir / "pom.xml").write_text(maven_pom())
        staged = scratch_dir / "libs"
        run_logged(
            [
                mvn,
                "-q",
                "-B",
                f"-Dmaven.repo.local={cache / 'maven-repo'}",
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={staged}",
            ],
            log_path,
            timeout_s=_MAVEN_TIMEOUT_S,
            cwd=scratch_dir,
        )
        _check_jars(staged)
        (staged / ".complete").write_text("maven copy-dependencies finished\n")
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    return target


def _check_jars(libs: Path) -> None:
    names = {jar.name for jar in libs.glob("*.jar")}
    required = (f"kafka_{SCALA_VERSION}-{KAFKA_VERSION}.jar", "log4j-slf4j-impl-")
    for prefix in required:
        if not any(name.startswith(prefix) for name in names):
            raise HarnessError(f"Maven finished but no {prefix}* jar is in {libs}")


def ensure_base_image(client: docker.DockerClient, cache: Path, progress: Progress) -> str:
    """The Debian+Java base image reference, imported from the cached rootfs tarball."""
    reference = f"{BASE_REPOSITORY}:{base_recipe_hash()}"
    if _image_exists(client, reference):
        return reference
    tarball = cache / "kafka" / f"rootfs-{base_recipe_hash()}.tar"
    if not tarball.exists():
        _build_rootfs_tarball(tarball, cache, progress)
    progress(f"importing {tarball.name} as {reference}")
    repository, tag = reference.split(":")
    client.api.import_image_from_file(str(tarball), repository=repository, tag=tag)
    if not _image_exists(client, reference):
        raise HarnessError(f"docker import of {tarball} did not produce {reference}")
    return reference


def _build_rootfs_tarball(tarball: Path, cache: Path, progress: Progress) -> None:
    if not is_root():
        raise HarnessError("building the Kafka base image runs debootstrap, which needs root")
    log_path = cache / "logs" / "debootstrap.log"
    debootstrap = ensure_command("debootstrap", "debootstrap", cache / "logs" / "apt.log", progress)
    rootfs = cache / "kafka" / "rootfs-build"
    remove_tree(rootfs)
    progress(
        f"debootstrap {DEBIAN_SUITE} (minbase + {', '.join(JAVA_PACKAGES)}), "
        f"about a minute or two (log: {log_path})"
    )
    try:
        run_logged(
            [
                debootstrap,
                "--variant=minbase",
                f"--include={','.join(JAVA_PACKAGES)}",
                DEBIAN_SUITE,
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            log_path,
            timeout_s=_DEBOOTSTRAP_TIMEOUT_S,
        )
        # Package caches are dead weight in the image.
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / leftover).glob("*"):
                if entry.is_file() and not entry.is_symlink():
                    entry.unlink()
        if not (rootfs / "usr/bin/java").exists():
            raise HarnessError(f"debootstrap finished but {rootfs}/usr/bin/java is missing")
        partial = tarball.with_suffix(".tar.partial")
        run_logged(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."],
            log_path,
            timeout_s=600,
        )
        partial.rename(tarball)
    finally:
        remove_tree(rootfs)


def _build_kafka_image(
    client: docker.DockerClient, image: KafkaImage, base: str, jars: Path, work: Path
) -> None:
    with tempfile.TemporaryDirectory(dir=work) as context_dir:
        context = Path(context_dir)
        for name in _RECIPE_FILES:
            shutil.copyfile(RECIPE_DIR / name, context / name)
        (context / "entrypoint.sh").chmod(0o755)
        libs = context / "libs"
        libs.mkdir()
        for jar in jars.glob("*.jar"):
            # Hard links keep a 50 MB context free to create; copy across file systems.
            try:
                os.link(jar, libs / jar.name)
            except OSError:
                shutil.copyfile(jar, libs / jar.name)
        client.images.build(
            path=str(context),
            tag=image.reference,
            buildargs={"BASE_IMAGE": base},
            labels={RECIPE_LABEL: image.recipe_hash},
            rm=True,
            forcerm=True,
            pull=False,
            network_mode="host",
        )
    client.images.get(image.reference).tag(IMAGE_REPOSITORY, KAFKA_VERSION)
