"""Pods nominated to a node hold the GPUs their preemption freed (kube-scheduler's nominated pods).

After preemption kube-scheduler sets the preemptor's ``status.nominatedNodeName`` and deletes
the victims. Until the preemptor is bound, its in-tree filters treat every pod nominated to a
node with a priority at least the filtered pod's (not the pod itself) as already there
(``RunFilterPluginsWithNominatedPods`` / ``addGENominatedPods``). ExtenderArgs carries no
nominated pods: the extender reads them from the watched pods. These tests run the scheduler's
side by hand against the fake API server: the status patch, the deletions, the filters and
binds in the wire format it sends.
"""

from __future__ import annotations

from typing import Any

from fakekube import FakeKube
from kubernetes_asyncio import client
from placement.kubeobjects import eventually, gpu_node, gpu_pod

from webhook.placement.state import ClusterState
from webhook.settings import Settings

GIB = 1024
A100 = 80 * GIB
MEM30 = {"nvidia.com/gpumem": str(30 * GIB)}
MEM60 = {"nvidia.com/gpumem": str(60 * GIB)}


def bound(name: str, node: str, devices: str, limits: dict[str, str], priority: int,
          start: str) -> dict[str, Any]:
    pod = gpu_pod(name, limits, node=node, devices=devices, phase="Running")
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["priority"] = priority
    pod["status"]["startTime"] = start
    return pod


def pending(name: str, limits: dict[str, str], priority: int,
            annotations: dict[str, str] | None = None, mutated: bool = True) -> dict[str, Any]:
    pod = gpu_pod(name, limits, annotations=annotations, mutated=mutated)
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["priority"] = priority
    return pod


def thirty_each(kube: FakeKube) -> None:
    """n1: two 80 GiB GPUs, two 30 GiB pods of priority 100 on each; n2: one empty GPU."""
    kube.put(gpu_node("n1", [("GPU-0", A100), ("GPU-1", A100)]))
    kube.put(gpu_node("n2", [("GPU-9", A100)]))
    for i, gpu in enumerate(("GPU-0", "GPU-0", "GPU-1", "GPU-1"), 1):
        kube.put(bound(f"p{i}", "n1", gpu, MEM30, 100, f"2026-01-01T00:00:0{i}Z"))


async def nominate(kube: FakeKube, pod: dict[str, Any], node: str) -> None:
    """What kube-scheduler does after preemption (and with "" when it clears a nomination):
    a strategic merge patch of the pod's status subresource."""
    async with kube.api_client() as api:
        await client.CoreV1Api(api).patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"],
            {"status": {"nominatedNodeName": node or None}})


async def filter_on(ext: Any, pod: dict[str, Any], *nodes: str) -> dict[str, Any]:
    return await ext.post("filter", {"Pod": kube_view(ext, pod), "NodeNames": list(nodes)})  # type: ignore[no-any-return]


def kube_view(ext: Any, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the scheduler sends it: the API server's object."""
    return ext.kube.get("pods", pod["metadata"]["name"]) or pod


async def preempted(kube: FakeKube, ext: Any, preemptor: dict[str, Any],
                    proposed: list[str]) -> list[str]:
    """The extender's victims on n1 for ``preemptor``; the scheduler nominates it to n1 and
    deletes them (at once: no grace period)."""
    out = await ext.post("preempt", {"Pod": kube_view(ext, preemptor), "NodeNameToVictims": None,
                                     "NodeNameToMetaVictims": {"n1": {
                                         "Pods": [{"UID": u} for u in proposed],
                                         "NumPDBViolations": 0}}})
    victims = [p["UID"] for p in out["NodeNameToMetaVictims"]["n1"]["Pods"]]
    await nominate(kube, preemptor, "n1")
    for uid in victims:
        kube.delete("pods", uid.removeprefix("uid-"))
    state = ext.placer.state
    await eventually(lambda: not any(u in state.allocs for u in victims))
    return victims


async def test_freed_gpu_is_held_for_the_nominated_preemptor(kube: FakeKube,
                                                             extender: Any) -> None:
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    late = kube.put(pending("late", MEM30, 100))
    ext = await extender()
    assert "n1" in (await filter_on(ext, big, "n1"))["FailedNodes"]
    victims = await preempted(kube, ext, big, ["uid-p4"])
    assert sorted(victims) in (["uid-p1", "uid-p2"], ["uid-p3", "uid-p4"])
    await eventually(lambda: "uid-big" in ext.placer.state.nominees)
    # A pod of lower priority scheduled meanwhile: kube-scheduler's in-tree filters see the
    # node totals with big added (60 + 60 + 30 of 160 GiB) and pass it to the extender.
    out = await filter_on(ext, late, "n1", "n2")
    assert out["NodeNames"] == ["n2"], out
    assert "too little free memory" in out["FailedNodes"]["n1"]
    assert await ext.bind(kube_view(ext, late), "n2") == ""
    # The preemptor fits where its victims were, and is bound there.
    assert (await filter_on(ext, big, "n1"))["NodeNames"] == ["n1"]
    assert await ext.bind(kube_view(ext, big), "n1") == ""
    freed = "GPU-0" if "uid-p1" in victims else "GPU-1"
    got = kube.get("pods", "big")
    assert got is not None and got["metadata"]["annotations"]["gpuslice.io/devices.main"] == freed


async def test_hold_counts_for_pods_of_equal_priority_not_higher_nor_the_nominee(
        kube: FakeKube, extender: Any) -> None:
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    ext = await extender()
    await preempted(kube, ext, big, ["uid-p4"])
    await eventually(lambda: "uid-big" in ext.placer.state.nominees)
    same = kube.put(pending("same", MEM30, 1000))
    higher = kube.put(pending("higher", MEM30, 2000))
    assert "n1" in (await filter_on(ext, same, "n1"))["FailedNodes"]
    assert (await filter_on(ext, higher, "n1"))["NodeNames"] == ["n1"]
    assert (await filter_on(ext, big, "n1"))["NodeNames"] == ["n1"]
    scores = await ext.post("prioritize", {"Pod": kube_view(ext, big), "NodeNames": ["n1"]})
    assert scores[0]["Score"] > 0


async def test_hold_is_released_when_the_nomination_is_cleared_bound_elsewhere_or_deleted(
        kube: FakeKube, extender: Any) -> None:
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    late = kube.put(pending("late", MEM30, 100))
    ext = await extender()
    state = ext.placer.state
    await preempted(kube, ext, big, ["uid-p4"])
    await eventually(lambda: "uid-big" in state.nominees)
    assert "n1" in (await filter_on(ext, late, "n1"))["FailedNodes"]
    # The scheduler clears the nomination (a later cycle found another node, or none).
    await nominate(kube, big, "")
    await eventually(lambda: "uid-big" not in state.nominees)
    assert (await filter_on(ext, late, "n1"))["NodeNames"] == ["n1"]
    # Nominated again, then bound elsewhere.
    await nominate(kube, big, "n1")
    await eventually(lambda: "uid-big" in state.nominees)
    assert "n1" in (await filter_on(ext, late, "n1"))["FailedNodes"]
    assert await ext.bind(kube_view(ext, big), "n2") == ""
    await eventually(lambda: "uid-big" not in state.nominees)
    assert (await filter_on(ext, late, "n1"))["NodeNames"] == ["n1"]
    # A nominee that is deleted.
    other = kube.put(pending("other", MEM60, 1000))
    await nominate(kube, other, "n1")
    await eventually(lambda: "uid-other" in state.nominees)
    assert "n1" in (await filter_on(ext, late, "n1"))["FailedNodes"]
    kube.delete("pods", "other")
    await eventually(lambda: "uid-other" not in state.nominees)
    assert (await filter_on(ext, late, "n1"))["NodeNames"] == ["n1"]


async def test_victims_still_terminating_do_not_free_the_hold(kube: FakeKube,
                                                              extender: Any) -> None:
    """Victims end gracefully: each is marked for deletion and goes later. While one of the two
    is still there the preemptor does not fit, yet what the other freed is held."""
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    late = kube.put(pending("late", MEM30, 100))
    ext = await extender()
    state = ext.placer.state
    out = await ext.post("preempt", {"Pod": kube_view(ext, big), "NodeNameToVictims": None,
                                     "NodeNameToMetaVictims": {"n1": {
                                         "Pods": [{"UID": "uid-p4"}], "NumPDBViolations": 0}}})
    victims = [p["UID"].removeprefix("uid-") for p in out["NodeNameToMetaVictims"]["n1"]["Pods"]]
    assert len(victims) == 2
    await nominate(kube, big, "n1")
    for name in victims:
        pod = kube.get("pods", name)
        assert pod is not None
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"
        kube.put(pod)
    kube.delete("pods", victims[0])
    await eventually(lambda: "uid-big" in state.nominees
                     and f"uid-{victims[0]}" not in state.allocs)
    # 30 GiB free where the victims were, 20 on the other GPU: late would fit the first.
    assert "n1" in (await filter_on(ext, late, "n1"))["FailedNodes"]
    kube.delete("pods", victims[1])
    await eventually(lambda: f"uid-{victims[1]}" not in state.allocs)
    assert "n1" in (await filter_on(ext, late, "n1"))["FailedNodes"]
    assert (await filter_on(ext, big, "n1"))["NodeNames"] == ["n1"]


async def test_bind_places_beside_the_hold(kube: FakeKube, extender: Any) -> None:
    """A pod filtered onto a node beside a hold is bound beside it: its spread policy would
    otherwise pick the emptiest GPU, the one held."""
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    ext = await extender()
    victims = await preempted(kube, ext, big, ["uid-p4"])
    other = sorted({"p1", "p2", "p3", "p4"} - {v.removeprefix("uid-") for v in victims})
    kube.delete("pods", other[0])  # the other GPU: 50 GiB free
    state = ext.placer.state
    await eventually(lambda: "uid-big" in state.nominees and f"uid-{other[0]}" not in state.allocs)
    late = kube.put(pending("late", MEM30, 100, {"gpuslice.io/placement": "spread"}))
    assert (await filter_on(ext, late, "n1"))["NodeNames"] == ["n1"]
    assert await ext.bind(kube_view(ext, late), "n1") == ""
    held = kube.get("pods", other[1])
    got = kube.get("pods", "late")
    assert got is not None and held is not None
    assert got["metadata"]["annotations"]["gpuslice.io/devices.main"] == \
        held["metadata"]["annotations"]["gpuslice.io/devices.main"]
    await eventually(lambda: "uid-late" in state.allocs and not state.allocs["uid-late"].assumed)
    assert (await filter_on(ext, big, "n1"))["NodeNames"] == ["n1"]


async def test_preemption_for_a_peer_leaves_the_hold_alone(kube: FakeKube, extender: Any) -> None:
    """A second preemptor of the same priority while the first is nominated: the scheduler's
    dry run counts the nominee as on the node (60 + 60 + 60 of 160 GiB) and proposes one of the
    pods left; the GPUs that free must be on a GPU the nominee does not hold."""
    thirty_each(kube)
    big = kube.put(pending("big", MEM60, 1000))
    peer = kube.put(pending("peer", MEM60, 1000))
    ext = await extender()
    victims = await preempted(kube, ext, big, ["uid-p4"])
    state = ext.placer.state
    await eventually(lambda: "uid-big" in state.nominees)
    assert "n1" in (await filter_on(ext, peer, "n1"))["FailedNodes"]
    left = sorted({"uid-p1", "uid-p2", "uid-p3", "uid-p4"} - set(victims))
    out = await ext.post("preempt", {"Pod": kube_view(ext, peer), "NodeNameToVictims": None,
                                     "NodeNameToMetaVictims": {"n1": {
                                         "Pods": [{"UID": left[1]}], "NumPDBViolations": 0}}})
    again = [p["UID"] for p in out["NodeNameToMetaVictims"]["n1"]["Pods"]]
    assert sorted(again) == left, out
    for uid in again:
        kube.delete("pods", uid.removeprefix("uid-"))
    await eventually(lambda: not any(u in state.allocs for u in again))
    assert (await filter_on(ext, peer, "n1"))["NodeNames"] == ["n1"]
    assert (await filter_on(ext, big, "n1"))["NodeNames"] == ["n1"]


def test_nominations_from_lists_and_out_of_order_views() -> None:
    state = ClusterState(Settings())
    state.replace_nodes([gpu_node("n1", [("GPU-0", A100)])])
    big = pending("big", MEM60, 1000)
    big["status"]["nominatedNodeName"] = "n1"
    big["metadata"]["resourceVersion"] = "10"
    cpu = pending("cpu", {}, 1000)  # no GPU: nothing to hold
    cpu["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    cpu["status"]["nominatedNodeName"] = "n1"
    raw = pending("raw", MEM60, 1000, mutated=False)  # never admitted: never placed here
    raw["status"]["nominatedNodeName"] = "n1"
    state.replace_pods([big, cpu, raw], listed_at=0.0, resource_version="10")
    assert set(state.nominees) == {"uid-big"}
    node = state.node("n1")
    assert node is not None
    held = state.held_usage(node, 100, "uid-late")
    assert held is not None and held["GPU-0"].mem == 60 * GIB
    assert state.held_usage(node, 100, "uid-big") is None  # not against itself
    assert state.held_usage(node, 2000, "uid-x") is None  # nor a pod of higher priority
    # An older view (a lagging watch) without the nomination does not release it.
    older = pending("big", MEM60, 1000)
    older["metadata"]["resourceVersion"] = "9"
    state.apply_pod(older)
    assert "uid-big" in state.nominees
    # A list that no longer has the pod releases it; one older than the nomination does not.
    state.replace_pods([], listed_at=1.0, resource_version="9")
    assert "uid-big" in state.nominees
    state.replace_pods([], listed_at=2.0, resource_version="11")
    assert not state.nominees and state.held_usage(node, 100, "uid-late") is None
    # Finished while nominated: released.
    big["metadata"]["resourceVersion"] = "12"
    state.apply_pod(big)
    assert "uid-big" in state.nominees
    big["status"]["phase"], big["metadata"]["resourceVersion"] = "Failed", "13"
    state.apply_pod(big)
    assert not state.nominees
