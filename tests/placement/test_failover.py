"""A kube-scheduler leader failover, as the chart deploys it: every replica runs a scheduler and
its own extender (the scheduler calls 127.0.0.1), the schedulers elect one leader, and each
extender keeps its own state, fed by its own watches.

The old leader's extender may have a Binding the API server has not applied yet (its answer
lost or late); the new leader's extender knows nothing of that reservation until the watch
shows the pod bound. So GPU binds wait after the scheduler's lease changes hands.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client
from placement.kubeobjects import eventually, gpu_node, gpu_pod

TWO = [("GPU-0", 10000), ("GPU-1", 10000)]
SIX_GIB = {"nvidia.com/gpumem": "6000"}


def held_mib(kube: FakeKube, uuid: str) -> int:
    """MiB the API server's bound pods hold on GPU ``uuid`` (what the nodes will run)."""
    total = 0
    for (plural, _, _), pod in kube.objects.items():
        ann = pod["metadata"].get("annotations") or {}
        if plural == "pods" and pod["spec"].get("nodeName") \
                and uuid in ann.get("gpuslice.io/devices.main", "").split(","):
            total += int(pod["spec"]["containers"][0]["resources"]["limits"]
                         ["nvidia.com/gpumem"])
    return total


LEASE = "default/gpuslice-scheduler"


def lease(holder: str, transitions: int, acquired_s_ago: float = 0.0) -> dict[str, Any]:
    """The scheduler's leader-election Lease as client-go writes it."""
    at = datetime.now(UTC) - timedelta(seconds=acquired_s_ago)
    stamp = at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "gpuslice-scheduler", "namespace": "default"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": transitions}}


async def test_failover_while_a_binding_is_undecided_never_overcommits_a_gpu(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", TWO))
    kube.put(lease("old_1", 0, acquired_s_ago=600))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    old = await extender(scheduler_lease=LEASE)  # the leader's replica
    new = await extender(scheduler_lease=LEASE)  # the other: its scheduler waits for the lease
    new.placer.assume_ttl_s = new.placer.bind_timeout_s = 0.5
    etcd_done = asyncio.Event()
    landed: list[asyncio.Task[None]] = []
    real = old.placer.core.create_namespaced_pod_binding

    async def slow_etcd(*args: Any, **kwargs: Any) -> Any:
        async def later() -> None:
            await etcd_done.wait()
            (await real(*args, **kwargs)).release()

        landed.append(asyncio.create_task(later()))
        raise TimeoutError  # our bind_timeout_s passed; the API server still holds the write

    old.placer.core.create_namespaced_pod_binding = slow_etcd
    assert (await old.bind(a, "n1")).startswith("gpuslice: bind request failed")
    # The old leader's extender keeps a's GPU reserved (for assume_ttl_s) ...
    assert old.placer.state.allocs[a["metadata"]["uid"]].assignment == {"main": ("GPU-0",)}
    # ... but its scheduler has lost the lease: the new leader schedules b.
    kube.put(lease("new_1", 1))
    out = await new.post("filter", {"Pod": b, "NodeNames": ["n1"]})
    assert out["NodeNames"] == ["n1"]
    assert "the scheduler leader changed" in await new.bind(b, "n1")
    assert kube.get("pods", "b")["spec"].get("nodeName") is None
    etcd_done.set()  # a's Binding lands within the API server's request timeout
    await landed[0]
    await eventually(lambda: a["metadata"]["uid"] in new.placer.state.allocs
                     and not new.placer.state.allocs[a["metadata"]["uid"]].assumed)
    await asyncio.sleep(new.placer.failover_hold_s)
    assert await new.bind(b, "n1") == ""  # the scheduler's retry, once nothing can land
    # No GPU holds more than its memory.
    assert held_mib(kube, "GPU-0") == 6000 and held_mib(kube, "GPU-1") == 6000


@pytest.mark.parametrize("lease_obj", [None, lease("first_1", 0), lease("new_1", 3, 120)],
                         ids=["no-lease", "first-leader", "changed-long-ago"])
async def test_binds_do_not_wait_without_a_recent_change_of_leader(
        kube: FakeKube, extender: Any, lease_obj: dict[str, Any] | None) -> None:
    kube.put(gpu_node("n1", TWO))
    if lease_obj is not None:
        kube.put(lease_obj)
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender(scheduler_lease=LEASE)
    assert await ext.bind(a, "n1") == ""


async def test_bind_that_cannot_read_the_lease_waits(kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", TWO))
    kube.put(lease("new_1", 1, 600))
    a = kube.put(gpu_pod("a", SIX_GIB))
    web = kube.put(gpu_pod("web", {"cpu": "1"}, mutated=False))
    ext = await extender(scheduler_lease=LEASE)
    kube.fail("GET", "/leases/gpuslice-scheduler$", 500)
    assert "cannot read the scheduler's leader lease default/gpuslice-scheduler (500)" \
        in await ext.bind(a, "n1")
    assert not ext.placer.state.allocs and not kube.requests_to("POST", "/binding$")
    assert await ext.bind(web, "n1") == ""  # a pod without GPUs reserves nothing: no wait
    assert await ext.bind(a, "n1") == ""


async def test_extender_restart_while_a_binding_is_undecided_never_overcommits_a_gpu(
        kube: FakeKube, extender: Any, tmp_path: Any) -> None:
    """The webhook container restarts (OOM, a crash) beside a scheduler that stays leader: the
    new process never saw the reservation of a Binding its predecessor sent."""
    kube.put(gpu_node("n1", TWO))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    marker = str(tmp_path / "extender-ran")  # in the pod's emptyDir: outlives the container
    first = await extender(restart_marker=marker)
    etcd_done = asyncio.Event()
    landed: list[asyncio.Task[None]] = []
    api = kube.api_client()  # the write outlives the process that sent it

    async def slow_etcd(*args: Any, **kwargs: Any) -> Any:
        async def later() -> None:
            await etcd_done.wait()
            await client.CoreV1Api(api).create_namespaced_pod_binding(
                *args, **kwargs | {"_preload_content": False})

        landed.append(asyncio.create_task(later()))
        raise TimeoutError

    first.placer.core.create_namespaced_pod_binding = slow_etcd
    assert (await first.bind(a, "n1")).startswith("gpuslice: bind request failed")
    await first.stop()
    second = await extender(restart_marker=marker)
    second.placer.assume_ttl_s = second.placer.bind_timeout_s = 0.5
    assert "restarted less than" in await second.bind(b, "n1")
    etcd_done.set()
    await landed[0]
    await api.close()
    await eventually(lambda: a["metadata"]["uid"] in second.placer.state.allocs)
    await asyncio.sleep(second.placer.failover_hold_s)
    assert await second.bind(b, "n1") == ""
    assert held_mib(kube, "GPU-0") == 6000 and held_mib(kube, "GPU-1") == 6000


async def test_first_start_in_a_pod_does_not_wait(
        kube: FakeKube, extender: Any, tmp_path: Any) -> None:
    kube.put(gpu_node("n1", TWO))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender(restart_marker=str(tmp_path / "extender-ran"))
    assert await ext.bind(a, "n1") == ""
    assert (tmp_path / "extender-ran").exists()


async def test_a_burst_of_gpu_binds_reads_the_lease_once(kube: FakeKube, extender: Any) -> None:
    """The scheduler binds many pods at once (each in its own binding goroutine): the binds
    waiting on one read of the lease share it, rather than each sending its own."""
    kube.put(gpu_node("n1", TWO))
    kube.put(lease("new_1", 3, 600))
    pods = [kube.put(gpu_pod(f"p{i}", {"nvidia.com/gpumem": "100"})) for i in range(12)]
    ext = await extender(scheduler_lease=LEASE)
    kube.requests.clear()
    assert await asyncio.gather(*(ext.bind(p, "n1") for p in pods)) == [""] * len(pods)
    assert len(kube.requests_to("GET", "/leases/gpuslice-scheduler$")) == 1


async def test_the_restart_hold_ends_on_time_whatever_the_wall_clock_does(
        kube: FakeKube, extender: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """The restart's hold is this process's own span: the wall clock stepped back an hour (NTP
    correcting a node's clock after boot) held GPU binds an hour more, and one stepped forward
    would have ended the hold at once."""
    import time

    from webhook.placement import placer as placer_module

    kube.put(gpu_node("n1", TWO))
    a = kube.put(gpu_pod("a", SIX_GIB))
    marker = tmp_path / "extender-ran"
    marker.touch()  # an earlier process of this container ran
    ext = await extender(restart_marker=str(marker))
    ext.placer.assume_ttl_s = ext.placer.bind_timeout_s = 0.2  # a hold of 0.4 s
    real = time.time
    monkeypatch.setattr(placer_module.time, "time", lambda: real() + 3600)
    assert "restarted less than" in await ext.bind(a, "n1")  # not ended by the jump forward
    monkeypatch.setattr(placer_module.time, "time", lambda: real() - 3600)
    await asyncio.sleep(0.45)
    assert await ext.bind(a, "n1") == ""
