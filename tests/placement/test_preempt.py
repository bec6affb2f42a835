"""Priority preemption of GPU pods: the extender's ``preempt`` verb against kube-scheduler's.

kube-scheduler's default preemption (PostFilter, DefaultPreemption) dry-runs each candidate
node: it removes the pods of lower priority, re-runs only its in-tree filter plugins, then
gives back ("reprieves") as many as still let the preemptor fit, most important first
(``SelectVictimsOnNode``). The extender's per-GPU fit is not among those plugins: the dry run
sees only the node totals of the extended resources the agent publishes. An extender with a
``preemptVerb`` then gets the candidates with their victims (``ProcessPreemption``; with
``nodeCacheCapable`` the victims as pod UIDs, ``MetaVictims``) and answers the nodes and victims
it accepts. :func:`dry_run` models the scheduler's side on those totals.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable
from typing import Any

import pytest
from aiohttp import web
from placement.kubeobjects import gpu_node, gpu_pod

from webhook.placement.extender import PLACEMENT_KEY, setup
from webhook.placement.fit import NoFit, place
from webhook.placement.inventory import add_usage
from webhook.placement.preempt import choose_victims
from webhook.placement.request import PodRequest, pod_request
from webhook.placement.state import ClusterState
from webhook.settings import Settings

GIB = 1024
A100 = 80 * GIB
SPLIT = Settings().split_count
RES = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores")


def bound(name: str, node: str, devices: str, limits: dict[str, str], priority: int,
          start: str, container: str = "main") -> dict[str, Any]:
    pod = gpu_pod(name, limits, container=container, node=node, devices=devices,
                  phase="Running")
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["priority"] = priority
    pod["status"]["startTime"] = start
    return pod


def pending(name: str, limits: dict[str, str], priority: int) -> dict[str, Any]:
    pod = gpu_pod(name, limits)
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["spec"]["priority"] = priority
    return pod


def _requests(pod: dict[str, Any]) -> dict[str, int]:
    """The pod's requests of the published resources, as the scheduler's NodeResourcesFit adds
    them up (the webhook adds nvidia.com/gpu: 1 where a container names none)."""
    out = dict.fromkeys(RES, 0)
    for c in pod["spec"]["containers"]:
        limits = (c.get("resources") or {}).get("limits") or {}
        if any(k in limits for k in RES):
            out["nvidia.com/gpu"] += int(limits.get("nvidia.com/gpu", "1"))
            out["nvidia.com/gpumem"] += int(limits.get("nvidia.com/gpumem", "0"))
            out["nvidia.com/gpucores"] += int(limits.get("nvidia.com/gpucores", "0"))
    return out


def dry_run(gpus: list[int], on_node: list[dict[str, Any]], preemptor: dict[str, Any]) -> list[str]:
    """kube-scheduler's SelectVictimsOnNode over the agent's published totals (healthy GPUs x
    split count, their memory, 100 cores each): the UIDs of the victims, most important
    first; [] when it finds none (the scheduler then drops the node)."""
    allocatable = {"nvidia.com/gpu": len(gpus) * SPLIT, "nvidia.com/gpumem": sum(gpus),
                   "nvidia.com/gpucores": 100 * len(gpus)}
    prio = preemptor["spec"].get("priority", 0)
    want = _requests(preemptor)

    def fits(pods: list[dict[str, Any]]) -> bool:
        used = dict.fromkeys(RES, 0)
        for p in pods:
            for k, v in _requests(p).items():
                used[k] += v
        return all(used[k] + want[k] <= allocatable[k] for k in RES)

    lower = [p for p in on_node if p["spec"].get("priority", 0) < prio]
    kept = [p for p in on_node if p not in lower]
    if not lower or not fits(kept):
        return []
    # MoreImportantPod: higher priority, then the earlier start.
    lower.sort(key=lambda p: (-p["spec"].get("priority", 0), p["status"]["startTime"]))
    victims = []
    for p in lower:
        if fits(kept + [p]):
            kept.append(p)
        else:
            victims.append(p["metadata"]["uid"])
    return victims


def preemption_args(preemptor: dict[str, Any], victims: dict[str, list[str]],
                    pdb: int = 0) -> dict[str, Any]:
    """ExtenderPreemptionArgs as kube-scheduler marshals it with nodeCacheCapable (no JSON tags:
    the Go field names; NodeNameToVictims a nil map)."""
    return {"Pod": preemptor, "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
                for node, uids in victims.items()}}


class Cluster:
    """One extender app over a placement state loaded with ``nodes`` and ``pods``."""

    def __init__(self, client: Any, state: ClusterState, pods: list[dict[str, Any]]) -> None:
        self.client, self.state, self.pods = client, state, pods

    async def post(self, verb: str, body: Any) -> tuple[int, Any]:
        resp = await self.client.post(f"/scheduler/{verb}", data=json.dumps(body),
                                      headers={"Content-Type": "application/json"})
        return resp.status, (await resp.json() if resp.status == 200 else await resp.text())

    async def filter(self, pod: dict[str, Any], node: str) -> dict[str, Any]:
        status, out = await self.post("filter", {"Pod": pod, "NodeNames": [node]})
        assert status == 200, out
        return out  # type: ignore[no-any-return]

    def evict(self, uids: list[str]) -> None:
        for p in [p for p in self.pods if p["metadata"]["uid"] in uids]:
            self.pods.remove(p)
            self.state.delete_pod(p)

    def on(self, node: str) -> list[dict[str, Any]]:
        return [p for p in self.pods if p["spec"].get("nodeName") == node]


@pytest.fixture
async def cluster(aiohttp_client: Any) -> Any:
    async def make(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Cluster:
        settings = Settings()
        state = ClusterState(settings)
        state.replace_nodes(nodes)
        state.replace_pods(pods, listed_at=0.0)
        app = web.Application()
        setup(app, settings, state=state)
        return Cluster(await aiohttp_client(app), state, list(pods))
    return make


def thirty_each() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two 80 GiB GPUs, two low-priority 30 GiB pods on each."""
    nodes = [gpu_node("n1", [("GPU-0", A100), ("GPU-1", A100)])]
    mem = {"nvidia.com/gpumem": str(30 * GIB)}
    pods = [bound("p1", "n1", "GPU-0", mem, 100, "2026-01-01T00:00:01Z"),
            bound("p2", "n1", "GPU-0", mem, 100, "2026-01-01T00:00:02Z"),
            bound("p3", "n1", "GPU-1", mem, 100, "2026-01-01T00:00:03Z"),
            bound("p4", "n1", "GPU-1", mem, 100, "2026-01-01T00:00:04Z")]
    return nodes, pods


async def preemption_round(c: Cluster, preemptor: dict[str, Any], node: str,
                           gpus: list[int]) -> list[str]:
    """One scheduling cycle's preemption on ``node``, as kube-scheduler runs it with the
    chart's extender: the victims it deletes ([] when it finds none)."""
    proposed = dry_run(gpus, c.on(node), preemptor)
    if not proposed:
        return []
    status, out = await c.post("preempt", preemption_args(preemptor, {node: proposed}))
    if status == 404:  # no preempt verb: the scheduler keeps its own victims
        return proposed
    assert status == 200, out
    meta = out["NodeNameToMetaVictims"].get(node)
    return [p["UID"] for p in meta["Pods"]] if meta else []


async def test_preemption_frees_room_on_one_gpu_for_a_large_slice(cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    first = await c.filter(big, "n1")
    assert "n1" in first["FailedNodes"]  # preemption may help: the scheduler tries it
    victims = await preemption_round(c, big, "n1", [A100, A100])
    assert victims, "no victims chosen"
    c.evict(victims)
    after = await c.filter(big, "n1")
    assert after["NodeNames"] == ["n1"], (victims, after)
    # Both from the same GPU: the fewest that free 60 GiB on one GPU.
    assert sorted(victims) in (["uid-p1", "uid-p2"], ["uid-p3", "uid-p4"])


async def preempt(c: Cluster, preemptor: dict[str, Any], victims: dict[str, list[str]],
                  pdb: int = 0) -> dict[str, Any]:
    status, out = await c.post("preempt", preemption_args(preemptor, victims, pdb))
    assert status == 200, out
    assert set(out) == {"NodeNameToMetaVictims"}
    return out["NodeNameToMetaVictims"]  # type: ignore[no-any-return]


def uids(meta: dict[str, Any]) -> list[str]:
    assert set(meta) == {"Pods", "NumPDBViolations"}
    assert all(set(p) == {"UID"} for p in meta["Pods"])
    return [p["UID"] for p in meta["Pods"]]


async def test_answer_is_kube_schedulers_wire_format(cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    resp = await c.client.post("/scheduler/preempt",
                               data=json.dumps(preemption_args(big, {"n1": ["uid-p4"]})),
                               headers={"Content-Type": "application/json"})
    assert resp.status == 200 and resp.content_type == "application/json"
    # The most important first (p3 started before p4); p4, the scheduler's, stays.
    assert await resp.json() == {"NodeNameToMetaVictims": {"n1": {
        "Pods": [{"UID": "uid-p3"}, {"UID": "uid-p4"}], "NumPDBViolations": 0}}}


async def test_victims_sent_whole_without_node_cache_are_read_by_their_uids(
        cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    body = {"Pod": big, "NodeNameToMetaVictims": None,
            "NodeNameToVictims": {"n1": {"Pods": [pods[3]], "NumPDBViolations": 1}}}
    status, out = await c.post("preempt", body)
    assert status == 200, out
    assert out == {"NodeNameToMetaVictims": {"n1": {
        "Pods": [{"UID": "uid-p3"}, {"UID": "uid-p4"}], "NumPDBViolations": 1}}}


async def test_the_schedulers_victim_on_the_wrong_gpu_is_dropped(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100), ("GPU-1", A100)])]
    mem = {"nvidia.com/gpumem": str(30 * GIB)}
    pods = [bound("a", "n1", "GPU-0", mem, 100, "2026-01-01T00:00:01Z"),
            bound("b", "n1", "GPU-0", mem, 100, "2026-01-01T00:00:02Z"),
            bound("c", "n1", "GPU-1", mem, 100, "2026-01-01T00:00:03Z"),
            bound("h", "n1", "GPU-1", mem, 2000, "2026-01-01T00:00:00Z")]
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    proposed = dry_run([A100, A100], c.on("n1"), big)
    assert proposed == ["uid-c"]  # frees 30 GiB beside h's: 50 GiB on GPU-1
    answer = await preempt(c, big, {"n1": proposed}, pdb=1)
    assert uids(answer["n1"]) == ["uid-a", "uid-b"]
    assert answer["n1"]["NumPDBViolations"] == 0  # c, the scheduler's only victim, stays
    c.evict(uids(answer["n1"]))
    assert (await c.filter(big, "n1"))["NodeNames"] == ["n1"]


async def test_pod_on_two_gpus_and_a_two_gpu_preemptor(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100), ("GPU-1", A100), ("GPU-2", A100)])]
    mem = {"nvidia.com/gpumem": str(40 * GIB)}
    pods = [bound("m", "n1", "GPU-0,GPU-1", mem | {"nvidia.com/gpu": "2"}, 100,
                  "2026-01-01T00:00:01Z"),
            bound("x", "n1", "GPU-0", mem, 100, "2026-01-01T00:00:02Z"),
            bound("y", "n1", "GPU-1", mem, 100, "2026-01-01T00:00:03Z"),
            bound("z", "n1", "GPU-2", mem, 100, "2026-01-01T00:00:04Z"),
            bound("w", "n1", "GPU-2", mem, 100, "2026-01-01T00:00:05Z")]
    c = await cluster(nodes, pods)
    two = pending("two", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": str(60 * GIB)}, 1000)
    assert "n1" in (await c.filter(two, "n1"))["FailedNodes"]
    proposed = dry_run([A100] * 3, c.on("n1"), two)
    assert proposed == ["uid-w"]
    answer = await preempt(c, two, {"n1": proposed})
    # m frees GPU-0 and GPU-1 but for x and y: three pods, not z and w and two more.
    assert sorted(uids(answer["n1"])) == ["uid-m", "uid-x", "uid-y"]
    c.evict(uids(answer["n1"]))
    assert (await c.filter(two, "n1"))["NodeNames"] == ["n1"]


async def test_compute_share_is_freed_on_the_gpu_that_needs_it(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100), ("GPU-1", A100)])]

    def cores(n: int) -> dict[str, str]:
        return {"nvidia.com/gpumem": str(GIB), "nvidia.com/gpucores": str(n)}

    pods = [bound("a", "n1", "GPU-0", cores(30), 100, "2026-01-01T00:00:01Z"),
            bound("b", "n1", "GPU-0", cores(30), 100, "2026-01-01T00:00:02Z"),
            bound("c", "n1", "GPU-1", cores(90), 100, "2026-01-01T00:00:03Z"),
            bound("v", "n1", "GPU-0", cores(25), 100, "2026-01-01T00:00:04Z")]
    c = await cluster(nodes, pods)
    fast = pending("fast", cores(50), 1000)
    proposed = dry_run([A100, A100], c.on("n1"), fast)
    assert proposed == ["uid-v"]  # GPU-0 would keep 60 cores: 40 free of the 50 asked
    answer = await preempt(c, fast, {"n1": proposed})
    assert uids(answer["n1"]) == ["uid-c"]
    c.evict(["uid-c"])
    assert (await c.filter(fast, "n1"))["NodeNames"] == ["n1"]


async def test_pods_of_equal_or_higher_priority_are_never_chosen(cluster: Any) -> None:
    nodes, pods = thirty_each()
    pods[0]["spec"]["priority"] = 1000  # p1 on GPU-0: the preemptor's own priority
    pods[2]["spec"]["priority"] = 5000  # p3 on GPU-1: higher
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    proposed = dry_run([A100, A100], c.on("n1"), big)
    assert proposed == ["uid-p4"]
    # Each GPU keeps a 30 GiB pod the preemptor may not take: no victims make 60 GiB.
    assert await preempt(c, big, {"n1": proposed}) == {}
    # A smaller slice fits once p2 or p4 goes; p1 and p3 stay whatever the scheduler says.
    mid = pending("mid", {"nvidia.com/gpumem": str(45 * GIB)}, 1000)
    answer = await preempt(c, mid, {"n1": ["uid-p1", "uid-p4"]})
    assert uids(answer["n1"]) == ["uid-p4"]


async def test_node_where_no_victims_help_is_left_out_and_others_kept(cluster: Any) -> None:
    nodes, pods = thirty_each()
    nodes.append(gpu_node("small", [("GPU-s0", 24 * GIB)]))
    pods.append(bound("s1", "small", "GPU-s0", {"nvidia.com/gpumem": str(20 * GIB)}, 100,
                      "2026-01-01T00:00:01Z"))
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    answer = await preempt(c, big, {"n1": ["uid-p4"], "small": ["uid-s1"],
                                    "gone": ["uid-x"]})
    assert set(answer) == {"n1"}


async def test_victims_without_gpus_stay_and_none_are_added(cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    # uid-cpu: a pod the extender has no GPUs for (the scheduler chose it for its CPU).
    answer = await preempt(c, big, {"n1": ["uid-cpu", "uid-p4"]}, pdb=2)
    # Not seen by the watch: priority 0, below the victims added.
    assert uids(answer["n1"]) == ["uid-p3", "uid-p4", "uid-cpu"]
    assert answer["n1"]["NumPDBViolations"] == 2


async def test_when_the_gpus_have_room_the_schedulers_victims_stand(cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    small = pending("small", {"nvidia.com/gpumem": str(10 * GIB)}, 1000)
    # It fits the GPUs now: the scheduler preempts for something else (CPU, memory).
    answer = await preempt(c, small, {"n1": ["uid-cpu", "uid-p2"]}, pdb=1)
    assert answer == {"n1": {"Pods": [{"UID": "uid-cpu"}, {"UID": "uid-p2"}],
                             "NumPDBViolations": 1}}


async def test_victims_are_listed_most_important_first(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100)])]
    mem = {"nvidia.com/gpumem": str(30 * GIB)}
    pods = [bound("lo", "n1", "GPU-0", mem, 10, "2026-01-01T00:00:01Z"),
            bound("mid", "n1", "GPU-0", mem, 500, "2026-01-01T00:00:02Z")]
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(79 * GIB)}, 1000)
    answer = await preempt(c, big, {"n1": ["uid-lo"]})
    # The scheduler reads the first as the highest priority among them.
    assert uids(answer["n1"]) == ["uid-mid", "uid-lo"]


async def test_an_in_flight_bind_is_taken_only_when_the_scheduler_proposes_it(
        cluster: Any) -> None:
    nodes, pods = thirty_each()
    in_flight = pods.pop(2)  # p3 on GPU-1: being bound, not yet seen bound by the watch
    c = await cluster(nodes, pods)
    req = c.state.allocs["uid-p4"].request
    c.state.reserve("uid-p3", "default", "p3", "n1", req, {"main": ("GPU-1",)}, priority=100)
    assert in_flight["metadata"]["uid"] not in {p["metadata"]["uid"] for p in c.pods}
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    answer = await preempt(c, big, {"n1": ["uid-p4"]})
    assert uids(answer["n1"]) == ["uid-p1", "uid-p2"]  # GPU-0, without p3
    answer = await preempt(c, big, {"n1": ["uid-p3", "uid-p4"]})
    assert uids(answer["n1"]) == ["uid-p4", "uid-p3"]  # p3 not started: the less important


async def test_preemptor_that_filter_never_offers_a_node_gets_none(cluster: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    foreign = pending("foreign", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    foreign["metadata"]["annotations"] = {}  # not admitted by the webhook
    assert await preempt(c, foreign, {"n1": ["uid-p4"]}) == {}
    bad = pending("bad", {"nvidia.com/gpumem": "lots"}, 1000)
    assert await preempt(c, bad, {"n1": ["uid-p4"]}) == {}


_POD = pending("big", {"nvidia.com/gpumem": "1024"}, 1)


@pytest.mark.parametrize("body,message", [
    ([], "ExtenderArgs must be a JSON object"),
    ({"NodeNameToMetaVictims": {}}, "ExtenderArgs.Pod must be a Pod object"),
    ({"Pod": _POD, "NodeNameToMetaVictims": []}, "NodeNameToMetaVictims must be an object"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": None}}, "['n1'] must be an object"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": {}}}},
     "['n1'].Pods must be a list"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [{"uid": "x"}]}}},
     "['n1'].Pods[0] must name a pod by a non-empty UID"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [None]}}},
     "Pods[0] must name a pod"),
    # an empty UID, or one that is not a string (passed when the check was 'and', mutation testing)
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": ""}]}}},
     "['n1'].Pods[0] must name a pod by a non-empty UID"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "uid-p4"}, {"UID": 7}]}}},
     "['n1'].Pods[1] must name a pod by a non-empty UID"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [], "NumPDBViolations": -1}}},
     "NumPDBViolations must be a non-negative integer"),
    ({"Pod": _POD, "NodeNameToMetaVictims": {"n1": {"Pods": [], "NumPDBViolations": "1"}}},
     "NumPDBViolations must be a non-negative integer"),
    ({"Pod": _POD, "NodeNameToVictims": {"n1": {"Pods": [{"metadata": {}}]}}},
     "Pods[0] must name a pod by a non-empty metadata.uid"),
])
async def test_bad_preemption_args_are_http_400(cluster: Any, body: Any, message: str) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    status, text = await c.post("preempt", body)
    assert status == 400 and message in text, text


async def test_preempt_before_the_first_list_is_http_503(cluster: Any,
                                                         monkeypatch: Any) -> None:
    nodes, pods = thirty_each()
    c = await cluster(nodes, pods)
    placer = c.client.app[PLACEMENT_KEY]
    monkeypatch.setattr(placer, "ready", lambda: False)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    status, text = await c.post("preempt", preemption_args(big, {"n1": ["uid-p4"]}))
    assert status == 503 and "still reading the cluster state" in text


async def test_preempt_out_of_time_leaves_the_other_nodes_out(cluster: Any) -> None:
    nodes, pods = [], []
    for i in range(50):
        more_nodes, more_pods = thirty_each()
        for n in more_nodes:
            n["metadata"]["name"] = f"n{i}"
        for p in more_pods:
            p["spec"]["nodeName"] = f"n{i}"
            p["metadata"]["uid"] += f"-{i}"
        nodes += more_nodes
        pods += more_pods
    c = await cluster(nodes, pods)
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    victims = {f"n{i}": [f"uid-p4-{i}"] for i in range(50)}
    assert len(await preempt(c, big, victims)) == 50
    c.client.app[PLACEMENT_KEY].preempt_deadline_s = -1.0
    assert await preempt(c, big, victims) == {}


async def test_fewest_victims_before_the_give_back_order(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100)])]

    def gib(n: int) -> dict[str, str]:
        return {"nvidia.com/gpumem": str(n * GIB)}

    pods = [bound("a", "n1", "GPU-0", gib(40), 100, "2026-01-01T00:00:01Z"),
            bound("b", "n1", "GPU-0", gib(20), 100, "2026-01-01T00:00:02Z"),
            bound("c", "n1", "GPU-0", gib(20), 100, "2026-01-01T00:00:03Z")]
    c = await cluster(nodes, pods)
    half = pending("half", gib(40), 1000)
    # Giving back a (started first) leaves b and c to go; a alone frees the 40 GiB.
    answer = await preempt(c, half, {"n1": ["uid-b", "uid-c"]}, pdb=1)
    assert uids(answer["n1"]) == ["uid-a"]
    assert answer["n1"]["NumPDBViolations"] == 0
    # Of lower priority, b and c go before a pod of a higher one, however many.
    c.state.allocs["uid-a"].priority = 500
    answer = await preempt(c, half, {"n1": ["uid-b", "uid-c"]})
    assert uids(answer["n1"]) == ["uid-b", "uid-c"]


async def test_a_terminating_pod_is_taken_before_a_running_one(cluster: Any) -> None:
    nodes = [gpu_node("n1", [("GPU-0", A100)])]

    def gib(n: int) -> dict[str, str]:
        return {"nvidia.com/gpumem": str(n * GIB)}

    going = bound("going", "n1", "GPU-0", gib(40), 100, "2026-01-01T00:00:01Z")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"  # deleted, still running
    pods = [going, bound("run", "n1", "GPU-0", gib(30), 100, "2026-01-01T00:00:02Z")]
    c = await cluster(nodes, pods)
    half = pending("half", gib(40), 1000)
    proposed = dry_run([A100], c.on("n1"), half)
    assert proposed == ["uid-run"]  # the scheduler's dry run: going started first, stays
    # going frees its 40 GiB whatever is preempted: evicting run too would be for nothing.
    answer = await preempt(c, half, {"n1": proposed})
    assert uids(answer["n1"]) == ["uid-going"]
    c.evict(["uid-going"])
    assert (await c.filter(half, "n1"))["NodeNames"] == ["n1"]
    # Two terminating pods that free the room are taken over one running pod that would too.
    nodes = [gpu_node("n2", [("GPU-0", A100)])]
    pods = [bound("t1", "n2", "GPU-0", gib(20), 100, "2026-01-01T00:00:01Z"),
            bound("t2", "n2", "GPU-0", gib(20), 100, "2026-01-01T00:00:02Z"),
            bound("big", "n2", "GPU-0", gib(40), 100, "2026-01-01T00:00:03Z")]
    for p in pods[:2]:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    c = await cluster(nodes, pods)
    answer = await preempt(c, half, {"n2": ["uid-big"]})
    assert sorted(uids(answer["n2"])) == ["uid-t1", "uid-t2"]


async def test_a_pod_seen_deleted_by_the_watch_is_terminating() -> None:
    state = ClusterState(Settings())
    state.replace_nodes([gpu_node("n1", [("GPU-0", A100)])])
    pod = bound("p", "n1", "GPU-0", {"nvidia.com/gpumem": str(GIB)}, 100,
                "2026-01-01T00:00:01Z")
    pod["metadata"]["resourceVersion"] = "10"
    state.apply_pod(pod)
    assert not state.allocs["uid-p"].terminating
    deleted = json.loads(json.dumps(pod))
    deleted["metadata"] |= {"resourceVersion": "11", "deletionTimestamp": "2026-01-01T01:00:00Z"}
    state.apply_pod(deleted)
    assert state.allocs["uid-p"].terminating


def pick_one_node(answer: dict[str, Any], priority: dict[str, int]) -> str:
    """kube-scheduler's pickOneNodeForPreemption, its first criteria: the fewest PDB
    violations, then the lowest highest priority, which it reads from each node's first
    victim (it assumes them ordered by decreasing priority), then the fewest victims."""
    return min(answer, key=lambda n: (answer[n]["NumPDBViolations"],
                                      priority[answer[n]["Pods"][0]["UID"]],
                                      len(answer[n]["Pods"])))


async def test_first_victim_is_the_highest_priority_with_a_pod_without_gpus(
        cluster: Any) -> None:
    nodes, pods = thirty_each()
    cpu = bound("cpu", "n1", "", {}, 0, "2026-01-01T00:00:05Z")  # a batch pod without GPUs
    del cpu["metadata"]["annotations"]["gpuslice.io/devices.main"]
    pods.append(cpu)
    more_nodes, more_pods = thirty_each()
    more_nodes[0]["metadata"]["name"] = "n2"
    for p in more_pods:
        p["spec"]["nodeName"] = "n2"
        p["metadata"]["uid"] = p["metadata"]["uid"].replace("uid-p", "uid-q")
        p["spec"]["priority"] = 50
    c = await cluster(nodes + more_nodes, pods + more_pods)
    priority = {p["metadata"]["uid"]: p["spec"]["priority"] for p in c.pods}
    big = pending("big", {"nvidia.com/gpumem": str(60 * GIB)}, 1000)
    # The scheduler chose cpu on n1 for its CPU (the extender keeps it) and a 30 GiB pod.
    answer = await preempt(c, big, {"n1": ["uid-cpu", "uid-p4"], "n2": ["uid-q4"]})
    assert sorted(uids(answer["n1"])) == ["uid-cpu", "uid-p3", "uid-p4"]
    assert sorted(uids(answer["n2"])) == ["uid-q3", "uid-q4"]
    # n1's victims include two pods of priority 100, n2's only pods of priority 50: the
    # scheduler must not read n1's highest as cpu's 0.
    assert priority[uids(answer["n1"])[0]] == 100, uids(answer["n1"])
    assert pick_one_node(answer, priority) == "n2"



def test_priorities_of_pods_without_gpus_follow_the_watch() -> None:
    state = ClusterState(Settings())
    cpu = bound("cpu", "n1", "", {}, 70, "2026-01-01T00:00:05Z")
    del cpu["metadata"]["annotations"]["gpuslice.io/devices.main"]
    state.apply_pod(cpu)
    assert state.priority_of("uid-cpu") == 70 and "uid-cpu" not in state.allocs
    done = json.loads(json.dumps(cpu))
    done["status"]["phase"] = "Succeeded"
    state.apply_pod(done)
    assert state.priority_of("uid-cpu") == 0 and not state.priorities
    state.apply_pod(cpu)
    state.delete_pod(cpu)
    assert not state.priorities
    state.apply_pod(cpu)
    state.replace_pods([], listed_at=0.0)
    assert not state.priorities


def _random_node(rng: random.Random, name: str, ngpus: int) -> tuple[ClusterState, list[str]]:
    """A node of ``ngpus`` GPUs of 80 GiB with up to 5 pods of priority 0-2 on 1 or 2 GPUs."""
    state = ClusterState(Settings())
    gpus = [(f"GPU-{name}-{i}", A100) for i in range(ngpus)]
    state.apply_node(gpu_node(name, gpus))
    node = state.node(name)
    assert node is not None
    placed: list[str] = []
    for k in range(rng.randint(1, 5)):
        limits = {"nvidia.com/gpu": str(rng.choice([1, 1, 2])),
                  "nvidia.com/gpumem": str(rng.choice([10, 20, 30, 40]) * GIB),
                  "nvidia.com/gpucores": str(rng.choice([10, 30, 50]))}
        fit = place(pod_request(pending("x", limits, 0), Settings()), node.gpus, node.usage,
                    SPLIT)
        if isinstance(fit, NoFit):
            continue
        p = bound(f"v{k}", name, ",".join(fit.assignment["main"]), limits,
                  rng.randint(0, 2), f"2026-01-01T00:00:0{k}Z")
        state.apply_pod(p)
        placed.append(p["metadata"]["uid"])
    return state, placed


def _fits_without(req: PodRequest, state: ClusterState, name: str, uids: Iterable[str]) -> bool:
    node = state.node(name)
    assert node is not None
    usage = dict(node.usage)
    for u in uids:
        add_usage(usage, state.allocs[u].demand, -1)
    return not isinstance(place(req, node.gpus, usage, SPLIT), NoFit)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_the_victims_let_the_pod_fit_and_none_fewer_of_no_higher_priority_would(
        count: int) -> None:
    # the search for fewer victims passes over sets that free too little without a fit (the
    # preemptor's GPUs must each be freed of what they lack): 2- and 4-GPU preemptors over
    # 1,500 candidate nodes took 2.2 and 3.0 s of the 5 s the verb has, now 1.3 s each
    # (scripts/bench_extender.py --preempt). Checked against every set, on small nodes where
    # the search is exhaustive.
    rng = random.Random(count)
    checked = 0
    for n in range(400):
        state, placed = _random_node(rng, f"n{n}", 2 if count == 1 else 4)
        node = state.node(f"n{n}")
        assert node is not None
        limits = {"nvidia.com/gpu": str(count),
                  "nvidia.com/gpumem": str(rng.choice({1: [60, 70], 2: [40, 60], 4: [20, 40]}[count]) * GIB),
                  "nvidia.com/gpucores": str(rng.choice([20, 50, 80]))}
        req = pod_request(pending("pre", limits, 3), Settings())
        victims = choose_victims(req, 3, node, state.allocs, set(placed), SPLIT)
        if victims is None:
            assert not _fits_without(req, state, node.name, placed)
            continue
        assert _fits_without(req, state, node.name, victims)
        if not victims:
            continue
        top = max(state.allocs[u].priority for u in victims)
        fewest = min(len(s) for size in range(len(placed) + 1)
                     for s in itertools.combinations(placed, size)
                     if all(state.allocs[u].priority <= top for u in s)
                     and _fits_without(req, state, node.name, s))
        assert len(victims) == fewest, (n, victims, fewest)
        checked += 1
    assert checked > 40, checked


def test_the_victims_are_the_cheapest_fitting_set_of_their_size_the_schedulers_own_preferred(
) -> None:
    # kube-scheduler proposes victims of its own. Of the fitting sets of as many pods as the
    # victims, they are the one with the lowest highest priority, then the lowest sum of
    # priorities, then the most of the scheduler's own (the fewest pods it did not expect to
    # lose). Checked against every set on small nodes, with a random part of the pods proposed;
    # here the give-back order (the scheduler's own given back last) decides the ties, the
    # search for fewer victims decides one in thousands of such nodes (the next test)
    rng = random.Random(11)
    decided = 0
    for n in range(600):
        state, placed = _random_node(rng, f"n{n}", rng.choice([2, 4]))
        node = state.node(f"n{n}")
        assert node is not None
        proposed = {u for u in placed if rng.random() < 0.5}
        limits = {"nvidia.com/gpu": str(rng.choice([1, 1, 2])),
                  "nvidia.com/gpumem": str(rng.choice([30, 40, 60]) * GIB),
                  "nvidia.com/gpucores": str(rng.choice([20, 50, 80]))}
        req = pod_request(pending("pre", limits, 3), Settings())
        victims = choose_victims(req, 3, node, state.allocs, proposed, SPLIT)
        if not victims:
            continue
        fitting = [s for s in itertools.combinations(placed, len(victims))
                   if _fits_without(req, state, node.name, s)]

        def cost(uids: Iterable[str], state: ClusterState = state,
                 proposed: set[str] = proposed) -> tuple[int, int, int]:
            prios = [state.allocs[u].priority for u in uids]
            return max(prios), sum(prios), sum(u not in proposed for u in uids)

        best = min(cost(s) for s in fitting)
        assert cost(victims) == best, (n, victims, proposed, sorted(map(cost, fitting)))
        if any(cost(s)[:2] == best[:2] and cost(s)[2] > best[2] for s in fitting):
            decided += 1  # another set of the same size and priorities had fewer of its own
    assert decided >= 10, decided


def test_of_two_single_victims_alike_the_one_the_scheduler_proposed_is_taken() -> None:
    # Four 80 GiB GPUs; the preemptor wants two with 60 GiB free each. GPU 3 is empty; the
    # second can be GPU 1 (v2 taken: v3's 20 GiB stay) or GPU 2 (v4 taken), each one pod of
    # priority 1.  Giving back the most important first leaves two victims (v3, v1); the search
    # for fewer finds both single sets, and takes v2, which the scheduler proposed, over v4,
    # which it did not (one pod it did not expect to lose fewer)
    state = ClusterState(Settings())
    gpus = [f"GPU-t-{i}" for i in range(4)]
    state.apply_node(gpu_node("t", [(g, A100) for g in gpus]))

    def put(name: str, on: list[int], gib: int, cores: int, priority: int, k: int) -> str:
        limits = {"nvidia.com/gpu": str(len(on)), "nvidia.com/gpumem": str(gib * GIB),
                  "nvidia.com/gpucores": str(cores)}
        state.apply_pod(bound(name, "t", ",".join(gpus[i] for i in on), limits, priority,
                              f"2026-01-01T00:00:0{k}Z"))
        return f"uid-{name}"

    put("v0", [0], 20, 10, 2, 0)
    put("v1", [0], 30, 30, 0, 1)
    put("v2", [1], 40, 10, 1, 2)
    put("v3", [0, 1], 20, 30, 1, 3)
    put("v4", [2], 40, 50, 1, 4)
    node = state.node("t")
    assert node is not None
    req = pod_request(pending("pre", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": str(60 * GIB),
                                      "nvidia.com/gpucores": "20"}, 3), Settings())
    assert choose_victims(req, 3, node, state.allocs, {"uid-v1", "uid-v2", "uid-v3"}, SPLIT) == ["uid-v2"]
    # proposed the other way round, the other is taken
    assert choose_victims(req, 3, node, state.allocs, {"uid-v4"}, SPLIT) == ["uid-v4"]
