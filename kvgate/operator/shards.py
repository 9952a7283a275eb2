"""Several admission replicas per pool: which replica drives which executor.

The pool's request partitions are spread over its admission replicas by their Kafka consumer
group; its executors are spread by the operator, here. Each replica schedules the requests it
read onto the executors it was given (its *shard*): a request never crosses shards, so the
bypass bound and the no-loss guarantees of one service hold per shard unchanged.

Why the operator and not the replicas: the operator already owns the membership (it alone
knows which executor pods are ready, draining or leaving), it can sequence a move (drain on
the old replica, then hand over), and an executor never has two replicas each believing it
its own — the replicas need no protocol among themselves. The price is that a dead replica's
executors move when the operator notices (a pod watch event, about a second), in parallel
with Kafka moving its partitions (the session timeout).

``split()`` is a pure function of what was observed, like ``planner.plan``::

    live replicas       ready pods whose admin API answered; the others hold nothing (a dead
                        replica's sessions are fenced by the new owner's newer epoch)
    holder of e         the live replica whose membership lists e (connected first, then by
                        name when a fenced replica still lists it)
    quota               n executors over k live replicas: n // k each, the first n % k (most
                        held first, then by name) one more
    owner of e          its holder while within quota (sticky: nothing moves without cause);
                        the executors a replica holds beyond its quota (draining ones first,
                        then by name from the end) and unheld ones go to the replicas below
                        quota, fewest first
    a move              the holder keeps e flagged draining (it hands e's requests to its
                        other executors by KV migration, or lets them finish) and drops it once
                        e holds no work; the new owner is given e only once no live replica
                        lists it, so two live replicas never open sessions to e at once

Executors the pool itself drains (``draining`` in the pool's membership: a scale-down or an
update) stay with their holder, as one service would keep them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from kvgate.protocol.admin import (
    ExecutorMembership,
    ExecutorSpec,
    ExecutorState,
    ExecutorStatus,
    QueueLoad,
)


@dataclass(frozen=True)
class Replica:
    """One admission pod as observed: its name, admin URL, readiness and membership."""

    name: str
    url: str | None  # None: the pod has no IP yet
    ready: bool
    reading: ExecutorMembership | None = None  # None: not asked, or it did not answer
    problem: str = ""

    @property
    def live(self) -> bool:
        return self.ready and self.url is not None and self.reading is not None

    @cached_property
    def held(self) -> Mapping[str, ExecutorStatus]:
        """The executors its membership lists, by name."""
        return {e.name: e for e in self.reading.executors} if self.reading is not None else {}


@dataclass(frozen=True)
class ShardPlan:
    owners: Mapping[str, str]  # executor -> the replica that drives it (or is to)
    memberships: Mapping[str, tuple[ExecutorSpec, ...]]  # live replica -> its membership
    # First round: what each replica lets go of (its membership less what it does not hold
    # yet). Second round, once every release is done: ``pushes`` get their whole membership.
    releases: Mapping[str, tuple[ExecutorSpec, ...]]
    pushes: tuple[str, ...]  # live replicas whose membership differs from what they report
    moving: tuple[str, ...]  # executors draining on one replica before they go to another
    live: tuple[str, ...]

    @property
    def settled(self) -> bool:
        return not self.moving and not self.pushes


def _holders(live: Sequence[Replica]) -> dict[str, str]:
    """executor -> the live replica that holds it; a connected holder wins over a fenced one."""
    candidates: dict[str, list[tuple[bool, str]]] = {}
    for replica in live:
        for name, status in replica.held.items():
            candidates.setdefault(name, []).append(
                (status.state is ExecutorState.LOST, replica.name)
            )
    return {name: min(options)[1] for name, options in candidates.items()}


def _owners(
    names: Sequence[str],
    pool_draining: set[str],
    holders: Mapping[str, str],
    shard_draining: Mapping[str, set[str]],
    live: Sequence[str],
) -> dict[str, str]:
    """The sticky, balanced assignment described in the module doc."""
    held: dict[str, list[str]] = {replica: [] for replica in live}
    unheld: list[str] = []
    for name in sorted(names):
        holder = holders.get(name)
        if holder is None:
            if name not in pool_draining:  # a draining executor nobody drives is left alone
                unheld.append(name)
        else:
            held[holder].append(name)
    total = sum(len(v) for v in held.values()) + len(unheld)
    order = sorted(live, key=lambda r: (-len(held[r]), r))
    quota = {
        r: total // len(live) + (1 if i < total % len(live) else 0) for i, r in enumerate(order)
    }
    owners: dict[str, str] = {}
    spare = list(unheld)
    for replica in live:
        # What it gives up: a move already under way first, then from the end of the names;
        # executors the pool drains never move.
        movable = [n for n in held[replica] if n not in pool_draining]
        keep_first = sorted(movable, key=lambda n: (n in shard_draining[replica], n))
        fixed = [n for n in held[replica] if n in pool_draining]
        room = max(quota[replica] - len(fixed), 0)
        for name in fixed + keep_first[:room]:
            owners[name] = replica
        spare.extend(keep_first[room:])
    counts = {replica: 0 for replica in live}
    for owner in owners.values():
        counts[owner] += 1
    for name in sorted(spare):
        short = min(live, key=lambda r: (counts[r] - quota[r], r))
        owners[name] = short
        counts[short] += 1
    return owners


def split(desired: Sequence[ExecutorSpec], replicas: Sequence[Replica]) -> ShardPlan:
    """Each live replica's membership for the pool membership ``desired`` (module doc)."""
    live = [r for r in replicas if r.live]
    if not live:
        return ShardPlan({}, {}, {}, (), (), ())
    names = [e.name for e in desired]
    specs = {e.name: e for e in desired}
    pool_draining = {e.name for e in desired if e.draining}
    holders = _holders(live)
    by_name = {r.name: r for r in live}
    shard_draining = {
        r.name: {n for n, s in r.held.items() if n not in pool_draining and s.state in _DRAINING}
        for r in live
    }
    owners = _owners(names, pool_draining, holders, shard_draining, [r.name for r in live])
    memberships: dict[str, list[ExecutorSpec]] = {r.name: [] for r in live}
    moving: list[str] = []
    for name in names:
        holder, owner = holders.get(name), owners.get(name)
        if holder is not None and holder != owner:
            status = by_name[holder].held.get(name)
            if status is not None and _busy(status):
                memberships[holder].append(specs[name].model_copy(update={"draining": True}))
                moving.append(name)
                continue
            # Released by its holder in the first round, given to its owner in the second.
        if owner is not None:
            memberships[owner].append(specs[name])
    releases: dict[str, tuple[ExecutorSpec, ...]] = {}
    for r in live:
        held = r.held
        kept = tuple(e for e in memberships[r.name] if e.name in held)
        if _view(kept) != _view(held.values()):
            releases[r.name] = kept
    pushes = tuple(r.name for r in live if _view(r.held.values()) != _view(memberships[r.name]))
    return ShardPlan(
        owners=owners,
        memberships={r: tuple(specs) for r, specs in memberships.items()},
        releases=releases,
        pushes=pushes,
        moving=tuple(moving),
        live=tuple(r.name for r in live),
    )


_DRAINING = (ExecutorState.DRAINING, ExecutorState.DRAINED)


def _busy(status: ExecutorStatus) -> bool:
    """Work is still on the executor: it must drain before it may move."""
    if status.state in (ExecutorState.DRAINED, ExecutorState.LOST):
        return False  # a LOST one's work is already handed back (or fenced away)
    return status.running_requests > 0 or status.waiting_requests > 0


def _view(entries: object) -> set[tuple[str, str, bool]]:
    """What a membership says, comparable between a reading and a desired membership."""
    view = set()
    for entry in entries:  # type: ignore[attr-defined]
        if isinstance(entry, ExecutorStatus):
            view.add((entry.name, entry.endpoint, entry.state in _DRAINING))
        else:
            assert isinstance(entry, ExecutorSpec)
            view.add((entry.name, entry.endpoint, entry.draining))
    return view


def merged(replicas: Sequence[Replica]) -> ExecutorMembership | None:
    """The pool's membership as one service would report it: each executor's status from its
    holder, the queues summed; None when no live replica answered."""
    live = [r for r in replicas if r.live]
    if not live:
        return None
    by_name = {r.name: r for r in live}
    statuses = [by_name[holder].held.get(name) for name, holder in sorted(_holders(live).items())]
    queues = [r.reading.queue for r in live if r.reading is not None and r.reading.queue]
    queue = None
    if queues:
        queue = QueueLoad(
            consumer_lag=sum(q.consumer_lag for q in queues),
            unplaced=sum(q.unplaced for q in queues),
        )
    return ExecutorMembership(executors=[s for s in statuses if s is not None], queue=queue)
