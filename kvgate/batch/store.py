"""Where file bytes live: an object store, streamed both ways.

Every object is written whole or not at all (:meth:`ObjectStore.put` consumes an async stream of
chunks; if the stream raises, nothing is left under the key) and read as a stream of chunks from
any byte offset. Nothing here holds a whole file: a write holds one chunk (the local store) or
a few multipart parts (S3); a read holds one chunk.

Keys::

    files/<file id>                              an uploaded file, or a batch's output/errors
    batches/<batch id>/segments/<first>-<end>.<out|err>   lines [first, end) of a batch's
                                                 output or error file, until it is finalized

:class:`LocalStore` keeps them under a directory (``kvgate run``); ``s3_store.S3Store`` in an
S3-compatible store (the ``s3`` extra). :func:`open_store` picks by the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import BinaryIO, Final, Protocol

from kvgate.batch.settings import StoreKind, StoreSettings

READ_CHUNK_BYTES: Final = 1 << 20
_PARTIAL: Final = ".partial-"


class ObjectMissing(KeyError):
    """No object under the key."""


class ObjectStore(Protocol):
    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """Write the stream under ``key`` (replacing what was there), whole or not at all;
        the bytes written. An exception from the stream propagates, and nothing is left."""
        ...

    def get(self, key: str, *, offset_bytes: int = 0) -> AsyncIterator[bytes]:
        """The object's bytes from ``offset_bytes`` on, in chunks; :class:`ObjectMissing`
        (when iterated) if there is none."""
        ...

    async def delete(self, key: str) -> None:
        """Delete ``key``; nothing happens if it is not there."""
        ...

    async def keys(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (a "directory": ends with ``/``)."""
        ...

    async def close(self) -> None: ...


def file_key(file_id: str) -> str:
    return f"files/{file_id}"


def segment_prefix(batch_id: str) -> str:
    return f"batches/{batch_id}/segments/"


def segment_key(batch_id: str, first: int, end: int, kind: str) -> str:
    return f"{segment_prefix(batch_id)}{first:09d}-{end:09d}.{kind}"


class LocalStore:
    """Objects as files under ``root``; a write goes to a partial file renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"the key {key!r} leaves the store")
        return path

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        path = self._path(key)
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}{_PARTIAL}{secrets.token_hex(4)}")
        written = 0
        file = await asyncio.to_thread(partial.open, "wb")
        try:
            async for chunk in chunks:
                await asyncio.to_thread(file.write, chunk)
                written += len(chunk)
            await asyncio.to_thread(_close_durably, file)
            await asyncio.to_thread(os.replace, partial, path)
        except BaseException:
            file.close()
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        return written

    async def get(self, key: str, *, offset_bytes: int = 0) -> AsyncIterator[bytes]:
        path = self._path(key)
        try:
            file = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        try:
            await asyncio.to_thread(file.seek, offset_bytes)
            while chunk := await asyncio.to_thread(file.read, READ_CHUNK_BYTES):
                yield chunk
        finally:
            file.close()

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self._path(key).unlink)

    async def keys(self, prefix: str) -> list[str]:
        def walk() -> list[str]:
            base = self._path(prefix) if prefix.endswith("/") else self._path(prefix).parent
            if not base.is_dir():
                return []
            found = [
                path.relative_to(self.root.resolve()).as_posix()
                for path in base.rglob("*")
                if path.is_file() and _PARTIAL not in path.name
            ]
            return sorted(key for key in found if key.startswith(prefix))

        return await asyncio.to_thread(walk)

    async def close(self) -> None:
        return None


def _close_durably(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())
    file.close()


def open_store(settings: StoreSettings) -> ObjectStore:
    """The store the settings name (S3 needs the ``s3`` extra)."""
    if settings.kind is StoreKind.LOCAL:
        assert settings.path is not None  # the settings' validator
        settings.path.mkdir(parents=True, exist_ok=True)
        return LocalStore(settings.path)
    from kvgate.batch.s3_store import S3Store  # noqa: PLC0415 (the s3 extra, only when asked)

    return S3Store(settings)


async def read_all(store: ObjectStore, key: str) -> bytes:
    """A small object whole (tests and segments' callers that know it is small)."""
    return b"".join([chunk async for chunk in store.get(key)])
