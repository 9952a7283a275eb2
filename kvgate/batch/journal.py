"""What the batch topics hold, and the one fold of them that every reader uses.

``kvgate.files`` (compacted, key = file id): a :class:`FileRecord` per file, a tombstone when it
is deleted. ``kvgate.batches`` (compacted, N partitions; every record of a batch goes to the
partition :func:`partition_of` names, set explicitly by the producer):

```
key batch/<id>   BatchRecord   written once by the gateway (epoch 0: the creation), then only
                               by the feeder that owns the partition (its claim's epoch)
key cancel/<id>  CancelRecord  written by the gateway on POST /v1/batches/<id>/cancel
key claim/<p>    ClaimRecord   written by a feeder when it takes partition p: epoch = 1 + the
                               highest it read there
```

Ownership is the feeder group's partition assignment; the epochs fence a member that lost its
partition without knowing it yet (its session expired while it kept writing): a ``BatchRecord``
whose epoch is below the partition's current claim is stale, and :class:`BatchTable` ignores
it. The stale writer sees the newer claim on the partition it still reads and stops; the owner
writes the batch's state again when it sees a stale record (the last word is the owner's, also
after compaction).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from kvgate.batch.objects import (
    BatchError,
    BatchStatus,
    Endpoint,
    FilePurpose,
    Metadata,
    RequestCounts,
    Usage,
)


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileRecord(_Record):
    kind: Literal["file"] = "file"
    id: str
    owner: str  # the API key's name: only it sees the file
    filename: str
    purpose: FilePurpose
    bytes: int
    lines: int  # lines that are not blank
    created_at: int
    expires_at: int | None = None

    def api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose.value,
            "status": "processed",
            "status_details": None,
        }


class Checkpoint(_Record):
    """How far a batch is, durably.

    ```
    input lines  0 ........ next_line ........................................ end
                 [segments written      ][sent, or answered and not yet written][unread]
                  ends: segment_ends      answers readable from results_from on
    ```

    Every line below ``next_line`` has its output or error line in a written segment (segment
    i holds lines ``[segment_ends[i-1], segment_ends[i])``, the first from 0); ``next_byte`` is
    where line ``next_line`` starts in the input file. Every answer to a line at or above it
    that has arrived is in the batch reply partition at ``results_from`` or later (None:
    nothing sent yet). Counts and usage are those of the written segments.
    """

    next_line: int = 0
    next_byte: int = 0
    segment_ends: list[int] = Field(default_factory=list)
    completed: int = 0
    failed: int = 0
    usage: Usage = Usage()
    results_from: int | None = None


class BatchRecord(_Record):
    kind: Literal["batch"] = "batch"
    id: str
    owner: str
    endpoint: Endpoint
    input_file_id: str
    completion_window: str
    metadata: Metadata | None = None
    output_expires_after_s: int | None = None  # of the output and error files (from creation)
    priority: int  # of every line's request (the batch class; never above the key's limit)
    status: BatchStatus
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0  # lines that are not blank, known once validated
    errors: list[BatchError] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    checkpoint: Checkpoint = Checkpoint()
    epoch: int = 0  # the claim it was written under; 0: the gateway's creation

    def api(self, cancel: CancelRecord | None = None) -> dict[str, Any]:
        """OpenAI's batch object; a cancel the owner has not acted on yet shows as
        ``cancelling`` (it is durable: the owner acts on it whenever it runs)."""
        status, cancelling_at = self.status, self.cancelling_at
        if cancel is not None and not status.terminal and status is not BatchStatus.CANCELLING:
            status, cancelling_at = BatchStatus.CANCELLING, cancel.requested_at
        point = self.checkpoint
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint.value,
            "errors": (
                None
                if self.errors is None
                else {"object": "list", "data": [e.model_dump() for e in self.errors]}
            ),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": RequestCounts(
                total=self.total, completed=point.completed, failed=point.failed
            ).model_dump(),
            "metadata": self.metadata,
            "model": None,
            "usage": point.usage.api(),
        }


class CancelRecord(_Record):
    kind: Literal["cancel"] = "cancel"
    batch_id: str
    requested_at: int


class ClaimRecord(_Record):
    kind: Literal["claim"] = "claim"
    partition: int
    epoch: int
    owner: str  # the feeder's member name, for logs


JournalRecord = Annotated[BatchRecord | CancelRecord | ClaimRecord, Field(discriminator="kind")]
_JOURNAL: TypeAdapter[BatchRecord | CancelRecord | ClaimRecord] = TypeAdapter(JournalRecord)
_FILE: TypeAdapter[FileRecord] = TypeAdapter(FileRecord)


def parse_journal(value: bytes) -> BatchRecord | CancelRecord | ClaimRecord:
    return _JOURNAL.validate_json(value)


def parse_file(value: bytes) -> FileRecord:
    return _FILE.validate_json(value)


def encode(record: _Record) -> bytes:
    return record.model_dump_json().encode()


def batch_key(batch_id: str) -> bytes:
    return f"batch/{batch_id}".encode()


def cancel_key(batch_id: str) -> bytes:
    return f"cancel/{batch_id}".encode()


def claim_key(partition: int) -> bytes:
    return f"claim/{partition}".encode()


def partition_of(batch_id: str, partitions: int) -> int:
    """The batch topic's partition of every record of ``batch_id`` (and the reply partition of
    its lines): a stable hash, the same in every process and version."""
    digest = hashlib.blake2b(batch_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


class Applied(Enum):
    TAKEN = "taken"
    STALE = "stale"  # a batch record under an older claim than the partition's: ignored
    KNOWN = "known"  # a second creation or cancel of the same batch: ignored


@dataclass
class BatchTable:
    """The fold of ``kvgate.batches``: the latest accepted record of every batch, its cancel,
    and each partition's claim. Pure: the gateway's view and each feeder apply the records of
    the partitions they read, in offset order."""

    batches: dict[str, BatchRecord] = field(default_factory=dict)
    cancels: dict[str, CancelRecord] = field(default_factory=dict)
    claims: dict[int, ClaimRecord] = field(default_factory=dict)

    def epoch(self, partition: int) -> int:
        claim = self.claims.get(partition)
        return 0 if claim is None else claim.epoch

    def apply(self, partition: int, record: BatchRecord | CancelRecord | ClaimRecord) -> Applied:
        if isinstance(record, ClaimRecord):
            if record.epoch <= self.epoch(partition):
                return Applied.STALE
            self.claims[partition] = record
            return Applied.TAKEN
        if isinstance(record, CancelRecord):
            if record.batch_id in self.cancels:
                return Applied.KNOWN
            self.cancels[record.batch_id] = record
            return Applied.TAKEN
        if record.epoch == 0:
            if record.id in self.batches:
                return Applied.KNOWN
        elif record.epoch < self.epoch(partition):
            return Applied.STALE
        self.batches[record.id] = record
        return Applied.TAKEN
