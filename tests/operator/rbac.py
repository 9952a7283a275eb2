"""Exactly the permissions the operator uses: its own calls (``kube``) and kopf's.

The chart's RBAC is checked against ``REQUIRED_RULES``, and the operator's behaviour tests check
that every API request the operator makes is covered by them. Bind them with a ClusterRole when
the operator watches all namespaces, or with a Role in each watched namespace otherwise (the
cluster-scoped ``clusterkopfpeerings`` rule is needed only for ``--all-namespaces``).

Not needed, on purpose: namespaces and CRDs (kopf's scanning is disabled: namespaces are given
explicitly), ``update`` (only merge patches), ``deletecollection``, and reading any Secret:
the operator derives each pool's admin token from its own key and only ``create``s the Secret
the admission pod mounts (``tokens.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kvgate.operator.naming import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    api_group: str  # "" is the core API group
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def as_policy_rule(self) -> dict[str, Any]:
        """The rule as an ``rbac.authorization.k8s.io/v1`` PolicyRule."""
        return {
            "apiGroups": [self.api_group],
            "resources": list(self.resources),
            "verbs": list(self.verbs),
        }


REQUIRED_RULES: Final[tuple[Rule, ...]] = (
    Rule(GROUP, (PLURAL,), ("get", "list", "watch", "patch"), "watch pools; kopf's bookkeeping"),
    Rule(GROUP, (f"{PLURAL}/status",), ("patch",), "report pool status"),
    Rule(GROUP, (f"{PLURAL}/scale",), ("patch",), "autoscaling: set replicas from the load"),
    Rule(
        "",
        ("pods",),
        ("list", "watch", "create", "patch", "delete"),
        "executor pods: create, mark draining, delete; watch pool pods",
    ),
    Rule("", ("services", "configmaps"), ("get", "create", "patch"), "pool Services, ConfigMap"),
    Rule("apps", ("deployments",), ("get", "create", "patch"), "admission Deployment"),
    Rule("", ("secrets",), ("create",), "per-pool admin token Secret (written once, never read)"),
    Rule("", ("events",), ("create",), "Events about pools"),
    Rule("kopf.dev", ("kopfpeerings",), ("get", "list", "watch", "patch"), "leader election"),
    Rule(
        "kopf.dev",
        ("clusterkopfpeerings",),
        ("get", "list", "watch", "patch"),
        "leader election with --all-namespaces",
    ),
)


def allows(api_group: str, resource: str, verb: str) -> bool:
    """Whether ``REQUIRED_RULES`` grant ``verb`` on ``resource`` (``plural[/subresource]``)."""
    return any(
        rule.api_group == api_group and resource in rule.resources and verb in rule.verbs
        for rule in REQUIRED_RULES
    )
