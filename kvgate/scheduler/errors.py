"""Errors the scheduler raises. "No room" is never an error; these are."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never run here (e.g. it cannot fit an empty cache)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


class SchedulerStalled(RuntimeError):
    """Work exists but no row progressed for ``stall_steps`` steps: a livelock made loud."""

    def __init__(self, message: str, dump: str) -> None:
        super().__init__(f"{message}\n{dump}")
        self.dump = dump


class InvariantViolation(AssertionError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class PlanRejected(RuntimeError):
    """The executor refused a plan; the scheduler's view of that executor is no longer valid."""
