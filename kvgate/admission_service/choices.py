"""``n > 1``: one request's choices as scheduler requests of their own, and their one answer.

Choice 0 runs under the request's id. Once it has its first token — its prompt is then in the
KV cache and its full pages published to the prefix cache — choices ``1..n-1`` are placed as
requests ``<id>#<c>`` (``#`` cannot occur in a request id, so they never collide with a
client's), on the same executor when it is ready, where their prompt's full pages come from
that cache: the prompt is prefilled once, and each choice computes only its last partial page.

Each choice is an ordinary request for the scheduler — its own KV, preemption, restore and
migration — and keeps its place in admission order: the ``n`` arrival numbers are taken when the
request is read, so a choice placed later still comes before anything read after its request,
and the bypass bound holds for it as for any request. Each draws from its own stream: choice
``c > 0`` of a seeded request gets the seed ``choice_seed(seed, c)`` (choice 0 keeps the seed,
so ``n = 1`` and choice 0 of ``n > 1`` draw alike); without a seed the derived id keys the draws.

The answer is assembled when every choice has finished: choice 0's fields at the top (a client
that reads only those gets a complete answer), every choice in ``choices``, the usage summed.
A choice that fails fails the request (the others are aborted); an aborted request aborts every
choice and answers once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kvgate.protocol.records import Choice, InferenceResult, SchedulingFacts, Usage
from kvgate.scheduler.request import RequestSpec

if TYPE_CHECKING:
    from kvgate.admission_service.tracking import Tracked

CHOICE_SEPARATOR: Final = "#"  # not in REQUEST_ID_PATTERN: derived ids never collide


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}{CHOICE_SEPARATOR}{index}"


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's for choice 0, a stable derivation for the rest."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"choice\x1f{seed}\x1f{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def choice_spec(spec: RequestSpec, index: int) -> RequestSpec:
    """The scheduler's request for choice ``index`` of ``spec`` (choice 0's)."""
    sampling = spec.sampling
    update: dict[str, object] = {"prompt_logprobs": None}  # reported once, by choice 0
    if sampling.seed is not None:
        update["seed"] = choice_seed(sampling.seed, index)
    return dataclasses.replace(
        spec,
        request_id=choice_id(spec.request_id, index),
        sampling=sampling.model_copy(update=update),
    )


@dataclass(eq=False, slots=True)
class ChoiceGroup:
    """The choices of one request: which are placed, and the results of those finished."""

    n: int
    members: dict[int, Tracked] = field(default_factory=dict)  # choice -> its Tracked
    spawned: bool = False  # choices 1..n-1 are placed (after choice 0's first token)
    results: dict[int, InferenceResult] = field(default_factory=dict)
    handed_off: bool = False  # its partition was revoked (the span says so once)

    @property
    def leader(self) -> Tracked:
        """Choice 0: its id is the request's, its span and record the request's."""
        return self.members[0]

    @property
    def complete(self) -> bool:
        return len(self.results) == (self.n if self.spawned else 1)


def assemble(request_id: str, group: ChoiceGroup) -> InferenceResult:
    """The request's answer from its choices' results (choice 0 first)."""
    first = group.results[0]
    choices = []
    for index in range(group.n):
        result = group.results.get(index)
        if result is None:  # never placed: choice 0 ended before its first token
            choices.append(Choice(index=index, finish_reason=first.finish_reason))
            continue
        choices.append(
            Choice(
                index=index,
                finish_reason=result.finish_reason,
                output_token_ids=result.output_token_ids,
                text=result.text,
                logprobs=result.logprobs,
                tool_calls=result.tool_calls,
                exit_depths=result.exit_depths,
            )
        )
    done = list(group.results.values())
    facts = SchedulingFacts(
        preemptions=sum(r.scheduling.preemptions for r in done),
        restores=sum(r.scheduling.restores for r in done),
        restore_modes=[m for r in done for m in r.scheduling.restore_modes],
        bypasses=max(r.scheduling.bypasses for r in done),
        recomputed_tokens=sum(r.scheduling.recomputed_tokens for r in done),
        executors=list(dict.fromkeys(e for r in done for e in r.scheduling.executors)),
    )
    return first.model_copy(
        update={
            "request_id": request_id,
            "choices": choices,
            "usage": Usage(
                prompt_tokens=first.usage.prompt_tokens,
                completion_tokens=sum(r.usage.completion_tokens for r in done),
            ),
            "scheduling": facts,
        }
    )
