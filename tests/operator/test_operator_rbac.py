"""REQUIRED_RULES: well-formed, and the check that guards them can fail."""

from __future__ import annotations

from tests.operator.kube_emulator import Call
from tests.operator.rbac import REQUIRED_RULES, allows
from tests.operator.rbac_check import unauthorised_calls


def call(
    method: str,
    group: str,
    plural: str,
    name: str | None = None,
    *,
    subresource: str | None = None,
    watch: bool = False,
    user_agent: str = "kvgate-operator",
) -> Call:
    return Call(
        seq=1,
        method=method,
        group=group,
        plural=plural,
        subresource=subresource,
        namespace="default",
        name=name,
        watch=watch,
        user_agent=user_agent,
        status=200,
    )


def test_rules_are_policy_rules_without_repeats() -> None:
    seen = set()
    for rule in REQUIRED_RULES:
        policy = rule.as_policy_rule()
        assert set(policy) == {"apiGroups", "resources", "verbs"}
        for resource in rule.resources:
            for verb in rule.verbs:
                key = (rule.api_group, resource, verb)
                assert key not in seen, key
                seen.add(key)
    assert not any("*" in part for part in (k for key in seen for k in key))  # nothing wild


def test_what_the_operator_must_never_do() -> None:
    assert not allows("", "secrets", "list")  # it reads only the admin-token Secrets by name
    assert not allows("", "pods", "update")
    assert not allows("apps", "deployments", "delete")  # children go by garbage collection
    assert not allows("", "namespaces", "list")
    assert not allows("kvgate.dev", "executorpools", "delete")


def test_the_check_reports_requests_outside_the_rules() -> None:
    journal = [
        call("GET", "", "pods", watch=True),
        call("PATCH", "kvgate.dev", "executorpools", "p", subresource="status"),
        call("DELETE", "apps", "deployments", "p-admission"),
        call("GET", "", "secrets"),
        call("DELETE", "apps", "deployments", "x", user_agent="kmock/0.8"),  # the test's own
    ]
    assert unauthorised_calls(journal) == ["delete apps/deployments", "list core/secrets"]
