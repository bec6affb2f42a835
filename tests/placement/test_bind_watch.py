"""Watch and bind against the in-process fake API server, through the real client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client
from placement.kubeobjects import eventually, gpu_node, gpu_pod

from webhook.placement.inventory import Usage

HEADLINE = {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10240", "nvidia.com/gpucores": "30"}
A10 = [("GPU-a0", 24576), ("GPU-a1", 24576)]


def usage(ext: Any, node: str) -> dict[str, Usage]:
    state = ext.placer.state.node(node)
    return {} if state is None else dict(state.usage)


async def test_state_is_rebuilt_from_node_inventory_and_pod_device_annotations(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    kube.put(gpu_pod("a", {"nvidia.com/gpumem": "4000", "nvidia.com/gpucores": "20"},
                     node="n1", devices="GPU-a1", phase="Running"))
    kube.put(gpu_pod("done", {"nvidia.com/gpumem": "9000"}, node="n1", devices="GPU-a0",
                     phase="Succeeded"))
    ext = await extender()
    assert ext.placer.ready()
    assert ext.placer.largest_gpu_memory_mib() == 24576
    assert usage(ext, "n1") == {"GPU-a1": Usage(4000, 20, 1, 0)}


async def test_headline_pod_is_bound_with_device_annotations_in_the_binding(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("trainer", HEADLINE))
    ext = await extender()
    filtered = await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]})
    assert filtered["NodeNames"] == ["n1"]
    assert await ext.bind(pod, "n1") == ""
    bound = kube.get("pods", "trainer")
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"]["gpuslice.io/devices.main"] == "GPU-a0,GPU-a1"
    (req,) = kube.requests_to("POST", "/pods/trainer/binding$")
    assert req.body["kind"] == "Binding"
    assert req.body["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert req.body["metadata"]["annotations"] == {"gpuslice.io/devices.main": "GPU-a0,GPU-a1"}
    assert req.body["metadata"]["uid"] == pod["metadata"]["uid"]
    uid = pod["metadata"]["uid"]
    await eventually(lambda: not ext.placer.state.allocs[uid].assumed)
    assert usage(ext, "n1") == {"GPU-a0": Usage(10240, 30, 1, 0),
                                "GPU-a1": Usage(10240, 30, 1, 0)}


async def test_bind_reads_the_pod_when_filter_never_saw_it(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    assert await ext.bind(pod, "n1") == ""
    assert kube.requests_to("GET", "/namespaces/default/pods/p$")
    assert kube.get("pods", "p")["metadata"]["annotations"]["gpuslice.io/devices.main"] == "GPU-a0"


async def test_bind_of_a_pod_without_gpus_binds_without_annotations(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("web", {"cpu": "1"}, mutated=False))  # the webhook let it be
    ext = await extender()
    assert await ext.bind(pod, "n1") == ""
    (req,) = kube.requests_to("POST", "/binding$")
    assert req.body["metadata"]["annotations"] == {}
    assert kube.get("pods", "web")["spec"]["nodeName"] == "n1"


async def _refused_bind(kube: FakeKube, ext: Any, pod: dict[str, Any], status: int) -> None:
    error = await ext.bind(pod, "n1")
    assert f"({status})" in error and error.startswith("gpuslice: bind refused")
    assert pod["metadata"]["uid"] not in ext.placer.state.allocs
    assert usage(ext, "n1") == {}


async def test_bind_conflict_409_releases_the_reservation(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    kube.put(gpu_node("n2", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]})
    kube.put(pod | {"spec": pod["spec"] | {"nodeName": "n2"}})  # someone else bound it
    await _refused_bind(kube, ext, pod, 409)


async def test_bind_of_a_deleted_pod_404_releases_the_reservation(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]})
    kube.delete("pods", "p")
    await _refused_bind(kube, ext, pod, 404)


async def test_bind_server_error_500_keeps_the_reservation_and_a_retry_replaces_it(
        kube: FakeKube, extender: Any) -> None:
    """A 5xx may come after the write (an etcd timeout): the GPU stays reserved for the pod."""
    kube.put(gpu_node("n1", [("GPU-a0", 24576)]))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "20000"}))
    ext = await extender()
    kube.fail("POST", "/binding$", 500)
    error = await ext.bind(pod, "n1")
    assert error.startswith("gpuslice: bind refused by the API server (500)")
    kept = ext.placer.state.allocs[pod["metadata"]["uid"]]
    assert kept.assumed and kept.expires_at is not None
    assert usage(ext, "n1") == {"GPU-a0": Usage(20000, 0, 1, 0)}
    assert await ext.bind(pod, "n1") == ""  # the retry takes the reservation's place
    assert usage(ext, "n1") == {"GPU-a0": Usage(20000, 0, 1, 0)}


async def test_bind_that_no_longer_fits_is_refused_before_calling_the_api(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", [("GPU-a0", 24576)]))
    first = kube.put(gpu_pod("first", {"nvidia.com/gpumem": "20000"}))
    second = kube.put(gpu_pod("second", {"nvidia.com/gpumem": "20000"}))
    ext = await extender()
    assert await ext.bind(first, "n1") == ""
    error = await ext.bind(second, "n1")
    assert "too little free memory" in error
    assert len(kube.requests_to("POST", "/binding$")) == 1


async def test_deleted_and_finished_pods_release_their_gpus(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    a = kube.put(gpu_pod("a", {"nvidia.com/gpumem": "1000"}, node="n1", devices="GPU-a0",
                         phase="Running"))
    b = kube.put(gpu_pod("b", {"nvidia.com/gpumem": "2000"}, node="n1", devices="GPU-a1",
                         phase="Running"))
    c = kube.put(gpu_pod("c", {"nvidia.com/gpumem": "3000"}, node="n1", devices="GPU-a1",
                         phase="Running"))
    ext = await extender()
    assert usage(ext, "n1") == {"GPU-a0": Usage(1000, 0, 1, 0), "GPU-a1": Usage(5000, 0, 2, 0)}
    kube.delete("pods", "a")
    kube.put(b | {"status": {"phase": "Succeeded"}})
    kube.put(c | {"status": {"phase": "Failed"}})
    await eventually(lambda: usage(ext, "n1") == {})
    assert not ext.placer.state.allocs
    del a


async def test_inventory_changes_are_watched(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1000"}))
    ext = await extender()
    assert (await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]}))["NodeNames"] == ["n1"]
    kube.put(gpu_node("n1", A10, unhealthy=("GPU-a1",)))
    await eventually(lambda: not ext.placer.state.node("n1").gpus[1].healthy)
    out = await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]})
    assert out["FailedAndUnresolvableNodes"]["n1"].endswith(
        "the node has 1 usable GPU [unhealthy GPUs skipped]")


async def test_restarted_extender_rebuilds_the_same_state(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    kube.put(gpu_node("n2", A10))
    first = await extender()
    pods = [kube.put(gpu_pod(f"p{i}", {"nvidia.com/gpumem": str(1000 * (i + 1)),
                                       "nvidia.com/gpucores": "10"})) for i in range(6)]
    for i, pod in enumerate(pods):
        assert await first.bind(pod, f"n{1 + i % 2}") == ""
    await eventually(lambda: not any(a.assumed for a in first.placer.state.allocs.values()))
    before = {n: usage(first, n) for n in ("n1", "n2")}
    await first.stop()
    second = await extender()
    assert {n: usage(second, n) for n in ("n1", "n2")} == before
    assert sum(u.slices for u in before["n1"].values()) == 3


async def test_watch_recovers_from_compaction_and_an_api_outage(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    ext = await extender()
    ext.placer.sync.backoff_max_s = 0.05
    kube.down = True
    kube.put(gpu_pod("a", {"nvidia.com/gpumem": "1000"}, node="n1", devices="GPU-a0",
                     phase="Running"))
    kube.compact()
    await eventually(lambda: len(kube.requests_to("GET", "/pods$")) >= 3)
    kube.down = False
    await eventually(lambda: usage(ext, "n1") == {"GPU-a0": Usage(1000, 0, 1, 0)})


async def test_lost_bind_answer_is_settled_by_reading_the_pod(
        kube: FakeKube, extender: Any) -> None:
    """The Binding reached the API server but its answer was lost: the bind still succeeds."""
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    real = ext.placer.core.create_namespaced_pod_binding

    async def answer_lost(*args: Any, **kwargs: Any) -> Any:
        resp = await real(*args, **kwargs)
        resp.release()
        raise TimeoutError

    ext.placer.core.create_namespaced_pod_binding = answer_lost
    assert await ext.bind(pod, "n1") == ""
    assert kube.get("pods", "p")["spec"]["nodeName"] == "n1"
    assert usage(ext, "n1") == {"GPU-a0": Usage(1000, 0, 1, 0)}


async def test_initial_list_failure_is_retried_until_ready(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    kube.fail("GET", "/api/v1/pods$", 500, times=2)
    ext = await extender()
    assert ext.placer.ready()
    assert len(kube.requests_to("GET", "/api/v1/pods$")) >= 3


async def test_bind_of_a_recreated_pod_with_another_uid_is_refused(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    stale = pod | {"metadata": pod["metadata"] | {"uid": "an-older-uid"}}
    error = await ext.bind(stale, "n1")
    assert "different UID" in error
    assert not kube.requests_to("POST", "/binding$")


async def test_bind_before_the_pod_list_is_in_asks_the_scheduler_to_retry(
        kube: FakeKube, extender: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted extender does not yet know what the bound pods hold: it binds no GPU pod."""
    kube.put(gpu_node("n1", [("GPU-a0", 10000)]))
    kube.put(gpu_pod("old", {"nvidia.com/gpumem": "6000"}, node="n1", devices="GPU-a0",
                     phase="Running"))
    new = kube.put(gpu_pod("new", {"nvidia.com/gpumem": "6000"}))
    web = kube.put(gpu_pod("web", {"cpu": "1"}, mutated=False))
    listed = asyncio.Event()
    list_pods = client.CoreV1Api.list_pod_for_all_namespaces

    async def slow_list(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("watch"):
            await listed.wait()  # a large cluster: the pod list takes a while
        return await list_pods(self, *args, **kwargs)

    monkeypatch.setattr(client.CoreV1Api, "list_pod_for_all_namespaces", slow_list)
    ext = await extender(wait_ready=False)
    await eventually(lambda: bool(ext.placer.state.node("n1") and
                                  ext.placer.state.node("n1").gpus))
    assert not ext.placer.ready()
    assert await ext.bind(new, "n1") == ("gpuslice: placement is still reading the cluster "
                                         "state; retry")
    assert await ext.bind(web, "n1") == ""  # a pod without GPUs needs no state
    assert [r.path for r in kube.requests_to("POST", "/binding$")] == [
        "/api/v1/namespaces/default/pods/web/binding"]
    listed.set()
    await eventually(ext.placer.ready)
    assert "too little free memory" in await ext.bind(new, "n1")
    assert usage(ext, "n1") == {"GPU-a0": Usage(6000, 0, 1, 0)}


async def test_gpu_pod_the_webhook_never_mutated_is_not_placed(
        kube: FakeKube, extender: Any) -> None:
    """Without the webhook's mark the pod has no interposer: its slice would not be enforced."""
    kube.put(gpu_node("n1", A10))
    kube.put(gpu_node("n2", A10))
    pod = kube.put(gpu_pod("raw", {"nvidia.com/gpumem": "1000"}, mutated=False))
    ext = await extender()
    out = await ext.post("filter", {"Pod": pod, "NodeNames": ["n1", "n2"]})
    reason = out["FailedAndUnresolvableNodes"]["n1"]
    assert out["NodeNames"] == [] and out["FailedAndUnresolvableNodes"] == {"n1": reason,
                                                                          "n2": reason}
    assert reason.startswith("gpuslice: pod was not admitted by the gpuslice webhook (no "
                             "gpuslice.io/mutated annotation)")
    assert await ext.bind(pod, "n1") == reason
    assert not kube.requests_to("POST", "/binding$")
    assert not ext.placer.state.allocs


async def test_binding_answered_2xx_with_a_body_that_is_not_json_is_settled_by_the_pod(
        kube: FakeKube, extender: Any) -> None:
    """A proxy's page in a 2xx answer: the Binding was applied; the pod says so."""
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    kube.garble("POST", "/pods/p/binding$", 201)
    assert await ext.bind(pod, "n1") == ""
    assert kube.get("pods", "p")["metadata"]["annotations"]["gpuslice.io/devices.main"] == "GPU-a0"
    await eventually(lambda: not ext.placer.state.allocs[pod["metadata"]["uid"]].assumed)
    assert usage(ext, "n1") == {"GPU-a0": Usage(1000, 0, 1, 0)}


async def test_binding_answered_2xx_but_not_applied_keeps_an_expiring_reservation(
        kube: FakeKube, extender: Any) -> None:
    """The 2xx page did not come from the API server: the outcome is unknown, so the GPU stays
    reserved for the pod until the deadline of an undecided bind, not forever."""
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    kube.garble("POST", "/pods/p/binding$", 200, apply=False)
    error = await ext.bind(pod, "n1")
    assert error.startswith("gpuslice: bind request failed") and "not JSON" in error
    kept = ext.placer.state.allocs[pod["metadata"]["uid"]]
    assert kept.assumed and kept.expires_at is not None
    assert await ext.bind(pod, "n1") == ""  # the retry lands on the same GPU
    assert kube.get("pods", "p")["metadata"]["annotations"]["gpuslice.io/devices.main"] == "GPU-a0"


@pytest.mark.parametrize("body", [b"<html>OK</html>", b"[]", b"null"])
async def test_pod_read_answered_with_a_body_that_is_not_a_pod_is_a_bind_error(
        kube: FakeKube, extender: Any, body: bytes) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    kube.garble("GET", "/namespaces/default/pods/p$", 200, body)
    error = await ext.bind(pod, "n1")  # filter never saw it: bind reads it
    assert error.startswith("gpuslice: cannot read the pod")
    assert not ext.placer.state.allocs and usage(ext, "n1") == {}
    assert not kube.requests_to("POST", "/binding$")


async def test_pod_reread_after_an_undecided_bind_answered_with_a_page_keeps_the_reservation(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    await ext.post("filter", {"Pod": pod, "NodeNames": ["n1"]})
    kube.fail("POST", "/pods/p/binding$", 503)
    kube.garble("GET", "/namespaces/default/pods/p$", 200)
    error = await ext.bind(pod, "n1")
    assert error.startswith("gpuslice: bind refused by the API server (503)")
    kept = ext.placer.state.allocs[pod["metadata"]["uid"]]
    assert kept.assumed and kept.expires_at is not None


@pytest.mark.parametrize("uuid", ["GPU-0 ", "GPU-0,GPU-1", "GPU-0\n"])
async def test_gpu_uuid_the_devices_annotation_cannot_carry_is_never_given_twice(
        kube: FakeKube, extender: Any, uuid: str) -> None:
    """The devices annotation is a comma list read back stripped: a published UUID with a comma
    or white space would be counted, once the watch confirms the bind, on another UUID."""
    kube.put(gpu_node("n1", [(uuid, 10000)]))
    a = kube.put(gpu_pod("a", {"nvidia.com/gpumem": "6000"}))
    b = kube.put(gpu_pod("b", {"nvidia.com/gpumem": "6000"}))
    ext = await extender()
    error_a = await ext.bind(a, "n1")
    if not error_a:
        await eventually(lambda: not ext.placer.state.allocs[a["metadata"]["uid"]].assumed)
    error_b = await ext.bind(b, "n1")
    assert error_a or error_b, "both pods bound to one 10000 MiB GPU with 6000 MiB each"
    assert "gpuslice.io/gpus[0].uuid" in (error_a or error_b)


@pytest.mark.parametrize("status", [200, 503])
async def test_binding_answered_with_a_deeply_nested_body_is_undecided_not_a_crash(
        kube: FakeKube, extender: Any, status: int) -> None:
    """json.loads raises RecursionError, not a ValueError, on deep nesting."""
    kube.put(gpu_node("n1", A10))
    pod = kube.put(gpu_pod("p", {"nvidia.com/gpumem": "1000"}))
    ext = await extender()
    kube.garble("POST", "/pods/p/binding$", status, b"[" * 200_000, apply=False)
    error = await ext.bind(pod, "n1")
    assert error.startswith("gpuslice: bind re")
    kept = ext.placer.state.allocs[pod["metadata"]["uid"]]
    assert kept.assumed and kept.expires_at is not None
