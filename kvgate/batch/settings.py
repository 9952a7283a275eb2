"""The batch settings of the gateway and of the feeder, parsed at the boundary.

The limits default to OpenAI's for batch input files (200 MB, 50,000 requests); lines go at
``priority`` (the batch class: 100, below interactive traffic's 0..); each batch keeps at most
``window`` lines sent and unanswered (docs/batch.md has the bound this gives).
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.protocol.records import BATCH_PRIORITY, REPLY_TOPIC_PATTERN

TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")]
FILES_TOPIC: Final = "kvgate.files"
BATCHES_TOPIC: Final = "kvgate.batches"
REPLY_TOPIC: Final = "kvgate.replies.batches"
FEEDER_GROUP: Final = "kvgate-batch-feeders"
COMPLETION_WINDOW_S: Final = {"24h": 86_400}  # OpenAI's one window


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StoreKind(StrEnum):
    LOCAL = "local"  # a directory (kvgate run; one machine)
    S3 = "s3"  # an S3-compatible object store (the s3 extra)


class StoreSettings(_Strict):
    """Where file bytes live. ``local``: under ``path``. ``s3``: ``bucket`` at ``endpoint``
    (None: AWS's endpoint for ``region``), keys under ``prefix``; the credentials from the two
    files (a mounted Secret), else from the usual ``AWS_*`` variables."""

    kind: StoreKind
    path: Path | None = None
    endpoint: str | None = None
    bucket: Annotated[str, Field(min_length=3, max_length=63)] | None = None
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9._/-]*$", max_length=200)] = "kvgate"
    region: str = "us-east-1"
    access_key_id_file: Path | None = None
    secret_access_key_file: Path | None = None
    allow_http: bool = False  # an http:// endpoint (tests, a store inside the cluster)
    virtual_hosted_style: bool = False  # bucket.endpoint/key instead of endpoint/bucket/key
    # A multipart upload sends parts of this size, two at a time: an upload holds about three
    # parts in memory whatever the file's size.
    part_bytes: Annotated[int, Field(ge=5 * 2**20, le=512 * 2**20)] = 8 * 2**20

    @model_validator(mode="after")
    def _complete(self) -> Self:
        if self.kind is StoreKind.LOCAL and self.path is None:
            raise ValueError("a local store needs path")
        if self.kind is StoreKind.S3 and self.bucket is None:
            raise ValueError("an s3 store needs bucket")
        if (self.access_key_id_file is None) != (self.secret_access_key_file is None):
            raise ValueError("give both access_key_id_file and secret_access_key_file, or neither")
        return self


class BatchSettings(_Strict):
    store: StoreSettings
    files_topic: TopicName = FILES_TOPIC
    batches_topic: TopicName = BATCHES_TOPIC
    reply_topic: Annotated[str, Field(pattern=REPLY_TOPIC_PATTERN)] = REPLY_TOPIC
    # Partitions of the batch topic and of the reply topic (the same count: a feeder that owns
    # batch partition p reads reply partition p). Fixed once the topics exist.
    partitions: Annotated[int, Field(ge=1, le=1000)] = 6
    replication_factor: Annotated[int, Field(ge=1, le=32)] = 1  # of the topics created here
    # Feed batches in this process (the gateway's pods) or leave it to `kvgate batch-feeder`.
    feeder: bool = True
    feeder_group: Annotated[str, Field(min_length=1, max_length=249)] = FEEDER_GROUP
    # The batch class: every line's priority (lower is more important; interactive traffic
    # asks for 0..). A key whose min_priority is above it gets its min_priority instead.
    priority: int = BATCH_PRIORITY
    # Lines of one batch sent and not yet answered (backpressure: the next line goes when an
    # answer comes).
    window: Annotated[int, Field(ge=1, le=10_000)] = 32
    max_file_bytes: Annotated[int, Field(ge=1024, le=2**40)] = 200 * 1000 * 1000
    max_file_lines: Annotated[int, Field(ge=1, le=10_000_000)] = 50_000
    max_line_bytes: Annotated[int, Field(ge=1024, le=64 * 2**20)] = 2**20
    # A segment (output and error lines of consecutive input lines) is written when it has
    # this many lines or bytes, or is this old: what an answered line waits, at most, to be
    # durable, and what a restart repeats at most.
    segment_lines: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    segment_bytes: Annotated[int, Field(ge=1024, le=512 * 2**20)] = 8 * 2**20
    segment_age_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # After a cancel or expiry: how long answers to the lines already sent are waited for
    # (their aborts are sent at once) before the rest is written as cancelled or expired.
    abort_grace_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    # Uploads: the whole body within this time (a 200 MB file at 1 MB/s needs 200 s).
    upload_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 900.0
    # The reply topic keeps answers at least as long as a batch may run, and then some.
    reply_retention_ms: Annotated[int, Field(ge=86_400_000)] = 7 * 86_400_000
    # The feeder group's timings (the embedded broker needs short ones).
    session_timeout_ms: Annotated[int, Field(ge=1000)] = 10_000
    heartbeat_interval_ms: Annotated[int, Field(ge=100)] = 3_000
    fetch_max_wait_ms: Annotated[int, Field(ge=1, le=10_000)] = 500

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be at most a third of session_timeout_ms")
        return self
