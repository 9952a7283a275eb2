"""Malformed and hostile request records, generated from a seed, each with what must become of it.

Every generator returns a :class:`Message` whose ``expect``, ``codes`` and ``request_id`` say
what the service must do with it: dead-letter it with one of ``codes`` (and answer ``rejected``
under ``request_id`` when the service can read one — from the body, else from the key), or run
it. The kinds cover what the issue lists — truncated JSON, wrong types, huge prompts, negative
or huge ``max_tokens``, unknown fields, binary garbage, duplicate ids, bad trace context — and a
few more a hostile producer would try (tombstones, deep nesting, wrong schema versions, token
ids outside the vocabulary, requests no cache can hold, non-object JSON, huge records, records
larger than the service's own producer limit, byte-order marks, UTF-16/32 bodies, NaN and
Infinity, strings and booleans for numbers).

:func:`hostile_stream` interleaves them with valid requests; a duplicate follows the valid
request whose id it copies (right behind it, or up to 200 records later), in the same partition.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.admission_service.settings import LimitsSettings
from kvgate.protocol.records import RejectCode
from tests.reliability.traffic import Expect, Message

R = RejectCode
_PRODUCTION = LimitsSettings()


@dataclass(frozen=True)
class Limits:
    """The service limits the generators aim at: the production defaults (a smaller byte limit
    once hid that the service could not dead-letter its largest records)."""

    vocab_size: int = 512
    max_prompt_tokens: int = _PRODUCTION.max_prompt_tokens
    max_output_tokens: int = _PRODUCTION.max_output_tokens
    max_message_bytes: int = _PRODUCTION.max_message_bytes
    # An executor's whole cache holds fewer tokens than max_prompt_tokens + max_output_tokens.
    # Records over the service producer's own request limit (4 × max_message_bytes): their
    # dead letters are truncated copies.
    oversized_bytes: int = int(4.5 * 2**20)
    oversized_every: int = 500  # one such record per this many


def _bad(
    value: bytes | None, key: str | None, codes: set[RejectCode], label: str, rid: str | None
) -> Message:
    return Message(
        value=value,
        key=None if key is None else key.encode(),
        expect=Expect.DEAD_LETTER,
        request_id=rid,
        codes=frozenset(codes),
        label=label,
    )


def _body(rng: random.Random, rid: str, limits: Limits, **fields: Any) -> dict[str, Any]:
    body = {
        "request_id": rid,
        "prompt": [rng.randrange(limits.vocab_size) for _ in range(rng.randint(1, 12))],
        "max_tokens": rng.randint(1, 8),
        "sampling": {"ignore_eos": True, "seed": rng.randrange(100)},
    }
    return body | fields


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


# ------------------------------------------------------------------------- the kinds
# Each takes (rng, serial number, limits) and returns a bad Message. ``rid`` is readable; a key
# is sometimes absent, sometimes unreadable (then only a readable body id names the request).


def _key(rng: random.Random, rid: str) -> tuple[str | None, str | None]:
    """(record key, the id readable from the key): present, absent, or not a valid id."""
    roll = rng.random()
    if roll < 0.6:
        return rid, rid
    if roll < 0.8:
        return None, None
    return f"bad key {rid}!", None


def truncated_json(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"trunc-{n}"
    raw = _json(_body(rng, rid, limits))
    key, key_id = _key(rng, rid)
    return _bad(raw[: rng.randrange(1, len(raw) - 1)], key, {R.MALFORMED_JSON}, "truncated", key_id)


def binary_garbage(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"garbage-{n}"
    raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
    if raw[:1].isdigit() or raw[:1] in b'[{"-tfn \t\r\n':  # could parse as JSON: make it not
        raw = b"\xff" + raw
    key, key_id = _key(rng, rid)
    return _bad(raw, key, {R.MALFORMED_JSON}, "garbage", key_id)


def tombstone(rng: random.Random, n: int, limits: Limits) -> Message:
    key, key_id = _key(rng, f"tomb-{n}")
    # A record needs a key or a value: a keyless tombstone gets a key that names no request.
    return _bad(None, key or f"\x00tomb {n}", {R.MALFORMED_JSON}, "tombstone", key_id)


def deep_nesting(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"deep-{n}"
    depth = rng.choice([2_000, 20_000, 40_000])  # 2 × depth bytes: the last is too large
    inner = b"[" * depth + b"1" + b"]" * depth
    raw = b'{"request_id": "' + rid.encode() + b'", "prompt": ' + inner + b"}"
    key, key_id = _key(rng, rid)
    code = R.TOO_LARGE if len(raw) > limits.max_message_bytes else R.MALFORMED_JSON
    # Nested beyond any parser's depth: only the key can name it.
    return _bad(raw, key, {code}, "deep nesting", key_id)


def not_an_object(rng: random.Random, n: int, limits: Limits) -> Message:
    value = rng.choice([[1, 2, 3], "a string", 42, 3.5, None, True, []])
    key, key_id = _key(rng, f"notobj-{n}")
    return _bad(_json(value), key, {R.SCHEMA}, "not an object", key_id)


def wrong_types(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"types-{n}"
    wrong: dict[str, Any] = rng.choice(
        [
            {"max_tokens": "ten"},
            {"max_tokens": 2.5},
            {"max_tokens": [4]},
            {"prompt": [1, "two", 3]},
            {"prompt": {"tokens": [1, 2]}},
            {"prompt": []},
            {"prompt": [-1, 2]},
            {"priority": "high"},
            {"sampling": "greedy"},
            {"sampling": {"temperature": "hot"}},
            {"sampling": {"top_p": 0.0}},
            {"loops": [1, 2]},
            {"deadline_unix_s": "tomorrow"},
            {"max_tokens": "4"},  # wire types are strict: no strings or booleans for numbers
            {"max_tokens": True},
            {"priority": False},
            {"sampling": {"seed": 1.0}},
            {"schema_version": True},
        ]
    )
    key, _ = _key(rng, rid)
    return _bad(_json(_body(rng, rid, limits, **wrong)), key, {R.SCHEMA}, "wrong type", rid)


def bad_encoding(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"encoding-{n}"
    text = json.dumps(_body(rng, rid, limits))
    raw = rng.choice(
        [
            b"\xef\xbb\xbf" + text.encode(),  # a UTF-8 byte-order mark
            text.encode("utf-16"),
            text.encode("utf-16-be"),
            text.encode("utf-32"),
            text.replace('"max_tokens": ', '"deadline_unix_s": Infinity, "max_tokens": ').encode(),
            text.replace('"max_tokens": ', '"deadline_unix_s": NaN, "max_tokens": ').encode(),
        ]
    )
    key, key_id = _key(rng, rid)
    return _bad(raw, key, {R.MALFORMED_JSON}, "bad encoding", key_id)


def oversized(rng: random.Random, n: int, limits: Limits) -> Message:
    """Larger than the service's own producer accepts: answered, its dead letter truncated."""
    rid = f"oversized-{n}"
    raw = b'{"request_id": "' + rid.encode() + b'", "prompt": "' + b"x" * limits.oversized_bytes
    key, key_id = _key(rng, rid)
    return _bad(raw + b'"}', key, {R.TOO_LARGE}, "oversized", key_id)


def id_of_wrong_type(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"idtype-{n}"
    body = _body(rng, rid, limits, request_id=rng.choice([n, None, ["x"], "", "has space", "é"]))
    key, key_id = _key(rng, rid)
    return _bad(_json(body), key, {R.SCHEMA}, "bad id", key_id)


def unknown_fields(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"unknown-{n}"
    extra = rng.choice(
        [{"tempreature": 0.5}, {"model": "gpt"}, {"sampling": {"seed": 1, "beam": 4}}, {"": 1}]
    )
    key, _ = _key(rng, rid)
    return _bad(_json(_body(rng, rid, limits, **extra)), key, {R.SCHEMA}, "unknown field", rid)


def bad_max_tokens(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"maxtok-{n}"
    value, codes = rng.choice(
        [
            (0, {R.SCHEMA}),
            (-rng.randint(1, 10**6), {R.SCHEMA}),
            (limits.max_output_tokens + rng.randint(1, 10**6), {R.MAX_TOKENS_TOO_LARGE}),
            (2**80, {R.MAX_TOKENS_TOO_LARGE}),
        ]
    )
    key, _ = _key(rng, rid)
    body = _json(_body(rng, rid, limits, max_tokens=value))
    return _bad(body, key, codes, "bad max_tokens", rid)


def huge_prompt(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"huge-{n}"
    key, key_id = _key(rng, rid)
    if rng.random() < 0.5:  # over the token limit, under the byte limit
        prompt = [rng.randrange(limits.vocab_size) for _ in range(limits.max_prompt_tokens + 1)]
        return _bad(
            _json(_body(rng, rid, limits, prompt=prompt)), key, {R.PROMPT_TOO_LONG}, "long", rid
        )
    # over the byte limit: dead-lettered unread, so only the key can name it
    prompt = [7] * (limits.max_message_bytes // 3 + rng.randint(1, 5000))
    return _bad(_json(_body(rng, rid, limits, prompt=prompt)), key, {R.TOO_LARGE}, "huge", key_id)


def out_of_range(rng: random.Random, n: int, limits: Limits) -> Message:
    rid = f"range-{n}"
    fields, codes, label = rng.choice(
        [
            ({"priority": 10**6}, {R.PRIORITY_OUT_OF_RANGE}, "priority"),
            ({"priority": -(10**6)}, {R.PRIORITY_OUT_OF_RANGE}, "priority"),
            ({"prompt": [limits.vocab_size + 5]}, {R.TOKEN_OUT_OF_VOCABULARY}, "vocabulary"),
            ({"schema_version": 2}, {R.UNSUPPORTED_VERSION}, "version"),
            ({"schema_version": "1"}, {R.SCHEMA}, "version type"),
            ({"prompt": "text without a tokenizer"}, {R.TEXT_WITHOUT_TOKENIZER}, "text"),
            (
                {
                    "prompt": [1] * limits.max_prompt_tokens,
                    "max_tokens": limits.max_output_tokens,
                },
                {R.INFEASIBLE},
                "infeasible",
            ),
        ]
    )
    key, _ = _key(rng, rid)
    return _bad(_json(_body(rng, rid, limits, **fields)), key, codes, label, rid)


BAD_KINDS: list[Callable[[random.Random, int, Limits], Message]] = [
    truncated_json,
    binary_garbage,
    tombstone,
    deep_nesting,
    not_an_object,
    wrong_types,
    bad_encoding,
    id_of_wrong_type,
    unknown_fields,
    bad_max_tokens,
    huge_prompt,
    out_of_range,
]

BAD_TRACEPARENTS = [
    b"",
    b"garbage",
    b"00-xyz-abc-01",
    b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
    b"00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
    b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    b"\xff\xfe\x00binary",
    "00-é".encode(),
    b"00-" + b"a" * 4096,
]


def valid_request(
    rng: random.Random, n: int, limits: Limits, *, max_tokens: tuple[int, int] = (4, 24)
) -> dict[str, Any]:
    return {
        "request_id": f"ok-{n}",
        "prompt": [rng.randrange(limits.vocab_size) for _ in range(rng.randint(4, 40))],
        "max_tokens": rng.randint(*max_tokens),
        "priority": rng.randint(-3, 3),
        "sampling": {"ignore_eos": True, "seed": rng.randrange(1000)},
    }


def hostile_stream(
    total: int, *, seed: int, limits: Limits, valid_share: float = 0.25
) -> tuple[list[Message], list[dict[str, Any]]]:
    """``total`` records: valid requests (about ``valid_share`` of them, some with hostile
    trace headers, some followed by a duplicate of their id) among bad ones. Returns the
    records and the valid bodies (the reference is computed from those)."""
    rng = random.Random(seed)
    messages: list[Message] = []
    bodies: list[dict[str, Any]] = []
    later: list[tuple[int, Message]] = []  # (insert once this many records are out, record)
    n = 0
    while len(messages) < total:
        n += 1
        if n % limits.oversized_every == 0:
            messages.append(oversized(rng, n, limits))
            continue
        if rng.random() >= valid_share:
            kind = BAD_KINDS[n % len(BAD_KINDS)]
            messages.append(kind(rng, n, limits))
            continue
        body = valid_request(rng, n, limits)
        bodies.append(body)
        headers: tuple[tuple[str, bytes], ...] = ()
        label = "valid"
        roll = rng.random()
        if roll < 0.3:
            headers = (("traceparent", rng.choice(BAD_TRACEPARENTS)),)
            label = "bad trace context"
        elif roll < 0.4:  # the control: a well-formed context must be continued
            trace_id, span_id = rng.getrandbits(128) | 1, rng.getrandbits(64) | 1
            headers = (("traceparent", f"00-{trace_id:032x}-{span_id:016x}-01".encode()),)
            label = "trace context"
        messages.append(Message.request(body, headers=headers, label=label))
        if rng.random() < 0.15:
            # The same id again (same key, same partition), right behind it or later: in flight
            # or answered, it is a duplicate — dead-lettered, and no second answer.
            duplicate = Message.request(body, label="duplicate id")
            copy = Message(
                duplicate.value,
                duplicate.key,
                expect=Expect.DUPLICATE,
                request_id=duplicate.request_id,
                codes=frozenset({R.DUPLICATE}),
                label="duplicate id",
            )
            if rng.random() < 0.5:
                messages.append(copy)
            else:
                later.append((len(messages) + rng.randint(20, 200), copy))
                later.sort(key=lambda item: item[0])
        while later and later[0][0] <= len(messages):
            messages.append(later.pop(0)[1])
    return messages[:total], bodies
