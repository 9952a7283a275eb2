"""Where a request is queued: cache-aware placement over the ready executors (pure: no I/O).

The service knows exactly which prompt pages every executor's prefix cache holds (each
scheduler keeps their digests, ``scheduler/kv.py``), so placement prices each executor by the
prefill work the request would cost there and the work already queued there::

    cost(e) = (prompt tokens − cached(e)) + backlog(e)                    [tokens to prefill]

    cached(e)  = prompt tokens whose pages e's prefix cache holds now; or, when the last request
                 placed with the same affinity key (``prompt_cache_key``, else the OpenAI
                 ``user``) is still on e and this prompt extends that one's, that one's prompt
                 (its pages are published as its fill completes)
    backlog(e) = prompt tokens still to fill of the requests waiting on e, not yet started

The least cost wins; ties go to more KV headroom, then to the name. Two rules keep it from
making a hot spot:

- *Load bound.* Only executors whose outstanding requests (placed and not finished) are at most
  ``(1 + load_spread) × least + load_slack_requests`` are candidates, the least being the least
  loaded ready executor's count. So at any placement the chosen executor holds at most that many
  before the new request: a popular prefix spills over to other executors instead of queueing
  behind itself.
- *Room.* An executor without KV headroom for the request's full length (cache blocks minus
  what its placed requests may grow into) is a candidate only when no candidate has room.

Re-evaluation: a request still waiting on its executor (not admitted there yet) may move when
an executor frees up (its queue empties) or a new one joins: to the candidate whose cost is
lower than its current one by ``move_margin_tokens`` or more, at most ``max_moves`` times per
request (hysteresis, so no request ping-pongs). It moves with its arrival number, bypass count
and ordering deadline (``Scheduler.withdraw``), so it keeps its place and its protection.

``policy: headroom`` is the rule before cache-aware placement (most headroom first), kept for
comparison (benchmarks/bench_placement.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvgate.scheduler.kv import page_hashes


class PlacementPolicy(StrEnum):
    CACHE_AWARE = "cache_aware"
    HEADROOM = "headroom"


class PlacementSettings(BaseModel):
    """The service's ``placement`` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PlacementPolicy = PlacementPolicy.CACHE_AWARE
    # Tokens of prefill an outstanding request on an executor counts as (its decode rows slow
    # every step there).
    load_tokens_per_request: Annotated[int, Field(ge=0)] = 64
    load_spread: Annotated[float, Field(ge=0.0, le=100.0)] = 0.25
    load_slack_requests: Annotated[int, Field(ge=0)] = 4
    move_margin_tokens: Annotated[int, Field(ge=0)] = 64
    max_moves: Annotated[int, Field(ge=0)] = 2
    # Affinity keys remembered (the least recently placed are forgotten first).
    affinity_keys: Annotated[int, Field(ge=0)] = 100_000


class ExecutorView(Protocol):
    """What placement reads of one ready executor."""

    @property
    def name(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def outstanding(self) -> int:
        """Requests placed here and not finished (waiting or running)."""
        ...

    @property
    def backlog_tokens(self) -> int:
        """Prompt tokens to fill of the requests waiting here that have not started."""
        ...

    @property
    def headroom_blocks(self) -> int: ...

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int: ...

    def has_room_for(self, prompt_len: int, max_tokens: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class Ask:
    """A request as placement sees it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    affinity_key: str | None = None
    moves: int = 0  # times it moved while waiting


@dataclass(frozen=True, slots=True)
class Priced:
    view: ExecutorView
    cached_tokens: int
    cost_tokens: int


@dataclass(frozen=True, slots=True)
class _Affinity:
    executor: str
    request_id: str
    block_size: int
    num_pages: int
    last_digest: bytes


class Placer:
    """The placement rule and its memory of affinity keys (see the module docstring)."""

    def __init__(self, settings: PlacementSettings) -> None:
        self.settings = settings
        self._affinity: OrderedDict[str, _Affinity] = OrderedDict()

    # --- ranking -----------------------------------------------------------------------------
    def rank(self, ask: Ask, executors: Sequence[ExecutorView]) -> list[ExecutorView]:
        """Every executor, best first: the candidates by cost, then the others (over the load
        bound) by load: a request is always placed if any executor takes it."""
        if not executors:
            return []
        if self.settings.policy is PlacementPolicy.HEADROOM:
            return sorted(executors, key=lambda e: (-e.headroom_blocks, e.name))
        eligible = self._eligible(executors)
        priced = sorted((self.price(ask, view) for view in eligible), key=lambda p: _order(p, ask))
        rest = sorted(
            (e for e in executors if e not in eligible), key=lambda e: (e.outstanding, e.name)
        )
        return [p.view for p in priced] + rest

    def price(self, ask: Ask, view: ExecutorView, *, own_backlog: int = 0) -> Priced:
        """``ask`` on ``view``; ``own_backlog``: its own tokens, counted in ``view``'s backlog
        when it already waits there."""
        prompt = ask.prompt_token_ids
        digests = page_hashes(prompt, view.block_size)
        cached = view.cached_prefix_pages(digests) * view.block_size
        cached = max(cached, self._affinity_tokens(ask, view, digests))
        load = max(0, view.backlog_tokens - own_backlog)
        load += self.settings.load_tokens_per_request * view.outstanding
        cost = len(prompt) - cached + load
        return Priced(view, cached, cost)

    def better(
        self, ask: Ask, current: ExecutorView, own_backlog: int, others: Sequence[ExecutorView]
    ) -> Priced | None:
        """Where ``ask``, waiting on ``current``, should move: an eligible executor cheaper by
        at least ``move_margin_tokens``, the cheapest; ``None`` to stay."""
        if self.settings.policy is PlacementPolicy.HEADROOM or ask.moves >= self.settings.max_moves:
            return None
        here = self.price(ask, current, own_backlog=own_backlog)
        eligible = [e for e in self._eligible([current, *others]) if e is not current]
        best: Priced | None = None
        for view in eligible:
            if not view.has_room_for(len(ask.prompt_token_ids), ask.max_tokens):
                continue
            priced = self.price(ask, view)
            if priced.cost_tokens + self.settings.move_margin_tokens > here.cost_tokens:
                continue
            if best is None or _order(priced, ask) < _order(best, ask):
                best = priced
        return best

    # --- affinity ----------------------------------------------------------------------------
    def placed(self, ask: Ask, view: ExecutorView) -> None:
        """``ask`` was queued on ``view``: remember it under its affinity key."""
        key = ask.affinity_key
        if key is None or self.settings.affinity_keys == 0:
            return
        digests = page_hashes(ask.prompt_token_ids, view.block_size)
        if not digests:
            self._affinity.pop(key, None)
            return
        self._affinity[key] = _Affinity(
            view.name, ask.request_id, view.block_size, len(digests), digests[-1]
        )
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.settings.affinity_keys:
            self._affinity.popitem(last=False)

    def left(self, request_id: str, affinity_key: str | None) -> None:
        """The request left its executor (finished, moved or lifted): its pages are published
        there or gone, so its affinity entry says nothing the cache does not."""
        if affinity_key is None:
            return
        entry = self._affinity.get(affinity_key)
        if entry is not None and entry.request_id == request_id:
            del self._affinity[affinity_key]

    def _affinity_tokens(self, ask: Ask, view: ExecutorView, digests: Sequence[bytes]) -> int:
        key = ask.affinity_key
        entry = self._affinity.get(key) if key is not None else None
        if entry is None or entry.executor != view.name or entry.block_size != view.block_size:
            return 0
        index = entry.num_pages - 1
        if index < len(digests) and digests[index] == entry.last_digest:
            return entry.num_pages * entry.block_size  # this prompt extends that one
        return 0

    # --- the load bound ------------------------------------------------------------------------
    def _eligible(self, executors: Sequence[ExecutorView]) -> list[ExecutorView]:
        least = min(e.outstanding for e in executors)
        bound = (1 + self.settings.load_spread) * least + self.settings.load_slack_requests
        return [e for e in executors if e.outstanding <= bound]


def _order(priced: Priced, ask: Ask) -> tuple[bool, int, int, str]:
    view = priced.view
    no_room = not view.has_room_for(len(ask.prompt_token_ids), ask.max_tokens)
    return (no_room, priced.cost_tokens, -view.headroom_blocks, view.name)


Move = Callable[[Ask, ExecutorView, ExecutorView], bool]


def pull(
    placer: Placer,
    target: ExecutorView,
    queued: Iterable[tuple[ExecutorView, Ask, int]],
    budget: int,
    move: Move,
) -> int:
    """``target`` freed up: move to it, oldest first, up to ``budget`` of the ``queued``
    requests (source, request, its own tokens in the source's backlog) that are cheaper there by
    the margin. ``move`` does it (``False``: it had started meanwhile). Returns the moves made."""
    moved = 0
    for source, ask, own in queued:
        if moved >= budget:
            break
        if placer.better(ask, source, own, [target]) is None:
            continue
        if move(ask, source, target):
            moved += 1
    return moved
