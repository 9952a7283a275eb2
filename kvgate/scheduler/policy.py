"""The one place that orders requests.

``admission_key`` orders the waiting queue (smaller first); the victim order is its reverse.
Every decision that compares two requests' importance calls ``may_evict`` — there is no second
place that compares priorities (the livelock this project grew out of was exactly that).

Within a priority class the key may carry, before the arrival number, the tenant's *share* (its
virtual token counter, with fairness) and the request's deadline (with deadline order)::

    (priority, [share], [deadline], arrival_seq)      priority only under ``policy: priority``

Both enter here and nowhere else: the fair order between tenants and earliest-deadline-first are
this key, and so is the victim order. How shares are kept and when a key is stamped is
``fairness.py`` and ``state.FairWaitingQueue``; docs/scheduler.md states the bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvgate.scheduler.config import Fairness, Policy, SchedulerConfig
from kvgate.scheduler.request import AdmissionKey, Request

Lane = tuple[int, str]
"""(priority class, tenant): the requests whose fair order is their tenant's share."""


class EvictionReason(StrEnum):
    ADMISSION = "admission"  # a more important waiting request needs room or a slot
    GROWTH = "growth"  # a running request needs a new block for its next row


def admission_key(
    policy: Policy,
    priority: int,
    arrival_seq: int,
    *,
    share: float | None = None,
    deadline_s: float | None = None,
) -> AdmissionKey:
    """Lower value = more important, like vLLM: (priority, arrival) or arrival alone; with a
    ``share`` (fairness) and a ``deadline_s`` (deadline order) before the arrival number."""
    if share is None and deadline_s is None:
        if policy is Policy.PRIORITY:
            return (priority, arrival_seq)
        return (arrival_seq,)
    key: tuple[float, ...] = (priority,) if policy is Policy.PRIORITY else ()
    if share is not None:
        key += (share,)
    if deadline_s is not None:
        key += (deadline_s,)
    return (*key, arrival_seq)


@dataclass(frozen=True, slots=True)
class Ordering:
    """The scheduler's settings for ``admission_key``, applied to a request."""

    policy: Policy
    fair: bool
    by_deadline: bool

    @classmethod
    def of(cls, config: SchedulerConfig) -> Ordering:
        return cls(config.policy, config.fairness is not Fairness.OFF, config.deadline_order)

    def key(self, request: Request, share: float = 0.0) -> AdmissionKey:
        """``request``'s key when its tenant's share is ``share`` (ignored without fairness).
        Within one lane every request has the same share, so ``key(r)`` (share 0) orders a
        lane as ``key(r, share)`` orders it in the waiting queue."""
        return admission_key(
            self.policy,
            request.spec.priority,
            request.arrival_seq,
            share=share if self.fair else None,
            deadline_s=request.order_deadline_s if self.by_deadline else None,
        )

    def lane(self, request: Request) -> Lane:
        return (request.priority_class, request.tenant)


def priority_class(policy: Policy, priority: int) -> int:
    """The part of the admission key that preemption compares (lower is more important): the
    priority under ``priority``, one class for every request under ``fcfs``.

    An ordering, not a metric label: it is unbounded and depends on the policy. Metrics label a
    request by what it asked for, bucketed to a bounded set
    (``kvgate.protocol.metric_labels.priority_label``)."""
    return priority if policy is Policy.PRIORITY else 0


def background_key(config: SchedulerConfig) -> AdmissionKey | None:
    """The smallest admission key of the background class (``background_priority``): every
    background request's key is at least this, every other request's below it. ``None``: the
    scheduler has no background class."""
    if config.background_priority is None:
        return None
    return (config.background_priority,)


def is_background(config: SchedulerConfig, request: Request) -> bool:
    start = config.background_priority
    return start is not None and request.priority_class >= start


def past_last_victim(
    requester: Request, victim: Request, reason: EvictionReason, *, fair: bool = False
) -> bool:
    """Walking running requests in victim order, whether ``victim`` and everything after it are
    too important to evict for ``requester`` (so the walk can stop). ``fair``: the key holds
    tenants' shares (``fairness: tokens``), and admission may evict within the requester's class
    what is behind it."""
    if reason is EvictionReason.ADMISSION and not fair:
        return victim.priority_class <= requester.priority_class
    return victim.key <= requester.key


def may_evict(
    requester: Request,
    victim: Request,
    reason: EvictionReason,
    *,
    step: int,
    min_residency_steps: int,
    requester_leads: bool,
    reach: AdmissionKey | None = None,
    standing: AdmissionKey | None = None,
) -> bool:
    """Whether ``requester`` may preempt the running ``victim``.

    - Admission preempts strictly less important *priority classes*: without fairness a waiting
      request never displaces running work of its own class (under ``fcfs`` admission never
      preempts). Under fairness it may also displace running work of *another tenant* of its
      class that is behind it in the order (so growth, which evicts only what is behind its
      requester, never undoes it), when its ``reach`` (its key with its tenant's share once it
      is served in full) is below the victim's ``standing`` (the victim's key with its tenant's
      share now; both ``FairWaitingQueue``), and the victim is outside its residency window: a
      tenant under its share does not wait for a saturated executor's slots to drain, a
      preemption never takes the requester's tenant past the victim's, and two tenants near
      equal shares do not trade victims back and forth.
    - Growth preempts a victim of a strictly less important class, or — within one class — only
      for the request that leads the running order (``requester_leads``); other requests of the
      class wait for blocks instead of evicting each other. The leader can always make room, so
      the class drains; on the livelock suite this removed a fifth of all preemptions at the same
      step count (docs/scheduler.md).
    - Residency: a victim restored less than ``min_residency_steps`` ago is protected from
      requesters that are not of a strictly more important class, so preempt/restore cannot
      ping-pong between equals.
    """
    if victim is requester:
        return False
    strictly_more_important = requester.priority_class < victim.priority_class
    recently_restored = (
        victim.restored_step is not None and step - victim.restored_step < min_residency_steps
    )
    if strictly_more_important:
        return True
    if reason is EvictionReason.ADMISSION:
        return (
            reach is not None
            and standing is not None
            and requester.priority_class == victim.priority_class
            and requester.tenant != victim.tenant
            and victim.key > requester.key
            and reach < standing
            and not recently_restored
        )
    if victim.key <= requester.key or not requester_leads:
        return False
    return not recently_restored
