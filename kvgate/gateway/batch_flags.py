"""The batch flags of ``kvgate gateway`` and ``kvgate batch-feeder``: one definition for both.

Batches are on when a store is named: ``--batch-store local --batch-store-path DIR``, or
``--batch-store s3 --batch-s3-bucket B [--batch-s3-endpoint URL ...]`` (credentials from the two
files, a mounted Secret, else the ``AWS_*`` variables).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvgate.batch.settings import BatchSettings, StoreKind, StoreSettings

_DEFAULTS = BatchSettings(store=StoreSettings(kind=StoreKind.LOCAL, path=Path(".")))


def add_batch_arguments(parser: argparse.ArgumentParser, *, feeder_flag: bool) -> None:
    group = parser.add_argument_group("batches (/v1/files, /v1/batches; docs/batch.md)")
    group.add_argument(
        "--batch-store", choices=[k.value for k in StoreKind],
        help="where batch files live (default: no batches)",
    )  # fmt: skip
    group.add_argument("--batch-store-path", type=Path, help="the directory (local store)")
    group.add_argument("--batch-s3-endpoint", help="e.g. https://s3.example.com (default: AWS)")
    group.add_argument("--batch-s3-bucket")
    group.add_argument("--batch-s3-prefix", default=_DEFAULTS.store.prefix)
    group.add_argument("--batch-s3-region", default=_DEFAULTS.store.region)
    group.add_argument("--batch-s3-access-key-id-file", type=Path)
    group.add_argument("--batch-s3-secret-access-key-file", type=Path)
    group.add_argument("--batch-s3-allow-http", action="store_true")
    group.add_argument("--batch-s3-virtual-hosted-style", action="store_true")
    d = _DEFAULTS
    group.add_argument("--batch-topic", default=d.batches_topic, help="batch records")
    group.add_argument("--batch-files-topic", default=d.files_topic, help="file records")
    group.add_argument("--batch-reply-topic", default=d.reply_topic, help="the lines' answers")
    group.add_argument("--batch-feeder-group", default=d.feeder_group)
    group.add_argument("--batch-partitions", type=int, default=d.partitions)
    group.add_argument("--batch-replication-factor", type=int, default=d.replication_factor)
    group.add_argument(
        "--batch-priority", type=int, default=d.priority,
        help="every batch line's priority: the batch class (lower is more important)",
    )  # fmt: skip
    group.add_argument(
        "--batch-window", type=int, default=d.window,
        help="lines of one batch sent and not yet answered, at most",
    )  # fmt: skip
    group.add_argument("--batch-max-file-bytes", type=int, default=d.max_file_bytes)
    group.add_argument("--batch-max-file-lines", type=int, default=d.max_file_lines)
    group.add_argument("--batch-max-line-bytes", type=int, default=d.max_line_bytes)
    group.add_argument("--batch-abort-grace-s", type=float, default=d.abort_grace_s)
    group.add_argument(
        "--batch-segment-lines", type=int, default=d.segment_lines,
        help="answers written (and the batch's progress shown) every this many lines",
    )  # fmt: skip
    group.add_argument("--batch-segment-age-s", type=float, default=d.segment_age_s)
    group.add_argument("--batch-session-timeout-ms", type=int, default=d.session_timeout_ms)
    group.add_argument("--batch-heartbeat-interval-ms", type=int, default=d.heartbeat_interval_ms)
    if feeder_flag:
        group.add_argument(
            "--batch-feeder", action=argparse.BooleanOptionalAction, default=True,
            help="feed batches in this process (off: `kvgate batch-feeder` does)",
        )  # fmt: skip


def batch_settings_from(args: argparse.Namespace) -> BatchSettings | None:
    if args.batch_store is None:
        return None
    store = StoreSettings(
        kind=StoreKind(args.batch_store), path=args.batch_store_path,
        endpoint=args.batch_s3_endpoint, bucket=args.batch_s3_bucket,
        prefix=args.batch_s3_prefix, region=args.batch_s3_region,
        access_key_id_file=args.batch_s3_access_key_id_file,
        secret_access_key_file=args.batch_s3_secret_access_key_file,
        allow_http=args.batch_s3_allow_http,
        virtual_hosted_style=args.batch_s3_virtual_hosted_style,
    )  # fmt: skip
    return BatchSettings(
        store=store, batches_topic=args.batch_topic, files_topic=args.batch_files_topic,
        reply_topic=args.batch_reply_topic, feeder_group=args.batch_feeder_group,
        partitions=args.batch_partitions, segment_lines=args.batch_segment_lines,
        segment_age_s=args.batch_segment_age_s,
        replication_factor=args.batch_replication_factor, priority=args.batch_priority,
        window=args.batch_window, max_file_bytes=args.batch_max_file_bytes,
        max_file_lines=args.batch_max_file_lines, max_line_bytes=args.batch_max_line_bytes,
        abort_grace_s=args.batch_abort_grace_s, session_timeout_ms=args.batch_session_timeout_ms,
        heartbeat_interval_ms=args.batch_heartbeat_interval_ms,
        feeder=getattr(args, "batch_feeder", True),
    )  # fmt: skip
