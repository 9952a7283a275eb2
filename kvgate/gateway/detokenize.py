"""Streamed token ids to text deltas whose concatenation is a prefix of the final text.

The service's result text is the truth (``tokenizer.decode(all ids)`` with special tokens left
out, ending before a stop string). While streaming, the text is decoded again as ids arrive and
only a safe prefix is released: never a trailing U+FFFD (a UTF-8 character cut between tokens),
never the last ``len(longest stop) - 1`` characters (they may begin a stop string, which the
final text does not contain), and nothing from a stop string on once one is complete (the
token that completes it is streamed too). The rest comes from the result at the end.

Each token decodes the whole sequence again: O(n²) characters over a stream, fine for the
lengths served here; an incremental decoder (a window of recent ids, as vLLM keeps) would
make it linear.
"""

from __future__ import annotations

from kvgate.admission_service.tokenizer import TextCodec


class StreamText:
    def __init__(self, codec: TextCodec | None, stops: list[str]) -> None:
        self._codec = codec
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int) -> str:
        """The next delta (often empty) after ``token_id``."""
        self._ids.append(token_id)
        if self._codec is None:
            return ""
        # Complete characters first, then the hold-back: a cut character is not one of the
        # characters a stop string could still begin with.
        text = self._codec.decode(self._ids).rstrip("\ufffd")
        safe = text[: len(text) - self._holdback] if self._holdback else text
        for stop in self._stops:  # the token that completes a stop: the text ends before it
            at = text.find(stop, max(0, len(self.sent) - len(stop)))
            if at >= 0:
                safe = safe[:at]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The last delta: what ``final_text`` holds beyond what was sent."""
        if not final_text.startswith(self.sent):  # cannot happen for a prefix-stable decoder
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta
