"""The agent's own-node guard: a ValidatingAdmissionPolicy that lets the agent's service account
change only the node its pod runs on (RBAC cannot name the node: its ClusterRole lets it patch
every node). Rendered where ValidatingAdmissionPolicy v1 is served (1.30+), valid against the
schemas; its CEL evaluated with cel-python on the requests the agent and others make."""

from __future__ import annotations

from typing import Any

import kubeschema
import pytest
from chart.test_chart_annotation_guard import policy_answer

NAMESPACE = "gpuslice-system"  # the render fixture's default
AGENT = f"system:serviceaccount:{NAMESPACE}:gpuslice-agent"
CLAIM = "authentication.kubernetes.io/node-name"
NAME = "gpuslice-agent-own-node"


def _guard(rendered: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    policies = [p for p in rendered.all("ValidatingAdmissionPolicy")
                if p["metadata"]["name"].endswith(NAME)]
    bindings = [b for b in rendered.all("ValidatingAdmissionPolicyBinding")
                if b["metadata"]["name"].endswith(NAME)]
    if not policies and not bindings:
        return None
    assert len(policies) == len(bindings) == 1, "the policy and its binding come together"
    return policies[0], bindings[0]


@pytest.mark.parametrize(("kube_version", "rendered"), [
    (kubeschema.OLDEST, False), ("1.29.0", False), ("1.30.0", True), (kubeschema.NEWEST, True)])
def test_rendered_where_the_v1_policy_api_is_served_and_valid(
        kube_version: str, rendered: bool, render: Any) -> None:
    guard = _guard(render({}, kube_version))
    assert (guard is not None) == rendered
    if guard is not None:
        policy, binding = guard
        assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                                   "validationActions": ["Deny"]}
        assert policy["spec"]["failurePolicy"] == "Fail"
        for obj in guard:
            kubeschema.assert_valid(obj, (kube_version, kubeschema.NEWEST))


@pytest.mark.parametrize("values", [{"agent": {"ownNodeOnly": False}},
                                    {"agent": {"enabled": False}}])
def test_not_rendered_when_turned_off_or_without_the_agent(values: dict, render: Any) -> None:
    assert _guard(render(values, "1.31.0")) is None


def test_the_agents_service_account_is_the_one_matched(render: Any) -> None:
    rendered = render({}, "1.31.0")
    guard = _guard(rendered)
    assert guard is not None
    account = [sa for sa in rendered.all("ServiceAccount")
               if sa["metadata"]["name"].endswith("-agent")]
    assert [f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
            for sa in account] == [AGENT]
    rules = guard[0]["spec"]["matchConstraints"]["resourceRules"]
    assert rules == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                      "resources": ["nodes", "nodes/status"], "scope": "Cluster"}]


def answer(policy: dict[str, Any], node: str, username: str = AGENT,
           extra: dict[str, list[str]] | None = None) -> str | None:
    """The policy's answer to an UPDATE of ``node`` (a patch arrives as one): None when
    admitted (or not matched), else the denial message."""
    request: dict[str, Any] = {"operation": "UPDATE", "name": node,
                               "userInfo": {"username": username}}
    if extra is not None:
        request["userInfo"]["extra"] = extra
    node_object = {"metadata": {"name": node}}
    denial = policy_answer(policy, request, node_object, node_object)
    return None if denial is None else " ".join(denial.split())


@pytest.fixture(scope="module")
def policy(render: Any) -> dict[str, Any]:
    guard = _guard(render({}, "1.31.0"))
    assert guard is not None
    return guard[0]


def test_the_agent_may_change_its_own_node(policy: dict[str, Any]) -> None:
    assert answer(policy, "gpu-1", extra={CLAIM: ["gpu-1"], "other": ["x"]}) is None


def test_the_agent_may_not_change_another_node(policy: dict[str, Any]) -> None:
    assert answer(policy, "gpu-2", extra={CLAIM: ["gpu-1"]}) == \
        "the gpuslice agent of node gpu-1 may change only that node, not gpu-2"


@pytest.mark.parametrize("extra", [None, {}, {CLAIM: []}, {"other": ["gpu-1"]}],
                         ids=["no-extra", "empty-extra", "empty-claim", "other-claims"])
def test_a_token_naming_no_node_is_refused_with_what_to_do(
        policy: dict[str, Any], extra: dict[str, list[str]] | None) -> None:
    denial = answer(policy, "gpu-1", extra=extra)
    assert denial is not None and "agent.ownNodeOnly=false" in denial


@pytest.mark.parametrize("username", ["system:node:gpu-2", "kubernetes-admin",
                                      f"system:serviceaccount:{NAMESPACE}:gpuslice"])
def test_nobody_else_is_matched(policy: dict[str, Any], username: str) -> None:
    assert answer(policy, "gpu-2", username=username, extra={CLAIM: ["gpu-1"]}) is None
