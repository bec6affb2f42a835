"""The GPUs held for nominated pods are kept between requests, and the verbs decide as if they
were worked out afresh each time.

The randomized tests run filter, prioritize and preempt over states that change between
requests (nominations made, moved, cleared; nominees bound, reserved, deleted; pods bound,
deleted, terminating; a node's GPUs changed) and compare every answer with the verbs' over a
plain recomputation of the holds (the algorithm as it was before they were kept) and no
cached results. The others change one thing between two requests of one pod and expect the
fresh answer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from placement.kubeobjects import gpu_node, gpu_pod

from webhook.placement.fit import NoFit, Placement, place
from webhook.placement.inventory import Usage, add_usage
from webhook.placement.model import Proposed
from webhook.placement.placer import Placer
from webhook.placement.request import pod_request
from webhook.placement.state import ClusterState, NodeState, pod_priority
from webhook.settings import Settings

GIB = 1024
SHAPES = [
    {"nvidia.com/gpumem": str(10 * GIB), "nvidia.com/gpucores": "20"},
    {"nvidia.com/gpumem": str(30 * GIB)},
    {"nvidia.com/gpumem": str(60 * GIB), "nvidia.com/gpucores": "50"},
    {"nvidia.com/gpu": "2", "nvidia.com/gpumem": str(20 * GIB)},
    {"nvidia.com/gpu": "1"},
    {"nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "40"},
    {"nvidia.com/gpu": "4", "nvidia.com/gpumem": str(70 * GIB)},  # rarely fits: full nodes
]
PRIORITIES = (0, 100, 1000)


def reference_held(state: ClusterState, node: NodeState, priority: int,
                   uid: str) -> dict[str, Usage] | None:
    """The holds worked out from scratch, from every nominee in the state."""
    holders = sorted((n for n in state.nominees.values()
                      if n.node == node.name and n.priority >= priority and n.uid != uid
                      and n.uid not in state.allocs), key=lambda n: (-n.priority, n.uid))
    if not holders:
        return None
    usage = {k: v.copy() for k, v in node.usage.items()}
    base = {k: v.copy() for k, v in node.usage.items()}
    for u in node.pods:
        if state.allocs[u].terminating:
            add_usage(base, state.allocs[u].demand, -1)
    held = False
    for nominee in holders:
        result = place(nominee.request, node.gpus, base, state.settings.split_count)
        if isinstance(result, Placement):
            add_usage(base, result.demand, 1)
            add_usage(usage, result.demand, 1)
            held = True
    return usage if held else None


@contextmanager
def recomputing(state: ClusterState) -> Iterator[Placer]:
    """A placer with nothing cached, over ``state`` with its holds worked out from scratch."""
    state.held_usage = (  # type: ignore[method-assign]
        lambda node, priority, uid: reference_held(state, node, priority, uid))
    try:
        yield Placer(state.settings, state)
    finally:
        del state.held_usage


def nonzero(usage: Mapping[str, Usage] | None) -> dict[str, Usage] | None:
    return None if usage is None else {k: v for k, v in usage.items() if not v.is_zero()}


class World:
    """Nodes and pods fed to a ClusterState as the watch delivers them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state = ClusterState(Settings())
        self.rv = 0
        self.nodes: list[str] = []
        self.bound: dict[str, dict[str, Any]] = {}
        self.pending: dict[str, dict[str, Any]] = {}
        self.serial = 0
        for i in range(6):
            self.nodes.append(f"n{i}")
            self.state.apply_node(self.node_obj(f"n{i}", self.rng.choice((1, 2, 4))))
        for _ in range(25):
            self.bind_new()
        for _ in range(12):
            self.nominate_new()

    def node_obj(self, name: str, count: int) -> dict[str, Any]:
        big = self.rng.random() < 0.5
        return gpu_node(name, [(f"GPU-{name}-{j}", (80 if big else 40) * GIB)
                               for j in range(count)])

    def stamp(self, pod: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        return pod

    def new_pod(self, prefix: str, node: str | None = None,
                devices: str | None = None, shape: dict[str, str] | None = None
                ) -> dict[str, Any]:
        self.serial += 1
        name = f"{prefix}{self.serial}"
        pod = gpu_pod(name, shape or self.rng.choice(SHAPES), node=node, devices=devices,
                      phase="Running" if node else "Pending")
        pod["metadata"]["uid"] = f"uid-{name}"
        pod["spec"]["priority"] = self.rng.choice(PRIORITIES)
        pod["status"]["startTime"] = f"2026-01-01T00:00:{self.serial % 60:02d}Z" if node else None
        return pod

    def placed_on(self, name: str, shape: dict[str, str]) -> str | None:
        node = self.state.node(name)
        assert node is not None
        probe = gpu_pod("probe", shape)
        result = place(pod_request(probe, self.state.settings), node.gpus, node.usage,
                       self.state.settings.split_count)
        return ",".join(result.assignment["main"]) if isinstance(result, Placement) else None

    def bind_new(self) -> None:
        name, shape = self.rng.choice(self.nodes), self.rng.choice(SHAPES[:3])
        devices = self.placed_on(name, shape)
        if devices:
            pod = self.new_pod("b", name, devices, shape)
            self.bound[pod["metadata"]["name"]] = pod
            self.state.apply_pod(self.stamp(pod))

    def nominate_new(self) -> None:
        pod = self.new_pod("nom")
        pod["status"]["nominatedNodeName"] = self.rng.choice(self.nodes)
        self.pending[pod["metadata"]["name"]] = pod
        self.state.apply_pod(self.stamp(pod))

    def step(self) -> str:
        """One change, as the watch (or a bind) makes it; returns what it was."""
        rng, state = self.rng, self.state
        op = rng.choice(("nominate", "renominate", "clear", "delete nominee", "bind nominee",
                         "reserve nominee", "release", "bind", "unbind", "terminating",
                         "gpus"))
        if op == "nominate":
            self.nominate_new()
        elif op in ("renominate", "clear", "delete nominee", "bind nominee") and self.pending:
            name = rng.choice(sorted(self.pending))
            pod = self.pending[name]
            if op == "renominate":
                pod["status"]["nominatedNodeName"] = rng.choice(self.nodes)
                state.apply_pod(self.stamp(pod))
            elif op == "clear":
                pod["status"]["nominatedNodeName"] = None
                state.apply_pod(self.stamp(pod))
            elif op == "delete nominee":
                del self.pending[name]
                state.delete_pod(pod)
            else:
                target = rng.choice(self.nodes)
                shape = pod["spec"]["containers"][0]["resources"]["limits"]
                devices = self.placed_on(target, shape)
                if devices:
                    del self.pending[name]
                    pod["spec"]["nodeName"] = target
                    pod["status"]["phase"] = "Running"
                    pod["metadata"]["annotations"]["gpuslice.io/devices.main"] = devices
                    self.bound[name] = pod
                    state.apply_pod(self.stamp(pod))
        elif op == "reserve nominee" and self.pending:
            pod = self.pending[rng.choice(sorted(self.pending))]
            target = rng.choice(self.nodes)
            shape = pod["spec"]["containers"][0]["resources"]["limits"]
            devices = self.placed_on(target, shape)
            uid = pod["metadata"]["uid"]
            if devices and uid not in state.allocs:
                        state.reserve(uid, "default", pod["metadata"]["name"], target,
                              pod_request(pod, state.settings), {"main": tuple(devices.split(","))},
                              pod["metadata"]["resourceVersion"], pod["spec"]["priority"])
        elif op == "release":
            assumed = sorted(u for u, a in state.allocs.items() if a.assumed)
            if assumed:
                state.release(rng.choice(assumed))
        elif op == "bind":
            self.bind_new()
        elif op in ("unbind", "terminating") and self.bound:
            name = rng.choice(sorted(self.bound))
            pod = self.bound[name]
            if op == "unbind":
                del self.bound[name]
                state.delete_pod(pod)
            else:
                pod["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"
                state.apply_pod(self.stamp(pod))
        elif op == "gpus":
            name = rng.choice(self.nodes)
            state.apply_node(self.node_obj(name, rng.choice((1, 2, 4))))
        return op

    def queries(self) -> list[dict[str, Any]]:
        """Pods to ask about: new ones of every priority around the nominees', and nominees
        themselves (left out of their own holds), none with an allocation."""
        out = []
        for shape in range(len(SHAPES) - 1):
            for priority in (-1, 0, 100, 500, 1000, 2000):
                pod = gpu_pod(f"q{shape}", SHAPES[shape])
                pod["metadata"]["uid"] = f"uid-q{shape}-{priority}"
                pod["spec"]["priority"] = priority
                out.append(pod)
        own = [p for p in self.pending.values() if p["metadata"]["uid"] not in self.state.allocs
               and p["metadata"]["uid"] in self.state.nominees]
        out.extend(self.rng.sample(own, min(4, len(own))))
        return out


def decisions(placer: Placer, pod: dict[str, Any], nodes: list[str]) -> tuple[Any, Any]:
    filtered = placer.filter({"Pod": pod, "NodeNames": nodes})
    scores = placer.prioritize({"Pod": pod, "NodeNames": nodes})
    return filtered, scores


def proposals(state: ClusterState) -> dict[str, Proposed]:
    return {name: Proposed(sorted(u for u in node.pods if state.allocs[u].demand), 0, {})
            for name, node in state.nodes.items() if node.pods}


@pytest.mark.parametrize("seed", range(6))
async def test_kept_holds_decide_as_a_recomputation_while_nominations_change(seed: int) -> None:
    world = World(seed)
    state = world.state
    placer = Placer(state.settings, state)
    held_seen = 0
    for step in range(40):
        for _ in range(world.rng.randint(1, 3)):
            world.step()
        for pod in world.queries():
            got = decisions(placer, pod, world.nodes)
            with recomputing(state) as fresh:
                want = decisions(fresh, pod, world.nodes)
            assert got == want, (seed, step, pod["metadata"]["uid"])
            for name in world.nodes:
                node = state.node(name)
                assert node is not None
                ref = reference_held(state, node, pod_priority(pod), pod["metadata"]["uid"])
                held_seen += ref is not None
                assert nonzero(state.held_usage(node, pod_priority(pod),
                                                pod["metadata"]["uid"])) == nonzero(ref)
        for pod in world.queries()[::5]:
            if pod["spec"]["priority"] <= 0:
                continue
            got_v = await placer.preempt(pod, proposals(state))
            with recomputing(state) as fresh:
                want_v = await fresh.preempt(pod, proposals(state))
            assert got_v == want_v, (seed, step, pod["metadata"]["uid"])
    assert held_seen  # the states did hold GPUs for nominees


# ----- invalidation: one change between two requests of one pod -----

def one_gpu_node(name: str) -> dict[str, Any]:
    return gpu_node(name, [(f"GPU-{name}", 80 * GIB)])


def pod_of(name: str, gib: int, priority: int, *, node: str | None = None,
           nominated: str | None = None, rv: int = 1) -> dict[str, Any]:
    pod = gpu_pod(name, {"nvidia.com/gpumem": str(gib * GIB)}, node=node,
                  devices=f"GPU-{node}" if node else None,
                  phase="Running" if node else "Pending")
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["metadata"]["resourceVersion"] = str(rv)
    pod["spec"]["priority"] = priority
    if nominated:
        pod["status"]["nominatedNodeName"] = nominated
    return pod


def setup_state(*pods: dict[str, Any]) -> tuple[ClusterState, Placer]:
    state = ClusterState(Settings())
    state.replace_nodes([one_gpu_node("n1"), one_gpu_node("n2")])
    for pod in pods:
        state.apply_pod(pod)
    return state, Placer(state.settings, state)


def passes(placer: Placer, pod: dict[str, Any]) -> list[str]:
    """The nodes filter passes for ``pod``; prioritize and preempt agree with a recomputation."""
    out = placer.filter({"Pod": pod, "NodeNames": ["n1", "n2"]})
    with recomputing(placer.state) as fresh:
        assert out == fresh.filter({"Pod": pod, "NodeNames": ["n1", "n2"]})
        assert placer.prioritize({"Pod": pod, "NodeNames": ["n1", "n2"]}) == \
            fresh.prioritize({"Pod": pod, "NodeNames": ["n1", "n2"]})
    return list(out["NodeNames"])


def test_a_nomination_made_moved_or_cleared_between_requests_is_seen() -> None:
    late = pod_of("late", 30, 100)
    big = pod_of("big", 60, 1000)
    state, placer = setup_state(big)
    assert passes(placer, late) == ["n1", "n2"]
    big["status"]["nominatedNodeName"], big["metadata"]["resourceVersion"] = "n1", "2"
    state.apply_pod(big)  # nominated: 60 of n1's 80 GiB held for it
    assert passes(placer, late) == ["n2"]
    big["status"]["nominatedNodeName"], big["metadata"]["resourceVersion"] = "n2", "3"
    state.apply_pod(big)  # renominated
    assert passes(placer, late) == ["n1"]
    big["status"]["nominatedNodeName"], big["metadata"]["resourceVersion"] = None, "4"
    state.apply_pod(big)  # cleared
    assert passes(placer, late) == ["n1", "n2"]
    big["status"]["nominatedNodeName"], big["metadata"]["resourceVersion"] = "n1", "5"
    state.apply_pod(big)
    assert passes(placer, late) == ["n2"]
    state.delete_pod(big)
    assert passes(placer, late) == ["n1", "n2"]


def test_a_nominee_of_lower_priority_added_beside_one_held_changes_the_hold() -> None:
    """Two nominees that both fit only one at a time: the one of higher priority holds; the
    other, added later, holds nothing, and removing the first lets it hold."""
    first = pod_of("first", 50, 1000, nominated="n1")
    state, placer = setup_state(first)
    late = pod_of("late", 20, 0)
    assert passes(placer, late) == ["n1", "n2"]  # 50 + 20 of 80
    second = pod_of("second", 40, 100, nominated="n1")
    state.apply_pod(second)
    assert passes(placer, late) == ["n1", "n2"]  # second does not fit beside first
    state.delete_pod(first)
    assert passes(placer, late) == ["n1", "n2"]  # second holds 40: 60 of 80
    assert passes(placer, pod_of("mid", 50, 100)) == ["n2"]  # second counts for its peers
    assert passes(placer, pod_of("high", 50, 200)) == ["n1", "n2"]  # not for higher ones


def test_a_nominee_reserved_elsewhere_then_released_holds_nothing_then_again() -> None:
    big = pod_of("big", 60, 1000, nominated="n1")
    state, placer = setup_state(big)
    late = pod_of("late", 30, 100)
    assert passes(placer, late) == ["n2"]
    state.reserve("uid-big", "default", "big", "n2", pod_request(big, state.settings),
                  {"main": ("GPU-n2",)}, "1", 1000)  # its bind under way, on n2
    assert passes(placer, late) == ["n1"]
    state.release("uid-big")  # the bind failed: nominated to n1 still
    assert passes(placer, late) == ["n2"]


def test_a_nominee_bound_counts_through_its_allocation() -> None:
    big = pod_of("big", 60, 1000, nominated="n1")
    state, placer = setup_state(big)
    late = pod_of("late", 30, 100)
    assert passes(placer, late) == ["n2"]
    bound = pod_of("big", 60, 1000, node="n2", nominated="n1", rv=2)
    state.apply_pod(bound)
    assert "uid-big" not in state.nominees
    assert passes(placer, late) == ["n1"]


def test_node_usage_changing_between_requests_gives_the_fresh_hold() -> None:
    """A pod bound beside the nominee leaves it no room: it holds nothing; deleted, it holds
    again."""
    big = pod_of("big", 60, 1000, nominated="n1")
    state, placer = setup_state(big)
    late = pod_of("late", 30, 100)
    assert passes(placer, late) == ["n2"]
    small = pod_of("small", 30, 5000, node="n1")
    state.apply_pod(small)
    assert passes(placer, late) == ["n1", "n2"]  # 30 + 30; big cannot fit beside small
    state.delete_pod(small)
    assert passes(placer, late) == ["n2"]


def test_a_victim_starting_to_terminate_frees_its_gpus_to_the_nominee() -> None:
    victim = pod_of("victim", 60, 0, node="n1")
    big = pod_of("big", 60, 1000, nominated="n1")
    state, placer = setup_state(victim, big)
    late = pod_of("late", 10, 0)
    assert passes(placer, late) == ["n1", "n2"]  # big does not fit beside the victim
    victim["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    victim["metadata"]["resourceVersion"] = "2"
    state.apply_pod(victim)  # no change of usage: the victim holds its GPUs until gone
    assert passes(placer, late) == ["n2"]  # 60 (victim) + 60 (big) already
    state.delete_pod(victim)
    assert passes(placer, late) == ["n1", "n2"]  # 60 (big) + 10


def test_node_gpus_changing_between_requests_gives_the_fresh_hold() -> None:
    big = pod_of("big", 60, 1000, nominated="n1")
    state, placer = setup_state(big)
    late = pod_of("late", 30, 100)
    assert passes(placer, late) == ["n2"]
    state.apply_node(gpu_node("n1", [("GPU-n1", 80 * GIB), ("GPU-n1b", 80 * GIB)]))
    assert passes(placer, late) == ["n1", "n2"]
    state.apply_node(gpu_node("n1", [("GPU-n1", 40 * GIB)]))  # big cannot fit: no hold
    assert passes(placer, late) == ["n1", "n2"]


def test_the_same_hold_is_handed_out_until_it_changes() -> None:
    big = pod_of("big", 60, 1000, nominated="n1")
    state, _ = setup_state(big)
    node = state.node("n1")
    assert node is not None
    first = state.held_usage(node, 100, "uid-late")
    assert first is not None and first is state.held_usage(node, 0, "uid-other")
    assert state.held_usage(node, 1000, "uid-big") is None  # not against itself
    assert state.held_usage(node, 1001, "uid-x") is None
    state.apply_pod(pod_of("small", 10, 0, node="n1"))
    second = state.held_usage(node, 100, "uid-late")
    assert second is not first and second is not None
    assert second["GPU-n1"].mem == 70 * GIB and first["GPU-n1"].mem == 60 * GIB


def test_a_nominee_that_fits_nowhere_holds_nothing() -> None:
    huge = pod_of("huge", 90, 1000, nominated="n1")
    state, placer = setup_state(huge)
    assert passes(placer, pod_of("late", 80, 0)) == ["n1", "n2"]
    node = state.node("n1")
    assert node is not None and state.held_usage(node, 0, "uid-late") is None
    assert isinstance(place(state.nominees["uid-huge"].request, node.gpus, {},
                            state.settings.split_count), NoFit)
