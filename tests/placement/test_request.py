"""Parsing a pod's GPU requests and placement annotations (DESIGN.md §1 rules)."""

from __future__ import annotations

from typing import Any

import pytest

from webhook.placement.request import ContainerRequest, RequestError, pod_request
from webhook.settings import Settings

S = Settings()


def pod(limits: dict[str, Any] | None = None, *, requests: dict[str, Any] | None = None,
        annotations: dict[str, str] | None = None, init: list[dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"metadata": {"name": "p", "annotations": annotations or {}},
            "spec": {"containers": [{"name": "c", "resources": resources}],
                     "initContainers": init or []}}


# (limits, expected (count, mem_mib, mem_percent, cores)) — None means no GPU request.
PARSE = [
    ({"nvidia.com/gpu": "1"}, (1, None, 100, 100)),
    ({"nvidia.com/gpu": "2"}, (2, None, 100, 100)),
    ({"nvidia.com/gpumem": "4096"}, (1, 4096, None, 0)),
    ({"nvidia.com/gpucores": "30"}, (1, None, 100, 30)),
    ({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10240", "nvidia.com/gpucores": "30"},
     (2, 10240, None, 30)),
    ({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "50"}, (1, None, 100, 50)),
    ({"nvidia.com/gpumem-percentage": "25"}, (1, None, 25, 0)),
    ({"nvidia.com/gpumem": "1k"}, (1, 1000, None, 0)),
    ({"nvidia.com/gpumem": "1Ki"}, (1, 1024, None, 0)),
    ({"nvidia.com/gpumem": 2048}, (1, 2048, None, 0)),
    ({"nvidia.com/gpu": "0"}, None),
    ({"cpu": "1"}, None),
]


@pytest.mark.parametrize("limits,expected", PARSE, ids=[str(p[0]) for p in PARSE])
def test_container_request_follows_the_resource_rules(limits: dict[str, Any],
                                                      expected: tuple[int, ...] | None) -> None:
    req = pod_request(pod(limits), S)
    if expected is None:
        assert req.containers == ()
        return
    (c,) = req.containers
    assert (c.count, c.mem_mib, c.mem_percent, c.cores) == expected


BAD = [
    ({"nvidia.com/gpumem": "1.5"}, "must be a whole number"),
    ({"nvidia.com/gpumem": "-1"}, "must not be negative"),
    ({"nvidia.com/gpumem": "lots"}, "not a quantity"),
    ({"nvidia.com/gpumem": "0"}, "must be at least 1"),
    ({"nvidia.com/gpumem-percentage": "0"}, "percentage from 1 to 100"),
    ({"nvidia.com/gpumem-percentage": "101"}, "percentage from 1 to 100"),
    ({"nvidia.com/gpucores": "101"}, "percentage from 1 to 100"),
    ({"nvidia.com/gpumem": "1", "nvidia.com/gpumem-percentage": "5"}, "both set"),
    ({"nvidia.com/gpu": "500m"}, "whole number"),
]


@pytest.mark.parametrize("limits,message", BAD, ids=[str(b[0]) for b in BAD])
def test_invalid_requests_raise_a_clear_error(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        pod_request(pod(limits), S)
    assert "container 'c'" in str(info.value)


def test_requests_without_limits_are_an_error_as_in_the_webhook() -> None:
    with pytest.raises(RequestError, match="put GPU resources in limits"):
        pod_request(pod(None, requests={"nvidia.com/gpumem": "100"}), S)


def test_requests_equal_to_limits_are_accepted() -> None:
    (c,) = pod_request(pod({"nvidia.com/gpumem": "100"},
                           requests={"nvidia.com/gpumem": "100"}), S).containers
    assert c.mem_mib == 100


def test_configured_resource_names_are_used() -> None:
    s = Settings(resource_gpu="example.com/gpu", resource_mem="example.com/mem",
                 resource_mem_percent="example.com/mem-pct", resource_cores="example.com/cores")
    (c,) = pod_request(pod({"example.com/mem": "100", "example.com/cores": "20"}), s).containers
    assert (c.mem_mib, c.cores) == (100, 20)
    assert pod_request(pod({"nvidia.com/gpumem": "100"}), s).containers == ()


def test_init_and_sidecar_containers_are_told_apart() -> None:
    init = [{"name": "side", "restartPolicy": "Always",
             "resources": {"limits": {"nvidia.com/gpumem": "1"}}},
            {"name": "prep", "resources": {"limits": {"nvidia.com/gpumem": "2"}}}]
    req = pod_request(pod({"nvidia.com/gpumem": "3"}, init=init), S)
    assert [(c.name, c.kind, c.order) for c in req.containers] == [
        ("side", "sidecar", 0), ("prep", "init", 1), ("c", "app", 0)]


def test_percentage_memory_resolves_against_the_gpu() -> None:
    c = ContainerRequest("c", "app", 0, 1, None, 25, 0)
    assert c.memory_on(81920) == 20480
    assert c.memory_on(24576) == 6144


def test_policy_and_filters_come_from_ours_and_hamis_annotations() -> None:
    req = pod_request(pod({"nvidia.com/gpumem": "1"}, annotations={
        "hami.io/gpu-scheduler-policy": "Spread",
        "gpuslice.io/gpu-type": "A100, H100", "nvidia.com/use-gputype": "H200",
        "nvidia.com/nouse-gputype": "T4", "gpuslice.io/avoid-gpu-uuid": "GPU-X",
        "nvidia.com/use-gpuuuid": "GPU-Y"}), S)
    assert req.policy == "spread"
    assert req.include_types == ("a100", "h100", "h200")
    assert req.exclude_types == ("t4",)
    assert req.exclude_uuids == ("gpu-x",)
    assert req.include_uuids == ("gpu-y",)


@pytest.mark.parametrize(("value", "policy"), [
    ("topology-aware", "binpack"), ("numa", "binpack"), ("Mutex", "binpack"),
    ("numa, spread", "spread"), ("binpack,topology-aware", "binpack")])
def test_hamis_own_gpu_policies_are_read_past(value: str, policy: str) -> None:
    """HAMi knows GPU policies gpuslice does not (and comma chains of them): a pod written for
    HAMi is placed by the binpack or spread in its chain, else by the default."""
    req = pod_request(pod({"nvidia.com/gpumem": "1"},
                          annotations={"hami.io/gpu-scheduler-policy": value}), S)
    assert req.policy == policy


def test_a_policy_hami_does_not_know_either_is_still_an_error() -> None:
    with pytest.raises(RequestError, match="hami.io/gpu-scheduler-policy"):
        pod_request(pod({"nvidia.com/gpumem": "1"},
                        annotations={"hami.io/gpu-scheduler-policy": "binpack,tight"}), S)
    with pytest.raises(RequestError, match="gpuslice.io/placement"):
        pod_request(pod({"nvidia.com/gpumem": "1"},
                        annotations={"gpuslice.io/placement": "numa"}), S)


def test_default_policy_comes_from_settings() -> None:
    req = pod_request(pod({"nvidia.com/gpumem": "1"}), Settings(default_policy="spread"))
    assert req.policy == "spread"


def test_unknown_policy_is_an_error_naming_the_annotation() -> None:
    with pytest.raises(RequestError, match="gpuslice.io/placement"):
        pod_request(pod({"nvidia.com/gpumem": "1"},
                        annotations={"gpuslice.io/placement": "random"}), S)
