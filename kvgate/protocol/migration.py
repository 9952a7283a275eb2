"""KV snapshot migration: what moves between executors, and how it is framed on the wire.

A draining executor exports a request's KV (``StepPlan.export``) under a one-time ticket; the
receiving executor fetches it from the leaving executor's HTTP port (``GET /v1/snapshots/
{ticket}``, the executors' bearer token), checks it frame by frame, and stages it; the
receiving scheduler adopts it as a host snapshot (``StepPlan.adopt``) and restores it by its
normal swap-in.

A transfer is a sequence of frames::

    frame   := MAGIC (4 bytes) | length (u32, big-endian) | sha256(payload) (32 bytes) | payload
    frame 0 := the SnapshotHeader as JSON (its size is bounded by MAX_HEADER_BYTES)
    frame 1.. := the snapshot's bytes in chunks of at most ``chunk_bytes``

The header names the layout (model fingerprint, block size, planes, dtype, layers, KV heads,
head size), the page count, the backend's request state and the payload's total size and
sha256. :class:`FrameDecoder` takes bytes as they arrive and refuses, with a
:class:`TransferError` naming a :class:`TransferFailure`, a frame whose checksum does not
match, a transfer larger than its limit, a layout other than the receiver's, a truncated or
malformed stream. Only pydantic and the standard library: the service and both executors share
it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAGIC: Final = b"KVS1"
_PREFIX: Final = struct.Struct(">4sI32s")
MAX_HEADER_BYTES: Final = 4 * 2**20
DEFAULT_CHUNK_BYTES: Final = 1 * 2**20
SNAPSHOTS_PATH: Final = "/v1/snapshots"
IMPORT_PATH: Final = "/v1/snapshots/import"
TICKET_HEADER: Final = "X-Kvgate-Ticket"


class TransferFailure(StrEnum):
    """Why a snapshot did not arrive; each is a recompute fallback with its own metric label."""

    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"  # no such ticket (taken already, expired, or the sender reset)
    SENDER_GONE = "sender_gone"  # the sender could not be reached or broke off
    CHECKSUM = "checksum"
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    LAYOUT_MISMATCH = "layout_mismatch"
    NO_HOST_ROOM = "no_host_room"
    BUSY = "busy"  # the receiver's staging area is full (backpressure)
    TIMEOUT = "timeout"
    RECEIVER_LOST = "receiver_lost"  # the receiver's session ended during the transfer
    NO_RECEIVER = "no_receiver"  # no ready executor takes snapshots


class TransferError(Exception):
    def __init__(self, failure: TransferFailure, message: str) -> None:
        super().__init__(f"{failure.value}: {message}")
        self.failure = failure
        self.message = message


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SnapshotLayout(_Frozen):
    """What must match between sender and receiver for their KV bytes to mean the same."""

    model_fingerprint: str
    block_size: Annotated[int, Field(ge=1)]
    num_planes: Annotated[int, Field(ge=1)]
    dtype: str
    num_layers: Annotated[int, Field(ge=1)]
    num_kv_heads: Annotated[int, Field(ge=1)]
    head_dim: Annotated[int, Field(ge=1)]

    def mismatch(self, other: SnapshotLayout) -> str | None:
        """The first field that differs from ``other`` (the receiver's), or None."""
        for name in type(self).model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} is {mine!r} in the snapshot, {theirs!r} here"
        return None


class SnapshotHeader(_Frozen):
    request_id: str
    layout: SnapshotLayout
    num_pages: Annotated[int, Field(ge=0)]
    state: dict[str, Any]  # the backend's request state (cursor, outputs, ...), JSON
    payload_bytes: Annotated[int, Field(ge=0)]
    payload_sha256: str


class SnapshotImport(_Frozen):
    """``POST /v1/snapshots/import``: fetch ``ticket`` from ``source`` (an executor's HTTP base)
    and stage it here for the plan that adopts it."""

    source: str
    ticket: Annotated[str, Field(min_length=16, max_length=128)]
    request_id: str


class SnapshotStaged(_Frozen):
    request_id: str
    num_pages: int
    num_blocks: int
    payload_bytes: int


class TransferRefusal(_Frozen):
    failure: TransferFailure
    message: str


def http_base(endpoint: str) -> str:
    """An executor's HTTP base from its step endpoint: ``ws://h:p/v1/steps`` -> ``http://h:p``."""
    scheme, _, rest = endpoint.partition("://")
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def encode(header_of: SnapshotHeader, payload: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """The frames of one snapshot: the header, then the payload in chunks."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    yield frame(header_of.model_dump_json().encode())
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_bytes):
        yield frame(bytes(view[start : start + chunk_bytes]))


def frame(payload: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def header(layout: SnapshotLayout, request_id: str, num_pages: int, state: dict[str, Any],
           payload: bytes) -> SnapshotHeader:  # fmt: skip
    return SnapshotHeader(
        request_id=request_id,
        layout=layout,
        num_pages=num_pages,
        state=state,
        payload_bytes=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
    )


class FrameDecoder:
    """Bytes in (any split), one checked snapshot out.

    ``max_bytes`` bounds the whole transfer (header and payload); ``layout`` is the receiver's
    and the header must match it before a payload byte is accepted.
    """

    def __init__(self, *, max_bytes: int, layout: SnapshotLayout | None = None) -> None:
        self._max_bytes = max_bytes
        self._layout = layout
        self._buffer = bytearray()
        self._received = 0
        self._header: SnapshotHeader | None = None
        self._payload = bytearray()
        self._digest = hashlib.sha256()
        self._frames = 0

    def feed(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self._max_bytes:
            raise TransferError(
                TransferFailure.TOO_LARGE, f"the transfer exceeds the limit of {self._max_bytes} B"
            )
        self._buffer += data
        while len(self._buffer) >= _PREFIX.size:
            magic, length, digest = _PREFIX.unpack_from(self._buffer)
            if magic != MAGIC:
                raise TransferError(TransferFailure.MALFORMED, "a frame does not start with KVS1")
            if self._header is None and length > MAX_HEADER_BYTES:
                raise TransferError(TransferFailure.TOO_LARGE, f"a {length} B snapshot header")
            end = _PREFIX.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[_PREFIX.size : end])
            del self._buffer[:end]
            if hashlib.sha256(payload).digest() != digest:
                raise TransferError(
                    TransferFailure.CHECKSUM, f"frame {self._frames} fails its sha256"
                )
            self._take(payload)
            self._frames += 1

    def _take(self, payload: bytes) -> None:
        if self._header is None:
            try:
                self._header = SnapshotHeader.model_validate_json(payload)
            except ValidationError as exc:
                raise TransferError(TransferFailure.MALFORMED, f"bad header: {exc}") from exc
            if self._header.payload_bytes + len(payload) > self._max_bytes:
                raise TransferError(
                    TransferFailure.TOO_LARGE,
                    f"a {self._header.payload_bytes} B snapshot exceeds the limit of "
                    f"{self._max_bytes} B",
                )
            if self._layout is not None:
                problem = self._header.layout.mismatch(self._layout)
                if problem is not None:
                    raise TransferError(TransferFailure.LAYOUT_MISMATCH, problem)
            return
        if len(self._payload) + len(payload) > self._header.payload_bytes:
            raise TransferError(TransferFailure.MALFORMED, "more payload than the header says")
        self._payload += payload
        self._digest.update(payload)

    def result(self) -> tuple[SnapshotHeader, bytes]:
        """The header and payload once every frame arrived; raises when the stream is short."""
        if self._header is None or self._buffer or len(self._payload) < self._header.payload_bytes:
            raise TransferError(TransferFailure.MALFORMED, "the transfer ended early")
        if self._digest.hexdigest() != self._header.payload_sha256:
            raise TransferError(TransferFailure.CHECKSUM, "the payload fails its sha256")
        return self._header, bytes(self._payload)


def decode(frames: bytes, *, max_bytes: int, layout: SnapshotLayout | None = None
           ) -> tuple[SnapshotHeader, bytes]:  # fmt: skip
    decoder = FrameDecoder(max_bytes=max_bytes, layout=layout)
    decoder.feed(frames)
    return decoder.result()
