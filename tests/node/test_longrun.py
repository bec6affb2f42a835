"""The agent as a long-running DaemonSet process: pods, containers and GPU processes come and
go by the thousand, and what the agent keeps about them (its maps and sets, its open
descriptors, the series of its metrics) must go with them, back to where it was before."""

from __future__ import annotations

import gc
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakekube import FakeKube
from node.fakenvml import GIB, MIB, FakeDevice
from node.test_agent import LIB, _node, _settings
from node.test_audit import GPU0, GPU1, Node, _auditor, cid, one_gpu, systemd_cgroup
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from webhook.node.audit import ABSENT_TTL
from webhook.node.inventory import DEPARTED_KEPT
from webhook.node.loop import Agent
from webhook.node.region import DeviceSlot, ProcessUsage, Region, encode_region


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def series(agent: Agent) -> int:
    text = generate_latest(agent.registry).decode()
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def held_state(agent: Agent) -> dict[str, int]:
    """The sizes of what the agent keeps per pod, container, process or region."""
    c, a = agent.collector, agent.auditor
    assert a is not None
    sizes = {
        "collector.busy": len(c._busy), "collector.bad_files": len(c._bad_files),
        "collector.pod_names": len(c.pod_names),
        "liveness.dead": len(c._liveness._dead), "liveness.host": len(c._liveness._host),
        "auditor.known": len(a._known), "auditor.unknown": len(a._unknown),
        "auditor.placed": len(a._placed), "auditor.listed_since": len(a._listed_since),
        "auditor.episodes": len(a._episodes), "auditor.running": len(a._running),
        "auditor.evicted": len(a._evicted),
        "inventory.known": len(agent.inventory._known),
        "inventory.problems": len(agent.inventory._problems),
    }
    if a.compute is not None:
        sizes["compute.tracks"] = len(a.compute._tracks)
        # (and each GPU's samples of the last LATE_US, which a query asks for again: a few)
    return sizes


NS_PID = 4026532000
"""The PID namespace inode of the pods' processes (each pod's own in a real node; one here)."""


def start_pod(kube: FakeKube, node: Node, state: Path, name: str, pid: int, held: int,
              cap_mib: int = 1024) -> dict[str, Any]:
    """A one-GPU pod on the node: on the API server, its region file in the state dir (one
    process slot, with the process's identity and no liveness token), its process in the
    host's /proc and in NVML's list of GPU 0."""
    pod = one_gpu(name, cap_mib)
    uid = pod["metadata"]["uid"]
    kube.put(pod)
    node.run_in(pod, "a", pid, {0: held}, started=pid)
    d = node.proc / str(pid)
    (d / "status").write_text(f"Name:\tpython3\nNSpid:\t{pid}\t7\n")
    (d / "ns").mkdir()
    (d / "ns" / "pid").symlink_to(f"pid:[{NS_PID}]")
    region = Region(pod_uid=uid, pod_name=name, namespace="ml", container="a",
                    devices=(DeviceSlot(0, GPU0, cap_mib * MIB, held, 0, pid),),
                    processes=(ProcessUsage(pid=7, used_bytes=(held,), pidns=NS_PID,
                                            start_time=pid),))
    path = state / uid / "a" / "region"
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_region(region))
    return pod


def kill(node: Node, pid: int) -> None:
    """The process killed (no exit handler: its region slot stays): gone from NVML and /proc."""
    node.stop(pid)
    shutil.rmtree(node.proc / str(pid))


class Clocks:
    """The agent's clocks: monotonic (the checks, the sampler), the wall clock (the cleanup's
    grace, NVML's sample stamps)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.wall = time.time()

    def tick(self, seconds: float) -> None:
        self.t += seconds
        self.wall += seconds


def fake_clocks(agent: Agent, clocks: Clocks) -> None:
    a = agent.auditor
    assert a is not None and a.compute is not None
    agent._clock = lambda: clocks.wall
    a._clock = a.compute._clock = lambda: clocks.t
    a.compute._wall = lambda: clocks.wall


@pytest.mark.slow
@pytest.mark.parametrize("trouble", ["none", "gpu1-list-unreadable", "outages"])
async def test_thousands_of_pods_coming_and_going_leave_nothing_behind(
        tmp_path: Path, trouble: str) -> None:
    """2,000 GPU pods (1,000 with troubles), 20 at a time, each with a region, a process on GPU 0 (some over their
    cap) that runs kernels, through the agent's rounds, checks, samples and scrapes: once they
    are gone, what the agent keeps, its open descriptors and its metrics' series are as before
    they came. So too with a GPU whose process list cannot be read all along, and with the API
    server and NVML gone now and then."""
    node = Node(tmp_path)
    if trouble == "gpu1-list-unreadable":  # e.g. a GPU in a bad state: left unhealthy, for days, until it is reset
        node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = \
            pynvml.NVML_ERROR_UNKNOWN
    settings = _settings(tmp_path, proc_root=str(node.proc), cleanup_grace=30.0,
                         audit_interval=10.0, compute_window=20.0,
                         over_limit_action="evict", over_limit_rounds=1)
    state = Path(settings.host_state_dir)
    clocks = Clocks()
    running: dict[int, int] = {}  # pid -> its SM %
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=node.inventory, api_client=api)
            fake_clocks(agent, clocks)

            async def cycle() -> None:
                """Ten seconds of the agent's life: samples every second, then a check, a round
                and a scrape."""
                for _ in range(10):
                    clocks.tick(1.0)
                    stamp = int(clocks.wall * 1e6)
                    dev = node.nvml.devices[0]
                    for p, pct in running.items():
                        dev.samples.append((p, stamp, pct))
                    dev.device_samples.append((stamp, min(100, sum(running.values()))))
                    await agent.sample_compute()
                await agent.audit()
                await agent.step()
                generate_latest(agent.registry)
                for k, v in held_state(agent).items():
                    peak[k] = max(peak.get(k, 0), v)

            peak: dict[str, int] = {}
            for _ in range(5):
                await cycle()
            gc.unfreeze()  # descriptors earlier tests left to the collector close now, not
            gc.collect()   # within the churn (20 open after, 22 before, in a longer run)
            before = (held_state(agent), open_fds(), series(agent))
            pid = 1000
            for batch in range(100 if trouble == "none" else 50):
                pods = []
                for n in range(20):
                    pid += 1
                    over = n % 5 == 0  # a few over their cap: episodes, Events
                    pods.append((start_pod(kube, node, state, f"p{batch}-{n}", pid,
                                           2 * GIB if over else 256 * MIB), pid))
                    running[pid] = 4
                    # and a process of a pod gpuslice does not know on the GPU
                    node.run(pid + 100_000, systemd_cgroup(str(uuid.uuid4()), cid(str(pid))),
                             {0: 64 * MIB}, started=pid)
                    if n == 7:  # and a region a tenant has broken
                        region = state / pods[-1][0]["metadata"]["uid"] / "a" / "region"
                        region.write_bytes(region.read_bytes()[:100])
                await cycle()
                if trouble == "outages" and batch % 2:
                    kube.down = True
                await cycle()
                kube.down = False
                if trouble == "outages" and batch % 3 == 0:
                    node.nvml.count_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
                for _, p in pods:
                    kill(node, p)
                    kill(node, p + 100_000)
                    del running[p]
                await cycle()
                node.nvml.count_error = None
                for pod, _ in pods:
                    if kube.get("pods", pod["metadata"]["name"], "ml") is not None:  # not evicted
                        kube.delete("pods", pod["metadata"]["name"], "ml")
                await cycle()
            clocks.tick(ABSENT_TTL)  # the episodes' (the cleanup's grace, the window: less)
            for _ in range(3):
                await cycle()
            gc.collect()
            after = (held_state(agent), open_fds(), series(agent))
            assert not list(state.iterdir())
            assert all(v for k, v in peak.items() if k != "inventory.problems"), peak  # all used
            assert after[1] <= before[1] and after[2] == before[2], (before[1:], after[1:])
            assert after[0] == before[0], {k: (before[0][k], v) for k, v in after[0].items()
                                           if before[0][k] != v}


async def test_a_pid_reused_long_after_its_process_left_the_lists_is_placed_beside_an_unreadable_gpu(
        tmp_path: Path) -> None:
    """While GPU 1's process list cannot be read (a GPU in a bad state, for days), pid 70 of a
    container on GPU 0 ended and NVML stopped listing it there; much later a process of another
    container gets pid 70 and holds 8 GiB on GPU 0 under a 1 GiB cap. The pid's old row
    (NVML listing it since before its new holder started) is not that process's: it is judged,
    and evicted. And the rows of the thousands of pids NVML stopped listing on GPU 0 meanwhile
    are not kept."""
    node = Node(tmp_path)
    node.nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_UNKNOWN
    old, hog = one_gpu("old", 10240), one_gpu("hog", 1024)
    node.run_in(old, "a", 70, {0: GIB}, started=100)
    ticks = [1000]
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(old)
        kube.put(hog)
        auditor = _auditor(node, api, action="evict", rounds=3, boot_clock=lambda: ticks[0])
        assert {h.tracked.pod for h in (await auditor.check()).holdings} == {"old"}
        kill(node, 70)  # ended; NVML lists it no more
        for n in range(2000):  # other processes of "old" come and go on GPU 0
            ticks[0] += 1000
            node.run_in(old, "a", 10_000 + n, {0: GIB}, started=ticks[0] - 500)
            await auditor.check()
            kill(node, 10_000 + n)
        ticks[0] += 1000
        await auditor.check()
        assert len(auditor._listed_since) == 0
        node.run_in(hog, "a", 70, {0: 8 * GIB}, started=ticks[0] + 500)  # the pid, another's now
        for _ in range(3):
            ticks[0] += 1000
            report = await auditor.check()
            assert {h.tracked.pod: h.used_bytes for h in report.holdings} == {"hog": 8 * GIB}
        assert auditor.evictions == 1 and kube.get("pods", "hog", "ml") is None


async def test_a_pid_named_by_the_gpu_whose_list_fails_keeps_its_row(tmp_path: Path) -> None:
    """The other side of the row kept: pid 80 held 8 GiB on GPU 1 when GPU 1's list began to
    fail; the process ended (a child holds its memory: NVML goes on naming it) and a process
    of a container capped at 1 GiB got pid 80. Readable again, GPU 1 still names pid 80: the
    8 GiB are not that container's."""
    node = Node(tmp_path)
    gone, victim = one_gpu("gone", 10240), one_gpu("victim", 1024)
    node.run_in(gone, "a", 80, {1: 8 * GIB}, started=100)
    ticks = [1000]
    async with FakeKube() as kube, kube.api_client() as api:
        kube.put(gone)
        kube.put(victim)
        auditor = _auditor(node, api, action="evict", rounds=1, boot_clock=lambda: ticks[0])
        assert {h.tracked.pod for h in (await auditor.check()).holdings} == {"gone"}
        dev = node.nvml.devices[1]
        dev.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_UNKNOWN
        for _ in range(3):
            ticks[0] += 1000
            await auditor.check()
        shutil.rmtree(node.proc / "80")
        node.run_in(victim, "a", 80, {}, started=ticks[0] + 500)
        for _ in range(3):
            ticks[0] += 1000
            await auditor.check()
        del dev.fail["nvmlDeviceGetComputeRunningProcesses"]
        ticks[0] += 1000
        report = await auditor.check()
        assert report.holdings == () and not report.complete
        assert auditor.evictions == 0


def per_gpu_state(agent: Agent) -> dict[str, int]:
    """The sizes of what the agent keeps per GPU (UUID)."""
    inv, a, pub = agent.inventory, agent.auditor, agent.publisher
    assert a is not None and a.compute is not None and pub is not None
    return {"inventory.known": len(inv._known), "inventory.problems": len(inv._problems),
            "inventory.recovering": len(inv._recovering),
            "inventory.unwatched": len(inv._unwatched),
            "compute.tracks": len(a.compute._tracks),
            "compute.unsupported": len(a.compute.unsupported), "publisher.seen": len(pub._seen)}


async def test_gpus_replaced_again_and_again_leave_no_bookkeeping_behind(tmp_path: Path) -> None:
    """GPU 1 of the node is replaced 60 times over (a new board: a new UUID), some boards gone
    Unhealthy first, some failing NVML's utilisation queries, some without XID events, through
    the agent's rounds, checks, samples and scrapes. What the agent keeps per GPU (its size,
    problem and recovery; the GPUs without XID events, those whose samples fail; the UUIDs
    seen) stays within the GPUs there and ``DEPARTED_KEPT`` gone ones: it kept an entry per
    board ever seen (after these 60 replacements: 61 sizes; 15 each of problems, recoveries,
    GPUs without XID events). The first GPU 1, which a pod still holds a slice of, stays
    known, and the node's totals go on counting that slice."""
    node = Node(tmp_path)
    settings = _settings(tmp_path, proc_root=str(node.proc), audit_interval=10.0,
                         compute_window=20.0)
    clocks = Clocks()
    async with FakeKube() as kube:
        kube.put(_node())
        pod = one_gpu("on-the-first-gpu1", 1024)
        pod["metadata"]["annotations"]["gpuslice.io/devices.a"] = GPU1
        kube.put(pod)
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=node.inventory, api_client=api)
            fake_clocks(agent, clocks)

            async def cycle() -> None:
                for _ in range(3):
                    clocks.tick(1.0)
                    await agent.sample_compute()
                await agent.audit()
                await agent.step()
                generate_latest(agent.registry)

            await cycle()
            for i in range(60):
                board = FakeDevice(f"GPU-{i:08d}-0000-0000-0000-000000000000", total=80 * GIB)
                if i % 4 == 1:
                    board.retired_pending = True
                elif i % 4 == 2:
                    board.fail["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_UNKNOWN
                elif i % 4 == 3:
                    board.fail["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NOT_SUPPORTED
                node.nvml.devices[1] = board
                for _ in range(2):
                    await cycle()
            sizes = per_gpu_state(agent)
            assert all(v <= 2 + DEPARTED_KEPT + 1 for v in sizes.values()), sizes
            assert GPU1 in agent.publisher._seen  # type: ignore[union-attr]
            capacity = kube.get("nodes", _node()["metadata"]["name"])["status"]["capacity"]
            healthy = sum(g.memory_mib for g in agent.inventory.last.healthy)
            assert int(capacity["nvidia.com/gpumem"]) == healthy + 1024
