"""The chart grants the operator exactly what it uses: tests/operator/rbac.py REQUIRED_RULES.

REQUIRED_RULES is the operator's own list; its behaviour tests check that every request the
operator makes against the API is covered by it (tests/operator/rbac_check.py). Here the
chart's Roles or ClusterRole must grant that list and nothing more: no missing verb, no extra
one, no wildcard. The one part that depends on how the operator runs is the peering kind, and
it is kopf that decides which one it uses.
"""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from kopf._core.engines.peering import guess_selectors

from tests.chart.conftest import rendered_set
from tests.chart.manifests import Permission, Rendered, permissions, wildcards
from tests.operator.rbac import REQUIRED_RULES, Rule

PEERING_PLURALS = {"kopfpeerings", "clusterkopfpeerings"}


def _required() -> set[Permission]:
    return permissions(rule.as_policy_rule() for rule in REQUIRED_RULES)


def _peering_plurals_kopf_uses(*, clusterwide: bool, standalone: bool) -> set[str]:
    settings = kopf.OperatorSettings()
    settings.peering.standalone = standalone
    settings.peering.clusterwide = clusterwide
    # kopf names its peering resources by plural (``any_name``) in two API groups; the chart
    # installs the kopf.dev ones.
    return {
        str(selector.plural or selector.any_name)
        for selector in guess_selectors(settings=settings)
        if selector.group == "kopf.dev"
    }


def expected_permissions(*, clusterwide: bool, standalone: bool) -> set[Permission]:
    used = _peering_plurals_kopf_uses(clusterwide=clusterwide, standalone=standalone)
    unused = PEERING_PLURALS - used
    return {p for p in _required() if p[1] not in unused}


def rbac_problems(rules: list[dict[str, Any]], expected: set[Permission]) -> list[str]:
    """What is wrong with ``rules`` as the operator's permissions (empty when exact)."""
    granted = permissions(rules)
    problems = [f"wildcard: {w}" for w in wildcards(rules)]
    problems += [
        f"missing: {verb} {group or 'core'}/{res}"
        for group, res, verb in sorted(expected - granted)
    ]
    problems += [
        f"not used by the operator: {verb} {group or 'core'}/{res}"
        for group, res, verb in sorted(granted - expected)
    ]
    for rule in rules:
        if set(rule) - {"apiGroups", "resources", "verbs"}:
            problems.append(f"unexpected keys in {rule}")
    return problems


def _mode(rendered: Rendered) -> tuple[bool, bool]:
    operator = rendered.value_set.values.get("operator", {})
    clusterwide = bool(operator.get("watch", {}).get("allNamespaces", False))
    standalone = not operator.get("peering", {}).get("enabled", True)
    return clusterwide, standalone


def test_every_role_grants_exactly_what_the_operator_uses(rendered: Rendered) -> None:
    clusterwide, standalone = _mode(rendered)
    expected = expected_permissions(clusterwide=clusterwide, standalone=standalone)
    roles = rendered.of_kind("ClusterRole" if clusterwide else "Role")
    assert roles, "no operator role rendered"
    for role in roles:
        assert rbac_problems(role["rules"], expected) == [], role["metadata"]
    assert rendered.of_kind("Role" if clusterwide else "ClusterRole") == []


def test_bindings_give_the_roles_to_the_operator_account(rendered: Rendered) -> None:
    clusterwide, _ = _mode(rendered)
    deployment = rendered.operator()
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = deployment["metadata"]["namespace"]
    roles = {
        (r["metadata"].get("namespace"), r["metadata"]["name"])
        for r in rendered.of_kind("ClusterRole" if clusterwide else "Role")
    }
    bindings = rendered.of_kind("ClusterRoleBinding" if clusterwide else "RoleBinding")
    assert len(bindings) == len(roles)
    for binding in bindings:
        ref = binding["roleRef"]
        assert ref["kind"] == ("ClusterRole" if clusterwide else "Role")
        assert (binding["metadata"].get("namespace"), ref["name"]) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        ]
    accounts = rendered.of_kind("ServiceAccount")
    created = rendered.value_set.values.get("serviceAccount", {}).get("create", True)
    assert [a["metadata"]["name"] for a in accounts] == ([account] if created else [])


def test_roles_cover_each_watched_namespace(rendered_sets: dict[str, Rendered]) -> None:
    rendered = rendered_set(rendered_sets, "everything")
    assert {r["metadata"]["namespace"] for r in rendered.of_kind("Role")} == {"serving", "batch"}


def test_kopf_decides_the_peering_kind() -> None:
    assert _peering_plurals_kopf_uses(clusterwide=False, standalone=False) == {"kopfpeerings"}
    assert _peering_plurals_kopf_uses(clusterwide=True, standalone=False) == {"clusterkopfpeerings"}
    assert _peering_plurals_kopf_uses(clusterwide=False, standalone=True) == set()
    # REQUIRED_RULES names both kinds; the chart grants the one in use.
    assert {p[1] for p in _required()} >= PEERING_PLURALS


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"verbs": ["get", "list", "watch"]}, "missing: patch kvgate.dev/executorpools"),
        ({"verbs": ["get", "list", "watch", "patch", "delete"]}, "not used by the operator"),
        ({"verbs": ["*"]}, "wildcard: verbs: *"),
        ({"resources": ["*"]}, "wildcard: resources: *"),
        ({"resourceNames": ["x"]}, "unexpected keys"),
    ],
    ids=["missing-verb", "extra-verb", "wildcard-verb", "wildcard-resource", "resource-names"],
)
def test_the_comparison_can_fail(change: dict[str, Any], problem: str) -> None:
    """A broken rule set is reported (the check above is not vacuous)."""
    expected = expected_permissions(clusterwide=False, standalone=False)
    rules = [
        Rule(r.api_group, r.resources, r.verbs, r.why).as_policy_rule()
        for r in REQUIRED_RULES
        if r.resources != ("clusterkopfpeerings",)
    ]
    assert rbac_problems(rules, expected) == []
    rules[0] = {**rules[0], **change}
    assert any(problem in p for p in rbac_problems(rules, expected)), rbac_problems(rules, expected)
