"""``kvgate replay``: a window of the request log through the simulator (docs/workloads.md).

Exit codes: 0 when the replay passed (as ``kvgate sim`` judges it) and, with ``--spans``, its
step decisions equal the recorded ones; 1 otherwise; 2 for bad arguments, settings, spans file
or an unreadable log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError

from kvgate.admission_service.settings import KafkaSettings, load_settings
from kvgate.admission_service.tokenizer import TextCodec, load_tokenizer
from kvgate.kafka_connection import SettingsError
from kvgate.protocol import topics
from kvgate.sim.backend import SimExecutorConfig, add_config_arguments, config_from_arguments
from kvgate.sim.replay import build_workload, load_pool_settings, run_replay
from kvgate.sim.replay_log import parse_position, read_window_sync
from kvgate.sim.replay_spans import first_divergence, load_recorded_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True, metavar="HOST:PORT")
    parser.add_argument("--topic", default=topics.REQUESTS)
    parser.add_argument(
        "--from",
        dest="start",
        required=True,
        metavar="TIMESTAMP|OFFSET",
        help="first record: an offset (every partition), P:O pairs, or an ISO 8601 time",
    )
    parser.add_argument("--to", dest="end", metavar="TIMESTAMP|OFFSET", help="end (exclusive)")
    parser.add_argument(
        "--config", type=Path, help="the admission service's settings file or an ExecutorPool"
    )
    parser.add_argument("--spans", type=Path, help="recorded spans (OTLP JSON or JSON lines)")
    parser.add_argument("--spans-executor", help="the executor whose steps --spans compares")
    parser.add_argument("--out", type=Path, help="write the report here (JSON)")
    parser.add_argument("--workload-out", type=Path, help="write the replayed workload file")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for text prompts")
    parser.add_argument(
        "--step-ms", type=float, default=10.0, help="milliseconds of arrival time per step"
    )
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--no-check", action="store_true", help="skip per-step invariant checks")
    add_config_arguments(
        parser.add_argument_group("the simulated executor (the pool's cache geometry)")
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.step_ms <= 0:
            raise ValueError("--step-ms must be positive")
        start = parse_position(args.start)
        end = None if args.end is None else parse_position(args.end)
        pool = load_pool_settings(args.config)
        kafka = _kafka_settings(args.config, args.bootstrap)
        executor = _executor(args)
        tokenizer: TextCodec | None = None
        if args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        recorded = (
            None
            if args.spans is None
            else load_recorded_steps(args.spans, executor=args.spans_executor)
        )
        window = read_window_sync(kafka, args.topic, start, end)
        replay_input = build_workload(
            window.records,
            pool,
            executor,
            step_ms=args.step_ms,
            tokenizer=tokenizer,
            max_steps=args.max_steps,
        )
    except (
        ValueError,  # LogPositionError, PoolSettingsError, SpansFileError, TokenizerError
        SettingsError,
        KafkaError,
        OSError,
    ) as exc:
        print(f"kvgate replay: {exc}", file=sys.stderr)
        return 2
    if args.workload_out is not None:
        args.workload_out.write_text(
            json.dumps(replay_input.workload.model_dump(mode="json"), indent=2) + "\n"
        )
    result = run_replay(replay_input.workload, check=not args.no_check)
    divergence = None if recorded is None else first_divergence(recorded, result.decisions)
    report: dict[str, Any] = {
        "source": {
            "topic": window.topic,
            "partitions": {str(p): list(b) for p, b in sorted(window.bounds.items())},
            "settings": pool.source,
            "step_ms": args.step_ms,
            "first_timestamp_ms": replay_input.first_timestamp_ms,
        },
        "records": replay_input.records,
        "replayed": len(replay_input.workload.requests),
        "rejected_records": dict(sorted(replay_input.rejections.items())),
        "rejected_record_reasons": replay_input.rejected,
        "skipped_text_prompts": replay_input.skipped_text,
        "sim": result.report.to_json(),
    }
    if recorded is not None:
        report["spans"] = {
            "recorded_steps": len(recorded),
            "replayed_steps": len(result.decisions),
            "matched": divergence is None,
            "first_divergence": None if divergence is None else divergence.to_json(),
        }
    text = json.dumps(report, indent=2, sort_keys=True)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    if divergence is not None:
        print(
            f"kvgate replay: step {divergence.step_id} (index {divergence.index}) differs in "
            f"{divergence.field}: recorded {divergence.expected}, replayed {divergence.got}",
            file=sys.stderr,
        )
    return 0 if result.report.passed and divergence is None else 1


def _kafka_settings(config: Path | None, bootstrap: str) -> KafkaSettings:
    """The settings file's Kafka security (TLS, SASL) when it has a kafka section; always the
    ``--bootstrap`` given."""
    if config is not None:
        try:
            service = load_settings(config, overrides=None)
        except SettingsError:
            service = None  # no kafka section (or an ExecutorPool): plaintext
        if service is not None:
            return service.kafka.model_copy(update={"bootstrap_servers": bootstrap})
    try:
        return KafkaSettings(bootstrap_servers=bootstrap, client_id="kvgate-replay")
    except ValidationError as exc:
        raise ValueError(f"--bootstrap {bootstrap!r}: {exc.errors()[0]['msg']}") from None


def _executor(args: argparse.Namespace) -> SimExecutorConfig:
    try:
        return config_from_arguments(args)
    except ValidationError as exc:
        raise ValueError(f"invalid simulated executor: {exc}") from None
