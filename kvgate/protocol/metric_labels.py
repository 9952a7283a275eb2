"""Metric labels the gateway and the admission service both put on their series.

They live in the protocol because both sides import it and neither may own them: a dashboard
joins the gateway's latencies with the service's on these labels, so both must name and bucket
them alike.
"""

from __future__ import annotations

from typing import Final

PRIORITY_LABEL: Final = "priority"
"""The label name of a request's priority on per-request metrics."""

PRIORITY_LABEL_MIN: Final = -10
PRIORITY_LABEL_MAX: Final = 10
"""Priorities in ``[PRIORITY_LABEL_MIN, PRIORITY_LABEL_MAX]`` are labelled with their value."""

# The overflow buckets: more important than any labelled value, and less important.
PRIORITY_LABEL_UNDERFLOW: Final = f"<{PRIORITY_LABEL_MIN}"
PRIORITY_LABEL_OVERFLOW: Final = f">{PRIORITY_LABEL_MAX}"


def priority_label(priority: int) -> str:
    """The ``priority`` label of a request: its priority (lower is more important) when it lies
    in ``[PRIORITY_LABEL_MIN, PRIORITY_LABEL_MAX]`` (-10..10), else ``"<-10"`` or ``">10"``.

    Why this scheme:

    - Bounded: a priority is the client's choice (the service accepts ``-1000..1000`` by
      default), a label set must not be; this one has 23 values whatever clients send.
    - Deterministic: the same priority gets the same label in the gateway, in every service
      replica and after every restart, so series sum across replicas and join across the two
      sides. (Labelling the first N distinct priorities a process sees, as the service once did,
      gives each replica its own meaning for each label.)
    - The operator's meaning kept: deployments use a handful of small integers (the default 0,
      a key's default such as 10), and each keeps a series of its own; the two overflow buckets
      still say on which side of the range a request was. Three classes (below 0, 0, above 0)
      would merge priorities an operator set apart on purpose.

    Not the scheduler's ``priority_class`` (``kvgate.scheduler.policy``): that orders admission
    and is 0 for every request under ``fcfs``; this label names what the request asked for.
    """
    if priority < PRIORITY_LABEL_MIN:
        return PRIORITY_LABEL_UNDERFLOW
    if priority > PRIORITY_LABEL_MAX:
        return PRIORITY_LABEL_OVERFLOW
    return str(priority)
