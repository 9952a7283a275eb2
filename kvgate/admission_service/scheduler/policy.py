"""The one place that orders requests.

``admission_key`` orders the waiting queue (smaller first); the victim order is its reverse.
Every decision that compares two requests' importance calls ``may_evict`` — there is no second
place that compares priorities (the livelock this project grew out of was exactly that).
"""

from __future__ import annotations

from enum import StrEnum

from kvgate.admission_service.scheduler.config import Policy
from kvgate.admission_service.scheduler.request import Request


class EvictionReason(StrEnum):
    ADMISSION = "admission"  # a more important waiting request needs room or a slot
    GROWTH = "growth"  # a running request needs a new block for its next row


def admission_key(policy: Policy, priority: int, arrival_seq: int) -> tuple[int, ...]:
    """Lower value = more important, like vLLM: (priority, arrival) or arrival alone."""
    if policy is Policy.PRIORITY:
        return (priority, arrival_seq)
    return (arrival_seq,)


def priority_class(policy: Policy, priority: int) -> int:
    return priority if policy is Policy.PRIORITY else 0


def past_last_victim(requester: Request, victim: Request, reason: EvictionReason) -> bool:
    """Walking running requests in victim order, whether ``victim`` and everything after it are
    too important to evict for ``requester`` (so the walk can stop)."""
    if reason is EvictionReason.ADMISSION:
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
) -> bool:
    """Whether ``requester`` may preempt the running ``victim``.

    - Admission preempts only strictly less important *priority classes*: a waiting request never
      displaces running work of its own class (under ``fcfs`` admission never preempts).
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
    if reason is EvictionReason.ADMISSION or strictly_more_important:
        return strictly_more_important
    if victim.key <= requester.key or not requester_leads:
        return False
    recently_restored = (
        victim.restored_step is not None and step - victim.restored_step < min_residency_steps
    )
    return not recently_restored
