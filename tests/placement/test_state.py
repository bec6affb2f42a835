"""The placement state: inventories, allocations from device annotations, reservations."""

from __future__ import annotations

import json
from typing import Any

import pytest
from placement.kubeobjects import gpu_node, gpu_pod

from webhook.placement.inventory import InventoryError, Usage, parse_inventory
from webhook.placement.request import pod_request
from webhook.placement.state import ClusterState, NodeState
from webhook.settings import Settings

S = Settings()


def node(state: ClusterState, name: str) -> NodeState:
    found = state.node(name)
    assert found is not None
    return found


def gpu(uuid: str = "GPU-0", **over: Any) -> dict[str, Any]:
    return {"uuid": uuid, "index": 0, "product": "NVIDIA L4", "memoryMiB": 24576,
            "health": "Healthy"} | over


@pytest.mark.parametrize("raw,message", [
    (None, "no gpuslice.io/gpus annotation"),
    ("{not json", "not valid JSON"),
    ('{"uuid": "x"}', "must be a JSON list"),
    (json.dumps(["x"]), "[0] must be an object"),
    (json.dumps([gpu(uuid="")]), "uuid must be a non-empty string"),
    (json.dumps([gpu(), gpu(index=1)]), "lists GPU-0 twice"),
    (json.dumps([gpu(), gpu("GPU-1")]), "lists index 0 twice"),
    (json.dumps([gpu(index=-1)]), "index must be a non-negative integer"),
    (json.dumps([gpu(memoryMiB=0)]), "memoryMiB must be a positive integer"),
    (json.dumps([gpu(memoryMiB="24G")]), "memoryMiB must be a positive integer"),
    (json.dumps([gpu(health="Sick")]), "health must be Healthy or Unhealthy"),
])
def test_malformed_inventory_is_rejected_with_the_reason(raw: Any, message: str) -> None:
    with pytest.raises(InventoryError, match=message.replace("[", r"\[")):
        parse_inventory(raw)


def test_inventory_is_sorted_by_index() -> None:
    gpus = parse_inventory(json.dumps([gpu("B", index=1), gpu("A", index=0)]))
    assert [g.uuid for g in gpus] == ["A", "B"]


def test_node_with_bad_inventory_offers_no_gpus_and_says_why() -> None:
    state = ClusterState(S)
    bad = gpu_node("n1", [("GPU-0", 1000)])
    bad["metadata"]["annotations"]["gpuslice.io/gpus"] = "[oops"
    state.apply_node(bad)
    assert node(state, "n1").gpus == ()
    assert "not valid JSON" in (node(state, "n1").inventory_error or "")


def test_percentage_allocations_are_recounted_when_the_inventory_arrives_late() -> None:
    state = ClusterState(S)
    pod = gpu_pod("a", {"nvidia.com/gpumem-percentage": "50"}, node="n1", devices="GPU-0",
                  phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    state.apply_pod(pod)  # the pod is seen before its node
    assert node(state, "n1").usage == {"GPU-0": Usage(0, 0, 1, 0)}
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    assert node(state, "n1").usage == {"GPU-0": Usage(12288, 0, 1, 0)}


def test_pod_with_unreadable_requests_holds_its_gpus_whole() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    pod = gpu_pod("a", {"nvidia.com/gpumem": "1.5"}, node="n1", devices="GPU-0",
                  phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    state.apply_pod(pod)
    assert node(state, "n1").usage == {"GPU-0": Usage(24576, 100, 1, 1)}


def test_pod_without_device_annotations_holds_nothing() -> None:
    state = ClusterState(S)
    pod = gpu_pod("a", {"nvidia.com/gpumem": "100"}, node="n1", phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    state.apply_pod(pod)
    assert state.allocs == {}


def test_long_container_names_use_the_shared_annotation_key() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    name = "c" * 70
    pod = gpu_pod("a", {"nvidia.com/gpumem": "100"}, container=name, node="n1",
                  phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    from webhook.names import devices_annotation
    pod["metadata"]["annotations"] = {devices_annotation(name): "GPU-0"}
    state.apply_pod(pod)
    assert node(state, "n1").usage == {"GPU-0": Usage(100, 0, 1, 0)}


def _reserve(state: ClusterState, uid: str) -> None:
    req = pod_request(gpu_pod(uid, {"nvidia.com/gpumem": "100"}), S)
    state.reserve(uid, "default", uid, "n1", req, {"main": ("GPU-0",)})


def test_relist_keeps_reservations_newer_than_the_list_and_drops_stale_ones() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    _reserve(state, "old")
    listed_at = state.allocs["old"].reserved_at + 1e-6
    state.allocs["old"].reserved_at -= 1.0  # reserved before the list was asked for
    _reserve(state, "new")
    state.allocs["new"].reserved_at = listed_at + 1.0  # reserved while the list was in flight
    state.replace_pods([], listed_at)
    assert set(state.allocs) == {"new"}
    assert node(state, "n1").usage == {"GPU-0": Usage(100, 0, 1, 0)}


def test_unbound_update_of_a_reserved_pod_keeps_the_reservation() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    _reserve(state, "p")
    pending = gpu_pod("p", {"nvidia.com/gpumem": "100"})
    pending["metadata"]["uid"] = "p"
    state.apply_pod(pending)  # e.g. a status update racing the bind
    assert state.allocs["p"].assumed
    state.release("p")
    assert state.allocs == {} and node(state, "n1").usage == {}


def test_deleted_node_keeps_the_usage_of_its_pods_until_they_go() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    pod = gpu_pod("a", {"nvidia.com/gpumem": "100"}, node="n1", devices="GPU-0",
                  phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    state.apply_pod(pod)
    state.delete_node("n1")
    assert node(state, "n1").gpus == () and node(state, "n1").usage
    state.delete_pod(pod)
    assert node(state, "n1").usage == {}


def test_undecided_reservation_is_kept_until_its_deadline_then_dropped() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    _reserve(state, "p")
    state.keep_until("p", 100.0)
    assert state.expire(99.9) == 0 and state.allocs["p"].expires_at == 100.0
    assert node(state, "n1").usage == {"GPU-0": Usage(100, 0, 1, 0)}
    assert state.expire(100.0) == 1
    assert state.allocs == {} and node(state, "n1").usage == {}


def test_undecided_reservation_confirmed_by_the_watch_no_longer_expires() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    _reserve(state, "p")
    state.keep_until("p", 100.0)
    bound = gpu_pod("p", {"nvidia.com/gpumem": "100"}, node="n1", devices="GPU-0")
    bound["metadata"]["uid"] = "p"
    state.apply_pod(bound)  # the late Binding, seen by the watch: counted once
    assert not state.allocs["p"].assumed and state.allocs["p"].expires_at is None
    assert state.expire(1e9) == 0
    assert node(state, "n1").usage == {"GPU-0": Usage(100, 0, 1, 0)}
