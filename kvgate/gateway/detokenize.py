"""Streamed token ids to text deltas whose concatenation is a prefix of the final text.

The service's result text is the truth (the whole output decoded, special tokens left out,
ending before a stop string). While streaming, text is decoded incrementally and only a safe
prefix is released: never a trailing U+FFFD (a UTF-8 character cut between tokens), never the
last ``len(longest stop) - 1`` characters (they may begin a stop string, which the final text
does not contain), and nothing from a stop string on once one is complete (the token that
completes it is streamed too). The rest comes from the result at the end.

Incremental decoding (the offsets vLLM's detokenizer keeps)::

    ids:   [ ....... decoded ....... | prefix ... | read ... new ]
                                     ^prefix_at   ^read_at
    delta = decode(ids[prefix_at:]) minus decode(ids[prefix_at:read_at])

A few tokens of context before the new ones let the tokenizer place spaces and join bytes as it
would in the whole text, and each token costs a short decode instead of the whole sequence.
"""

from __future__ import annotations

from kvgate.admission_service.tokenizer import TextCodec


class StreamText:
    def __init__(self, codec: TextCodec | None, stops: list[str]) -> None:
        self._codec = codec
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix_at = 0
        self._read_at = 0
        self._text = ""  # everything decoded so far (complete characters)
        self.sent = ""

    def _decode_new(self) -> None:
        assert self._codec is not None
        prefix = self._codec.decode(self._ids[self._prefix_at : self._read_at])
        whole = self._codec.decode(self._ids[self._prefix_at :])
        if len(whole) > len(prefix) and not whole.endswith("\ufffd"):
            self._text += whole[len(prefix) :]
            self._prefix_at = self._read_at
            self._read_at = len(self._ids)

    def add(self, token_id: int) -> str:
        """The next delta (often empty) after ``token_id``."""
        self._ids.append(token_id)
        if self._codec is None:
            return ""
        self._decode_new()
        text = self._text
        safe_len = len(text) - self._holdback
        for stop in self._stops:  # the token that completes a stop: the text ends before it
            at = text.find(stop, max(0, len(self.sent) - len(stop)))
            if at >= 0:
                safe_len = min(safe_len, at)
        if safe_len <= len(self.sent):
            return ""
        delta = text[len(self.sent) : safe_len]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The last delta: what ``final_text`` holds beyond what was sent."""
        if not final_text.startswith(self.sent):  # a decoder that is not prefix-stable
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
