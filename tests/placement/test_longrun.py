"""The extender as a long-running service in a churning cluster.

Pods and nodes come and go for many cycles while the watches are cut, expired, answered with
errors or the API server is down for a while; afterwards the extender's view must be the API
server's truth (no reservation of a deleted pod holding GPU capacity, no bound pod missing) and
what it keeps per pod or per node must not grow with the number of pods or nodes ever seen.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakekube import FakeKube
from placement.kubeobjects import eventually, gpu_node, gpu_pod

from webhook.placement.placer import Placer
from webhook.settings import Settings

GPUS = [("GPU-0", 24576), ("GPU-1", 24576)]
MIB = {"nvidia.com/gpumem": "1024"}


@pytest.fixture
async def placer(kube: FakeKube) -> AsyncIterator[Placer]:
    """A started :class:`Placer` on ``kube`` with a short back-off (a churn test cannot wait
    the default 30 s between lists)."""
    async with kube.api_client() as api:
        p = Placer(Settings(kube_enabled=True), api=api)
        assert p.sync is not None
        p.sync.backoff_s, p.sync.backoff_max_s = 0.01, 0.05
        p.start()
        try:
            await asyncio.wait_for(p.sync.ready.wait(), 5)
            yield p
        finally:
            await p.stop()


def truth(kube: FakeKube) -> dict[str, dict[str, int]]:
    """UID → MiB per GPU of every pod the API server shows bound with devices."""
    out: dict[str, dict[str, int]] = {}
    for (plural, _, _), pod in kube.objects.items():
        ann = pod["metadata"].get("annotations") or {}
        if plural == "pods" and pod["spec"].get("nodeName") and "gpuslice.io/devices.main" in ann:
            mib = int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"])
            out[pod["metadata"]["uid"]] = {u: mib for u in ann["gpuslice.io/devices.main"].split(",")}
    return out


def seen(p: Placer) -> dict[str, dict[str, int]]:
    return {uid: {u: d.mem for u, d in a.demand.items()} for uid, a in p.state.allocs.items()}


def used_mib(p: Placer) -> int:
    return sum(u.mem for n in p.state.nodes.values() for u in n.usage.values())


def bind_args(pod: dict[str, Any], node: str) -> Any:
    m = pod["metadata"]
    return {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node}


def filter_args(pod: dict[str, Any], nodes: list[str]) -> Any:
    return {"Pod": pod, "NodeNames": nodes}


async def converged(p: Placer, kube: FakeKube, timeout: float = 10.0) -> None:
    """Wait until the view is the API server's truth, undecided binds expired."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        p.state.expire(time.monotonic())
        want, have = truth(kube), seen(p)
        if want == have:
            return
        if loop.time() > deadline:
            extra = {u: (a.namespace, a.name, a.node, a.assumed, a.expires_at)
                     for u, a in p.state.allocs.items() if u not in want}
            missing = sorted(set(want) - set(have))
            raise AssertionError(f"not converged: held by pods not bound: {extra}; "
                                 f"bound but not held: {missing}; "
                                 f"wrong: {[u for u in want if u in have and want[u] != have[u]]}")
        await asyncio.sleep(0.01)


def disrupt(kube: FakeKube, rng: random.Random) -> None:
    """Now and then, what happens to watches in a real cluster."""
    roll = rng.random()
    if roll < 0.04:
        kube.end_watches()  # their timeoutSeconds
    elif roll < 0.08:
        kube.drop_watches()  # a proxy or a restarting API server cuts them mid-event
    elif roll < 0.11:
        kube.compact()  # resumed from a compacted version: 410
        kube.end_watches()
    elif roll < 0.13:
        kube.error_watches(410)  # an ERROR event mid-stream
    elif roll < 0.14:
        kube.error_watches(500, "internal error")
    elif roll < 0.16:
        kube.fail("GET", "/api/v1/(pods|nodes)$", 410, watch=True, as_event=True)
        kube.end_watches()
    elif roll < 0.18:
        kube.fail("GET", "/api/v1/(pods|nodes)$", 500, watch=True)
        kube.end_watches()
    elif roll < 0.30:
        kube.bookmark_watches()


async def test_churn_with_broken_watches_and_binds_converges_to_the_api_servers_truth(
        kube: FakeKube, placer: Placer) -> None:
    """Pods created, bound (some Binding answers lost, some never sent, some refused with a
    500, some retried), deleted at any point; nodes replaced; watches cut, expired, errored,
    bookmarked; the API server down now and then. Whenever a bind finds no room the view
    must catch up with the truth, and at the end it is the truth, with nothing left over."""
    rng = random.Random(134)
    placer.assume_ttl_s = 0.3
    nodes = [f"n{i}" for i in range(4)]
    for n in nodes:
        kube.put(gpu_node(n, GPUS))
    await eventually(lambda: len(placer.state.nodes) == len(nodes))
    assert placer.core is not None
    real_bind = placer.core.create_namespaced_pod_binding
    fate: list[str] = []

    async def binding(*args: Any, **kwargs: Any) -> Any:
        what = fate.pop() if fate else "ok"
        if what == "unsent":
            raise TimeoutError
        if what == "deleted-first":
            kube.delete("pods", args[0])
        resp = await real_bind(*args, **kwargs)
        if what == "lost":
            resp.release()
            raise TimeoutError
        return resp

    placer.core.create_namespaced_pod_binding = binding  # type: ignore[method-assign]
    live: list[dict[str, Any]] = []
    new_node = len(nodes)
    for cycle in range(400):
        pod = kube.put(gpu_pod(f"p{cycle}", MIB))
        node = rng.choice(nodes)
        placer.filter(filter_args(pod, nodes))
        fate.append(rng.choice(["ok"] * 12 + ["unsent", "lost", "deleted-first", "500"]))
        if fate[-1] == "500":
            fate[-1] = "ok"
            kube.fail("POST", "/binding$", 500)
        error = (await placer.bind(bind_args(pod, node)))["Error"]
        if "not enough GPUs" in error:  # the watch lags behind the deletions: wait for it
            await converged(placer, kube)
            error = (await placer.bind(bind_args(pod, node)))["Error"]
            assert "not enough GPUs" not in error
        if kube.get("pods", pod["metadata"]["name"]) is not None:
            live.append(pod)
        if error and rng.random() < 0.5:  # the scheduler retries, maybe elsewhere
            await placer.bind(bind_args(pod, rng.choice(nodes)))
        if len(live) > 12 or rng.random() < 0.3:
            gone = live.pop(rng.randrange(len(live)))
            if kube.get("pods", gone["metadata"]["name"]) is not None:
                kube.delete("pods", gone["metadata"]["name"])
        if rng.random() < 0.03:  # a node replaced: deleted, then the pod GC deletes its pods
            old = nodes.pop(rng.randrange(len(nodes)))
            kube.delete("nodes", old)
            for p in list(live):
                if (kube.get("pods", p["metadata"]["name"]) or {}).get("spec", {}).get(
                        "nodeName") == old:
                    kube.delete("pods", p["metadata"]["name"])
                    live.remove(p)
            nodes.append(f"n{new_node}")
            kube.put(gpu_node(nodes[-1], GPUS))
            new_node += 1
            await eventually(lambda: nodes[-1] in placer.state.nodes)
        disrupt(kube, rng)
        if rng.random() < 0.01:
            kube.down = True
            await asyncio.sleep(0.05)
            kube.down = False
        await asyncio.sleep(0)
    await asyncio.sleep(placer.assume_ttl_s)
    probe = gpu_pod("probe", MIB)
    probe["metadata"]["uid"] = "probe"
    placer.filter(filter_args(probe, nodes))  # expires undecided reservations
    want = truth(kube)
    assert len(want) > 5 and new_node > 6
    await eventually(lambda: seen(placer) == want, timeout=10)
    assert used_mib(placer) == sum(sum(v.values()) for v in want.values())
    assert all(not a.assumed for a in placer.state.allocs.values())
    assert placer.state._expiring == {}
    assert sorted(placer.state.nodes) == sorted(nodes)
    assert sum(len(per_node) for per_node in placer._results.values()) <= 2 * len(nodes) + 16


async def test_nodes_deleted_before_their_pods_are_forgotten_once_the_pods_go(
        kube: FakeKube, placer: Placer) -> None:
    """A node that vanishes with pods on it (a spot VM reclaimed: the node object is deleted,
    then the pod garbage collector deletes its pods) keeps their usage until they go; then
    nothing of it may stay behind."""
    for i in range(100):
        name = f"spot-{i}"
        kube.put(gpu_node(name, GPUS))
        pod = kube.put(gpu_pod(f"job-{i}", MIB, node=name, devices="GPU-0", phase="Running"))
        await eventually(lambda: pod["metadata"]["uid"] in placer.state.allocs)  # noqa: B023
        kube.delete("nodes", name)
        await eventually(lambda: placer.state.nodes[name].gpus == ())  # noqa: B023
        kube.delete("pods", pod["metadata"]["name"])
        await eventually(lambda: pod["metadata"]["uid"] not in placer.state.allocs)  # noqa: B023
    assert placer.state.allocs == {}
    assert len(placer.state.nodes) == 0, \
        f"{len(placer.state.nodes)} of 100 deleted nodes still held"


async def test_nodes_deleted_during_a_watch_gap_are_forgotten_by_the_next_list(
        kube: FakeKube, placer: Placer) -> None:
    """A node whose DELETED event is lost (the watch expired) is removed by the list that
    follows, whether or not it ever published GPUs (most nodes of a cluster have none)."""
    for i in range(50):
        kube.put(gpu_node(f"gpu-{i}", GPUS))
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"cpu-{i}"}})
    await eventually(lambda: len(placer.state.nodes) == 100)
    kube.fail("GET", "/api/v1/nodes$", 500, watch=True, times=10**6)
    kube.end_watches()
    for i in range(50):
        kube.delete("nodes", f"gpu-{i}")
        kube.delete("nodes", f"cpu-{i}")
    kube.compact()
    kube._faults.clear()
    kube.end_watches()
    await eventually(lambda: not any(n.gpus for n in placer.state.nodes.values()))
    await asyncio.sleep(0.2)
    assert len(placer.state.nodes) == 0, \
        f"{len(placer.state.nodes)} of 100 deleted nodes still held"


def test_placement_results_of_deleted_nodes_are_not_kept() -> None:
    """Nodes come and go (an autoscaler, with unique node names); the same workload keeps
    being filtered. The cached results of nodes that no longer exist must not pile up."""
    p = Placer(Settings())
    for i in range(1000):
        name = f"auto-{i}"
        p.state.apply_node(gpu_node(name, GPUS))
        pod = gpu_pod(f"w-{i}", MIB)
        pod["metadata"]["uid"] = f"uid-{i}"
        assert p.filter(filter_args(pod, [name]))["NodeNames"] == [name]
        p.state.delete_node(name)
    kept = sum(len(per_node) for per_node in p._results.values())
    assert kept <= 64, f"{kept} cached placement results of 1000 deleted nodes"


async def test_pods_deleted_before_their_bind_leave_nothing_behind(
        kube: FakeKube, placer: Placer) -> None:
    """The scheduler gives up on pods or they are deleted between filter and bind, or between
    the reservation and the Binding: no reservation may outlive them."""
    kube.put(gpu_node("n1", GPUS))
    await eventually(lambda: "n1" in placer.state.nodes)
    bound = 0
    for i in range(300):
        pod = kube.put(gpu_pod(f"gone-{i}", MIB))
        placer.filter(filter_args(pod, ["n1"]))
        placer.prioritize(filter_args(pod, ["n1"]))
        if i % 2:
            kube.delete("pods", pod["metadata"]["name"])  # before the bind: 404
            await placer.bind(bind_args(pod, "n1"))
        else:
            bound += (await placer.bind(bind_args(pod, "n1")))["Error"] == ""
            kube.delete("pods", pod["metadata"]["name"])
    await eventually(lambda: placer.state.allocs == {})
    assert placer.state.nodes["n1"].usage == {}
    assert used_mib(placer) == 0 and bound == 150
