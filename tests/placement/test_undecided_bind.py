"""Binds whose outcome is unknown: the API server may apply the Binding after we gave up.

The Binding calls are intercepted on the extender's client; everything else goes to the fake
API server. An undecided reservation must block the GPU until the watch, a retry or its
expiry settles it, and must never be counted twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client
from placement.kubeobjects import eventually, gpu_node, gpu_pod

from webhook.placement.inventory import Usage

SMALL = [("GPU-0", 10000)]
SIX_GIB = {"nvidia.com/gpumem": "6000"}

Binder = Callable[..., Awaitable[Any]]


def usage(ext: Any, node: str) -> dict[str, Usage]:
    state = ext.placer.state.node(node)
    return {} if state is None else dict(state.usage)


def bound_pods(kube: FakeKube, node: str) -> list[str]:
    return sorted(p["metadata"]["name"] for (plural, _, _), p in kube.objects.items()
                  if plural == "pods" and p["spec"].get("nodeName") == node)


def intercept_binds(ext: Any, answer: Callable[[Binder, tuple[Any, ...], dict[str, Any]],
                                               Awaitable[Any]]) -> None:
    """Route the extender's Binding calls through ``answer(real, args, kwargs)``."""
    real = ext.placer.core.create_namespaced_pod_binding

    async def call(*args: Any, **kwargs: Any) -> Any:
        return await answer(real, args, kwargs)

    ext.placer.core.create_namespaced_pod_binding = call


def never_sent(ext: Any) -> None:
    async def answer(real: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise TimeoutError

    intercept_binds(ext, answer)


@pytest.mark.parametrize("reread_fails", [False, True], ids=["pod-unbound", "reread-fails"])
async def test_binding_applied_after_our_timeout_is_never_double_booked(
        kube: FakeKube, extender: Any, reread_fails: bool) -> None:
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    etcd_done = asyncio.Event()
    landed: list[asyncio.Task[None]] = []

    async def slow_etcd(real: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        async def later() -> None:
            await etcd_done.wait()
            (await real(*args, **kwargs)).release()

        landed.append(asyncio.create_task(later()))
        if reread_fails:
            kube.fail("GET", "/namespaces/default/pods/a$", 500)
        raise TimeoutError  # our bind_timeout_s passed; the API server still holds the write

    intercept_binds(ext, slow_etcd)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    uid_a = a["metadata"]["uid"]
    assert ext.placer.state.allocs[uid_a].assumed
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}

    # While a's Binding is undecided, its 6000 MiB are taken: b fits nowhere.
    out = await ext.post("filter", {"Pod": b, "NodeNames": ["n1"]})
    assert "too little free memory" in out["FailedNodes"]["n1"]
    assert "too little free memory" in await ext.bind(b, "n1")

    etcd_done.set()  # the write lands; the watch shows a bound
    await landed[0]
    await eventually(lambda: not ext.placer.state.allocs[uid_a].assumed)
    assert bound_pods(kube, "n1") == ["a"]
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}
    assert list(ext.placer.state.allocs) == [uid_a]


async def test_undecided_reservation_is_released_after_its_expiry(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    ext.placer.assume_ttl_s = 1.0
    never_sent(ext)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}
    out = await ext.post("filter", {"Pod": b, "NodeNames": ["n1"]})
    assert out["NodeNames"] == []

    await asyncio.sleep(1.05)  # nothing settled it: not the watch, not a retry
    out = await ext.post("filter", {"Pod": b, "NodeNames": ["n1"]})
    assert out["NodeNames"] == ["n1"]
    assert usage(ext, "n1") == {} and not ext.placer.state.allocs


async def test_retry_elsewhere_waits_until_the_undecided_reservation_is_settled(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", SMALL))
    kube.put(gpu_node("n2", [("GPU-b0", 10000)]))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender()
    ext.placer.assume_ttl_s = 0.5
    real = ext.placer.core.create_namespaced_pod_binding
    never_sent(ext)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")

    ext.placer.core.create_namespaced_pod_binding = real
    assert (await ext.bind(a, "n2")).startswith(  # kube-scheduler's retry, elsewhere
        "gpuslice: an earlier bind of this pod to node n1 may still be applied")
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)} and usage(ext, "n2") == {}
    await asyncio.sleep(0.55)  # the first Binding can no longer be applied
    assert await ext.bind(a, "n2") == ""
    assert usage(ext, "n1") == {}
    assert usage(ext, "n2") == {"GPU-b0": Usage(6000, 0, 1, 0)}
    uid = a["metadata"]["uid"]
    await eventually(lambda: not ext.placer.state.allocs[uid].assumed)
    assert usage(ext, "n2") == {"GPU-b0": Usage(6000, 0, 1, 0)}
    assert ext.placer.state.allocs[uid].expires_at is None


async def test_retry_refused_because_the_first_attempt_landed_counts_the_first(
        kube: FakeKube, extender: Any) -> None:
    """The retry replaced the reservation, then the first Binding won: the 409 is settled
    from the pod at once, before the watch, so the GPU is never free in between."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def first_lands_late(real: Binder, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        if not held:
            held.append((args, kwargs))
            raise TimeoutError
        (await real(*held[0][0], **held[0][1])).release()  # the first write lands now
        return await real(*args, **kwargs)  # 409: the pod is already assigned

    intercept_binds(ext, first_lands_late)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    await ext.placer.sync.stop()  # the watch lags behind
    assert await ext.bind(a, "n1") == ""  # bound, with the devices this bind chose
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}
    assert not ext.placer.state.allocs[a["metadata"]["uid"]].assumed
    assert "too little free memory" in await ext.bind(b, "n1")


@pytest.mark.parametrize("fate", ["deleted", "recreated", "bound-elsewhere"])
async def test_undecided_bind_is_settled_at_once_when_the_pod_says_so(
        kube: FakeKube, extender: Any, fate: str) -> None:
    kube.put(gpu_node("n1", SMALL))
    kube.put(gpu_node("n2", [("GPU-b0", 10000)]))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender()

    async def meanwhile(real: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if fate == "bound-elsewhere":  # by another extender replica, say
            kube.put(gpu_pod("a", SIX_GIB, node="n2", devices="GPU-b0"))
        else:
            kube.delete("pods", "a")
        if fate == "recreated":
            kube.put(gpu_pod("a", SIX_GIB))
        raise TimeoutError

    await ext.placer.sync.stop()  # only the bind's own read of the pod settles it
    intercept_binds(ext, meanwhile)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    assert usage(ext, "n1") == {}
    expected = {"GPU-b0": Usage(6000, 0, 1, 0)} if fate == "bound-elsewhere" else {}
    assert usage(ext, "n2") == expected


async def test_relist_taken_before_a_lost_bind_answer_never_frees_the_bound_gpu(
        kube: FakeKube, extender: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relist's snapshot is taken (a unbound); a's bind lands but its answer is lost, and
    the bind's read of the pod confirms it; then the older snapshot is applied. a's GPU must
    stay taken throughout: b, which would not fit beside it, is refused."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    snapshot_taken, deliver = asyncio.Event(), asyncio.Event()
    hold: list[bool] = []
    list_pods = client.CoreV1Api.list_pod_for_all_namespaces

    async def slow_list(self: Any, *args: Any, **kwargs: Any) -> Any:
        resp = await list_pods(self, *args, **kwargs)
        if hold and not kwargs.get("watch"):
            hold.clear()
            await resp.read()  # the snapshot is taken now, and arrives later
            snapshot_taken.set()
            await deliver.wait()
        return resp

    monkeypatch.setattr(client.CoreV1Api, "list_pod_for_all_namespaces", slow_list)
    ext = await extender()
    state = ext.placer.state
    seen_after_list: list[tuple[dict[str, Usage], list[str]]] = []
    replace_pods = state.replace_pods

    def replace_and_look(*args: Any) -> None:
        replace_pods(*args)
        seen_after_list.append((usage(ext, "n1"),
                                ext.placer.filter({"Pod": b, "NodeNames": ["n1"]})["NodeNames"]))

    monkeypatch.setattr(state, "replace_pods", replace_and_look)
    hold.append(True)
    await eventually(lambda: "pods" in kube.open_watches)
    kube.fail("GET", "/api/v1/pods$", 410, watch=True, as_event=True)  # the watch expires
    kube.end_watches()
    await asyncio.wait_for(snapshot_taken.wait(), 5)

    async def answer_lost(real: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        (await real(*args, **kwargs)).release()
        raise TimeoutError

    intercept_binds(ext, answer_lost)
    assert await ext.bind(a, "n1") == ""
    assert not state.allocs[a["metadata"]["uid"]].assumed  # confirmed by reading the pod
    deliver.set()
    await eventually(lambda: bool(seen_after_list))
    assert seen_after_list[0] == ({"GPU-0": Usage(6000, 0, 1, 0)}, [])
    assert "too little free memory" in await ext.bind(b, "n1")
    assert bound_pods(kube, "n1") == ["a"]


@pytest.mark.parametrize("first", ["undecided", "answered"])
async def test_retry_elsewhere_never_frees_the_gpus_the_first_binding_may_take(
        kube: FakeKube, extender: Any, first: str) -> None:
    """a's first Binding (n1) gets no answer, or its answer is lost to kube-scheduler; the
    retry goes to n2. The first Binding lands while the retry is under way, and b is bound
    meanwhile: b must not get a's GPU on n1, which a now holds."""
    kube.put(gpu_node("n1", SMALL))
    kube.put(gpu_node("n2", [("GPU-b0", 10000)]))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    await ext.placer.sync.stop()  # the watch lags behind
    real_bind = ext.placer.core.create_namespaced_pod_binding
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    b_bound: list[str] = []

    async def first_lands_late(real: Binder, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        if args[0] == "a" and not held:
            held.append((args, kwargs))
            if first == "answered":
                return await real(*args, **kwargs)
            raise TimeoutError
        if args[0] == "a":
            if first == "undecided":
                (await real(*held[0][0], **held[0][1])).release()  # the first write lands
            b_bound.append(await ext.bind(b, "n1"))
        return await real(*args, **kwargs)

    intercept_binds(ext, first_lands_late)
    await ext.bind(a, "n1")
    await ext.bind(a, "n2")  # kube-scheduler's retry, elsewhere
    if not kube.get("pods", "a")["spec"].get("nodeName"):  # the first lands after the retry
        (await real_bind(*held[0][0], **held[0][1])).release()
    if not b_bound:
        b_bound.append(await ext.bind(b, "n1"))
    assert kube.get("pods", "a")["spec"]["nodeName"] == "n1"
    assert "too little free memory" in b_bound[0]
    assert bound_pods(kube, "n1") == ["a"]
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}


async def test_retry_on_the_same_node_asks_for_the_gpus_the_first_binding_may_take(
        kube: FakeKube, extender: Any) -> None:
    """a's first Binding (GPU-1) gets no answer; z, on GPU-1, finishes; the retry on the same
    node would now choose GPU-0. The first Binding lands while the retry is under way and b is
    bound meanwhile: b must not get GPU-1, which a now holds."""
    kube.put(gpu_node("n1", [("GPU-0", 10000), ("GPU-1", 10000)]))
    z = kube.put(gpu_pod("z", {"nvidia.com/gpumem": "2000"}, node="n1", devices="GPU-1",
                         phase="Running"))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    await ext.placer.sync.stop()  # the watch lags behind; the state is fed by hand below
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    b_bound: list[str] = []

    async def first_lands_late(real: Binder, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        if args[0] == "a" and not held:
            held.append((args, kwargs))
            raise TimeoutError
        if args[0] == "a":
            (await real(*held[0][0], **held[0][1])).release()  # the first write lands
            b_bound.append(await ext.bind(b, "n1"))
        return await real(*args, **kwargs)

    intercept_binds(ext, first_lands_late)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    ext.placer.state.apply_pod(kube.put(z | {"status": {"phase": "Succeeded"}}))
    await ext.bind(a, "n1")  # kube-scheduler's retry
    pods = {p["metadata"]["name"]: p["metadata"]["annotations"]["gpuslice.io/devices.main"]
            for p in (kube.get("pods", "a"), kube.get("pods", "b"))}
    assert pods == {"a": "GPU-1", "b": "GPU-0"}, b_bound
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0), "GPU-1": Usage(6000, 0, 1, 0)}


async def test_refused_retry_keeps_the_gpus_the_first_binding_may_take(
        kube: FakeKube, extender: Any) -> None:
    """a's first Binding gets no answer; the retry is refused (429: the API server sheds load)
    and says nothing of the first, which then lands: b must not get a's GPU."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await extender()
    await ext.placer.sync.stop()  # the watch lags behind
    real_bind = ext.placer.core.create_namespaced_pod_binding
    held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def first_unanswered(real: Binder, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> Any:
        if not held:
            held.append((args, kwargs))
            raise TimeoutError
        return await real(*args, **kwargs)

    intercept_binds(ext, first_unanswered)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    kube.fail("POST", "/pods/a/binding$", 429, message="too many requests")
    assert "(429)" in await ext.bind(a, "n1")  # kube-scheduler's retry
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}
    (await real_bind(*held[0][0], **held[0][1])).release()  # the first Binding lands
    assert "too little free memory" in await ext.bind(b, "n1")
    assert bound_pods(kube, "n1") == ["a"]


async def test_filter_sends_the_retry_to_the_node_of_the_undecided_binding(
        kube: FakeKube, extender: Any) -> None:
    """The retry can only go where the first Binding may land: filter passes that node (the
    pod's own reservation is not counted against it) and no other."""
    kube.put(gpu_node("n1", SMALL))
    kube.put(gpu_node("n2", [("GPU-b0", 10000)]))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender()
    real = ext.placer.core.create_namespaced_pod_binding
    never_sent(ext)
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    out = await ext.post("filter", {"Pod": a, "NodeNames": ["n1", "n2"]})
    assert out["NodeNames"] == ["n1"]
    assert out["FailedNodes"]["n2"].startswith(
        "gpuslice: an earlier bind of this pod to node n1 may still be applied")
    out = await ext.post("filter", {"Pod": a, "NodeNames": ["n2"]})  # n1 ruled out upstream
    assert out["NodeNames"] == [] and out["Error"].startswith("gpuslice: an earlier bind")
    ext.placer.core.create_namespaced_pod_binding = real
    assert await ext.bind(a, "n1") == ""
    assert kube.get("pods", "a")["metadata"]["annotations"]["gpuslice.io/devices.main"] == "GPU-0"
    assert usage(ext, "n1") == {"GPU-0": Usage(6000, 0, 1, 0)}


class _Answer:
    """A raw response whose body was read already (what ``read_json`` needs of one)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self._body = status, body

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass


async def test_pod_deleted_while_the_bind_reads_it_leaves_no_ghost(
        kube: FakeKube, extender: Any) -> None:
    """The Binding lands but its answer is lost; the bind reads the pod (bound), and before
    that answer is handled the pod is deleted and the watch has dropped the reservation. The
    older read must not bring the deleted pod's GPUs back: nothing after it would drop them
    until the next full list (minutes)."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await extender()
    uid = a["metadata"]["uid"]

    sent: list[bool] = []

    async def answer_lost(real: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        (await real(*args, **kwargs)).release()
        sent.append(True)
        raise TimeoutError

    intercept_binds(ext, answer_lost)
    read_pod = ext.placer.core.read_namespaced_pod

    async def read_then_deleted(*args: Any, **kwargs: Any) -> Any:
        resp = await read_pod(*args, **kwargs)
        if not sent:  # bind's first read (filter never saw the pod)
            return resp
        body = await resp.read()
        resp.release()
        kube.delete("pods", "a")  # graceful deletion ends; the watch says DELETED
        await eventually(lambda: uid not in ext.placer.state.allocs)
        return _Answer(resp.status, body)

    ext.placer.core.read_namespaced_pod = read_then_deleted
    assert await ext.bind(a, "n1") == ""  # it was bound, as asked
    await asyncio.sleep(0.2)  # the watch has nothing more to say about a
    assert kube.get("pods", "a") is None
    assert uid not in ext.placer.state.allocs, "a deleted pod holds GPUs"
    assert usage(ext, "n1") == {}


async def test_relist_sent_before_a_bind_drops_the_reservation_of_a_pod_deleted_since(
        kube: FakeKube, extender: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relist is asked for (a watch expired) and waits in the API server's queue; meanwhile
    a is bound and deleted; then the snapshot is taken, without a. The reservation was made
    after the list was asked for, so the list cannot tell by time that it is stale; but a was
    seen (by the bind) at a version older than the list's: it is gone, and so are its GPUs.
    Kept, nothing would drop them before the next full list (minutes)."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    queued, serve = asyncio.Event(), asyncio.Event()
    hold: list[bool] = []
    list_pods = client.CoreV1Api.list_pod_for_all_namespaces

    async def queued_list(self: Any, *args: Any, **kwargs: Any) -> Any:
        if hold and not kwargs.get("watch"):
            hold.clear()
            queued.set()
            await serve.wait()  # the request waits before the snapshot is taken
        return await list_pods(self, *args, **kwargs)

    monkeypatch.setattr(client.CoreV1Api, "list_pod_for_all_namespaces", queued_list)
    ext = await extender()
    ext.placer.filter({"Pod": a, "NodeNames": ["n1"]})
    hold.append(True)
    await eventually(lambda: "pods" in kube.open_watches)
    kube.fail("GET", "/api/v1/pods$", 410, watch=True, as_event=True)
    kube.end_watches()
    await asyncio.wait_for(queued.wait(), 5)
    assert await ext.bind(a, "n1") == ""
    kube.delete("pods", "a")
    lists = len([r for r in kube.requests_to("GET", "/api/v1/pods$") if not r.watch])
    serve.set()
    await eventually(lambda: len([r for r in kube.requests_to("GET", "/api/v1/pods$")
                                  if not r.watch]) > lists)
    await eventually(lambda: "pods" in kube.open_watches)
    await asyncio.sleep(0.1)
    assert usage(ext, "n1") == {}, "a deleted pod's GPUs are held"
    assert a["metadata"]["uid"] not in ext.placer.state.allocs
