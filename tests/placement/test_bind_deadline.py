"""Bind under a slow API server: the extender answers before kube-scheduler gives up.

kube-scheduler waits ``httpTimeout`` (the chart's ``scheduler.extender.httpTimeout``, 10 s) for
an extender call. A bind makes up to four API calls (read the pod, read the scheduler's lease,
create the Binding, read the pod again when the Binding's outcome is unknown), each bounded by
``bind_timeout_s`` (3 s): 12 s when each call takes nearly its bound. A deadline passed down
through the calls bounds the whole bind by ``bind_deadline_s``, below ``httpTimeout``.

The tests run at a fifth of the real times (``bind_timeout_s`` 0.6 s, ``bind_deadline_s``
1.6 s, the scheduler's timeout 2 s). At a tenth, a read that answers "just in time" had 10 ms,
or 50 ms, left for the fake API server and the client, in one event loop, to pass the answer
(up to 73 ms in 200 reads on a 2-core machine at load 7 with a busy loop beside), so it timed
out now and then ("cannot read the pod").
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakekube import FakeKube
from placement.kubeobjects import eventually, gpu_node, gpu_pod

from webhook.placement.inventory import Usage
from webhook.placement.placer import Placer
from webhook.settings import Settings

LEASE = "default/gpuslice-scheduler"
SCALE = 0.2
HTTP_TIMEOUT_S = 10.0 * SCALE  # the chart's httpTimeout, scaled
# A read that answers just in time: 0.1 s inside bind_timeout_s (10 ms, then 50 ms at a tenth
# of the real times, were too little for a busy machine's event loop: the read timed out and
# the Binding under test was never sent); the four calls of a bind still take 2.2 s, more than
# httpTimeout, without the deadline
JUST_IN_TIME = 2.5 * SCALE
SMALL = [("GPU-0", 10000)]
SIX_GIB = {"nvidia.com/gpumem": "6000"}
VALUES = Path(__file__).resolve().parents[2] / "charts" / "gpuslice" / "values.yaml"


def first_leader_lease() -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "gpuslice-scheduler", "namespace": "default"},
            "spec": {"holderIdentity": "first_1", "leaseDurationSeconds": 15,
                     "leaseTransitions": 0}}


async def scaled_extender(kube: FakeKube, extender: Any) -> Any:
    kube.put(first_leader_lease())
    ext = await extender(scheduler_lease=LEASE)
    ext.placer.bind_timeout_s = 3.0 * SCALE
    ext.placer.bind_deadline_s = 8.0 * SCALE
    ext.placer.assume_ttl_s = 60.0 * SCALE
    return ext


def slow_api(kube: FakeKube, pod: str, binding_s: float = 50.0 * SCALE) -> None:
    """Every call of a bind of ``pod`` takes nearly, or more than, ``bind_timeout_s``: the
    reads answer just in time, the Binding and the read after it do not."""
    kube.delay("GET", f"/pods/{pod}$", JUST_IN_TIME)
    kube.delay("GET", "/leases/gpuslice-scheduler$", JUST_IN_TIME)
    kube.delay("POST", f"/pods/{pod}/binding$", binding_s)
    kube.delay("GET", f"/pods/{pod}$", 50.0 * SCALE)


async def test_bind_answers_within_the_schedulers_http_timeout_however_slow_the_api(
        kube: FakeKube, extender: Any) -> None:
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await scaled_extender(kube, extender)
    slow_api(kube, "a")  # and a is not in the pod cache (no filter first): bind reads it
    started = time.monotonic()
    error = await ext.bind(a, "n1")
    took = time.monotonic() - started
    assert error.startswith("gpuslice: bind request failed")
    assert took < HTTP_TIMEOUT_S, f"bind answered after {took:.2f}s"
    # Its outcome unknown, the Binding's GPU room stays reserved (for assume_ttl_s).
    assert ext.placer.state.allocs[a["metadata"]["uid"]].assumed


def test_the_bind_deadline_is_below_the_charts_http_timeout() -> None:
    placer = Placer(Settings())
    http_timeout = yaml.safe_load(VALUES.read_text())["scheduler"]["extender"]["httpTimeout"]
    match = re.fullmatch(r"(\d+)s", http_timeout)
    assert match, http_timeout
    # 1 s for the HTTPS exchange with the scheduler and a busy event loop.
    assert placer.bind_deadline_s + 1.0 <= int(match[1])
    assert placer.bind_timeout_s < placer.bind_deadline_s


@pytest.mark.parametrize("scheduler_timeout_s", [0.5, HTTP_TIMEOUT_S],
                         ids=["scheduler-gives-up-first", "chart-http-timeout"])
async def test_scheduler_giving_up_neither_binds_twice_nor_overcommits(
        kube: FakeKube, extender: Any, scheduler_timeout_s: float) -> None:
    """kube-scheduler calls bind with its httpTimeout and, when it gets an error or gives up,
    retries the pod after a back-off. a's Binding is applied late (after the extender stopped
    waiting for it); b asks for the room a holds meanwhile. a is bound once, and b never
    shares the GPU, whether the scheduler gave up (an httpTimeout below ``bind_deadline_s``)
    or heard the extender's answer."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await scaled_extender(kube, extender)
    slow_api(kube, "a", binding_s=6.0 * SCALE)  # the Binding lands 1.2 s after it was sent
    # The scheduler stops waiting; the extender's handler goes on (the service's server does
    # not cancel a handler whose client left; the test server would).
    call = asyncio.create_task(ext.bind(a, "n1"))
    try:
        first = await asyncio.wait_for(asyncio.shield(call), scheduler_timeout_s)
    except TimeoutError:
        first = "(the scheduler gave up)"
    if scheduler_timeout_s < ext.placer.bind_deadline_s:
        assert first == "(the scheduler gave up)"
    else:
        assert first.startswith("gpuslice: bind request failed")
    # b's attempts start once a's bind has reserved its room (after its reads: a scheduler
    # that gave up first can retry b before that, and b fits then, rightly).
    await eventually(lambda: a["metadata"]["uid"] in ext.placer.state.allocs)

    peak = 0
    for _ in range(15):  # the scheduler's retries of a, and b's attempts, 0.2 s apart
        await asyncio.sleep(1.0 * SCALE)
        out = await ext.post("filter", {"Pod": b, "NodeNames": ["n1"]})
        assert out["NodeNames"] == [], "b offered the room a's Binding may take"
        assert "too little free memory" in await ext.bind(b, "n1")
        if kube.get("pods", "a")["spec"].get("nodeName") is None:
            await ext.bind(a, "n1")
        peak = max(peak, sum(u.mem for u in ext.placer.state.node("n1").usage.values()))
    await eventually(lambda: not ext.placer.state.allocs[a["metadata"]["uid"]].assumed)
    assert kube.get("pods", "a")["spec"]["nodeName"] == "n1"
    assert kube.get("pods", "b")["spec"].get("nodeName") is None
    assert peak == 6000  # never a second 6000 MiB on the 10000 MiB GPU
    assert dict(ext.placer.state.node("n1").usage) == {"GPU-0": Usage(6000, 0, 1, 0)}
    await call


async def test_a_binding_that_never_lands_holds_its_room_for_the_deadline_and_the_ttl(
        kube: FakeKube, extender: Any) -> None:
    """The API server stalls and then drops a's Binding: its room stays reserved from the
    bind until ``assume_ttl_s`` after the extender's answer, at most ``bind_deadline_s`` +
    ``assume_ttl_s`` (68 s at the defaults), then b fits."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    b = kube.put(gpu_pod("b", SIX_GIB))
    ext = await scaled_extender(kube, extender)
    ext.placer.assume_ttl_s = 1.0
    slow_api(kube, "a")
    kube.fail("POST", "/pods/a/binding$", 500)  # after its delay: never applied
    started = time.monotonic()
    assert (await ext.bind(a, "n1")).startswith("gpuslice: bind request failed")
    while not (await ext.post("filter", {"Pod": b, "NodeNames": ["n1"]}))["NodeNames"]:
        await asyncio.sleep(0.02)
    held = time.monotonic() - started
    assert ext.placer.assume_ttl_s <= held < ext.placer.bind_deadline_s + \
        ext.placer.assume_ttl_s + 0.3, held
    assert kube.get("pods", "a")["spec"].get("nodeName") is None


async def test_no_binding_is_sent_too_late_to_hear_its_answer(
        kube: FakeKube, extender: Any) -> None:
    """The reads before the Binding took nearly the whole deadline: sent then, the Binding
    would most likely stay undecided and hold its room for ``assume_ttl_s``; the bind is
    refused instead and the scheduler retries."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    ext = await scaled_extender(kube, extender)
    # the two reads leave 0.1 s, less than a third of bind_timeout_s
    ext.placer.bind_deadline_s = 2 * JUST_IN_TIME + 0.5 * SCALE
    slow_api(kube, "a")
    error = await ext.bind(a, "n1")
    assert "took too long to send the Binding in time" in error
    assert kube.requests_to("POST", "/pods/a/binding$") == []
    assert not ext.placer.state.allocs


@pytest.mark.parametrize("cold", [False, True], ids=["listed", "cold"])
async def test_filter_and_prioritize_never_call_the_api(
        kube: FakeKube, extender: Any, cold: bool) -> None:
    """Filter and prioritize answer from the watched state: no API call, so no wait on a slow
    API server. Before the first list is in (cold), filter answers "retry" at once."""
    kube.put(gpu_node("n1", SMALL))
    a = kube.put(gpu_pod("a", SIX_GIB))
    if cold:
        kube.delay("GET", "/api/v1/(nodes|pods)$", 50.0 * SCALE, times=2)
    ext = await extender(wait_ready=not cold)
    kube.delay("*", "", 50.0 * SCALE, times=1000)  # every later request hangs
    # The sync's own requests are all sent (a sleep of 0.05 s was not always long enough).
    if cold:
        await eventually(lambda: len(kube.requests_to("GET", "/api/v1/(nodes|pods)$")) == 2)
    else:
        await eventually(lambda: sorted(kube.open_watches) == ["nodes", "pods"])
    before = len(kube.requests)
    started = time.monotonic()
    out = await ext.post("filter", {"Pod": a, "NodeNames": ["n1"]})
    scores = await ext.post("prioritize", {"Pod": a, "NodeNames": ["n1"]})
    took = time.monotonic() - started
    assert took < 1.0, took  # every API request would take 5 s
    assert len(kube.requests) == before
    if cold:
        assert out["Error"] == "gpuslice: placement is still reading the cluster state; retry"
        assert scores == [{"Host": "n1", "Score": 0}]
    else:
        assert out["NodeNames"] == ["n1"] and scores[0]["Score"] > 0
