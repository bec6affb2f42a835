"""The placement state: inventories, allocations from device annotations, reservations."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
from placement.kubeobjects import gpu_node, gpu_pod

from webhook import names
from webhook.placement.fit import Placement, place
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
    (json.dumps([gpu(uuid="GPU-0,GPU-1")]), "uuid 'GPU-0,GPU-1' must not contain commas"),
    (json.dumps([gpu(uuid=" GPU-0")]), "must not contain commas, white space"),
    (json.dumps([gpu(uuid="GPU-\x000")]), "or control characters"),
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


@pytest.mark.parametrize("key", [names.ANN_PLACEMENT, names.HAMI_POLICY])
def test_policy_annotation_edited_on_a_bound_pod_leaves_it_holding_its_slice(key: str) -> None:
    """The placement policy only matters until the pod is placed, and pod annotations stay
    editable (the annotation guard keeps only the device and limits keys): a bound pod whose
    policy annotation is later set to a value the webhook would refuse still holds its slice,
    not its GPUs whole, which would keep every other pod off them while it runs (and after a
    restart of the extender, which counts it again from the pod)."""
    pod = gpu_pod("a", {"nvidia.com/gpumem": "8000"}, node="n1", devices="GPU-0",
                  phase="Running")
    pod["metadata"]["uid"] = "uid-a"
    pod["metadata"]["resourceVersion"] = "10"
    edited = copy.deepcopy(pod)
    edited["metadata"]["annotations"][key] = "pack"
    edited["metadata"]["resourceVersion"] = "11"
    second = pod_request(gpu_pod("b", {"nvidia.com/gpumem": "8000"}), S)
    running, restarted = ClusterState(S), ClusterState(S)
    for state in (running, restarted):
        state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    running.apply_pod(pod)
    running.apply_pod(edited)  # the watch's MODIFIED event
    restarted.apply_pod(edited)  # a fresh extender's list
    for state in (running, restarted):
        n1 = node(state, "n1")
        assert n1.usage == {"GPU-0": Usage(8000, 0, 1, 0)}
        assert isinstance(place(second, n1.gpus, n1.usage, S.split_count), Placement)


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
    assert state.node("n1") is None  # forgotten with its last pod


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


def _pod(uid: str, rv: str, node: str | None = "n1", mib: str = "6000",
         phase: str = "Running") -> dict[str, Any]:
    pod = gpu_pod(uid, {"nvidia.com/gpumem": mib}, node=node,
                  devices="GPU-0" if node else None, phase=phase)
    pod["metadata"] |= {"uid": uid, "resourceVersion": rv}
    return pod


def test_lagging_watch_event_older_than_the_bound_pod_is_ignored() -> None:
    """The bind's read of the pod showed it bound (version 7); the watch then delivers an
    older update (version 6, still unbound): the GPU stays taken."""
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 10000)]))
    _reserve(state, "p")
    state.apply_pod(_pod("p", "7"))
    state.apply_pod(_pod("p", "6", node=None, phase="Pending"))
    assert not state.allocs["p"].assumed
    assert node(state, "n1").usage == {"GPU-0": Usage(6000, 0, 1, 0)}
    state.apply_pod(_pod("p", "9", phase="Succeeded"))  # newer: applied
    assert state.allocs == {} and node(state, "n1").usage == {}


@pytest.mark.parametrize("in_snapshot", [True, False], ids=["unbound-in-list", "absent"])
def test_relist_snapshot_older_than_a_confirmed_bind_keeps_it(in_snapshot: bool) -> None:
    """A list is requested (version 5), the bind's answer is lost and its read of the pod
    confirms it (version 7), then the list arrives with the pod unbound (or not yet created)."""
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 10000)]))
    listed_at = time.monotonic()
    _reserve(state, "p")
    state.apply_pod(_pod("p", "7"))
    snapshot = [_pod("p", "4", node=None, phase="Pending")] if in_snapshot else []
    state.replace_pods(snapshot, listed_at, "5")
    assert not state.allocs["p"].assumed
    assert node(state, "n1").usage == {"GPU-0": Usage(6000, 0, 1, 0)}


def test_relist_still_drops_pods_deleted_before_it() -> None:
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 10000)]))
    state.apply_pod(_pod("gone", "3"))
    state.apply_pod(_pod("done", "4"))
    listed_at = time.monotonic()
    state.replace_pods([_pod("done", "6", phase="Succeeded")], listed_at, "8")
    assert state.allocs == {} and node(state, "n1").usage == {}


def test_opaque_resource_versions_fall_back_to_when_the_list_was_requested() -> None:
    """Versions that are not integers are never compared: what was applied after the list
    was requested is kept, what was applied before it follows the list."""
    state = ClusterState(S)
    state.apply_node(gpu_node("n1", [("GPU-0", 24576)]))
    state.apply_pod(_pod("before", "x1", mib="1000"))
    listed_at = time.monotonic()
    state.apply_pod(_pod("after", "x2", mib="2000"))
    state.apply_pod(_pod("late", "x3", mib="3000"))
    state.replace_pods([_pod("late", "x0", node=None, phase="Pending")], listed_at, "x9")
    assert set(state.allocs) == {"after", "late"}
    assert node(state, "n1").usage == {"GPU-0": Usage(5000, 0, 2, 0)}


def test_pods_on_a_failed_or_vanished_gpu_neither_free_nor_burden_the_others() -> None:
    """GPU-1 goes Unhealthy, then falls out of the annotation, then comes back after a reset:
    its pod's slice stays on GPU-1 throughout (never moved onto GPU-0's view, never counted
    twice), nothing new goes to GPU-1 while it is not healthy, and GPU-0 keeps its whole room;
    back healthy, GPU-1's room is what its pod left."""
    state = ClusterState(S)
    two = [("GPU-0", 24576), ("GPU-1", 24576)]
    state.apply_node(gpu_node("n1", two))
    on1 = gpu_pod("on1", {"nvidia.com/gpumem-percentage": "75", "nvidia.com/gpucores": "40"},
                  node="n1", devices="GPU-1", phase="Running")
    on1["metadata"]["uid"] = "uid-on1"
    state.apply_pod(on1)
    want = pod_request(gpu_pod("new", {"nvidia.com/gpumem": "20000"}), S)
    big = pod_request(gpu_pod("big", {"nvidia.com/gpumem": "24576"}), S)
    for inventory in (gpu_node("n1", two, unhealthy=("GPU-1",)), gpu_node("n1", two[:1])):
        state.apply_node(inventory)
        n = node(state, "n1")
        assert n.usage == {"GPU-1": Usage(18432 if len(n.gpus) == 2 else 0, 40, 1, 0)}
        for req in (want, big):  # GPU-0 whole
            placed = place(req, n.gpus, n.usage, S.split_count)
            assert isinstance(placed, Placement) and placed.assignment == {"main": ("GPU-0",)}
        state.reserve("uid-x", "default", "x", "n1", want, {"main": ("GPU-0",)})
        placed2 = place(want, n.gpus, n.usage, S.split_count)
        assert not isinstance(placed2, Placement)  # GPU-0 full, GPU-1 not offered
        state.release("uid-x")
    state.apply_node(gpu_node("n1", two))  # reset: healthy again
    n = node(state, "n1")
    assert n.usage == {"GPU-1": Usage(18432, 40, 1, 0)}
    small = pod_request(gpu_pod("s", {"nvidia.com/gpumem": "6000"}), S)
    state.reserve("uid-y", "default", "y", "n1", big, {"main": ("GPU-0",)})
    placed = place(small, n.gpus, n.usage, S.split_count)
    assert isinstance(placed, Placement) and placed.assignment == {"main": ("GPU-1",)}
    assert not isinstance(place(want, n.gpus, n.usage, S.split_count), Placement)
