"""The outside memory check (webhook.node.audit): NVML's per-process figures, placed into
containers by their cgroups and the pod list of the fake API server, against the caps the
webhook wrote; metrics, the Warning Event, the eviction (and a refused one), outages."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client
from kubeschema import assert_valid
from node.fakenvml import GIB, MIB, FakeDevice, FakeNvml
from node.test_metrics import ctr_labels, samples, write_region

from webhook import names
from webhook.admission.mutate import mutate_pod
from webhook.node.audit import (
    ABSENT_TTL,
    Auditor,
    Cap,
    boot_ticks,
    cap_from,
    parse_size,
    pod_and_container,
    shares_pid_namespace,
    start_ticks,
    tracked_containers,
)
from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.loop import Agent
from webhook.node.metrics import AgentCollector, AgentStatus, make_registry
from webhook.settings import Settings

NODE = "gpu-node-1"
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def cid(name: str) -> str:
    """A 64-hex container ID, as runtimes make them."""
    return hashlib.sha256(name.encode()).hexdigest()


def systemd_cgroup(pod_uid: str, ident: str, qos: str = "burstable", sub: str = "") -> str:
    """A cgroup v2 /proc/<pid>/cgroup line as containerd with the systemd driver writes it, seen
    from another cgroup namespace (the agent's): relative, starting with ``..``."""
    return (f"0::/../../kubepods-{qos}.slice/kubepods-{qos}-pod{pod_uid.replace('-', '_')}.slice/"
            f"cri-containerd-{ident}.scope{sub}\n")


# ---- parsing -----------------------------------------------------------------------------

UID = "0f0e0d0c-0b0a-0908-0706-050403020100"


@pytest.mark.parametrize("text, want", [
    # containerd, systemd driver, cgroup v2, from the host's cgroup namespace
    ((f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
      f"{UID.replace('-', '_')}.slice/cri-containerd-{cid('a')}.scope\n"), (UID, cid("a"))),
    # the same seen from the agent's own cgroup namespace
    (systemd_cgroup(UID, cid("a")), (UID, cid("a"))),
    # a guaranteed pod: no QoS slice
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{cid('b')}.scope\n",
     (UID, cid("b"))),
    # cgroupfs driver, cgroup v1 (several hierarchies; the first that names one is taken)
    ((f"12:pids:/\n11:memory:/kubepods/besteffort/pod{UID}/{cid('c')}\n"
      f"10:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{cid('c')}\n"), (UID, cid("c"))),
    (f"0::/kubepods/burstable/pod{UID}/docker-{cid('d')}.scope\n", (UID, cid("d"))),
    # a sub-cgroup the container made itself, even one named after another container's ID
    (systemd_cgroup(UID, cid("a"), sub=f"/{cid('victim')}/x"), (UID, cid("a"))),
    # a host process, a pod-level process, garbage
    ("0::/system.slice/containerd.service\n", None),
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice\n", None),
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/not-an-id.scope\n", None),
    ("", None), ("garbage\n\x00\n", None),
])
def test_the_cgroup_names_the_pod_and_container(text: str, want: tuple[str, str] | None) -> None:
    assert pod_and_container(text) == want


@pytest.mark.parametrize("text, want", [
    ("10240m", 10240 * MIB), ("2g", 2 * GIB), ("2G", 2 * GIB), (" 512K ", 512 * 1024),
    ("1t", 1 << 40), ("4096", 4096), ("", None), ("10 GiB", None), ("-1m", None), ("1.5g", None),
    ("10 m", None), ("\u0661\u0662m", None),  # as the interposer: no space, ASCII digits only
])
def test_sizes_read_like_the_interposer(text: str, want: int | None) -> None:
    assert parse_size(text) == want


def test_a_percentage_cap_rounds_like_the_interposer() -> None:
    total = 143_771 * MIB + 123  # an H200's NVML total, plus an odd remainder
    # config.c env_percent_cap: whole MiB of the total's whole MiB, as the extender reserves it
    assert Cap(percent=25).on(total) == 143_771 * 25 // 100 * MIB == 35_942 * MIB
    assert Cap(percent=100).on(total) == 143_771 * MIB
    assert Cap(percent=1).on(MIB + 5) == (MIB + 5) // 100  # under a whole MiB: in bytes
    assert Cap(percent=25).on(None) is None and Cap(percent=25).on(0) is None
    assert Cap(limit_bytes=5).on(None) == 5
    assert cap_from({"CUDA_DEVICE_MEMORY_LIMIT": "1024m"}) == Cap(limit_bytes=GIB)
    assert cap_from({"GPUSLICE_MEMORY_PERCENT": "30"}) == Cap(percent=30)
    assert cap_from({"GPUSLICE_MEMORY_PERCENT": "0"}) is None
    assert cap_from({"GPUSLICE_MEMORY_PERCENT": "101"}) is None
    assert cap_from({"CUDA_DEVICE_MEMORY_LIMIT": "lots"}) is None
    assert cap_from({"CUDA_DEVICE_SM_LIMIT": "30"}) is None


# ---- pods --------------------------------------------------------------------------------

def gpu_pod(name: str, containers: dict[str, dict[str, Any]], *, namespace: str = "ml",
            uid: str | None = None, started: bool = True) -> dict[str, Any]:
    """A pod as the webhook admits it (its real mutation) and kubelet reports it running;
    ``containers``: name -> resource limits."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4())},
           "spec": {"containers": [{"name": c, "image": "cuda", "resources": {"limits": lim}}
                                   for c, lim in containers.items()]}}
    mutated = copy.deepcopy(mutate_pod(pod, Settings()).pod)
    mutated["spec"]["nodeName"] = NODE
    if started:
        mutated["status"] = {"phase": "Running", "containerStatuses": [
            {"name": c, "containerID": f"containerd://{cid(name + '/' + c)}", "ready": True,
             "restartCount": 0, "image": "cuda", "imageID": "", "started": True}
            for c in containers]}
    return mutated


def one_gpu(name: str, mib: int) -> dict[str, Any]:
    """A pod with one container ``a`` of one GPU capped at ``mib`` MiB."""
    return gpu_pod(name, {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mib)}})


async def as_models(*pods: dict[str, Any]) -> list[client.V1Pod]:
    """The pods as the client reads them from the API server."""
    async with client.ApiClient() as api:
        return [api.deserialize(_Resp(p), "V1Pod") for p in pods]


class _Resp:
    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj)


async def test_tracked_containers_come_from_the_limits_annotation_and_the_pod_status() -> None:
    pod = gpu_pod("train", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10240"},
                            "b": {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25"}})
    pod["spec"]["containers"].append({"name": "sidecar", "image": "busybox"})
    pod["status"]["containerStatuses"].append(
        {"name": "sidecar", "containerID": f"containerd://{cid('side')}", "ready": True,
         "restartCount": 0, "image": "busybox", "imageID": ""})
    got = tracked_containers(await as_models(pod))
    assert set(got) == {cid("train/a"), cid("train/b")}  # the sidecar has no cap
    a, b = got[cid("train/a")], got[cid("train/b")]
    assert (a.namespace, a.pod, a.pod_uid, a.container) == ("ml", "train", pod["metadata"]["uid"], "a")
    assert a.cap == Cap(limit_bytes=10240 * MIB) and b.cap == Cap(percent=25)
    assert a.field_path == "spec.containers{a}"


async def test_an_init_container_is_tracked_and_named_as_one() -> None:
    pod = gpu_pod("prep", {"main": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}})
    spec = pod["spec"]
    spec["initContainers"] = [spec["containers"].pop(0)]
    spec["containers"] = [{"name": "app", "image": "busybox"}]
    st = pod["status"]
    st["initContainerStatuses"] = st.pop("containerStatuses")
    (t,) = tracked_containers(await as_models(pod)).values()
    assert (t.container, t.field_path, t.cap) == ("main", "spec.initContainers{main}",
                                                  Cap(limit_bytes=GIB))


async def test_pods_admitted_before_the_limits_annotation_use_the_spec_env() -> None:
    pod = one_gpu("old", 2048)
    del pod["metadata"]["annotations"][names.limits_annotation("a")]
    assert tracked_containers(await as_models(pod))[cid("old/a")].cap == Cap(limit_bytes=2 * GIB)


async def test_pods_not_ours_or_not_started_are_not_tracked() -> None:
    ours = one_gpu("p", 1024)
    foreign = one_gpu("hami", 1024)
    del foreign["metadata"]["annotations"][names.ANN_MUTATED]  # env that looks like ours
    pending = gpu_pod("q", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}},
                      started=False)
    waiting = one_gpu("w", 1024)
    del waiting["status"]["containerStatuses"][0]["containerID"]
    got = tracked_containers(await as_models(ours, foreign, pending, waiting))
    assert set(got) == {cid("p/a")}


def stat_line(pid: int, started: int, comm: str = "python3") -> str:
    """A ``/proc/<pid>/stat`` line: fields 4 to 21 are filler, 22 the start time."""
    return f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 " + "0 " * 12 + f"{started} 1000 20 0\n"


@pytest.mark.parametrize("comm", ["python3", "a b", "x) S 9 (y", ")"])
def test_the_start_time_is_read_past_any_command_name(comm: str) -> None:
    assert start_ticks(stat_line(7, 123456, comm)) == 123456
    assert start_ticks(f"7 ({comm}) S 1") is None and start_ticks("") is None


def test_the_boot_clock_counts_in_proc_ticks() -> None:
    """The running test started before now, in the same ticks its stat says."""
    mine = start_ticks(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert mine is not None and 0 < mine < boot_ticks()


# ---- the check ---------------------------------------------------------------------------

class Node:
    """A fake node: NVML devices with processes, a host /proc with their cgroups."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc = tmp_path / "proc"
        self.proc.mkdir(exist_ok=True)
        self.nvml = FakeNvml([FakeDevice(GPU0, total=80 * GIB), FakeDevice(GPU1, total=80 * GIB)])
        self.inventory = Inventory(self.nvml)
        self.inventory.discover()

    def run(self, pid: int, cgroup: str, held: dict[int, int | None], started: int = 1) -> None:
        """Process ``pid`` in ``cgroup`` holding ``held[gpu index]`` bytes, started ``started``
        ticks after boot."""
        d = self.proc / str(pid)
        d.mkdir(exist_ok=True)
        (d / "cgroup").write_text(cgroup)
        (d / "stat").write_text(stat_line(pid, started))
        for index, used in held.items():
            self.nvml.devices[index].processes[pid] = used

    def run_in(self, pod: dict[str, Any], container: str, pid: int,
               held: dict[int, int | None], started: int = 1) -> None:
        self.run(pid, systemd_cgroup(pod["metadata"]["uid"],
                                     cid(pod["metadata"]["name"] + "/" + container)), held,
                 started)

    def stop(self, pid: int) -> None:
        for dev in self.nvml.devices:
            dev.processes.pop(pid, None)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _auditor(node: Node, api: Any, **kw: Any) -> Auditor:
    from webhook.node.publish import Publisher
    pub = Publisher(api, AgentSettings(node_name=NODE))
    return Auditor(node.inventory, node.proc, list_pods=pub.node_pods, api_client=api,
                   node_name=NODE, **kw)


@contextlib.asynccontextmanager
async def _evicting(tmp_path: Path, name: str, cap_mib: int, pid: int, held: int,
                    rounds: int) -> AsyncIterator[tuple[dict[str, Any], FakeKube, Auditor]]:
    """A one-GPU pod ``name`` on a fake node whose process ``pid`` holds ``held`` bytes, put on
    a fake API server, and an auditor that evicts after ``rounds`` checks over the cap."""
    node = Node(tmp_path)
    pod = one_gpu(name, cap_mib)
    node.run_in(pod, "a", pid, {0: held})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        yield pod, kube, _auditor(node, api, action="evict", rounds=rounds)


def _lists(kube: FakeKube) -> int:
    return len(kube.requests_to("GET", r"/api/v1/pods$"))


async def test_each_container_is_measured_per_gpu_and_the_rest_is_unattributed(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    train = gpu_pod("train", {"a": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10240"}})
    serve = gpu_pod("serve", {"s": {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "10"}},
                    namespace="web")
    node.run_in(train, "a", 1001, {0: 3 * GIB, 1: 1 * GIB})
    node.run_in(train, "a", 1002, {0: 2 * GIB})
    node.run_in(serve, "s", 2001, {1: 7 * GIB})
    node.run(3001, "0::/system.slice/xorg.service\n", {0: 512 * MIB})  # the host's own
    node.run(3002, systemd_cgroup(str(uuid.uuid4()), cid("other")), {1: 256 * MIB})
    node.nvml.devices[0].processes[3003] = 64 * MIB  # listed by NVML, gone from /proc
    async with FakeKube() as kube:
        kube.put(train)
        kube.put(serve)
        async with kube.api_client() as api:
            auditor = _auditor(node, api)
            report = await auditor.check()
            got = {(h.tracked.pod, h.uuid): (h.used_bytes, h.cap_bytes, h.pids)
                   for h in report.holdings}
            assert got == {
                ("train", GPU0): (5 * GIB, 10 * GIB, (1001, 1002)),
                ("train", GPU1): (1 * GIB, 10 * GIB, (1001,)),
                ("serve", GPU1): (7 * GIB, 8 * GIB, (2001,)),  # 10 % of 80 GiB
            }
            assert dict(report.unattributed) == {GPU0: 512 * MIB + 64 * MIB, GPU1: 256 * MIB}
            assert report.complete and not any(h.over(0) for h in report.holdings)
            assert kube.requests_to("POST", "/events") == []
            # steady state: the containers are mapped and the others remembered, no more lists
            lists = _lists(kube)
            for _ in range(3):
                await auditor.check()
            assert _lists(kube) == lists == 1


async def test_a_tampered_region_does_not_hide_memory_from_the_outside_check(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tenant rewrote its region file (0 used) and holds 12 GiB under a 10 GiB cap: the
    region's figures say nothing is wrong, NVML and the cgroups do."""
    node = Node(tmp_path)
    state = tmp_path / "state"
    pod = one_gpu("sneaky", 10240)
    node.run_in(pod, "a", 4242, {0: 12 * GIB})
    async with FakeKube() as kube:
        pod = kube.put(pod)
        write_region(state, pod["metadata"]["uid"], "sneaky", "ml", "a",
                     [(0, GPU0, 10 * GIB, 0, 100, 0)])
        async with kube.api_client() as api:
            auditor = _auditor(node, api)
            with caplog.at_level(logging.WARNING, logger="webhook.node.audit"):
                await auditor.check()
                await auditor.check()
            registry = make_registry(AgentCollector(node.inventory, state, AgentStatus(),
                                                    auditor=auditor))
            got = samples(registry)
            lab = ctr_labels("ml", "sneaky", pod["metadata"]["uid"], "a", GPU0)
            assert got[("gpuslice_container_memory_used_bytes", lab)] == 0  # the region lies
            assert got[("gpuslice_container_memory_observed_bytes", lab)] == 12 * GIB
            assert got[("gpuslice_container_memory_over_limit", lab)] == 1
            assert got[("gpuslice_agent_over_limit_events_total", ())] == 1
            assert got[("gpuslice_agent_evictions_total", ())] == 0
            # logged and recorded once per episode, with the figures; not evicted (action none)
            warned = [r for r in caplog.records if "more GPU memory than its cap" in r.message]
            assert len(warned) == 1
            assert (warned[0].used_mib, warned[0].cap_mib, warned[0].pids) == (12288, 10240, [4242])
            events = [o for (p, _, _), o in kube.objects.items() if p == "events"]
            assert len(events) == 1
            ev = events[0]
            assert (ev["reason"], ev["type"], ev["involvedObject"]["uid"]) == \
                ("GPUMemoryOverLimit", "Warning", pod["metadata"]["uid"])
            assert "12288 MiB" in ev["message"] and "10240 MiB" in ev["message"]
            assert ev["involvedObject"]["fieldPath"] == "spec.containers{a}"
            emitted = {k: v for k, v in ev.items() if k not in ("metadata",)}
            emitted["metadata"] = {"name": ev["metadata"]["name"], "namespace": "ml"}
            assert_valid(emitted)
            assert kube.get("pods", "sneaky", "ml") is not None
            # under the cap for fewer checks than the rounds (3): the same episode goes on
            node.nvml.devices[0].processes[4242] = 9 * GIB
            for _ in range(2):
                await auditor.check()
            assert samples(registry)[("gpuslice_container_memory_over_limit", lab)] == 0
            node.nvml.devices[0].processes[4242] = 11 * GIB
            await auditor.check()
            assert auditor.episodes == 1 and auditor.events == 1
            # under for three checks in a row: it ends; over again: a new one, a new Event
            node.nvml.devices[0].processes[4242] = 9 * GIB
            for _ in range(3):
                await auditor.check()
            node.nvml.devices[0].processes[4242] = 11 * GIB
            await auditor.check()
            assert auditor.episodes == 2 and auditor.events == 2


async def test_evict_after_the_rounds_a_refusal_is_retried_and_only_once(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("hog", 4096)
    node.run_in(pod, "a", 5000, {0: 5 * GIB})
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            auditor = _auditor(node, api, action="evict", rounds=2)
            await auditor.check()
            assert kube.requests_to("POST", "/eviction") == []  # one check is not enough
            kube.fail("POST", r"/pods/hog/eviction$", 429,
                      message="Cannot evict pod as it would violate the pod's disruption budget.")
            await auditor.check()
            assert kube.get("pods", "hog", "ml") is not None and auditor.errors == 1
            await auditor.check()  # retried
            posts = kube.requests_to("POST", r"/namespaces/ml/pods/hog/eviction$")
            assert len(posts) == 2 and kube.get("pods", "hog", "ml") is None
            assert auditor.evictions == 1
            body = posts[-1].body
            assert (body["apiVersion"], body["kind"], body["metadata"]["name"]) == \
                ("policy/v1", "Eviction", "hog")
            assert_valid(body)
            # the processes linger while the pod terminates: no second eviction
            await auditor.check()
            assert len(kube.requests_to("POST", "/eviction")) == 2


async def test_an_eviction_that_conflicts_on_a_disruption_budget_is_retried(
        tmp_path: Path) -> None:
    """The API server answers 409 also when its updates of the pod's PodDisruptionBudget keep
    conflicting (busy evictions, e.g. a drain beside us): the pod is still there, so the
    eviction is asked again at the next check. Before, every 409 was taken as "the pod is
    gone": the pod over its cap ran on, never asked for again in that episode."""
    async with _evicting(tmp_path, "hog", 4096, 5000, 5 * GIB, rounds=1) as (_, kube, auditor):
        kube.fail("POST", r"/pods/hog/eviction$", 409,
                  message='Operation cannot be fulfilled on poddisruptionbudgets.policy "hog": '
                          "the object has been modified; please apply your changes to the "
                          "latest version and try again")
        await auditor.check()
        assert kube.get("pods", "hog", "ml") is not None
        assert auditor.evictions == 0 and auditor.errors == 1
        # the 409 was looked into: the pod listed by name, still with its own UID
        (look,) = [r for r in kube.requests_to("GET", r"/namespaces/ml/pods$")
                   if "metadata.name=hog" in r.query.get("fieldSelector", "")]
        assert "resourceVersion" not in look.query  # a consistent read
        await auditor.check()  # retried
        assert len(kube.requests_to("POST", r"/pods/hog/eviction$")) == 2
        assert kube.get("pods", "hog", "ml") is None and auditor.evictions == 1


async def test_a_pod_over_on_two_gpus_is_evicted_once(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = gpu_pod("wide", {"a": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1024"}})
    node.run_in(pod, "a", 7000, {0: 2 * GIB, 1: 2 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=1)
        report = await auditor.check()
        assert len(report.holdings) == 2 and all(h.over(0) for h in report.holdings)
        assert len(kube.requests_to("POST", "/eviction")) == 1 and auditor.evictions == 1
        assert auditor.events == 2  # one per container and GPU


async def test_the_tolerance_and_an_unknown_figure(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("p", 1024)
    node.run_in(pod, "a", 10, {0: 1024 * MIB + 100 * MIB})
    node.run_in(pod, "a", 11, {0: None})  # NVML cannot say (counted as 0, listed)
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            auditor = _auditor(node, api, tolerance_bytes=128 * MIB)
            report = await auditor.check()
            (h,) = report.holdings
            assert (h.used_bytes, h.pids, h.unknown_pids) == (1124 * MIB, (10, 11), (11,))
            assert not report.complete  # a figure is missing
            assert not h.over(auditor.tolerance) and h.over(0)
            assert auditor.episodes == 0


async def test_a_cgroup_naming_another_pods_container_is_not_believed(tmp_path: Path) -> None:
    """A process whose cgroup pairs a container ID with another pod's UID is nobody's."""
    node = Node(tmp_path)
    pod = one_gpu("p", 1024)
    node.run(20, systemd_cgroup(str(uuid.uuid4()), cid("p/a")), {0: 2 * GIB})
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            report = await _auditor(node, api).check()
            assert report.holdings == () and report.unattributed[GPU0] == 2 * GIB


async def test_new_containers_are_looked_up_unknown_ones_after_a_while(tmp_path: Path) -> None:
    node = Node(tmp_path)
    clock = Clock()
    node.run(30, systemd_cgroup(str(uuid.uuid4()), cid("stranger")), {0: GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        auditor = _auditor(node, api, clock=clock)
        await auditor.check()
        await auditor.check()
        assert _lists(kube) == 1
        # a new gpuslice container starts: looked up at once
        pod = one_gpu("late", 1024)
        kube.put(pod)
        node.run_in(pod, "a", 31, {0: 2 * GIB})
        report = await auditor.check()
        assert _lists(kube) == 2 and [h.tracked.pod for h in report.holdings] == ["late"]
        # the stranger is asked about again only after UNKNOWN_TTL
        await auditor.check()
        assert _lists(kube) == 2
        clock.t += 61
        await auditor.check()
        assert _lists(kube) == 3
        # a container whose processes all ended is forgotten, then looked up again
        node.stop(31)
        await auditor.check()
        node.run_in(pod, "a", 32, {0: 2 * GIB})
        assert len((await auditor.check()).holdings) == 1 and _lists(kube) == 4


async def test_api_outage_and_nvml_failure_leave_the_check_incomplete_not_broken(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("p", 4096)
    node.run_in(pod, "a", 40, {0: 2 * GIB, 1: 2 * GIB})
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            auditor = _auditor(node, api)
            kube.down = True
            report = await auditor.check()
            assert not report.complete and report.holdings == () and auditor.errors == 1
            kube.down = False
            node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = \
                pynvml.NVML_ERROR_UNKNOWN
            report = await auditor.check()
            assert not report.complete
            assert [(h.uuid, h.used_bytes) for h in report.holdings] == [(GPU0, 2 * GIB)]
            del node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"]
            node.nvml.devices[1].graphics_supported = False  # consumer cards: not a failure
            report = await auditor.check()
            assert report.complete and len(report.holdings) == 2
            # the Event cannot be written: counted, the check goes on
            kube.fail("POST", "/events", 403)
            node.nvml.devices[0].processes[40] = 5 * GIB
            report = await auditor.check()
            assert report.holdings[0].over(0) and auditor.errors == 2 and auditor.events == 0


async def test_pids_of_another_namespace_are_explained_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process NVML lists as pid 0 (one the driver could not name in the agent's namespace)
    cannot be placed: said once, with what to set."""
    node = Node(tmp_path)
    node.nvml.devices[0].processes[0] = GIB
    async with FakeKube() as kube, kube.api_client() as api:
        auditor = _auditor(node, api)
        with caplog.at_level(logging.WARNING, logger="webhook.node.audit"):
            for _ in range(3):
                report = await auditor.check()
        assert report.unattributed[GPU0] == GIB
        warned = [r.message for r in caplog.records if r.name == "webhook.node.audit"]
        assert len(warned) == 1 and "pid 0" in warned[0] and "agent.hostPID" in warned[0]


async def test_an_agent_in_its_own_pid_namespace_is_blind_until_nvml_lists_a_host_pid(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A driver that gives NVML callers their own namespace's pids leaves every other
    namespace's processes out (open kernel modules: os_find_ns_pid). An agent whose PID
    namespace is not its proc root's cannot tell an empty list from a hidden one: it warns once
    and its checks are incomplete until NVML lists a pid, which shows the driver gives host
    pids (no GPU process runs in the agent's namespace)."""
    node = Node(tmp_path)
    (node.proc / "self").symlink_to(str(os.getpid() + 100_000))  # ourselves, as the host names us
    pod = one_gpu("p", 4096)
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            with caplog.at_level(logging.INFO, logger="webhook.node.audit"):
                auditor = _auditor(node, api)
                assert auditor.blind
                for _ in range(2):
                    report = await auditor.check()
                    assert not report.complete and report.holdings == ()
                warned = [r.getMessage() for r in caplog.records
                          if r.name == "webhook.node.audit" and r.levelno == logging.WARNING]
                assert len(warned) == 1 and "PID namespace of its own" in warned[0] \
                    and "agent.hostPID" in warned[0] and str(node.proc) in warned[0]
                # the metric operators alert on says so
                status = AgentStatus()
                registry = make_registry(AgentCollector(node.inventory, tmp_path / "state",
                                                        status, auditor=auditor))
                assert samples(registry)[("gpuslice_agent_audit_complete", ())] == 0
                node.run_in(pod, "a", 4242, {0: GIB})
                report = await auditor.check()
                assert not auditor.blind and report.complete
                assert [(h.tracked.pod, h.used_bytes) for h in report.holdings] == [("p", GIB)]
                assert samples(registry)[("gpuslice_agent_audit_complete", ())] == 1
                # a pid of 0 is the other driver's sign: it does not end the blindness
                (tmp_path / "other").mkdir()
                other = Node(tmp_path / "other")
                (other.proc / "self").symlink_to("1")
                other.nvml.devices[0].processes[0] = GIB
                blind = _auditor(other, api)
                assert not (await blind.check()).complete and blind.blind


def test_the_pid_namespace_test_reads_the_procfs_self_link(tmp_path: Path) -> None:
    assert shares_pid_namespace("/proc") is True
    assert shares_pid_namespace(tmp_path) is None  # not a procfs
    (tmp_path / "self").symlink_to(str(os.getpid()))
    assert shares_pid_namespace(tmp_path) is True
    (tmp_path / "self").unlink()
    (tmp_path / "self").symlink_to("garbage")
    assert shares_pid_namespace(tmp_path) is None


def test_a_real_child_pid_namespace_is_told_apart_from_its_host() -> None:
    """In a new PID namespace (unshare, root) the host's procfs names us by our host pid."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    code = ("import sys; sys.path[:0] = sys.argv[1:]; from webhook.node.audit import "
            "shares_pid_namespace as s; import os; print(os.getpid(), s('/proc'))")
    probe = subprocess.run([unshare, "--pid", "--fork", sys.executable, "-c", code,
                            str(Path(__file__).resolve().parents[2])],
                           check=False, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 and "Operation not permitted" in probe.stderr:
        pytest.skip("unshare --pid needs privileges here")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["1", "False"]  # pid 1 of its own, not the host procfs's


async def test_graphics_and_compute_lists_are_one_process(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("viz", 1024)
    node.run_in(pod, "a", 50, {0: 700 * MIB})
    node.nvml.devices[0].graphics[50] = 700 * MIB
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            (h,) = (await _auditor(node, api).check()).holdings
            assert h.used_bytes == 700 * MIB


async def test_the_agent_runs_the_check_beside_its_rounds_and_serves_it(tmp_path: Path) -> None:
    import asyncio

    from node.test_agent import LIB, _node, _scrape, _settings
    node = Node(tmp_path)
    pod = one_gpu("p", 1024)
    node.run_in(pod, "a", 60, {0: 3 * GIB})
    settings = _settings(tmp_path, proc_root=str(node.proc), audit_interval=0.05,
                         over_limit_action="evict", over_limit_rounds=2)
    async with FakeKube() as kube:
        kube.put(_node())
        kube.put(pod)
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=node.inventory, api_client=api)
            await agent.start()
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))
            try:
                for _ in range(200):
                    if kube.get("pods", "p", "ml") is None:
                        break
                    await asyncio.sleep(0.02)
                text = await _scrape(agent.metrics_port)
            finally:
                stop.set()
                await asyncio.wait_for(task, 5)
                await agent.close()
    assert kube.get("pods", "p", "ml") is None
    assert 'gpuslice_container_memory_observed_bytes{container="a",namespace="ml",pod="p"' in text
    assert "gpuslice_agent_evictions_total 1.0" in text
    assert agent.status.last_audit > 0


def test_the_check_is_off_at_interval_zero(tmp_path: Path) -> None:
    from node.test_agent import LIB, _settings
    agent = Agent(_settings(tmp_path, audit_interval=0), LIB, inventory=Node(tmp_path).inventory)
    assert agent.auditor is None
    assert "gpuslice_container_memory_observed_bytes" not in \
        {k[0] for k in samples(agent.registry)}


async def test_a_missing_graphics_query_is_no_gap_a_missing_compute_query_is(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("p", 1024)
    node.run_in(pod, "a", 80, {0: GIB, 1: GIB})
    node.nvml.devices[0].fail["nvmlDeviceGetGraphicsRunningProcesses"] = \
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND  # an old driver
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api)
        assert (await auditor.check()).complete
        # what pynvml raises there for its unversioned call (not an NVMLError)
        mismatch = pynvml.NVMLLibraryMismatchError("Unversioned function called")

        def missing(_handle: int) -> list[Any]:
            raise mismatch
        node.nvml.nvmlDeviceGetGraphicsRunningProcesses = missing  # type: ignore[method-assign]
        assert (await auditor.check()).complete
        node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = \
            pynvml.NVML_ERROR_NOT_SUPPORTED
        report = await auditor.check()
        assert not report.complete and [h.uuid for h in report.holdings] == [GPU0]


async def test_a_pid_reused_since_nvmls_list_is_not_placed(tmp_path: Path) -> None:
    """NVML listed pid 70 of container p/a; before its cgroup was read the process ended and
    pid 70 went to a process of another gpuslice container. The stat read after the cgroup
    says that process started after the list: its container is not charged the listed figure,
    and the check says it is incomplete."""
    node = Node(tmp_path)
    small, other = one_gpu("p", 10240), one_gpu("q", 1024)
    node.run_in(small, "a", 70, {0: 4 * GIB})
    node.run_in(other, "a", 71, {0: 512 * MIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(small)
        kube.put(other)
        auditor = _auditor(node, api, boot_clock=lambda: 5000)
        report = await auditor.check()
        assert report.complete and {h.tracked.pod: h.used_bytes for h in report.holdings} == \
            {"p": 4 * GIB, "q": 512 * MIB}
        # the reuse: pid 70 is now a process of q/a started at tick 5000, after the list
        node.run_in(other, "a", 70, {}, started=5000)
        report = await auditor.check()
        assert not report.complete
        assert {h.tracked.pod: (h.used_bytes, h.pids) for h in report.holdings} == \
            {"q": (512 * MIB, (71,))}
        assert report.unattributed == {GPU0: 0, GPU1: 0}
        assert not [o for (p, _, _), o in kube.objects.items() if p == "events"]
        # a stat that cannot be parsed is not believed either
        (node.proc / "70" / "stat").write_text("70 (python3) S")
        assert not (await auditor.check()).complete


async def test_a_driver_before_v3_process_lists_is_judged_through_v2(tmp_path: Path) -> None:
    """A driver before about 510 has no ``_v3`` process queries, behind pynvml's unversioned
    call: the check asks for ``_v2`` (same entries) and judges the GPU; a driver with neither
    leaves it unjudged."""
    node = Node(tmp_path)
    pod = one_gpu("p", 1024)
    node.run_in(pod, "a", 80, {0: 2 * GIB})
    node.nvml.devices[0].graphics[81] = 512 * MIB  # a graphics context in the same container
    node.nvml.devices[0].mps[82] = 0
    node.nvml.absent = {f"nvmlDeviceGet{kind}RunningProcesses_v3"
                        for kind in ("Compute", "Graphics", "MPSCompute")}
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api)
        report = await auditor.check()
        assert report.complete
        (h,) = report.holdings
        assert (h.uuid, h.used_bytes, h.pids, h.over(0)) == (GPU0, 2 * GIB, (80,), True)
        assert report.unattributed == {GPU0: 512 * MIB, GPU1: 0}
        node.nvml.absent |= {"nvmlDeviceGetComputeRunningProcesses_v2"}
        report = await auditor.check()
        assert not report.complete and report.holdings == ()


async def test_on_an_r535_driver_every_process_of_a_container_is_charged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """R535/R545 drivers list processes in 32-byte entries, which pynvml read as 24-byte ones:
    the container's second process went missing behind a garbage pid 0 (the check charged it
    1 GiB of its 2.5, under its 2 GiB cap: no Event, no eviction, and a false warning to run
    the agent with hostPID). Read with their own size, the breach is found."""
    node = Node(tmp_path)
    node.nvml.r535 = True
    node.inventory = Inventory(node.nvml)
    node.inventory.discover()
    pod = one_gpu("p", 2048)
    node.run_in(pod, "a", 80, {0: 1 * GIB})
    node.run_in(pod, "a", 81, {0: 1536 * MIB})
    node.run(3001, "0::/system.slice/xorg.service\n", {0: 256 * MIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api)
        with caplog.at_level(logging.WARNING, logger="webhook.node.audit"):
            report = await auditor.check()
        (h,) = report.holdings
        assert (h.uuid, h.used_bytes, h.pids, h.over(0)) == (GPU0, 2560 * MIB, (80, 81), True)
        assert report.complete and report.unattributed == {GPU0: 256 * MIB, GPU1: 0}
        assert auditor.events == 1
        assert not [r for r in caplog.records if "pid 0" in r.message]


async def test_memory_on_a_gpu_not_assigned_to_the_container_is_a_breach(
        tmp_path: Path) -> None:
    """The bind's device annotation names the container's GPUs; any memory on another one (a
    runtime that exposed every GPU, say) is reported whatever the cap and the tolerance."""
    node = Node(tmp_path)
    pod = one_gpu("p", 10240)
    pod["metadata"]["annotations"][names.devices_annotation("a")] = f" {GPU0} "
    node.run_in(pod, "a", 90, {0: 2 * GIB, 1: 300 * MIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, tolerance_bytes=512 * MIB)
        report = await auditor.check()
        got = {h.uuid: (h.assigned, h.cap_bytes, h.over(auditor.tolerance))
               for h in report.holdings}
        assert got == {GPU0: (True, 10 * GIB, False), GPU1: (False, 0, True)}
        (event,) = [o for (p, _, _), o in kube.objects.items() if p == "events"]
        assert f"300 MiB on GPU {GPU1}" in event["message"]
        assert f"a GPU not assigned to it (it has {GPU0})" in event["message"]
        (t,) = tracked_containers(await as_models(pod)).values()
        assert t.gpus == frozenset({GPU0})


async def test_a_container_that_requested_no_gpu_but_holds_memory_is_a_breach(
        tmp_path: Path) -> None:
    """The webhook gives a GPU pod's other containers NVIDIA_VISIBLE_DEVICES=none; one that
    still holds GPU memory (a runtime that ignored it, a device node mounted by hand) is
    reported whatever the tolerance. A sidecar of a pod admitted before (no such env) is not
    judged: its memory is unattributed."""
    node = Node(tmp_path)
    pod = gpu_pod("p", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}, "side": {}})
    side = next(c for c in pod["spec"]["containers"] if c["name"] == "side")
    assert side["env"] == [{"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}]
    node.run_in(pod, "a", 60, {0: 512 * MIB})
    node.run_in(pod, "side", 61, {1: 300 * MIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, tolerance_bytes=512 * MIB)
        report = await auditor.check()
        got = {(h.tracked.container, h.uuid): (h.cap_bytes, h.over(auditor.tolerance))
               for h in report.holdings}
        assert got == {("a", GPU0): (GIB, False), ("side", GPU1): (0, True)}
        (event,) = [o for (p, _, _), o in kube.objects.items() if p == "events"]
        assert event["involvedObject"]["fieldPath"] == "spec.containers{side}"
        assert "container side holds 300 MiB on GPU" in event["message"]
        assert "although it requested no GPU" in event["message"]
        assert_valid(event)
    old = copy.deepcopy(pod)
    del next(c for c in old["spec"]["containers"] if c["name"] == "side")["env"]
    assert set(tracked_containers(await as_models(old)).values()) == \
        {t for t in tracked_containers(await as_models(pod)).values() if t.container == "a"}


async def test_a_sidecar_cannot_claim_a_cap_of_its_own_nor_is_another_plugins_gpu_judged() -> None:
    """A sidecar the webhook gave no GPU keeps any CUDA_DEVICE_MEMORY_LIMIT it wrote (the
    webhook strips those from GPU containers only): it still counts as cap 0 on no GPU. A
    container that names another device plugin's nvidia.com/ resource (left alone by the
    webhook) and says NVIDIA_VISIBLE_DEVICES=none itself is not judged: that plugin may give it
    a device through a list the env does not decide."""
    pod = gpu_pod("p", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}, "side": {},
                        "mig": {"nvidia.com/mig-1g.10gb": "1"}})
    by_name = {c["name"]: c for c in pod["spec"]["containers"]}
    by_name["side"]["env"].append({"name": names.ENV_MEMORY_LIMIT, "value": "100g"})
    assert "env" not in by_name["mig"]  # the webhook left it alone
    by_name["mig"]["env"] = [{"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}]
    # likewise a container given a device through a resource claim (DRA)
    pod["spec"]["containers"].append({"name": "dra", "image": "cuda", "env": by_name["mig"]["env"],
                                      "resources": {"claims": [{"name": "gpu"}]}})
    pod["status"]["containerStatuses"].append(
        {"name": "dra", "containerID": f"containerd://{cid('p/dra')}", "ready": True,
         "restartCount": 0, "image": "cuda", "imageID": ""})
    got = {t.container: (t.cap, t.gpus) for t in tracked_containers(await as_models(pod)).values()}
    assert got == {"a": (Cap(limit_bytes=GIB), None), "side": (Cap(limit_bytes=0), frozenset())}


async def test_a_container_asking_for_none_of_another_plugins_resource_is_judged() -> None:
    """0 of another device plugin's nvidia.com/ resource gets no device from it (the webhook
    gives such a container NVIDIA_VISIBLE_DEVICES=none like any other): GPU memory it holds is
    a breach, cap 0 on no GPU, not another plugin's device."""
    pod = gpu_pod("p", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"},
                        "zero": {"nvidia.com/mig-1g.10gb": "0"}})
    zero = next(c for c in pod["spec"]["containers"] if c["name"] == "zero")
    assert zero["env"] == [{"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}]
    got = {t.container: (t.cap, t.gpus) for t in tracked_containers(await as_models(pod)).values()}
    assert got == {"a": (Cap(limit_bytes=GIB), None), "zero": (Cap(limit_bytes=0), frozenset())}


async def test_a_container_asking_only_for_the_task_priority_is_judged(tmp_path: Path) -> None:
    """HAMi's task priority (nvidia.com/priority) gives no device: the webhook reads it past
    and gives a container that asks only for it NVIDIA_VISIBLE_DEVICES=none, so GPU memory it
    holds is a breach (cap 0 on no GPU), not another device plugin's GPU. The agent is told the
    name (--resource-priority); another nvidia.com/ name still counts as another plugin's."""
    node = Node(tmp_path)
    pod = gpu_pod("p", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"},
                        "prio": {"nvidia.com/priority": "1"}})
    prio = next(c for c in pod["spec"]["containers"] if c["name"] == "prio")
    assert prio["env"] == [{"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}]
    models = await as_models(pod)
    got = {t.container: (t.cap, t.gpus) for t in tracked_containers(models).values()}
    assert got == {"a": (Cap(limit_bytes=GIB), None), "prio": (Cap(limit_bytes=0), frozenset())}
    # renamed: the default name is then another plugin's resource, the new one reads past
    got = tracked_containers(models, priority="nvidia.com/task-priority").values()
    assert {t.container for t in got} == {"a"}
    renamed = copy.deepcopy(pod)
    limits = next(c for c in renamed["spec"]["containers"] if c["name"] == "prio")["resources"]
    limits["limits"] = {"nvidia.com/task-priority": "1"}
    got = tracked_containers(await as_models(renamed), priority="nvidia.com/task-priority")
    assert {t.container for t in got.values()} == {"a", "prio"}
    node.run_in(pod, "prio", 62, {1: 300 * MIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, tolerance_bytes=512 * MIB)
        report = await auditor.check()
        got_h = {(h.tracked.container, h.uuid): (h.cap_bytes, h.over(auditor.tolerance))
                 for h in report.holdings}
        assert got_h == {("prio", GPU1): (0, True)}
        (event,) = [o for (p, _, _), o in kube.objects.items() if p == "events"]
        assert "container prio holds 300 MiB on GPU" in event["message"]
        # an auditor told another name takes nvidia.com/priority for another plugin's GPU
        renamed_auditor = _auditor(node, api, priority="nvidia.com/task-priority")
        assert not (await renamed_auditor.check()).holdings


async def test_a_new_pod_under_the_evicted_ones_name_is_not_evicted(tmp_path: Path) -> None:
    """A StatefulSet's db-0 went over, was deleted and made again (a new UID) while the old
    process lingers: the eviction carries the old UID as its precondition."""
    async with _evicting(tmp_path, "db-0", 1024, 95, 3 * GIB, rounds=2) as (old, kube, auditor):
        await auditor.check()
        kube.delete("pods", "db-0", "ml")
        new = one_gpu("db-0", 1024)
        new["status"]["containerStatuses"][0]["containerID"] = f"containerd://{cid('db-0/a/2')}"
        kube.put(new)
        await auditor.check()
        (post,) = kube.requests_to("POST", "/pods/db-0/eviction$")
        assert post.body["deleteOptions"]["preconditions"]["uid"] == old["metadata"]["uid"]
        assert_valid(post.body)
        assert kube.get("pods", "db-0", "ml")["metadata"]["uid"] == new["metadata"]["uid"]
        await auditor.check()  # the 409 settled it: not asked again
        assert len(kube.requests_to("POST", "/eviction$")) == 1 and auditor.evictions == 0


async def test_a_container_whose_id_is_not_in_its_pods_status_yet_is_looked_up_again(
        tmp_path: Path) -> None:
    """kubelet writes a started container's ID into the status a little later; a check in
    between is incomplete and the next one finds the container (not UNKNOWN_TTL later)."""
    node = Node(tmp_path)
    pod = one_gpu("fresh", 1024)
    reported = copy.deepcopy(pod["status"])
    del pod["status"]["containerStatuses"][0]["containerID"]
    node.run_in(pod, "a", 96, {0: 8 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api)
        report = await auditor.check()
        assert report.holdings == () and not report.complete
        pod["status"] = reported
        kube.put(pod)
        report = await auditor.check()
        assert [h.used_bytes for h in report.holdings] == [8 * GIB] and report.complete
        assert _lists(kube) == 2
        # a debug container (no cap) using the GPU: reported, so not ours, not asked again
        pod["status"]["ephemeralContainerStatuses"] = [
            {"name": "debug", "containerID": f"containerd://{cid('debug')}", "ready": False,
             "restartCount": 0, "image": "cuda", "imageID": ""}]
        kube.put(pod)
        node.run(99, systemd_cgroup(pod["metadata"]["uid"], cid("debug")), {0: GIB})
        for _ in range(3):
            report = await auditor.check()
        assert report.complete and report.unattributed[GPU0] == GIB and _lists(kube) == 3


async def test_a_container_that_dips_under_its_cap_now_and_then_is_still_evicted(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("flap", 1024)
    node.run_in(pod, "a", 97, {0: 4 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=3)
        for used in (4 * GIB, 512 * MIB, 4 * GIB, 512 * MIB, 4 * GIB):
            node.nvml.devices[0].processes[97] = used
            await auditor.check()
        assert auditor.evictions == 1 and auditor.events == 1
        assert kube.get("pods", "flap", "ml") is None


async def test_mps_clients_are_counted(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pod = one_gpu("mps", 1024)
    node.run_in(pod, "a", 98, {})
    node.nvml.devices[0].mps[98] = 2 * GIB
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        (h,) = (await _auditor(node, api).check()).holdings
        assert h.used_bytes == 2 * GIB and h.over(0)


def restarted(pod: dict[str, Any], name: str) -> None:
    """Kubelet restarted container ``a`` of ``pod`` as ``name``: its ID now, the old one in
    ``lastState``."""
    st = pod["status"]["containerStatuses"][0]
    st["lastState"] = {"terminated": {"exitCode": 1, "reason": "Error",
                                      "containerID": st["containerID"]}}
    st["containerID"] = f"containerd://{cid(name)}"
    st["restartCount"] += 1


def restart(kube: FakeKube, node: Node, pod: dict[str, Any], name: str, pid: int,
            held: dict[int, int | None]) -> None:
    """:func:`restarted`, reported to the API server, its new instance running ``pid``."""
    restarted(pod, name)
    kube.put(pod)
    node.run(pid, systemd_cgroup(pod["metadata"]["uid"], cid(name)), held)


@pytest.mark.parametrize("fresh", [False, True], ids=["agent-saw-it", "agent-started-after"])
async def test_a_restarted_container_beside_its_old_instance_is_one_holding(
        tmp_path: Path, fresh: bool) -> None:
    """Its region (so its cap) is one for both instances: their memory adds up, in one verdict
    and one series; an agent that never saw the old instance knows it from ``lastState``."""
    node = Node(tmp_path)
    pod = one_gpu("r", 2560)
    uid = pod["metadata"]["uid"]
    node.run_in(pod, "a", 100, {0: 1 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api)
        if not fresh:
            await auditor.check()
        # restarted: a new ID in the status, the old instance's process not gone yet
        restart(kube, node, pod, "r/a/2", 101, {0: 2 * GIB})
        report = await auditor.check()
        (h,) = report.holdings
        assert h.container_ids == tuple(sorted([cid("r/a"), cid("r/a/2")]))
        assert (h.used_bytes, h.pids, h.over(0), report.complete) == (3 * GIB, (100, 101), True, True)
        assert report.unattributed == {GPU0: 0, GPU1: 0}
        registry = make_registry(AgentCollector(node.inventory, tmp_path, AgentStatus(),
                                                auditor=auditor))
        got = {k: v for k, v in samples(registry).items()
               if k[0].startswith("gpuslice_container_memory_")}
        lab = ctr_labels("ml", "r", uid, "a", GPU0)
        assert got == {("gpuslice_container_memory_observed_bytes", lab): 3 * GIB,
                       ("gpuslice_container_memory_over_limit", lab): 1}
        assert auditor.episodes == 1


async def test_a_container_crashing_over_its_cap_is_evicted_across_its_restarts(
        tmp_path: Path) -> None:
    """Each instance goes over its cap for one check and crashes; kubelet restarts it after a
    back-off. The checks between find no process of it: neither over nor under, so the episode
    goes on (per instance, no episode ever reached the rounds)."""
    node, clock = Node(tmp_path), Clock()
    pod = one_gpu("crash", 1024)
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=3, clock=clock)
        pid = 200
        for n in range(3):
            if n:
                restart(kube, node, pod, f"crash/a/{n}", pid + n, {0: 2 * GIB})
            else:
                node.run_in(pod, "a", pid, {0: 2 * GIB})
            clock.t += 10
            await auditor.check()
            node.stop(pid + n)
            for _ in range(4):  # the back-off: no process of it on the GPU
                clock.t += 10
                await auditor.check()
        (post,) = kube.requests_to("POST", r"/namespaces/ml/pods/crash/eviction$")
        assert_valid(post.body)
        assert auditor.episodes == 1 and auditor.evictions == 1


async def test_an_episode_ends_once_its_container_is_gone_long_enough(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = one_gpu("once", 1024)
    node.run_in(pod, "a", 300, {0: 2 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=3, clock=clock)
        await auditor.check()
        node.stop(300)
        clock.t += ABSENT_TTL - 1
        await auditor.check()
        assert len(auditor._episodes) == 1  # still waiting for it to come back
        clock.t += 1
        await auditor.check()
        assert auditor._episodes == {}
        node.run_in(pod, "a", 301, {0: 2 * GIB})
        await auditor.check()
        assert auditor.episodes == 2 and kube.requests_to("POST", "/eviction") == []


async def test_a_container_restarting_beside_one_over_its_cap_is_judged_apart(
        tmp_path: Path) -> None:
    """Episodes are per container name: ``a`` restarting under its cap neither joins nor
    resets ``b``'s, which is evicted after its rounds."""
    node, clock = Node(tmp_path), Clock()
    lim = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}
    pod = gpu_pod("two", {"a": lim, "b": lim})
    node.run_in(pod, "a", 10, {0: GIB // 2})
    node.run_in(pod, "b", 20, {0: 2 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=3, clock=clock)
        for n in range(3):
            clock.t += 10
            if n:
                node.stop(10 + n - 1)
                restart(kube, node, pod, f"two/a/{n}", 10 + n, {0: GIB // 2})
            assert (await auditor.check()).complete
        assert (auditor.episodes, auditor.evictions) == (1, 1)
        assert {k[2] for k in auditor._episodes} == {"b"}


async def test_an_unreadable_gpu_list_ends_no_episode_however_long(tmp_path: Path) -> None:
    """A GPU whose process list cannot be read changes nothing, for 10 minutes too: readable
    again, the container still over its cap goes on with its episode (no second Event)."""
    node, clock = Node(tmp_path), Clock()
    pod = one_gpu("stuck", 1024)
    node.run_in(pod, "a", 990, {0: 2 * GIB})
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        auditor = _auditor(node, api, action="evict", rounds=3, clock=clock)
        await auditor.check()
        dev = node.nvml.devices[0]
        dev.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_UNKNOWN
        for _ in range(int(ABSENT_TTL // 10)):
            clock.t += 10
            await auditor.check()
        del dev.fail["nvmlDeviceGetComputeRunningProcesses"]
        clock.t += 10
        await auditor.check()
        assert (auditor.episodes, auditor.events) == (1, 1)


async def test_stopping_the_agent_does_not_wait_for_a_hung_check(tmp_path: Path) -> None:
    import asyncio

    from node.test_agent import LIB, _settings
    node = Node(tmp_path)
    agent = Agent(_settings(tmp_path, audit_interval=0.01), LIB, inventory=node.inventory)
    assert agent.auditor is not None
    entered = asyncio.Event()

    async def hung() -> None:  # an API server that accepted the request and never answers
        entered.set()
        await asyncio.Event().wait()
    agent.auditor.check = hung  # type: ignore[method-assign, assignment]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.wait_for(entered.wait(), 5)
    stop.set()
    await asyncio.wait_for(task, 5)
    await agent.close()


async def test_a_pid_nvml_lists_since_before_its_holder_started_is_not_placed(
        tmp_path: Path) -> None:
    """NVML goes on listing a pid whose process has ended while its memory is still held (a
    child that inherited its device descriptors keeps the allocations; the driver names the
    process that made them). The pid went to a process of another gpuslice container, started
    after NVML first listed it but before the check: the listed 8 GiB were that container's,
    over its 1 GiB cap, and its pod was evicted."""
    node = Node(tmp_path)
    gone, victim = one_gpu("gone", 10240), one_gpu("victim", 1024)
    node.run_in(gone, "a", 70, {0: 8 * GIB}, started=100)
    node.run_in(victim, "a", 71, {0: 256 * MIB}, started=200)
    ticks = [1000]
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(gone)
        kube.put(victim)
        auditor = _auditor(node, api, action="evict", rounds=3, boot_clock=lambda: ticks[0])
        assert {h.tracked.pod: h.used_bytes for h in (await auditor.check()).holdings} == \
            {"gone": 8 * GIB, "victim": 256 * MIB}
        shutil.rmtree(node.proc / "70")  # ended (and reaped); NVML still lists pid 70
        ticks[0] = 2000
        report = await auditor.check()
        assert report.unattributed[GPU0] == 8 * GIB
        node.run_in(victim, "a", 70, {0: 8 * GIB}, started=2500)  # the pid, another's now
        for _ in range(4):
            ticks[0] += 1000
            report = await auditor.check()
            assert {h.tracked.pod: (h.used_bytes, h.pids) for h in report.holdings} == \
                {"victim": (256 * MIB, (71,))}
        assert auditor.evictions == 0 and kube.get("pods", "victim", "ml") is not None
        # once NVML stops listing it, the pid is placed again as any other
        node.nvml.devices[0].processes.pop(70)
        await auditor.check()
        node.nvml.devices[0].processes[70] = 512 * MIB
        ticks[0] += 1000
        assert {h.tracked.pod: h.used_bytes for h in (await auditor.check()).holdings} == \
            {"victim": 768 * MIB}
        # one that started between the ticks and the list is placed from the next check on
        node.run_in(victim, "a", 72, {0: 128 * MIB}, started=ticks[0])
        assert {h.tracked.pod: h.used_bytes for h in (await auditor.check()).holdings} == \
            {"victim": 768 * MIB}
        ticks[0] += 1000
        assert {h.tracked.pod: h.used_bytes for h in (await auditor.check()).holdings} == \
            {"victim": 896 * MIB}


async def test_an_agent_restarted_while_its_eviction_runs_does_not_evict_again(
        tmp_path: Path) -> None:
    """The agent evicted a pod over its cap; the pod terminates for its grace period (its
    process still holds the memory) and the agent restarts meanwhile (a rollout, a crash): the
    new agent does not know of its eviction. The API server lists the pod as being deleted:
    it is not asked for again (a second eviction, counted and logged as one, for one pod)."""
    node = Node(tmp_path)
    pod = one_gpu("hog", 4096)
    node.run_in(pod, "a", 5000, {0: 5 * GIB})
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = 600
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(pod)
        restarted = _auditor(node, api, action="evict", rounds=1)
        report = await restarted.check()
        assert report.holdings[0].over(0)  # still over: reported, in the metrics
        assert kube.requests_to("POST", "/eviction") == []
        assert restarted.evictions == 0 and restarted.errors == 0
        (event,) = [o for (p, _, _), o in kube.objects.items() if p == "events"]
        assert "being deleted already" in event["message"]
        await restarted.check()
        assert kube.requests_to("POST", "/eviction") == []


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN])
async def test_one_gpu_whose_list_fails_leaves_the_others_checked(tmp_path: Path,
                                                                 code: int) -> None:
    """GPU1 fell off the bus (or its list fails) for good: the container over its cap on GPU0
    is still evicted after the rounds, and nothing is judged on GPU1."""
    node = Node(tmp_path)
    hog, other = one_gpu("hog", 1024), one_gpu("other", 1024)
    node.run_in(hog, "a", 990, {0: 2 * GIB})
    node.run_in(other, "a", 991, {1: 4 * GIB})
    node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = code
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(hog)
        kube.put(other)
        auditor = _auditor(node, api, action="evict", rounds=2)
        for _ in range(3):
            report = await auditor.check()
        assert not report.complete
        assert [h.uuid for h in report.holdings] == [GPU0]
        assert kube.get("pods", "hog", "ml") is None and auditor.evictions == 1
        assert kube.get("pods", "other", "ml") is not None
