"""The executor's side of structured outputs: one grammar matcher per constrained request, and
each step's masks built while the forward pass runs.

```
run(step):  begin(states that may sample)  ──▶ worker thread: llguidance fills the int32
            │                                    bitmask [k, V/32] (its own threads, no GIL)
            forward pass (embed, layers, LM head)        │
            coda: wait() ◀──────────────────────────────┘ bits -> bool [k, V] on the device
                  sample (the mask is one batched masked_fill with the other processors)
                  advance each matcher by its sampled token
```

The masks of a step depend only on the tokens sampled before it, so they are built during the
step's forward pass (as vLLM builds its next bitmask while the model runs): on a GPU the host
fills them while the device computes; on a CPU torch's kernels and llguidance's threads share
the cores. What the step still waits for is measured (``exposed_s``), and so is the filling
itself (``fill_s``): docs/benchmarks.md reports both as a share of a step.

A request's matcher is built from its outputs (``attach``): a fresh request starts at the
grammar's beginning, a recompute restore or a migrated request replays what it generated, a
swapped-out request keeps its matcher on the host with the rest of its state. Every tensor
parallel rank runs the same matchers over the same tokens and builds the same masks (ranks
sample the same logits identically: ``tensor_parallel/ranks.py``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvgate.executor.requests import RequestState
from kvgate.executor.tokenizer import TextTokenizer
from kvgate.grammar import GrammarError, GrammarMatcher, TokenVocabulary

log = logging.getLogger(__name__)


@dataclass
class PendingMasks:
    """The masks of one step's constrained rows, being filled."""

    request_ids: list[str]
    bitmask: torch.Tensor  # int32 [k, words] on the host
    future: Future[float] | None  # the fill's duration, once done


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: TextTokenizer | None,
        *,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._device = device
        self._vocabulary: TokenVocabulary | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-grammar")
        self._table: torch.Tensor | None = None
        self.fill_s = 0.0  # seconds spent filling masks (on the worker, beside the forward)
        self.exposed_s = 0.0  # seconds steps waited for masks after their forward
        self.masked_rows = 0

    @property
    def available(self) -> bool:
        """A grammar can be enforced: the model has a tokenizer and an EOS to end on."""
        return self._tokenizer is not None and self._eos is not None

    def _vocab(self) -> TokenVocabulary:
        if self._vocabulary is None:
            assert self._tokenizer is not None and self._eos is not None
            self._vocabulary = TokenVocabulary(
                self._tokenizer.to_json(), vocab_size=self._vocab_size, eos_token_id=self._eos
            )
        return self._vocabulary

    # ----------------------------------------------------------------------- per request

    def attach(self, state: RequestState) -> None:
        """Give a constrained request its matcher, at the end of the outputs it has."""
        spec = state.sampling.grammar
        if spec is None:
            return
        if not self.available:
            # The admission service places grammars only on executors that say they can.
            raise ValueError(f"{state.request_id}: this executor cannot enforce a grammar")
        try:
            state.matcher = self._vocab().matcher(spec, state.outputs)
        except GrammarError as exc:
            raise ValueError(f"{state.request_id}: {exc}") from exc
        problem = state.matcher.error
        if problem is not None:
            log.warning("%s: its outputs leave its grammar (%s)", state.request_id, problem)

    @staticmethod
    def advance(state: RequestState, token: int) -> None:
        if state.matcher is not None:
            state.matcher.advance(token)
            problem = state.matcher.error
            if problem is not None:
                log.warning("%s: token %d left its grammar (%s)", state.request_id, token, problem)

    # ----------------------------------------------------------------------- per step

    def begin(self, states: list[RequestState]) -> PendingMasks | None:
        """Start filling the masks of the constrained ``states`` (those that may sample in this
        step); None when none is constrained."""
        constrained = [s for s in states if s.matcher is not None]
        if not constrained:
            return None
        vocabulary = self._vocab()
        bitmask = torch.zeros((len(constrained), vocabulary.mask_words), dtype=torch.int32)
        matchers: list[GrammarMatcher] = [s.matcher for s in constrained]  # type: ignore[misc]

        def fill() -> float:
            began = time.perf_counter()
            vocabulary.fill_masks(matchers, bitmask.data_ptr())
            return time.perf_counter() - began

        self.masked_rows += len(constrained)
        return PendingMasks([s.request_id for s in constrained], bitmask, self._worker.submit(fill))

    def allowed(self, pending: PendingMasks | None, request_ids: list[str]) -> torch.Tensor | None:
        """bool ``[c, V]`` on the device: the allowed tokens of the ``c`` rows of ``request_ids``
        that are constrained, in row order (the sampler's ``allowed``); None when none is. A
        matcher with nothing left to allow (it left its grammar) allows the EOS, so the request
        ends."""
        if pending is None:
            return None
        began = time.perf_counter()
        assert pending.future is not None
        self.fill_s += pending.future.result()
        self.exposed_s += time.perf_counter() - began
        rows = {rid: i for i, rid in enumerate(pending.request_ids)}
        index = [rows[rid] for rid in request_ids if rid in rows]
        if not index:
            return None
        device = self._device
        bits = pending.bitmask
        if index != list(range(bits.shape[0])):
            bits = bits[torch.tensor(index)]
        # Bits to bools through a table of the 256 bytes (little-endian words: token t is bit
        # t % 8 of byte t // 8), on the device: a third cheaper than shifting every word.
        table = self._byte_table()
        octets = bits.contiguous().view(torch.uint8).to(device, non_blocking=True)
        masks = table[octets.long()].view(len(index), -1)[:, : self._vocab_size]
        assert self._eos is not None
        masks[:, self._eos] |= ~masks.any(dim=-1)
        return masks

    def _byte_table(self) -> torch.Tensor:
        """bool ``[256, 8]``: the bits of each byte, lowest first, on the device."""
        if self._table is None:
            byte = torch.arange(256).unsqueeze(1)
            self._table = ((byte >> torch.arange(8)) & 1).to(torch.bool).to(self._device)
        return self._table

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
