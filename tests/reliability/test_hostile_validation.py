"""Every hostile record of the fuzz scenario, through validation alone (in-process, fast): the
verdict each generator promises, and never an exception.

Regression (found by scenario 5): JSON nested deeper than the parser's recursion limit raised
``RecursionError`` out of validation. The intake loop died with it and the service exited; its
offset was never committed, so a restarted service read the same record and died again — one
40 KB record stopped the whole pool (the abort reader had the same weakness).
"""

from __future__ import annotations

import pytest

from kvgate.admission_service.settings import LimitsSettings
from kvgate.admission_service.validation import (
    Accepted,
    RawRecord,
    Rejection,
    validate_abort,
    validate_request,
)
from kvgate.protocol.records import RejectCode
from tests.reliability.fuzz import Limits, hostile_stream
from tests.reliability.traffic import Expect

LIMITS = Limits()
SETTINGS = LimitsSettings(
    max_prompt_tokens=LIMITS.max_prompt_tokens,
    max_output_tokens=LIMITS.max_output_tokens,
    max_message_bytes=LIMITS.max_message_bytes,
)
# Decided where the knowledge lives, at placement: validation lets these through.
AT_PLACEMENT = {RejectCode.INFEASIBLE, RejectCode.TOKEN_OUT_OF_VOCABULARY, RejectCode.DUPLICATE}


@pytest.mark.parametrize("depth", [1_000, 5_000, 30_000])
def test_deeply_nested_json_is_a_dead_letter_not_a_crash(depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    record = RawRecord(
        "requests", 0, 7, b"deep-1", b'{"request_id": "deep-1", "prompt": ' + nested + b"}"
    )
    verdict = validate_request(record, SETTINGS, None)
    assert isinstance(verdict, Rejection)
    assert verdict.code is RejectCode.MALFORMED_JSON and verdict.request_id == "deep-1"
    abort = validate_abort(RawRecord("aborts", 0, 1, None, nested), 1 << 20)
    assert isinstance(abort, Rejection) and abort.code is RejectCode.MALFORMED_JSON


def test_every_generated_record_gets_the_promised_verdict() -> None:
    messages, _ = hostile_stream(3_000, seed=1, limits=LIMITS)
    wrong: list[str] = []
    for offset, message in enumerate(messages):
        record = RawRecord("requests", 0, offset, message.key, message.value, message.headers)
        verdict = validate_request(record, SETTINGS, None)
        rejected_here = message.expect is Expect.DEAD_LETTER and not message.codes <= AT_PLACEMENT
        if not rejected_here:
            if not isinstance(verdict, Accepted):
                wrong.append(f"{message.label} at {offset}: rejected ({verdict.reason})")
        elif not isinstance(verdict, Rejection):
            wrong.append(f"{message.label} at {offset}: accepted")
        elif verdict.code not in message.codes or verdict.request_id != message.request_id:
            wrong.append(
                f"{message.label} at {offset}: {verdict.code}/{verdict.request_id!r}, expected "
                f"{sorted(message.codes)}/{message.request_id!r}"
            )
        elif not verdict.reason.strip():
            wrong.append(f"{message.label} at {offset}: no reason")
    assert not wrong, f"{len(wrong)} wrong verdicts, e.g. {wrong[:5]}"
