"""Table-driven tests of the pure placement functions (cases in fit_cases.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from webhook.placement.fit import NoFit, Placement, node_score, place
from webhook.placement.inventory import Gpu, Usage
from webhook.placement.request import pod_request
from webhook.settings import Settings

CASES = yaml.safe_load((Path(__file__).parent / "fit_cases.yaml").read_text())
SETTINGS = Settings()


def make_gpus(spec: list[dict[str, Any]]) -> tuple[Gpu, ...]:
    return tuple(Gpu(g["uuid"], g.get("index", i), g.get("product", "NVIDIA A100-SXM4-80GB"),
                     g["memoryMiB"], g.get("health", "Healthy") == "Healthy")
                 for i, g in enumerate(spec))


def make_pod(spec: dict[str, Any]) -> dict[str, Any]:
    def container(c: dict[str, Any]) -> dict[str, Any]:
        out = {"name": c["name"], "image": "x", "resources": {"limits": c.get("limits", {})}}
        if "restartPolicy" in c:
            out["restartPolicy"] = c["restartPolicy"]
        return out
    return {"metadata": {"name": "p", "namespace": "default", "uid": "u",
                         "annotations": spec.get("annotations", {})},
            "spec": {"containers": [container(c) for c in spec.get("containers", [])],
                     "initContainers": [container(c) for c in spec.get("initContainers", [])]}}


def run_case(case: dict[str, Any]) -> Placement | NoFit:
    gpus = make_gpus(case["gpus"])
    used = {uuid: Usage(**u) for uuid, u in (case.get("used") or {}).items()}
    req = pod_request(make_pod(case["pod"]), SETTINGS)
    return place(req, gpus, used, case.get("split", 10))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_fit_case(case: dict[str, Any]) -> None:
    result = run_case(case)
    expect = case["expect"]
    if "nofit" in expect:
        assert isinstance(result, NoFit), f"expected no fit, got {result}"
        assert expect["nofit"] in result.reason
        assert result.unresolvable is expect["unresolvable"]
        return
    assert isinstance(result, Placement), f"expected a placement, got {result}"
    assert {c: list(u) for c, u in result.assignment.items()} == expect["assignment"]
    if "demand" in expect:
        assert result.demand == {uuid: Usage(**d) for uuid, d in expect["demand"].items()}
    if "score" in expect:
        assert result.score == expect["score"]


def test_placement_never_mutates_the_usage_it_is_given() -> None:
    case = next(c for c in CASES if c["name"] == "binpack_picks_the_tightest_fitting_gpu")
    gpus = make_gpus(case["gpus"])
    used = {uuid: Usage(**u) for uuid, u in case["used"].items()}
    before = {k: v.copy() for k, v in used.items()}
    place(pod_request(make_pod(case["pod"]), SETTINGS), gpus, used, 10)
    assert used == before


@pytest.mark.parametrize("policy,fuller_wins", [("binpack", True), ("spread", False)])
def test_node_score_orders_nodes_by_policy(policy: str, fuller_wins: bool) -> None:
    gpus = make_gpus([{"uuid": "A", "memoryMiB": 10000}])
    demand = {"A": Usage(1000, 0, 1, 0)}
    full = node_score(policy, gpus, {"A": Usage(7000, 0, 1, 0)}, demand)
    empty = node_score(policy, gpus, {}, demand)
    assert (full > empty) is fuller_wins
    assert 0 <= min(full, empty) and max(full, empty) <= 10


def test_node_score_of_a_node_without_healthy_gpus_is_zero() -> None:
    gpus = make_gpus([{"uuid": "A", "memoryMiB": 10000, "health": "Unhealthy"}])
    assert node_score("binpack", gpus, {}, {}) == 0
