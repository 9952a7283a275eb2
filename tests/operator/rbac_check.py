"""Which of the operator's API requests ``REQUIRED_RULES`` would not allow."""

from __future__ import annotations

from collections.abc import Iterable

from tests.operator.kube_emulator import Call
from tests.operator.rbac import allows


def verb(call: Call) -> str:
    if call.method == "GET":
        return "watch" if call.watch else ("get" if call.name else "list")
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[call.method]


def unauthorised_calls(journal: Iterable[Call]) -> list[str]:
    """Requests by the operator (not by the test) outside REQUIRED_RULES, as 'verb group/res'."""
    denied = set()
    for call in journal:
        if call.user_agent.startswith("kmock/") or not call.plural:
            continue  # the test's own requests; discovery (non-resource URLs, always allowed)
        resource = call.plural + (f"/{call.subresource}" if call.subresource else "")
        if not allows(call.group, resource, verb(call)):
            denied.add(f"{verb(call)} {call.group or 'core'}/{resource}")
    return sorted(denied)


def used_permissions(journal: Iterable[Call]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of every request the operator made."""
    used = set()
    for call in journal:
        if call.user_agent.startswith("kmock/") or not call.plural:
            continue
        resource = call.plural + (f"/{call.subresource}" if call.subresource else "")
        used.add((call.group, resource, verb(call)))
    return used
