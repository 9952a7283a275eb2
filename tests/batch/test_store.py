"""The object-store contract (``kvgate.batch.store.ObjectStore``), held by the local store and by
the S3 store against a real S3 server (versitygw): whole-or-nothing writes from a stream,
ranged streamed reads, deletes, listing."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvgate.batch.settings import StoreKind, StoreSettings
from kvgate.batch.store import ObjectMissing, ObjectStore, open_store, read_all
from tests.harness.versitygw import REGION, S3Server

PART = 5 * 2**20  # the smallest multipart part S3 takes


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield open_store(StoreSettings(kind=StoreKind.LOCAL, path=tmp_path / "store"))
        return
    server: S3Server = request.getfixturevalue("s3_server")
    key_id, secret = server.write_credentials(tmp_path / "credentials")
    yield open_store(
        StoreSettings(
            kind=StoreKind.S3, endpoint=server.endpoint, bucket=server.bucket,
            prefix=f"test-{os.urandom(4).hex()}", region=REGION, access_key_id_file=key_id,
            secret_access_key_file=secret, allow_http=True, part_bytes=PART,
        )
    )  # fmt: skip


async def _chunks(*pieces: bytes, fail_after: int | None = None) -> AsyncIterator[bytes]:
    for index, piece in enumerate(pieces):
        if fail_after is not None and index == fail_after:
            raise OSError("the upload's source failed")
        yield piece


async def test_a_streamed_write_reads_back_whole_and_from_any_offset(store: ObjectStore) -> None:
    # Three chunks adding up to more than two parts: a multipart upload on S3.
    pieces = [os.urandom(PART + 123), os.urandom(PART // 2), b"tail\n"]
    data = b"".join(pieces)
    assert await store.put("files/a", _chunks(*pieces)) == len(data)
    got = b"".join([chunk async for chunk in store.get("files/a")])
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    for offset in (1, PART, len(data) - 5):
        assert (
            b"".join([c async for c in store.get("files/a", offset_bytes=offset)]) == data[offset:]
        )
    assert [c async for c in store.get("files/a", offset_bytes=len(data))] == []


async def test_a_failed_write_leaves_what_was_there(store: ObjectStore) -> None:
    await store.put("files/b", _chunks(b"first version\n"))
    with pytest.raises(OSError, match="source failed"):
        await store.put("files/b", _chunks(os.urandom(PART + 1), b"x", fail_after=1))
    assert await read_all(store, "files/b") == b"first version\n"
    with pytest.raises(OSError, match="source failed"):
        await store.put("files/new", _chunks(os.urandom(PART + 1), b"x", fail_after=1))
    with pytest.raises(ObjectMissing):
        await read_all(store, "files/new")
    assert await store.keys("files/") == ["files/b"]


async def test_empty_objects_deletes_and_listing(store: ObjectStore) -> None:
    await store.put("batches/x/segments/000000000-000000005.out", _chunks())
    await store.put("batches/x/segments/000000000-000000005.err", _chunks(b"e\n"))
    await store.put("batches/y/segments/000000000-000000001.out", _chunks(b"o\n"))
    assert await read_all(store, "batches/x/segments/000000000-000000005.out") == b""
    assert await store.keys("batches/x/segments/") == [
        "batches/x/segments/000000000-000000005.err",
        "batches/x/segments/000000000-000000005.out",
    ]
    await store.delete("batches/x/segments/000000000-000000005.err")
    await store.delete("batches/x/segments/never-written")  # nothing there: no error
    assert await store.keys("batches/x/segments/") == ["batches/x/segments/000000000-000000005.out"]
    with pytest.raises(ObjectMissing):
        await read_all(store, "batches/x/segments/000000000-000000005.err")
    await store.close()


async def test_the_local_store_keeps_keys_inside_its_directory(tmp_path: Path) -> None:
    store = open_store(StoreSettings(kind=StoreKind.LOCAL, path=tmp_path / "store"))
    with pytest.raises(ValueError, match="leaves the store"):
        await store.put("../outside", _chunks(b"x"))
    assert not (tmp_path / "outside").exists()
