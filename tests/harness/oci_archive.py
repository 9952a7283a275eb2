"""One-layer container images written from a directory, with no registry and no builder.

:func:`image_tar_from_directory` writes a ``docker save`` style archive (``manifest.json``, an
image config, one layer tar) that ``ctr images import`` and ``docker load`` both read. It is for
images made of a few static files: the pause image, CoreDNS, a Go test binary. Files are stored
with their modes, owned by root, with a fixed timestamp, so the same directory always gives the
same image ID.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.harness.system import HarnessError

_EPOCH = 0  # fixed mtime: identical inputs give identical layers and image IDs


def _layer_tar(root_dir: Path, out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as layer:
        for dirpath, dirnames, filenames in os.walk(root_dir):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = Path(dirpath) / name
                info = layer.gettarinfo(str(path), arcname=str(path.relative_to(root_dir)))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = _EPOCH
                if info.isfile():
                    with path.open("rb") as handle:
                        layer.addfile(info, handle)
                else:
                    layer.addfile(info)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = _EPOCH
    archive.addfile(info, io.BytesIO(data))


def image_tar_from_directory(
    root_dir: Path,
    reference: str,
    entrypoint: Sequence[str],
    out_tar: Path,
    *,
    env: Sequence[str] = (),
    user: str = "",
) -> Path:
    """Write ``root_dir`` as a one-layer linux/amd64 image named ``reference`` to ``out_tar``.

    ``reference`` needs a tag (``name:tag``); ``entrypoint`` is the image's ENTRYPOINT (an
    absolute path inside the image first). Returns ``out_tar``.
    """
    if not root_dir.is_dir():
        raise HarnessError(f"image root {root_dir} is not a directory")
    if ":" not in reference.rsplit("/", 1)[-1]:
        raise HarnessError(f"image reference {reference!r} needs a tag (name:tag)")
    if not entrypoint or not entrypoint[0].startswith("/"):
        raise HarnessError(f"entrypoint must start with an absolute path, not {entrypoint!r}")
    if not (root_dir / entrypoint[0].lstrip("/")).exists():
        raise HarnessError(f"entrypoint {entrypoint[0]} is not in {root_dir}")
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_tar.parent) as scratch:
        layer_path = Path(scratch) / "layer.tar"
        _layer_tar(root_dir, layer_path)
        layer_digest = _sha256_file(layer_path)
        config = {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": {
                "Entrypoint": list(entrypoint),
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", *env],
                "User": user,
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "kvgate test harness"}],
        }
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_name = f"{hashlib.sha256(config_bytes).hexdigest()}.json"
        manifest = [
            {
                "Config": config_name,
                "RepoTags": [reference],
                "Layers": [f"{layer_digest}/layer.tar"],
            }
        ]
        partial = out_tar.with_name(out_tar.name + ".partial")
        with tarfile.open(partial, "w") as archive:
            _add_bytes(archive, config_name, config_bytes)
            archive.add(str(layer_path), arcname=f"{layer_digest}/layer.tar")
            _add_bytes(archive, "manifest.json", json.dumps(manifest).encode())
        partial.replace(out_tar)
    return out_tar
