"""The token stop rule: when a request's generation ends, and why. One rule, four readers.

The scheduler finishes requests by it (and reports the reason), the batch planner asks it
whether an in-flight token will be the last, and every executor — the real one and the
simulator — marks a request finished by it, so that a decode row planned for a request the
executor already considers done is skipped rather than run. If these disagreed, the scheduler
would plan rows the executor refuses (``skipped_request_ids``) or wait for tokens that never come.

After a request's ``n``-th output (``n`` counts from 1) with token id ``t``::

    n >= min_tokens and t is the EOS id (ignore_eos off)
                    or t is in stop_token_ids        ->  FinishReason.STOP
    n >= max_tokens                                  ->  FinishReason.LENGTH
    otherwise                                        ->  None: it goes on

in that order. A token that is both the end-of-sequence and the ``max_tokens``-th output
finishes with ``stop``: the model ended its answer itself, and reporting ``length`` would tell
the client the text was cut short when it was not. Before ``min_tokens`` outputs the sampler
masks the stopping tokens out, so they are drawn only where a grammar leaves nothing else; such
a token then does not stop the request either.

Text stop strings (``InferenceRequest.stop``) are a different rule, applied by the admission
service to detokenized text (``kvgate.admission_service.stops``); they need a tokenizer, which
no executor has. Stop conditions on token ids (minimum lengths, stop token ids) live here, as
fields of ``StopRule`` read by ``finish_reason``. A structured output or a forced tool call
needs no rule of its own: once its grammar is complete the mask leaves only the EOS, which ends
the request here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvgate.protocol.enums import FinishReason

if TYPE_CHECKING:
    from kvgate.protocol.step import SamplingParams

DEFAULT_MAX_TOKENS: Final = 16
"""Outputs a request may generate when it does not say: OpenAI's default for completions, and
the default of every kvgate request model (Kafka records, the step protocol)."""


@dataclass(frozen=True, slots=True)
class StopRule:
    """One request's stop conditions, built once per request (``StopRule.of``) and then asked
    once per token: a plain comparison of ints, with nothing allocated."""

    max_tokens: int
    # The token that ends the request early; None when the model has none or the request
    # ignores it (``ignore_eos``).
    eos_token_id: int | None
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, sampling: SamplingParams, eos_token_id: int | None) -> StopRule:
        """The rule for a request sampled with ``sampling`` on a model whose EOS is
        ``eos_token_id``."""
        return cls(
            max_tokens=sampling.max_tokens,
            eos_token_id=None if sampling.ignore_eos else eos_token_id,
            min_tokens=sampling.min_tokens,
            stop_token_ids=frozenset(sampling.stop_token_ids),
        )

    def finish_reason(self, num_outputs: int, last_token_id: int) -> FinishReason | None:
        """Why the request ends now that it has ``num_outputs`` outputs, the newest being
        ``last_token_id``; None while it goes on."""
        if num_outputs >= self.min_tokens and (
            last_token_id == self.eos_token_id or last_token_id in self.stop_token_ids
        ):
            return FinishReason.STOP
        if num_outputs >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def stopping_token_ids(self) -> list[int]:
        """Tokens that would end the request (the EOS unless ignored, and the stop token ids):
        the sampler masks them until ``min_tokens`` outputs exist."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return sorted(ids)

    def length_reached(self, num_outputs: int) -> bool:
        """Whether ``num_outputs`` outputs end the request whatever the last one is.

        The batch planner asks this about a token still in flight, whose id it cannot know:
        a token that turns out to be the EOS ends the request too, and a pass planned after it
        is skipped by the executor."""
        return num_outputs >= self.max_tokens
