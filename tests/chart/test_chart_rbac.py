"""RBAC is least privilege: exactly the rules each component needs, names pinned where
Kubernetes allows it, no wildcards, and every binding points at an account and a role that exist."""

from __future__ import annotations

from typing import Any

import pytest

BUILT_IN_CLUSTER_ROLES = {"system:kube-scheduler", "system:volume-scheduler"}
BUILT_IN_ROLES = {("kube-system", "extension-apiserver-authentication-reader")}


def _rules(role: dict[str, Any]) -> set[tuple[Any, ...]]:
    return {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])),
             tuple(r.get("resourceNames", ()))) for r in role["rules"]}


@pytest.mark.parametrize("values", [{}, {"tls": {"mode": "cert-manager"}},
                                    {"metrics": {"serviceMonitor": {"enabled": True}}}])
def test_no_wildcards_anywhere(values: dict[str, Any], render: Any) -> None:
    rendered = render(values)
    for role in rendered.all("ClusterRole") + rendered.all("Role"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)


def test_webhook_service_rules(render: Any) -> None:
    rendered = render()
    assert _rules(rendered.one("ClusterRole", "gpuslice-webhook")) == {
        (("",), ("pods",), ("get", "list", "watch"), ()),
        (("",), ("pods/binding",), ("create",), ()),
        (("",), ("nodes",), ("list", "watch"), ()),
        (("admissionregistration.k8s.io",), ("mutatingwebhookconfigurations",),
         ("get", "list", "patch", "watch"), ("gpuslice",)),
    }
    tls_role = rendered.one("Role", "gpuslice-tls")
    assert tls_role["metadata"]["namespace"] == "gpuslice-system"
    assert _rules(tls_role) == {(("",), ("secrets",), ("get", "update"), ("gpuslice-tls",)),
                                (("",), ("secrets",), ("create",), ())}


def test_cert_manager_mode_drops_the_bootstrap_permissions(render: Any) -> None:
    rendered = render({"tls": {"mode": "cert-manager"}})
    assert rendered.all("Role") == [rendered.one("Role", "gpuslice-scheduler-lease")]
    resources = {res for r in rendered.one("ClusterRole", "gpuslice-webhook")["rules"]
                 for res in r["resources"]}
    assert "mutatingwebhookconfigurations" not in resources and "secrets" not in resources


def test_scheduler_gets_the_stock_scheduler_roles_and_its_own_lease(render: Any) -> None:
    rendered = render({"scheduler": {"name": "shared-gpu"}})
    bound = {b["roleRef"]["name"] for b in rendered.all("ClusterRoleBinding")}
    assert BUILT_IN_CLUSTER_ROLES <= bound
    reader = rendered.one("RoleBinding", "gpuslice-scheduler-auth-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    assert _rules(rendered.one("Role", "gpuslice-scheduler-lease")) == {
        (("coordination.k8s.io",), ("leases",), ("get", "update"), ("shared-gpu",)),
        (("coordination.k8s.io",), ("leases",), ("create",), ())}


_AGENT_BASE = {
    (("",), ("nodes",), ("get", "patch"), ()),
    (("",), ("nodes/status",), ("patch",), ()),
    (("",), ("pods",), ("list",), ()),
}
_EVENTS = (("",), ("events",), ("create",), ())
_EVICT = (("",), ("pods/eviction",), ("create",), ())


@pytest.mark.parametrize("audit, extra", [
    ({}, {_EVENTS}),  # the outside check records Warning Events
    ({"overLimitAction": "evict"}, {_EVENTS, _EVICT}),
    ({"compute": {"window": 60, "tolerancePercent": 10, "overLimitAction": "evict"}},
     {_EVENTS, _EVICT}),  # the compute check evicts, the memory check does not
    ({"interval": 0, "overLimitAction": "evict"}, set()),  # the check is off
], ids=["default", "evict", "compute-evict", "off"])
def test_agent_rules_touch_only_nodes_and_list_pods_plus_what_the_check_needs(
        audit: dict[str, Any], extra: set[Any], render: Any) -> None:
    rendered = render({"agent": {"audit": audit}})
    assert _rules(rendered.one("ClusterRole", "gpuslice-agent")) == _AGENT_BASE | extra


def test_each_component_runs_as_its_own_service_account(render: Any) -> None:
    rendered = render()
    deployment = rendered.one("Deployment", "gpuslice")["spec"]["template"]["spec"]
    daemonset = rendered.one("DaemonSet", "gpuslice-agent")["spec"]["template"]["spec"]
    accounts = {sa["metadata"]["name"] for sa in rendered.all("ServiceAccount")}
    assert {deployment["serviceAccountName"], daemonset["serviceAccountName"]} == accounts
    assert deployment["serviceAccountName"] != daemonset["serviceAccountName"]


@pytest.mark.parametrize("values", [{}, {"tls": {"mode": "cert-manager"}}])
def test_every_binding_names_an_existing_account_and_role(values: dict[str, Any],
                                                          render: Any) -> None:
    rendered = render(values)
    accounts = {(sa["metadata"]["namespace"], sa["metadata"]["name"])
                for sa in rendered.all("ServiceAccount")}
    cluster_roles = {r["metadata"]["name"] for r in rendered.all("ClusterRole")}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in rendered.all("Role")}
    for binding in rendered.all("ClusterRoleBinding") + rendered.all("RoleBinding"):
        for subject in binding["subjects"]:
            assert (subject["namespace"], subject["name"]) in accounts, binding["metadata"]
        ref = binding["roleRef"]
        if ref["kind"] == "ClusterRole":
            assert ref["name"] in cluster_roles | BUILT_IN_CLUSTER_ROLES, ref
        else:
            key = (binding["metadata"]["namespace"], ref["name"])
            assert key in roles | BUILT_IN_ROLES, ref


def test_rbac_create_false_renders_accounts_but_no_roles(render: Any) -> None:
    rendered = render({"rbac": {"create": False}})
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        assert rendered.all(kind) == [], kind
    assert len(rendered.all("ServiceAccount")) == 2
