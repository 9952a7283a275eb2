"""The gateway's pure parts: key comparison, the rate limit, streamed text, body mapping."""

from __future__ import annotations

import hmac
import random

import pytest

from kvgate.gateway import auth
from kvgate.gateway.auth import KeyRing, RateLimiter
from kvgate.gateway.detokenize import StreamText
from kvgate.gateway.openai_api import ApiError, ChatBody, CompletionBody, parse_body, to_request
from kvgate.gateway.settings import ApiKey
from kvgate.kafka_connection import KafkaConnection
from kvgate.protocol.records import ReplyTo

KEYS = [ApiKey(name=f"k{i}", key=f"sk-{i}-" + "x" * 20) for i in range(4)]
REPLY = ReplyTo(topic="kvgate.replies.test", partition=0)


def test_keys_match_exactly_and_every_key_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = KeyRing(KEYS, allow_anonymous=False)
    assert ring.authenticate(f"Bearer {KEYS[2].key}") == KEYS[2]
    for wrong in (
        None, "", "Bearer ", f"Bearer {KEYS[2].key}y", f"Bearer {(KEYS[2].key or '')[:-1]}",
        f"Basic {KEYS[2].key}", f"bearer {KEYS[2].key}",
    ):  # fmt: skip
        assert ring.authenticate(wrong) is None, wrong
    calls = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert ring.authenticate(f"Bearer {KEYS[0].key}") == KEYS[0]  # the first key matches...
    assert len(calls) == len(KEYS)  # ...and the loop still compares all of them


def test_anonymous_only_when_allowed() -> None:
    assert KeyRing([], allow_anonymous=True).authenticate(None) is auth.ANONYMOUS
    ring = KeyRing(KEYS, allow_anonymous=True)
    assert ring.authenticate("Bearer wrong-key-0123456789") is None  # a wrong key is not anonymous


def test_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    key = ApiKey(name="r", key="k" * 16, requests_per_s=2.0, burst=3)
    assert [limiter.take(key) for _ in range(3)] == [None, None, None]
    wait = limiter.take(key)
    assert wait == pytest.approx(0.5)
    now[0] += 0.5
    assert limiter.take(key) is None
    assert limiter.take(key) == pytest.approx(0.5)
    assert limiter.take(ApiKey(name="free", key="k" * 16)) is None  # no rate: no limit


class _Bytes:
    """A byte-level codec: token id = byte, decoded lossily (as tokenizers' byte-level decoder)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: object) -> str:
        raise NotImplementedError


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_is_always_a_prefix_of_the_final_text(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [p.encode() for p in ("a", "b", "é", "€", "😀", "\n", "ab")] + [b"\xff"]  # one invalid
    ids = [b for _ in range(rng.randint(1, 30)) for b in rng.choice(pieces)]
    full = bytes(ids).decode("utf-8", errors="replace")
    stops = rng.sample(["ab", "€\n", "b😀", "zz"], k=rng.randint(0, 2))
    cut = min((full.find(s) for s in stops if s in full), default=-1)
    final = full if cut < 0 else full[:cut]
    # the service stops at the token that completes the stop: stream only up to there
    stream = StreamText(_Bytes(), stops)
    sent = ""
    for i, token in enumerate(ids):
        sent += stream.add(token)
        assert final.startswith(sent), (sent, final)
        if cut >= 0 and any(s in bytes(ids[: i + 1]).decode(errors="replace") for s in stops):
            break
    sent += stream.finish(final)
    assert sent == final


def test_holding_back_nothing_would_leak_a_stop_prefix() -> None:
    """The rule the stream relies on, broken once: with no hold-back the first half of a stop
    string goes out before the stop is known."""
    stream = StreamText(_Bytes(), [])  # as if no stops were given
    sent = "".join(stream.add(t) for t in b"xyST")
    assert not "xy".startswith(sent)  # 'ST' would be a stop's start: it leaked
    held = StreamText(_Bytes(), ["STOP"])
    sent = "".join(held.add(t) for t in b"xyST")
    assert "xy".startswith(sent)


def _mapped(body: dict[str, object], chat: bool = False) -> object:
    parsed = parse_body(ChatBody if chat else CompletionBody, {"model": "m", **body})
    return to_request(parsed, request_id="r1", priority=3, default_max_tokens=99, reply=REPLY)


def test_mapping_to_the_record() -> None:
    m = _mapped({"prompt": ["hi"], "stop": "x", "temperature": 0.5, "top_k": -1, "seed": 9})
    r = m.request  # type: ignore[attr-defined]
    assert (r.prompt, r.stop, r.max_tokens, r.priority) == ("hi", ["x"], 16, 3)
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.seed) == (0.5, None, 9)
    assert r.reply == REPLY and not r.reply.tokens
    m = _mapped(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
         "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 5},
        chat=True,
    )  # fmt: skip
    r = m.request  # type: ignore[attr-defined]
    assert (r.messages[0].content, r.logprobs, r.max_tokens) == ("a", 4, 5)
    streamed = _mapped({"prompt": [1, 2], "stream": True}).request  # type: ignore[attr-defined]
    assert streamed.prompt == [1, 2] and streamed.reply.tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "nope": 1}, "nope"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
        ({"prompt": "a", "logit_bias": {"x": 2.0}}, "logit_bias"),
        ({"prompt": "", "max_tokens": 1}, "prompt"),
        ({"prompt": "a", "stop": ""}, "stop"),
        ({"prompt": "a", "top_k": -2}, "top_k"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_fields_are_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _mapped(body)
    assert caught.value.status == 400 and caught.value.param == param


async def test_not_connected_is_503_and_not_ready() -> None:
    """A gateway whose Kafka bridge is not up answers 503 (after auth), and /readyz says so."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvgate.gateway.server import Gateway
    from kvgate.gateway.settings import GatewaySettings, ModelRoute

    settings = GatewaySettings(
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:1"), models=[ModelRoute(name="m")],
        keys=KEYS[:1], open_health=True,
    )  # fmt: skip
    gateway = Gateway(settings)
    async with TestClient(TestServer(gateway.app(), host="127.0.0.1")) as http:
        headers = {"Authorization": f"Bearer {KEYS[0].key}"}
        body = {"model": "m", "prompt": "a"}
        response = await http.post("/v1/completions", json=body, headers=headers)
        assert response.status == 503
        assert (await response.json())["error"]["type"] == "server_error"
        assert (await http.post("/v1/completions", json=body)).status == 401
        assert (await http.get("/readyz")).status == 503
        assert (await http.get("/healthz")).status == 200


def test_keys_from_a_file_and_the_environment(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    from pydantic import ValidationError

    from kvgate.gateway.settings import API_KEY_ENV, load_keys

    folder = Path(str(tmp_path))
    secret = folder / "team-b"
    secret.write_text("sk-from-a-file-0123456789\n")
    keys_file = folder / "keys.yaml"
    keys_file.write_text(
        "keys:\n  - {name: a, key: sk-aaaaaaaaaaaaaaaa, min_priority: -5}\n"
        f"  - {{name: b, key_file: {secret}}}\n"
    )
    monkeypatch.setenv(API_KEY_ENV, "sk-from-the-env-0123456789")
    keys = load_keys(keys_file)
    assert [k.name for k in keys] == ["a", "b", "env"]
    ring = KeyRing(keys, allow_anonymous=False)
    assert ring.authenticate("Bearer sk-from-a-file-0123456789") == keys[1]
    assert ring.authenticate("Bearer sk-from-the-env-0123456789") == keys[2]
    assert keys[0].priority == 0 and keys[1].priority == 0
    for bad in (
        "keys:\n  - {name: a, key: short}\n",
        "keys:\n  - {name: a}\n",
        "keys:\n  - {name: a, key: sk-aaaaaaaaaaaaaaaa, default_priority: -1}\n",
        "keys:\n  - {name: a, key: sk-aaaaaaaaaaaaaaaa, bogus: 1}\n",
    ):
        keys_file.write_text(bad)
        with pytest.raises(ValidationError):
            load_keys(keys_file)


def test_incremental_text_equals_the_whole_decode_with_a_real_bpe_tokenizer() -> None:
    """A byte-level BPE tokenizer trained here (merges, spaces as Ġ, multi-byte characters
    split across tokens): the streamed deltas concatenate to the whole decode, the service's
    text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvgate.admission_service.tokenizer import FileTokenizer

    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café — 東京 😀 ok"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    codec = FileTokenizer(bpe)
    for text in ("the lazy café 東京 fox", "😀😀 naïve — the dog", " over  the\nquick"):
        ids = codec.encode(text)
        stream = StreamText(codec, [])
        sent = ""
        for token in ids:
            sent += stream.add(token)
            assert text.startswith(sent)
        assert sent == text  # all of it streamed: no stop strings, nothing cut at the end
        assert stream.finish(codec.decode(ids)) == ""
