"""The outside compute check (webhook.node.compute, webhook.node.audit): NVML's per-process
utilisation, placed into containers by their cgroups as it is sampled, averaged over a sliding
window and judged against the compute limit the webhook wrote; the metric, the Warning Event,
the eviction, and NVML's failures and quirks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fakekube import FakeKube
from kubeschema import assert_valid
from node.fakenvml import GIB, FakeDevice, FakeNvml
from node.test_audit import (
    GPU0,
    GPU1,
    NODE,
    Clock,
    Node,
    _auditor,
    cid,
    gpu_pod,
    restart,
)
from node.test_metrics import ctr_labels, samples

from webhook.node.audit import Auditor, cores_from, tracked_containers
from webhook.node.compute import ComputeSampler
from webhook.node.config import AgentSettings, SettingsError, add_arguments, settings_from_args
from webhook.node.inventory import Inventory
from webhook.node.metrics import AgentCollector, AgentStatus, make_registry

WINDOW = 20.0


def cores_pod(name: str, cores: str | None, *, gpus: str = "1", mib: str = "4096",
              namespace: str = "ml") -> dict[str, Any]:
    """A pod with one container ``a`` of ``gpus`` GPUs, ``mib`` MiB each, ``cores`` % of each."""
    limits = {"nvidia.com/gpu": gpus, "nvidia.com/gpumem": mib}
    if cores is not None:
        limits["nvidia.com/gpucores"] = cores
    return gpu_pod(name, {"a": limits}, namespace=namespace)


START_US = 1_700_000_000_000_000


class Gpus:
    """Drives the fake driver's samples and the clocks, one second (one sample period) at a
    time: per process, a sample of its share in each period it ran; per device, a sample of
    every period (the processes' shares summed)."""

    def __init__(self, node: Node, clock: Clock, lag: int = 0) -> None:
        self.node, self.clock = node, clock
        self.stamp = START_US  # µs, as NVML stamps its samples (the wall clock)
        self.second = 0
        self.lag = lag
        """1: a period's process samples show up a poll after its device sample; -1: the
        device sample a poll after the process samples."""
        self._held: list[tuple[list[Any], tuple[Any, ...]]] = []

    def wall(self) -> float:
        return self.stamp / 1e6

    def run(self, sampler: ComputeSampler, seconds: int,
            shares: dict[tuple[int, int], int | list[int]]) -> None:
        """``shares``: (GPU index, pid) -> its SM % in each second, or a list of them taken in
        turn (0: it did not run: no sample of it)."""
        for _ in range(seconds):
            self.clock.t += 1.0
            self.stamp += 1_000_000
            busy = [0] * len(self.node.nvml.devices)
            held, self._held = self._held, []
            for buffer, sample in held:  # what the driver shows a poll late
                buffer.append(sample)
            for (gpu, pid), pct in shares.items():
                now = pct[self.second % len(pct)] if isinstance(pct, list) else pct
                if now:
                    self._show(self.node.nvml.devices[gpu].samples, (pid, self.stamp, now),
                               self.lag > 0)
                    busy[gpu] += now
            for dev, total in zip(self.node.nvml.devices, busy, strict=True):
                self._show(dev.device_samples, (self.stamp, min(100, total)), self.lag < 0)
                dev.util = min(100, total)  # the last period's, as nvmlDeviceGetUtilizationRates
            self.second += 1
            sampler.poll()

    def _show(self, buffer: list[Any], sample: tuple[Any, ...], late: bool) -> None:
        if late:
            self._held.append((buffer, sample))
        else:
            buffer.append(sample)


@contextlib.asynccontextmanager
async def served(node: Node, clock: Clock, gpus: Gpus, *pods: dict[str, Any],
                 **kw: Any) -> AsyncIterator[tuple[FakeKube, Auditor]]:
    """The fake API server with ``pods``, and an auditor with the compute check (``kw``)."""
    async with FakeKube() as kube:
        for pod in pods:
            kube.put(pod)
        async with kube.api_client() as api:
            yield kube, compute_auditor(node, api, clock, gpus, **kw)


def compute_auditor(node: Node, api: Any, clock: Clock, gpus: Gpus, **kw: Any) -> Auditor:
    kw.setdefault("compute_window", WINDOW)
    auditor = _auditor(node, api, clock=clock, **kw)
    assert auditor.compute is not None
    auditor.compute._wall = gpus.wall  # the fake driver's wall clock
    return auditor


def loads(report: Any) -> dict[tuple[str, str], tuple[float, int, bool]]:
    return {(c.tracked.pod, c.uuid): (round(c.percent, 1), c.limit, c.judged)
            for c in report.loads}


# ---- NVML's figures ---------------------------------------------------------------------

def test_samples_newer_than_asked_and_not_garbage_with_the_processes_listed() -> None:
    nvml = FakeNvml([FakeDevice(GPU0, processes={10: GIB, 99: GIB}, samples=[
        (10, 100, 30), (10, 200, 40), (11, 150, 20), (12, 160, 4294967295), (13, 90, 50),
        (14, 170, 10 ** 9)], device_samples=[(100, 50), (200, 30), (10 ** 13, 99)])])
    inv = Inventory(nvml)
    inv.discover()
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=1000)
    # over 100 %, or stamped far past the wall clock (garbage): dropped
    assert (sorted(u.samples or []), u.newest, u.device, u.dev_newest) == \
        ([(10, 200, 40), (11, 150, 20)], 200, 30.0, 200)
    assert u.running == {10, 99}  # to place them while they live
    (u,) = inv.process_utilisation({}, wall_us=1000)  # from the start: all the driver keeps
    # over time: the oldest sample speaks for a period before it (1 s, none shorter seen), the
    # next one for the 100 µs since
    assert len(u.samples or []) == 4 and u.dev_newest == 200
    assert u.device == pytest.approx((50 * 1e6 + 30 * 100) / (1e6 + 100))


def test_no_new_sample_is_nothing_new_and_a_failing_query_is_no_answer() -> None:
    nvml = FakeNvml([FakeDevice(GPU0, samples=[(10, 100, 30)], device_samples=[(100, 30)]),
                     FakeDevice(GPU1, util=55)])
    inv = Inventory(nvml)
    inv.discover()
    got = inv.process_utilisation({GPU0: (100, 100)})
    assert [(u.samples, u.newest, u.device) for u in got] == [([], 100, None), ([], 0, None)]
    nvml.empty_success = True  # pynvml raises NVMLError(0) for a driver's "none, success"
    assert [u.samples for u in inv.process_utilisation({GPU0: (100, 100)})] == [[], []]
    # a sample between pynvml's sizing call and its read: asked again
    nvml.devices[0].fail_once["nvmlDeviceGetProcessUtilization"] = \
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    nvml.devices[0].fail_once["nvmlDeviceGetSamples"] = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert inv.process_utilisation({})[0].samples == [(10, 100, 30)]
    # a driver without the device's sample buffer: the last period's utilisation, every time
    nvml.devices[1].fail["nvmlDeviceGetSamples"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert [u.device for u in inv.process_utilisation({})] == [30.0, 55.0]
    nvml.devices[0].fail["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_UNKNOWN
    nvml.devices[1].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_UNKNOWN
    assert [u.samples for u in inv.process_utilisation({})] == [None, None]
    nvml.devices[0].fail = {"nvmlDeviceGetSamples": pynvml.NVML_ERROR_GPU_IS_LOST}
    assert inv.process_utilisation({})[0].samples is None
    assert Inventory(FakeNvml()).process_utilisation({}) == []  # not discovered: nothing


class RepeatingNvml(FakeNvml):
    """A driver that repeats old news: samples stamped at the time asked for come back too."""

    def nvmlDeviceGetProcessUtilization(self, handle: int, timeStamp: int) -> list[Any]:
        return super().nvmlDeviceGetProcessUtilization(handle, timeStamp - 1)

    def nvmlDeviceGetSamples(self, handle: int, kind: int, timeStamp: int) -> tuple[int, list[Any]]:
        return super().nvmlDeviceGetSamples(handle, kind, timeStamp - 1)


def test_samples_are_taken_from_just_after_the_time_asked_up_to_now_and_waited_for_up_to_5_s_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The windows' exact bounds: a sample stamped at the time asked for is old news (taken
    twice, a busy period counted twice); one stamped at the wall clock is taken; one ahead of it
    by up to AHEAD_US waits (``ahead``: periods did end) and sets the driver's clock; one further
    ahead is garbage. The wall clock is held still here (``time.monotonic`` fixed)."""
    from webhook.node import inventory as inventory_module
    from webhook.node.inventory import AHEAD_US
    monkeypatch.setattr(inventory_module.time, "monotonic", lambda: 50.0)
    wall = 10_000_000
    dev = FakeDevice(GPU0, processes={10: GIB}, samples=[
        (10, 100, 30), (10, wall, 40), (11, wall + 1, 20), (13, wall + AHEAD_US + 1, 5)],
        device_samples=[(100, 90), (wall - 10, 4294967295), (wall, 30), (wall + 1, 20),
                        (wall + AHEAD_US, 10), (wall + AHEAD_US + 1, 5)])
    inv = Inventory(RepeatingNvml([dev]))
    inv.discover()
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=wall, read_at=50.0)
    assert (u.samples, u.newest, u.dev_newest, u.ahead, u.clock_us) == \
        ([(10, wall, 40)], wall, wall, True, wall + AHEAD_US)
    assert u.device == pytest.approx(30.0)  # the one period taken (not the garbage, 4294967295)
    # (the device's sample at the time asked for, repeated, would speak for no time: it is
    # dropped all the same)
    # nothing stamped past the wall clock: nothing waits, even with a sample right at it
    dev.samples = [(10, wall, 40)]
    dev.device_samples = [(wall, 30)]
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=wall, read_at=50.0)
    assert (u.samples, u.ahead, u.clock_us) == ([(10, wall, 40)], False, wall)
    # a process's sample alone ahead sets the clock
    dev.samples = [(10, wall, 40), (12, wall + AHEAD_US, 10)]
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=wall, read_at=50.0)
    assert (u.samples, u.clock_us) == ([(10, wall, 40)], wall + AHEAD_US)


def test_idle_is_said_only_where_no_period_ended_and_the_last_read_0_percent() -> None:
    """``idle``: no device period ended since the time asked and the driver's last period read
    0 %. A driver repeating only old news has samples but none new: not idle by that alone; the
    last period's figure unreadable: not idle either."""
    dev = FakeDevice(GPU0, samples=[(10, 100, 30)], device_samples=[(100, 0)], util=0)
    inv = Inventory(RepeatingNvml([dev]))
    inv.discover()
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=1000)
    assert (u.device, u.idle) == (None, False)  # a sample came, only an old one
    dev.device_samples = []  # none at all: NVML_ERROR_NOT_FOUND, the last period read 0 %
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=1000)
    assert (u.device, u.idle) == (None, True)
    dev.fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_UNKNOWN
    (u,) = inv.process_utilisation({GPU0: (100, 100)}, wall_us=1000)
    assert (u.device, u.idle) == (None, False)


def test_the_compute_limit_comes_from_the_limits_the_webhook_wrote() -> None:
    assert cores_from({"CUDA_DEVICE_SM_LIMIT": "30"}) == 30
    for text in ("100", "0", "", "thirty", "-5", "150"):
        assert cores_from({"CUDA_DEVICE_SM_LIMIT": text}) is None
    assert cores_from({}) is None


async def test_tracked_containers_carry_their_compute_limit() -> None:
    from node.test_audit import as_models
    got = tracked_containers(await as_models(cores_pod("a30", "30"), cores_pod("none", None),
                                             cores_pod("whole", "100")))
    assert {t.pod: t.cores for t in got.values()} == {"a30": 30, "none": None, "whole": None}


# ---- the check --------------------------------------------------------------------------

async def test_a_container_within_its_limit_passes_one_over_it_is_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two containers at 30 % on one GPU: one paced (28 %), one that never loaded the library
    (65 %), beside a host process. The region files are not read: NVML alone says it."""
    node, clock = Node(tmp_path), Clock()
    paced, rogue = cores_pod("paced", "30"), cores_pod("rogue", "30")
    node.run_in(paced, "a", 1001, {0: 2 * GIB})
    node.run_in(rogue, "a", 2001, {0: 2 * GIB})
    node.run(3001, "0::/system.slice/xorg.service\n", {0: GIB})
    gpus = Gpus(node, clock)
    busy = {(0, 1001): 28, (0, 2001): 65, (0, 3001): 5}
    async with FakeKube() as kube:
        paced, rogue = kube.put(paced), kube.put(rogue)
        async with kube.api_client() as api:
            auditor = compute_auditor(node, api, clock, gpus)
            assert auditor.compute is not None
            gpus.run(auditor.compute, 10, busy)
            report = await auditor.check()
            # half the window: figures, no verdict yet
            assert loads(report) == {("paced", GPU0): (28.0, 30, False),
                                     ("rogue", GPU0): (65.0, 30, False)}
            assert auditor.episodes == 0
            gpus.run(auditor.compute, 10, busy)
            with caplog.at_level(logging.WARNING, logger="webhook.node.audit"):
                report = await auditor.check()
            assert loads(report) == {("paced", GPU0): (28.0, 30, True),
                                     ("rogue", GPU0): (65.0, 30, True)}
            assert [c.tracked.pod for c in report.loads if c.over(10)] == ["rogue"]
            assert not any(h.over(0) for h in report.holdings)  # memory is fine
            events = [o for (p, _, _), o in kube.objects.items() if p == "events"]
            assert len(events) == 1
            ev = events[0]
            assert (ev["reason"], ev["type"], ev["involvedObject"]["uid"]) == \
                ("GPUComputeOverLimit", "Warning", rogue["metadata"]["uid"])
            assert "used 65 % of GPU" in ev["message"] and "compute limit of 30 %" in ev["message"]
            assert "pids 2001" in ev["message"]
            emitted = {k: v for k, v in ev.items() if k != "metadata"}
            emitted["metadata"] = {"name": ev["metadata"]["name"], "namespace": "ml"}
            assert_valid(emitted)
            warned = [r for r in caplog.records if "compute limit" in r.message]
            assert [(r.pod, r.percent, r.limit_percent, r.pids) for r in warned] == \
                [("rogue", 65.0, 30, [2001])]
            registry = make_registry(AgentCollector(node.inventory, tmp_path / "state",
                                                    AgentStatus(), auditor=auditor))
            got = samples(registry)
            for pod, pct, over in ((paced, 28.0, 0), (rogue, 65.0, 1)):
                lab = ctr_labels("ml", pod["metadata"]["name"], pod["metadata"]["uid"], "a", GPU0)
                assert got[("gpuslice_container_compute_observed_percent", lab)] == pct
                assert got[("gpuslice_container_compute_over_limit", lab)] == over
                assert got[("gpuslice_container_compute_judged", lab)] == 1
            assert got[("gpuslice_agent_over_limit_events_total", ())] == 1
            # the host's process (no container)
            assert got[("gpuslice_gpu_compute_unattributed_percent", (("uuid", GPU0),))] == 5.0
            # not evicted (the compute action is none), and one Event per episode
            gpus.run(auditor.compute, 10, busy)
            await auditor.check()
            assert kube.get("pods", "rogue", "ml") is not None and auditor.events == 1


async def test_over_the_limit_for_the_rounds_is_evicted_under_the_compute_action(
        tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("hog", "20")
    node.run_in(pod, "a", 5000, {0: GIB})
    gpus = Gpus(node, clock)
    async with FakeKube() as kube:
        kube.put(pod)
        async with kube.api_client() as api:
            # the memory action alone does not evict for compute
            auditor = compute_auditor(node, api, clock, gpus, action="evict", rounds=2)
            gpus.run(auditor.compute, 20, {(0, 5000): 90})
            for _ in range(3):
                await auditor.check()
                gpus.run(auditor.compute, 10, {(0, 5000): 90})
            assert kube.requests_to("POST", "/eviction") == [] and auditor.events == 1
            auditor = compute_auditor(node, api, clock, gpus, compute_action="evict", rounds=2)
            gpus.run(auditor.compute, 20, {(0, 5000): 90})
            await auditor.check()
            assert kube.requests_to("POST", "/eviction") == []  # one check is not enough
            gpus.run(auditor.compute, 10, {(0, 5000): 90})
            await auditor.check()
            (post,) = kube.requests_to("POST", r"/namespaces/ml/pods/hog/eviction$")
            assert_valid(post.body)
            assert kube.get("pods", "hog", "ml") is None and auditor.evictions == 1


@pytest.mark.parametrize(("pcts", "over"), [
    ((38,), False),  # within the tolerance (10 points)
    ((41,), True),
    ((20, 21), True),  # two processes of the container: their shares add up
])
async def test_the_tolerance_and_a_containers_processes_summed(
        tmp_path: Path, pcts: tuple[int, ...], over: bool) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    busy = {}
    for i, pct in enumerate(pcts):
        node.run_in(pod, "a", 100 + i, {0: GIB})
        busy[(0, 100 + i)] = pct
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 20, busy)
        (load,) = (await auditor.check()).loads
        assert load.percent == pytest.approx(sum(pcts)) and load.over(10) is over
        assert load.pids == tuple(sorted(100 + i for i in range(len(pcts))))
        assert auditor.episodes == (1 if over else 0)


async def test_a_container_restarted_within_the_window_is_one_share(tmp_path: Path) -> None:
    """Its instances' samples add up: 60 % for 10 s as one ID, then 60 % for 10 s as the next,
    is 60 % of the window, where each ID alone read 30 % (under a limit of 30 plus 10 points'
    tolerance)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("flaky", "30")
    node.run_in(pod, "a", 400, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (kube, auditor):
        gpus.run(auditor.compute, 1, {})
        gpus.run(auditor.compute, 10, {(0, 400): 60})
        node.stop(400)
        restart(kube, node, pod, "flaky/a/2", 401, {0: GIB})
        gpus.run(auditor.compute, 10, {(0, 401): 60})
        (load,) = (await auditor.check()).loads
        assert load.container_ids == tuple(sorted([cid("flaky/a"), cid("flaky/a/2")]))
        assert (round(load.percent), load.pids, load.judged, load.over(10)) == \
            (60, (400, 401), True, True)
        assert auditor.episodes == 1


@pytest.mark.parametrize("ahead", [1_500_000, 4_500_000])
async def test_a_sample_stamped_ahead_of_the_wall_clock_hides_no_later_ones(
        tmp_path: Path, ahead: int) -> None:
    """A sample stamped a few seconds ahead (within what is not garbage) is taken when the wall
    clock reaches it: the next queries still ask from now, so the periods stamped meanwhile are
    not skipped (a process sample moved the read position ahead and lost the container's
    samples of the next seconds; a device sample made the GPU silent and restarted it)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("steady", "30")
    node.run_in(pod, "a", 500, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 5, {(0, 500): 50})
        dev = node.nvml.devices[0]
        dev.samples.append((900, gpus.stamp + ahead, 1))  # a host process's
        dev.device_samples.append((gpus.stamp + ahead, 51))
        gpus.run(auditor.compute, 20, {(0, 500): 50})
        (load,) = (await auditor.check()).loads
        assert auditor.compute.failures == 0
        assert (load.judged, load.covered) == (True, WINDOW)
        assert load.percent == pytest.approx(50, abs=1)


async def test_a_container_over_its_limit_in_every_run_is_evicted_across_its_crashes(
        tmp_path: Path) -> None:
    """Defaults (a 60 s window, a check every 10 s, 3 rounds). Each instance runs at 100 % (limit
    60, tolerance 10) for 44 s, crashes, and is restarted 96 s later: 2 checks over per run.
    The window's tail after a crash (no process of it on the GPU) and the next instance's first
    window (it holds time it did not run) are no verdict: the episode goes on, the pod is
    evicted in its second run (the tail and the ramp each ended the episode, and it never was)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("crash", "60")
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, compute_window=60, compute_action="evict",
                      rounds=3) as (kube, auditor):
        gpus.run(auditor.compute, 60, {})
        over = 0
        for n in range(4):
            pid = 600 + n
            if n:
                restart(kube, node, pod, f"crash/a/{n}", pid, {0: GIB})
            else:
                node.run_in(pod, "a", pid, {0: GIB})
            for second in range(1, 141):
                if second == 45:  # crashed
                    node.stop(pid)
                    shutil.rmtree(node.proc / str(pid))
                gpus.run(auditor.compute, 1, {(0, pid): 100} if second < 45 else {})
                if second % 10 == 0:
                    over += sum(c.over(10) for c in (await auditor.check()).loads)
        assert over == 8
        assert (auditor.episodes, auditor.evictions) == (1, 1)
        assert len(kube.requests_to("POST", r"/namespaces/ml/pods/crash/eviction$")) == 1


async def test_a_gone_containers_samples_left_in_the_window_do_not_end_its_episode(
        tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("gone", "30")
    node.run_in(pod, "a", 700, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, rounds=3) as (_kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 700): 90})
        await auditor.check()
        assert len(auditor._episodes) == 1
        node.stop(700)
        shutil.rmtree(node.proc / "700")
        seen = []
        for _ in range(9):  # its share falls under the limit as its samples leave the window
            gpus.run(auditor.compute, 2, {})
            seen += [round(c.percent) for c in (await auditor.check()).loads]
        assert seen[-1] < 30 and len(auditor._episodes) == 1, seen


async def test_a_driver_clock_ahead_loses_no_sample_of_an_exited_process(tmp_path: Path) -> None:
    """The driver stamps its samples 4 s ahead of the agent's wall clock: they are taken once
    the wall clock reaches them, after the process is gone; it was last seen alive at the
    driver's clock, so its last samples are still its container's (30 % of the window, not
    24 %)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("short", "30")
    node.run_in(pod, "a", 800, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        auditor.compute._wall = lambda: gpus.wall() - 4.0
        gpus.run(auditor.compute, 10, {})
        gpus.run(auditor.compute, 10, {(0, 800): 60})
        node.stop(800)
        shutil.rmtree(node.proc / "800")
        gpus.run(auditor.compute, 8, {})
        (load,) = (await auditor.check()).loads
        assert load.judged and round(load.percent) == 30, auditor.last.compute_unattributed


async def test_a_driver_clock_ahead_is_no_silence_when_the_gpu_gets_busy(tmp_path: Path) -> None:
    """A driver that gives no device sample for idle periods, its clock 3.5 s ahead: idle for
    20 s, then busy. The first busy periods are stamped past the wall clock, found but not
    taken yet for 4 polls: periods did end, so that is no silence (it was a failure, the GPU
    started again)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("ahead", "30")
    node.run_in(pod, "a", 950, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        sampler = auditor.compute
        sampler._wall = lambda: gpus.wall() - 3.5
        dev = node.nvml.devices[0]
        for second in range(40):
            clock.t += 1.0
            gpus.stamp += 1_000_000
            busy = 50 if second >= 20 else 0
            if busy:  # no sample for an idle period
                dev.samples.append((950, gpus.stamp, busy))
                dev.device_samples.append((gpus.stamp, busy))
            dev.util = busy
            sampler.poll()
        assert sampler.failures == 0


async def test_a_burst_then_silence_is_averaged_over_the_window(tmp_path: Path) -> None:
    """A long kernel paid for afterwards (the library's debts): 100 % for 5 s, then nothing
    while the debt is paid. No process sample comes while nothing runs; the device's idle
    periods say that time was idle."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 77, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 5, {})  # the first answer starts the covered time
        gpus.run(auditor.compute, 5, {(0, 77): 100})
        gpus.run(auditor.compute, 15, {})
        (load,) = (await auditor.check()).loads
        # every second since the first answer: 20 s of the 20 s window
        assert load.judged and load.covered == WINDOW
        assert load.percent == pytest.approx(500 / load.covered) and not load.over(10)
        # the burst leaves the window; a container that ran nothing reads 0
        gpus.run(auditor.compute, 20, {})
        (load,) = (await auditor.check()).loads
        assert (load.percent, load.pids, load.judged) == (0.0, (), True)


async def test_no_limit_no_load_and_a_gpu_not_assigned_is_the_memory_checks(
        tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    free, whole = cores_pod("free", None), cores_pod("whole", "100")
    stray = cores_pod("stray", "30")
    stray["metadata"]["annotations"]["gpuslice.io/devices.a"] = GPU1
    node.run_in(free, "a", 1, {0: GIB})
    node.run_in(whole, "a", 2, {0: GIB})
    node.run_in(stray, "a", 3, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, free, whole, stray) as (kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 1): 90, (0, 2): 90, (0, 3): 90})
        report = await auditor.check()
        assert report.loads == ()
        # the stray's memory on a GPU not its own is the breach reported, once
        assert [(h.tracked.pod, h.assigned) for h in report.holdings if h.over(0)] == \
            [("stray", False)]
        assert [r for r in kube.objects if r[0] == "events"] and auditor.episodes == 1


async def test_a_failing_query_leaves_the_window_unjudged_and_the_episode_as_it_was(
        tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("hog", "30")
    node.run_in(pod, "a", 9, {0: GIB})
    gpus = Gpus(node, clock)
    fail = node.nvml.devices[0].fail
    async with served(node, clock, gpus, pod, compute_action="evict", rounds=3) as (kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 9): 80})
        await auditor.check()
        assert auditor.episodes == 1
        fail["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_UNKNOWN
        gpus.run(auditor.compute, 20, {(0, 9): 80})
        for _ in range(4):  # more checks than the rounds: neither over nor under
            (load,) = (await auditor.check()).loads
            assert not load.judged and load.covered == 0.0
        assert auditor.compute.failures == 20 and kube.get("pods", "hog", "ml") is not None
        del fail["nvmlDeviceGetProcessUtilization"]
        gpus.run(auditor.compute, 1, {})  # answers again: from here on, covered
        gpus.run(auditor.compute, 16, {(0, 9): 80})
        await auditor.check()
        assert kube.get("pods", "hog", "ml") is not None  # the second round over
        gpus.run(auditor.compute, 5, {(0, 9): 80})
        await auditor.check()
        assert kube.get("pods", "hog", "ml") is None and auditor.episodes == 1
        registry = make_registry(AgentCollector(node.inventory, tmp_path / "state",
                                                AgentStatus(), auditor=auditor))
        assert samples(registry)[("gpuslice_agent_compute_sample_errors_total", ())] == 20


async def test_a_process_that_ended_before_the_check_still_counts(tmp_path: Path) -> None:
    """Placed when sampled: a process that ran over the limit and exited (its /proc entry and
    its memory gone) before the check is still its container's."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("short", "30")
    node.run_in(pod, "a", 31, {0: GIB})
    node.run_in(pod, "a", 32, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 31): 70, (0, 32): 0})
        node.stop(31)
        for f in (node.proc / "31").iterdir():
            f.unlink()
        (node.proc / "31").rmdir()
        (load,) = (await auditor.check()).loads
        assert load.over(10) and load.pids == (31,)


async def test_an_episode_begun_after_its_process_ended_goes_on_across_checks(
        tmp_path: Path) -> None:
    """A process ran over the limit and exited before the check (a short job, a crash): its
    samples left in the window start the episode, and the next checks go on with it (one Event,
    evicted after the rounds) on a node up for a day as on one just booted. The episode's
    'last seen' began at 0 on the monotonic clock (seconds since boot): on a node up more than
    ABSENT_TTL it read as gone that long and was dropped at once, so every check began a new
    episode and a new Event and the rounds were never reached."""
    node, clock = Node(tmp_path), Clock()
    clock.t = 86_400.0  # time.monotonic() on a node up for a day
    pod = cores_pod("short", "30")
    node.run_in(pod, "a", 31, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, compute_action="evict",
                      rounds=3) as (kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 31): 90})
        node.stop(31)
        shutil.rmtree(node.proc / "31")
        for _ in range(3):
            gpus.run(auditor.compute, 1, {})
            (load,) = (await auditor.check()).loads
            assert load.over(10)
        assert (auditor.episodes, auditor.events, auditor.evictions) == (1, 1, 1)
        assert len(kube.requests_to("POST", r"/namespaces/ml/pods/short/eviction$")) == 1


async def test_a_pid_reused_since_the_sample_is_not_placed(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 44, {0: GIB}, started=5000)  # started after the query: not the one
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, boot_clock=lambda: 4000) as (_kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 44): 90})
        report = await auditor.check()
        assert report.loads == ()


async def test_gpus_come_and_go_and_the_window_slides(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("two", "30", gpus="2")
    node.run_in(pod, "a", 8, {0: GIB, 1: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        assert auditor.compute is not None
        gpus.run(auditor.compute, 20, {(0, 8): 90, (1, 8): 20})
        got = loads(await auditor.check())
        assert got == {("two", GPU0): (90.0, 30, True), ("two", GPU1): (20.0, 30, True)}
        gpus.run(auditor.compute, 10, {(0, 8): 10, (1, 8): 20})  # half the window at 10 %
        got = loads(await auditor.check())
        assert got[("two", GPU0)] == (50.0, 30, True)
        node.nvml.devices.pop()  # GPU1 gone from the node
        node.inventory.discover()
        gpus.run(auditor.compute, 1, {(0, 8): 10})
        assert set(auditor.compute.snapshot()[1]) == {GPU0}


def test_the_sampler_needs_a_window() -> None:
    with pytest.raises(ValueError, match="window"):
        ComputeSampler(Inventory(FakeNvml()), lambda stamps, listed, wall: {}, 0)
    auditor = Auditor(Inventory(FakeNvml()), "/proc", list_pods=None)
    assert auditor.compute is None  # off unless asked for
    with pytest.raises(ValueError, match="over-limit action"):
        Auditor(Inventory(FakeNvml()), "/proc", list_pods=None, compute_action="kill")


# ---- settings and the agent -------------------------------------------------------------

def test_the_compute_settings_are_checked() -> None:
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from_args(p.parse_args(["--node-name", NODE, "--compute-window", "30",
                                         "--compute-tolerance", "5",
                                         "--compute-over-limit-action", "evict"]))
    assert (s.compute_window, s.compute_tolerance, s.compute_over_limit_action) == \
        (30.0, 5.0, "evict")
    d = AgentSettings(node_name=NODE)
    assert (d.compute_window, d.compute_tolerance, d.compute_over_limit_action) == \
        (60.0, 10.0, "none")
    assert AgentSettings(node_name=NODE, compute_window=0).compute_window == 0
    for bad, why in (({"compute_window": 2}, "--compute-window"),
                     ({"compute_window": 7200}, "--compute-window"),
                     ({"compute_tolerance": -1}, "--compute-tolerance"),
                     ({"compute_over_limit_action": "kill"}, "--compute-over-limit-action")):
        with pytest.raises(SettingsError, match=why):
            AgentSettings(node_name=NODE, **bad)


async def test_the_agent_samples_every_second_and_serves_the_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node.test_agent import LIB, _node, _scrape, _settings

    from webhook.node import loop
    from webhook.node.loop import Agent
    monkeypatch.setattr(loop, "SAMPLE_INTERVAL", 0.01)
    node = Node(tmp_path)
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 60, {0: GIB})
    settings = _settings(tmp_path, proc_root=str(node.proc), audit_interval=0.05,
                         compute_window=20)
    stamp = [1_000]

    def utilisation(since: Any, wall_us: int, read_at: float | None = None) -> Any:
        stamp[0] = max(stamp[0] + 1, wall_us)  # a new period at every query, the process busy
        node.nvml.devices[0].samples.append((60, stamp[0], 80))
        node.nvml.devices[0].device_samples.append((stamp[0], 80))
        return real(since, wall_us, read_at)

    real = node.inventory.process_utilisation
    monkeypatch.setattr(node.inventory, "process_utilisation", utilisation)
    async with FakeKube() as kube:
        kube.put(_node())
        kube.put(pod)
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=node.inventory, api_client=api)
            assert agent.auditor is not None and agent.auditor.compute is not None
            await agent.start()
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))
            try:
                for _ in range(300):
                    if any(c.percent for c in agent.auditor.last.loads):
                        break
                    await asyncio.sleep(0.02)
                text = await _scrape(agent.metrics_port)
            finally:
                stop.set()
                await asyncio.wait_for(task, 5)
                await agent.close()
    assert stamp[0] > 3  # polled again and again
    assert 'gpuslice_container_compute_observed_percent{container="a",namespace="ml",pod="p"' \
        in text and 'uuid="GPU-0' in text
    (load,) = agent.auditor.last.loads
    # the periods' stamps (the wall clock at each query) and the polls' spans (the monotonic
    # clock after it) differ by the query's own time, which the window evens out
    assert load.percent == pytest.approx(80.0, abs=8.0) and load.tracked.pod == "p"


async def test_a_sampler_bug_is_logged_and_the_agent_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from node.test_agent import LIB, _settings

    from webhook.node.loop import Agent
    node = Node(tmp_path)
    agent = Agent(_settings(tmp_path, proc_root=str(node.proc)), LIB, inventory=node.inventory)
    assert agent.auditor is not None and agent.auditor.compute is not None

    def broken(since: Any, wall_us: int) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(node.inventory, "process_utilisation", broken)
    with caplog.at_level(logging.ERROR, logger="webhook.node.loop"):
        await agent.sample_compute()
    assert agent.auditor.errors == 1
    assert any("per-process utilisation failed" in r.message for r in caplog.records)
    off = Agent(_settings(tmp_path, proc_root=str(node.proc), compute_window=0), LIB,
                inventory=node.inventory)
    assert off.auditor is not None and off.auditor.compute is None
    await off.sample_compute()  # nothing to do


async def test_a_pid_reused_between_polls_is_placed_again(tmp_path: Path) -> None:
    """The sampler keeps each sampled pid's place while its start time stays the same; a pid
    that another container's process took meanwhile (a new start time) is placed again."""
    node, clock = Node(tmp_path), Clock()
    first, second = cores_pod("first", "30"), cores_pod("second", "30")
    node.run_in(first, "a", 70, {0: GIB}, started=10)
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, first, second,
                      boot_clock=lambda: 10_000) as (_kube, auditor):
        gpus.run(auditor.compute, 10, {(0, 70): 90})
        node.run_in(second, "a", 70, {0: GIB}, started=20)  # the pid, reused
        gpus.run(auditor.compute, 10, {(0, 70): 10})
        # each over the window (19 s covered: the first poll only starts it)
        got = loads(await auditor.check())
        assert got == {("first", GPU0): (round(90 * 9 / 19, 1), 30, True),
                       ("second", GPU0): (round(10 * 10 / 19, 1), 30, True)}


# ---- the driver's sample periods, and what can go wrong -----------------------------------

@pytest.mark.parametrize(("limit", "pattern", "want"), [
    # paced by running, then waiting it off: a sample only for the periods it ran in
    ("30", [90, 0, 0], 30.0),
    ("30", [60, 0], 30.0),
    ("50", [100, 0], 50.0),
    ("30", [100, 100, 0, 0, 0, 0, 0], 200 / 7),
])
async def test_a_container_paced_by_waiting_reads_its_time_share(
        tmp_path: Path, limit: str, pattern: list[int], want: float) -> None:
    """The library paces a kernel of K seconds by a wait of K x (100/C - 1): the driver gives
    the process samples only for the periods it ran in, the device one for every period. Each
    process sample taken for the whole time since the last one read 90 % for the first pattern
    and 100 % for the third (both flagged)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("paced", limit)
    node.run_in(pod, "a", 21, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, compute_window=42.0) as (_kube, auditor):
        gpus.run(auditor.compute, 43, {(0, 21): pattern})
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(want, abs=1.0)
        assert not load.over(10) and auditor.episodes == 0


async def test_containers_taking_turns_each_read_their_own_share(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    one, two = cores_pod("one", "30"), cores_pod("two", "40")
    node.run_in(one, "a", 1, {0: GIB})
    node.run_in(two, "a", 2, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, one, two, compute_window=30.0) as (_kube, auditor):
        gpus.run(auditor.compute, 31, {(0, 1): [90, 0, 0], (0, 2): [0, 60, 60]})
        got = {c.tracked.pod: round(c.percent, 1) for c in (await auditor.check()).loads}
        assert got == {"one": 30.0, "two": 40.0}


async def test_several_periods_per_poll_are_weighed_by_their_samples(tmp_path: Path) -> None:
    """A driver period shorter than the poll's second: a process that ran in two periods of
    three weighs twice one that ran in one (their samples add up, not average)."""
    node, clock = Node(tmp_path), Clock()
    pods = [cores_pod("two-thirds", "30"), cores_pod("one-third", "30")]
    for pid, pod in enumerate(pods, start=1):
        node.run_in(pod, "a", pid, {0: GIB})
    gpus = Gpus(node, clock)
    dev = node.nvml.devices[0]
    async with served(node, clock, gpus, *pods, compute_window=20.0) as (_kube, auditor):
        assert auditor.compute is not None
        for _ in range(21):
            clock.t += 1.0
            for third in range(3):
                gpus.stamp += 333_333
                dev.device_samples.append((gpus.stamp, 100))
                dev.samples.append((1 if third < 2 else 2, gpus.stamp, 100))
            auditor.compute.poll()
        got = {c.tracked.pod: round(c.percent, 1) for c in (await auditor.check()).loads}
        assert got == {"two-thirds": pytest.approx(66.7, abs=0.1),
                       "one-third": pytest.approx(33.3, abs=0.1)}


async def test_without_the_device_sample_buffer_the_last_periods_figure_is_used(
        tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 5, {0: GIB})
    dev = node.nvml.devices[0]
    dev.fail["nvmlDeviceGetSamples"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    dev.util = 80
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 21, {(0, 5): 80})
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(80.0) and load.over(10)


async def test_a_wall_clock_stepped_back_does_not_blind_the_check(tmp_path: Path) -> None:
    """NVML stamps its samples with the wall clock: stepped back an hour, every sample is
    older than the newest seen. The sampler starts again from the driver's buffer."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 6, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 10, {(0, 6): 95})
        gpus.stamp -= 3600 * 1_000_000
        for dev in node.nvml.devices:  # what the driver keeps from before: gone
            dev.samples.clear()
            dev.device_samples.clear()
        gpus.run(auditor.compute, 25, {(0, 6): 95})
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(95.0) and load.over(10)


async def test_what_the_driver_kept_while_queries_failed_is_not_placed(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 7, {0: GIB})
    gpus = Gpus(node, clock)
    fail = node.nvml.devices[0].fail
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 2, {(0, 7): 10})
        fail["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_UNKNOWN
        gpus.run(auditor.compute, 10, {(0, 7): 95})  # kept by the driver, unread
        del fail["nvmlDeviceGetProcessUtilization"]
        gpus.run(auditor.compute, 20, {(0, 7): 10})
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(10.0)


async def test_nvml_gone_for_a_while_changes_no_episode(tmp_path: Path) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("hog", "30")
    node.run_in(pod, "a", 11, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod, compute_action="evict", rounds=3) as (kube, auditor):
        gpus.run(auditor.compute, 20, {(0, 11): 90})
        await auditor.check()
        assert auditor.episodes == 1
        node.inventory.close()  # NVML unavailable: no GPU read at all
        for _ in range(5):
            gpus.run(auditor.compute, 1, {(0, 11): 90})
            await auditor.check()
        node.inventory.discover()
        gpus.run(auditor.compute, 20, {(0, 11): 90})
        await auditor.check()
        assert kube.get("pods", "hog", "ml") is not None  # the second round over
        await auditor.check()
        assert kube.get("pods", "hog", "ml") is None and auditor.episodes == 1


async def test_a_pod_over_its_memory_cap_and_compute_limit_is_evicted_once(
        tmp_path: Path) -> None:
    """The memory episode evicts first; the pod terminates for a while (the API server keeps it
    and takes a second eviction of it): the compute episode, reaching its rounds later, does
    not ask again."""
    from fakekube import status_object
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("rogue", "30")
    node.run_in(pod, "a", 900, {0: 8 * GIB})
    gpus = Gpus(node, clock)
    async with FakeKube() as kube:
        kube.put(pod)
        kube._evict = lambda key, body: status_object(201, "", "")  # type: ignore[method-assign]
        async with kube.api_client() as api:
            auditor = compute_auditor(node, api, clock, gpus, action="evict",
                                      compute_action="evict", rounds=2)
            for _ in range(6):
                gpus.run(auditor.compute, 10, {(0, 900): 95})
                await auditor.check()
            assert auditor.episodes == 2 and auditor.events == 2  # one memory, one compute
            assert len(kube.requests_to("POST", "/eviction")) == 1 and auditor.evictions == 1


@pytest.mark.parametrize("lag", [1, -1], ids=["process-samples-late", "device-samples-late"])
async def test_streams_a_poll_apart_still_give_each_container_its_share(
        tmp_path: Path, lag: int) -> None:
    """The device's sample of a period and the processes' samples of it may show up in
    different polls: split per poll, a container taking turns with another got the other's
    busy time (15 % read 45 %), and a rogue alone running every other second read 0 %."""
    node, clock = Node(tmp_path), Clock()
    limited, other, rogue = cores_pod("limited", "30"), cores_pod("other", None), \
        cores_pod("rogue", "30")
    node.run_in(limited, "a", 1, {0: GIB})
    node.run_in(other, "a", 2, {0: GIB})
    node.run_in(rogue, "a", 3, {1: GIB})
    gpus = Gpus(node, clock, lag=lag)
    async with served(node, clock, gpus, limited, other, rogue,
                      compute_window=30.0) as (_kube, auditor):
        gpus.run(auditor.compute, 32, {(0, 1): [30, 0], (0, 2): [0, 90],
                                       (1, 3): [100, 0]})
        got = {c.tracked.pod: (round(c.percent), c.judged, c.over(10))
               for c in (await auditor.check()).loads}
        assert got == {"limited": (15, True, False), "rogue": (50, True, True)}


async def test_a_rogue_of_short_lived_processes_is_placed_while_they_live(
        tmp_path: Path) -> None:
    """A new process each second, gone before its sample shows up: placed while NVML lists it
    (and its place kept a while after it ends), it is its container's."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("churn", "30")
    gpus = Gpus(node, clock)
    dev = node.nvml.devices[0]
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        assert auditor.compute is not None
        node.run_in(pod, "a", 4000, {0: GIB})  # keeps the container mapped (memory)
        for i in range(22):
            clock.t += 1.0
            gpus.stamp += 1_000_000
            pid = 3000 + i
            if i:  # the last one ended; its sample shows up now
                node.stop(pid - 1)
                for f in (node.proc / str(pid - 1)).iterdir():
                    f.unlink()
                (node.proc / str(pid - 1)).rmdir()
                dev.samples.append((pid - 1, gpus.stamp - 500_000, 100))
                dev.device_samples.append((gpus.stamp, 100))
            node.run_in(pod, "a", pid, {0: GIB})
            auditor.compute.poll()
        report = await auditor.check()
        (load,) = report.loads
        assert load.judged and load.percent == pytest.approx(100.0) and load.over(10)
        # GPU1 gave no period, and its last one read 0 %: idle, covered
        assert report.compute_unattributed == {GPU0: 0.0, GPU1: 0.0}


async def test_a_gpu_that_gives_no_sample_period_is_not_judged_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 8, {0: GIB})
    gpus = Gpus(node, clock)
    dev = node.nvml.devices[0]
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        assert auditor.compute is not None
        with caplog.at_level(logging.WARNING, logger="webhook.node.compute"):
            for _ in range(25):  # process samples, never a device period
                clock.t += 1.0
                gpus.stamp += 1_000_000
                dev.samples.append((8, gpus.stamp, 95))
                auditor.compute.poll()
        (load,) = (await auditor.check()).loads
        assert not load.judged and load.covered == 0.0
        warned = [r for r in caplog.records if "no utilisation sample period" in r.message]
        # once, not once per silence; GPU1 ran nothing (no process sample, its last period
        # read 0 %): idle time, covered, no silence
        assert len(warned) == 1
        assert auditor.compute.failures == 8  # one per silence of 3 s
        gpus.run(auditor.compute, 21, {(0, 8): 95})  # the periods come (again)
        (load,) = (await auditor.check()).loads
        assert load.judged and load.over(10)


async def test_a_driver_without_device_samples_for_idle_periods_reads_the_time_share(
        tmp_path: Path) -> None:
    """Some drivers give no device sample for an idle period. A container paced to 33 % (a
    second's run, two seconds' wait) then has device samples of its busy seconds only: taken at
    their mean it read 100 % (judged, over its limit, evicted), and an idle GPU fell silent
    (never judged, a failure every 3 s). Now a gap counts idle, and a poll with no period, no
    process sample and a last period of 0 % is covered idle time."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("paced", "40")
    node.run_in(pod, "a", 31, {0: GIB})
    gpus = Gpus(node, clock)
    dev = node.nvml.devices[0]
    async with served(node, clock, gpus, pod, compute_window=30.0) as (_kube, auditor):
        assert auditor.compute is not None
        for second in range(31):
            clock.t += 1.0
            gpus.stamp += 1_000_000
            busy = second % 3 == 0
            if busy:
                dev.device_samples.append((gpus.stamp, 100))
                dev.samples.append((31, gpus.stamp, 100))
            dev.util = 100 if busy else 0
            auditor.compute.poll()
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(33.3, abs=1.0)
        assert not load.over(10) and auditor.compute.failures == 0


async def test_busy_time_the_processes_samples_cannot_account_for_is_not_judged(
        tmp_path: Path) -> None:
    """The device busy all the time, the only process samples a container's 5 %: the rest ran
    in something NVML gives no samples of (MPS, or samples the driver lost). Split by the
    samples alone, the container read 100 %."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("small", "30")
    node.run_in(pod, "a", 41, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        for _ in range(21):
            tick(node, clock, gpus, auditor, 100, [(41, 0, 5)])
        report = await auditor.check()
        (load,) = report.loads
        assert not load.judged and load.covered == 0.0 and auditor.episodes == 0
        assert report.compute_unattributed[GPU0] == 100.0
        # samples that account for the busy time are judged
        for _ in range(21):
            tick(node, clock, gpus, auditor, 100, [(41, 0, 95)])
        (load,) = (await auditor.check()).loads
        assert load.judged and load.percent == pytest.approx(100.0) and load.over(10)


def tick(node: Node, clock: Clock, gpus: Gpus, auditor: Auditor, device: int,
         samples: list[tuple[int, int, int]], seconds: float = 1.0) -> None:
    """One poll after ``seconds``: GPU 0 shows a device sample of ``device`` % for each second
    of them (a driver's period is 1 s at most) and the process samples (pid, µs before now,
    %)."""
    assert auditor.compute is not None
    clock.t += seconds
    dev = node.nvml.devices[0]
    for _ in range(max(1, int(seconds))):
        gpus.stamp += int(seconds * 1_000_000) // max(1, int(seconds))
        dev.device_samples.append((gpus.stamp, device))
    dev.util = device
    dev.samples.extend((pid, gpus.stamp - ago, pct) for pid, ago, pct in samples)
    auditor.compute.poll()


async def test_processes_whose_samples_all_read_zero(tmp_path: Path) -> None:
    """Copies only (or a driver that lists idle processes at 0 %): no process's sample to split
    the time by. Idle, every container reads 0 %; busy, nobody is judged (and the memory check
    goes on)."""
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("copies", "30", mib="1024")
    node.run_in(pod, "a", 12, {0: 4 * GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        for _ in range(21):
            tick(node, clock, gpus, auditor, 0, [(12, 0, 0)])
        report = await auditor.check()
        ((load,), (held,)) = report.loads, report.holdings
        assert (load.percent, load.judged, held.over(0)) == (0.0, True, True)
        for _ in range(21):
            tick(node, clock, gpus, auditor, 90, [(12, 0, 0)])
        report = await auditor.check()
        (load,) = report.loads
        assert not load.judged and report.compute_unattributed == {GPU0: 90.0, GPU1: 0.0}


async def test_a_pids_samples_a_poll_late_are_still_counted(tmp_path: Path) -> None:
    """Drivers stamp each pid on its own schedule: one pid's sample of a period shows up after a
    newer one of another pid's. Asked from the newest seen, it was lost (50 % read 0 %, 30 %
    read 80 %)."""
    node, clock = Node(tmp_path), Clock()
    late, prompt = cores_pod("late", "60"), cores_pod("prompt", "60")
    node.run_in(late, "a", 1, {0: GIB})
    node.run_in(prompt, "a", 2, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, late, prompt) as (_kube, auditor):
        for _ in range(22):  # pid 1's sample of the last period, pid 2's of this one
            tick(node, clock, gpus, auditor, 80, [(1, 1_000_000, 50), (2, 0, 30)])
        got = {c.tracked.pod: round(c.percent) for c in (await auditor.check()).loads}
        assert got == {"late": 50, "prompt": 30}


async def test_a_gone_processs_place_holds_for_its_last_samples_only(tmp_path: Path) -> None:
    """Its pid taken by processes of another container never seen alive (short-lived): their
    samples, stamped later than its last ones could be, are not its container's."""
    node, clock = Node(tmp_path), Clock()
    victim, other = cores_pod("victim", "30"), cores_pod("other", "30")
    node.run_in(victim, "a", 70, {0: GIB})
    node.run_in(other, "a", 71, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, victim, other) as (_kube, auditor):
        for _ in range(5):
            tick(node, clock, gpus, auditor, 20, [(70, 0, 20)])
        node.stop(70)
        for f in (node.proc / "70").iterdir():
            f.unlink()
        (node.proc / "70").rmdir()
        tick(node, clock, gpus, auditor, 20, [(70, 500_000, 20)])  # its last period
        for _ in range(16):  # pid 70 again, short-lived processes at 100 %
            tick(node, clock, gpus, auditor, 100, [(70, 0, 100)])
        got = {c.tracked.pod: round(c.percent) for c in (await auditor.check()).loads}
        assert got["victim"] < 30  # its 6 s at 20 %: about 6 % of the window
        assert 70 not in auditor._placed  # forgotten GONE_TTL (10 s) after it went
        assert (await auditor.check()).compute_unattributed[GPU0] > 70


async def test_other_pods_processes_are_unattributed(tmp_path: Path) -> None:
    from node.test_audit import cid, systemd_cgroup
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("ours", "30")
    node.run_in(pod, "a", 1, {0: GIB})
    node.run(2, systemd_cgroup("11111111-2222-3333-4444-555555555555", cid("theirs")),
             {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 21, {(0, 1): 20, (0, 2): 45})
        report = await auditor.check()
        assert loads(report) == {("ours", GPU0): (20.0, 30, True)}
        assert report.compute_unattributed == {GPU0: pytest.approx(45.0), GPU1: 0.0}


def test_device_samples_of_another_value_type_are_no_answer() -> None:
    nvml = FakeNvml([FakeDevice(GPU0, device_samples=[(100, 30)])])
    nvml.value_type = pynvml.NVML_VALUE_TYPE_DOUBLE
    inv = Inventory(nvml)
    inv.discover()
    assert inv.process_utilisation({})[0].samples is None


async def test_a_span_cut_by_the_windows_start_counts_in_part(tmp_path: Path) -> None:
    """Spans of 4 s (a poll every 4 s), a window of 10 s: of the span ending 8 s before now,
    the last 2 s count, its samples by half."""
    node, clock = Node(tmp_path), Clock()
    first, then = cores_pod("first", "60"), cores_pod("then", "90")
    node.run_in(first, "a", 1, {0: GIB})
    node.run_in(then, "a", 2, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, first, then, compute_window=10.0) as (_kube, auditor):
        tick(node, clock, gpus, auditor, 100, [], 4.0)  # the first answer
        for pid in (1, 1, 1, 2, 2):
            tick(node, clock, gpus, auditor, 100, [(pid, 0, 100)], 4.0)
        got = {c.tracked.pod: round(c.percent, 1) for c in (await auditor.check()).loads}
        # in the window: 2 s of "first" (half its samples), 8 s of "then"
        assert got == {"first": 20.0, "then": 80.0}


async def test_a_wall_clock_stepped_back_a_little_is_no_silence(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30")
    node.run_in(pod, "a", 9, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        gpus.run(auditor.compute, 10, {(0, 9): 20})
        gpus.stamp -= 3_500_000  # NTP steps the clock back 3.5 s
        with caplog.at_level(logging.WARNING, logger="webhook.node.compute"):
            gpus.run(auditor.compute, 12, {(0, 9): 20})
        assert not [r for r in caplog.records if r.name == "webhook.node.compute"]
        assert auditor.compute is not None
        assert auditor.compute.failures == 0
        (load,) = (await auditor.check()).loads
        # the seconds whose device samples the step hid (stamped before the newest seen) count
        # idle: 20 % reads a little less, never more
        assert load.judged and 15.0 <= load.percent <= 20.0


async def test_a_bug_in_the_compute_window_leaves_the_memory_check_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    node, clock = Node(tmp_path), Clock()
    pod = cores_pod("p", "30", mib="1024")
    node.run_in(pod, "a", 3, {0: 4 * GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, pod) as (_kube, auditor):
        assert auditor.compute is not None

        def broken() -> Any:
            raise ZeroDivisionError("float division by zero")

        monkeypatch.setattr(auditor.compute, "snapshot", broken)
        with caplog.at_level(logging.ERROR, logger="webhook.node.audit"):
            report = await auditor.check()
        (held,) = report.holdings
        assert held.over(0) and not any(c.judged for c in report.loads) and auditor.errors == 1
        assert any("compute check failed" in r.message for r in caplog.records)


async def test_a_pid_reused_within_a_poll_keeps_the_gone_processs_samples_its_own(
        tmp_path: Path) -> None:
    """Between two polls a process of one container ran its last period and ended, and a
    process of another container took its pid (started before the next query). That query's
    samples of the pid are the gone one's up to the new one's start: they were all charged to
    the new holder (a container that had not run at all read the other's 90 %)."""
    node, clock = Node(tmp_path), Clock()
    first, second = cores_pod("first", "30"), cores_pod("second", "30")
    ticks = os.sysconf("SC_CLK_TCK")
    gpus = Gpus(node, clock)

    def boot() -> int:  # boot ticks, in step with the fake driver's wall clock
        return (gpus.stamp - START_US) * ticks // 1_000_000 + 100_000

    node.run_in(first, "a", 70, {0: GIB}, started=boot())
    async with served(node, clock, gpus, first, second, boot_clock=boot) as (_kube, auditor):
        for _ in range(5):
            tick(node, clock, gpus, auditor, 90, [(70, 0, 90)])
        # its last period ends 0.5 s after this poll; the pid is another's 0.7 s after it
        node.stop(70)
        node.run_in(second, "a", 70, {0: GIB}, started=boot() + 7 * ticks // 10)
        tick(node, clock, gpus, auditor, 90, [(70, 500_000, 90)])
        for _ in range(14):  # the new holder never runs
            tick(node, clock, gpus, auditor, 0, [])
        got = {c.tracked.pod: round(c.percent, 1) for c in (await auditor.check()).loads}
        # its 5 periods at 90 % in the 19 s covered (the first poll only starts the window)
        assert got == {"first": round(90 * 5 / 19, 1), "second": 0.0}


async def test_a_gone_processs_last_samples_count_beside_a_later_holders(
        tmp_path: Path) -> None:
    """A poll late (3 s after the last): the gone process's last period and a short-lived later
    process's under its pid come in one answer. Placed by the newest stamp (the later one's,
    too late to be its), the gone one's last period was nobody's."""
    node, clock = Node(tmp_path), Clock()
    victim = cores_pod("victim", "30")
    node.run_in(victim, "a", 70, {0: GIB})
    gpus = Gpus(node, clock)
    async with served(node, clock, gpus, victim) as (_kube, auditor):
        for _ in range(5):
            tick(node, clock, gpus, auditor, 60, [(70, 0, 60)])
        node.stop(70)
        shutil.rmtree(node.proc / "70")
        # its last period, 0.5 s after the last poll; another process's, 2.5 s later
        tick(node, clock, gpus, auditor, 60, [(70, 2_500_000, 60), (70, 0, 60)], seconds=3)
        node.run_in(victim, "a", 71, {0: GIB})  # (a process of it on the GPU: judged)
        for _ in range(12):
            tick(node, clock, gpus, auditor, 0, [])
        (load,) = (await auditor.check()).loads
        # busy 60 % for 7 of the 19 s covered; 5 of the 6 samples in them its
        assert load.pids == (70,) and round(load.percent, 1) == round(60 * 7 / 19 * 5 / 6, 1)
