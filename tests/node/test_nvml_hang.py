"""An NVML call that hangs (a GPU fallen off the bus: NVML's calls to it block for seconds or
for ever instead of failing) holds up none of the agent: the rounds go on and publish the GPU
being queried Unhealthy, /metrics and /healthz answer, the outside check goes on, no new NVML
call waits behind the hung one; once it returns, all is as before."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from fakekube import FakeKube
from node.fakenvml import FakeDevice, FakeNvml, two_a100s
from node.test_shutdown import _settings as shutdown_settings

from webhook import names
from webhook.node import inventory as inventory_module
from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.loop import Agent

NODE = "gpu-node-1"
LIB = b"\x7fELF" + b"interposer" * 50
HUNG_S = 0.5
"""The deadline after which a call is judged hung, in these tests."""
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


@pytest.fixture(autouse=True)
def _short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory_module, "HUNG_S", HUNG_S, raising=False)


def _settings(tmp_path: Path, **kw: object) -> AgentSettings:
    """The shutdown tests' settings, with short rounds and checks."""
    return shutdown_settings(tmp_path, **{"interval": 0.2, "audit_interval": 0.1, **kw})


async def _until(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(why)
        await asyncio.sleep(0.02)


def _published(kube: FakeKube) -> dict[str, str]:
    node = kube.get("nodes", NODE) or {}
    gpus = json.loads(node.get("metadata", {}).get("annotations", {}).get(
        names.ANN_NODE_GPUS) or "[]")
    return {g["uuid"]: g["health"] for g in gpus}


def _allocatable(kube: FakeKube) -> str:
    node = kube.get("nodes", NODE) or {}
    return str(node.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu"))


async def _get(session: aiohttp.ClientSession, port: int, path: str) -> tuple[int, str]:
    async with session.get(f"http://127.0.0.1:{port}{path}",
                           timeout=aiohttp.ClientTimeout(total=3)) as r:
        return r.status, await r.text()


async def test_a_hung_nvml_call_marks_its_gpu_unhealthy_and_holds_nothing_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_a100s()
    release = threading.Event()
    async with FakeKube() as kube:
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                  "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}})
        async with kube.api_client() as api, aiohttp.ClientSession() as session:
            agent = Agent(_settings(tmp_path), LIB, inventory=Inventory(nvml), api_client=api)
            await agent.start()
            stop = asyncio.Event()
            run = asyncio.create_task(agent.run(stop))
            try:
                await _until(lambda: _published(kube) == {g.uuid: "Healthy"
                                                          for g in nvml.devices},
                             5, "the GPUs were never published")
                # GPU 1 falls off the bus: NVML's health probe of it never returns
                nvml.devices[1].hang["nvmlDeviceGetRemappedRows"] = release
                await asyncio.to_thread(nvml.hung.wait, 5)
                assert nvml.hung.is_set(), "the round never asked NVML again"
                calls = nvml.calls
                with caplog.at_level("INFO"):
                    await _until(lambda: _published(kube).get(GPU1) == "Unhealthy", 5,
                                 "the GPU whose NVML call hangs is still published Healthy")
                    assert _published(kube)[nvml.devices[0].uuid] == "Healthy"
                    await _until(lambda: _allocatable(kube) == "10", 5,
                                 "the hung GPU's slices are still allocatable")
                    # the rounds go on, the outside check too
                    done, audited = agent._round_done, agent.status.last_audit
                    await _until(lambda: agent._round_done > done
                                 and agent.status.last_audit > audited, 5,
                                 "the rounds or the outside check stand still")
                    # /metrics and /healthz answer, and say so
                    status, text = await _get(session, agent.metrics_port, "/metrics")
                    assert status == 200
                    assert "gpuslice_nvml_hung 1.0" in text
                    assert f'gpuslice_gpu_healthy{{index="1",product="NVIDIA A100-SXM4-80GB",' \
                        f'uuid="{GPU1}"}} 0.0' in text
                    assert "NVML call hung" in text  # the reason
                    assert (await _get(session, agent.metrics_port, "/healthz"))[0] == 200
                    await asyncio.sleep(3 * HUNG_S)
                    assert nvml.hung.is_set()
                    assert nvml.calls == calls, "NVML was called again while a call hangs"
                hung_logs = [r for r in caplog.records if "NVML call hung" in r.getMessage()]
                assert len(hung_logs) == 1, [r.getMessage() for r in hung_logs]
                # the call returns: all as before
                del nvml.devices[1].hang["nvmlDeviceGetRemappedRows"]
                with caplog.at_level("INFO"):
                    release.set()
                    await _until(lambda: _published(kube).get(GPU1) == "Healthy", 5,
                                 "the GPU stays Unhealthy after NVML answers again")
                status, text = await _get(session, agent.metrics_port, "/metrics")
                assert "gpuslice_nvml_hung 0.0" in text
                assert 'gpuslice_gpu_memory_used_bytes{index="1"' in text
                assert any("NVML answers again" in r.getMessage() for r in caplog.records)
            finally:
                release.set()
                stop.set()
                await asyncio.wait_for(run, 5)
                await agent.close()


async def test_a_call_hung_outside_any_one_gpu_marks_every_gpu_and_a_first_one_no_nvml(
        tmp_path: Path) -> None:
    """Hung in nvmlDeviceGetCount, which queries no one GPU: every GPU known is Unhealthy;
    hung in the first discovery, with none known yet: NVML unavailable (zero GPUs published)."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    assert inv.discover().healthy
    release = threading.Event()
    count = nvml.nvmlDeviceGetCount

    def hung() -> int:
        nvml.hung.set()
        release.wait()
        return count()

    nvml.nvmlDeviceGetCount = hung  # type: ignore[method-assign]
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB, inventory=inv)
    try:
        started = time.monotonic()
        got = await agent._discover()
        assert time.monotonic() - started < HUNG_S + 1
        assert [g.health for g in got.gpus] == ["Unhealthy", "Unhealthy"]
        assert got.available and not got.healthy
        # another discovery waits on the hung one; it starts no call of its own
        calls = nvml.calls
        assert not (await agent._discover()).healthy
        assert nvml.calls == calls
    finally:
        release.set()
    assert len((await agent._discover()).healthy) == 2
    assert agent._discovering is None

    fresh = Inventory(nvml)
    release.clear()
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB, inventory=fresh)
    try:
        got = await agent._discover()
        assert not got.available and "NVML call hung" in got.reason and not got.gpus
    finally:
        release.set()
    assert len((await agent._discover()).healthy) == 2


async def test_scrapes_audits_and_the_sampler_make_no_call_behind_a_hung_one(
        tmp_path: Path) -> None:
    """Once a call has run for HUNG_S, the inventory's other readers answer at once, without
    NVML: the scrape's figures none (health as ``last`` says), the process lists unreadable
    (the outside check then changes nothing), the utilisation samples none."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    release = threading.Event()
    nvml.devices[1].hang["nvmlDeviceGetMemoryInfo"] = release
    hung = asyncio.create_task(asyncio.to_thread(inv.sample))  # a scrape hangs in it
    try:
        await asyncio.to_thread(nvml.hung.wait, 5)
        calls = nvml.calls
        started = time.monotonic()
        # within the deadline a reader waits (a call may be slow, not hung)...
        samples = await asyncio.to_thread(inv.sample)
        assert HUNG_S * 0.8 < time.monotonic() - started < HUNG_S + 0.5
        assert inv.hung() is not None
        # ...past it, none does
        started = time.monotonic()
        processes = await asyncio.to_thread(inv.processes)
        utilisation = await asyncio.to_thread(inv.process_utilisation, {})
        assert time.monotonic() - started < 0.2
        assert nvml.calls == calls
        assert [(s.gpu.health, s.memory_used_bytes) for s in samples] == \
            [("Healthy", None), ("Unhealthy", None)]
        assert [(p.gpu.uuid, p.total_bytes, p.processes) for p in processes] == \
            [(g.uuid, None, None) for g in inv.last.gpus]
        assert utilisation == []
    finally:
        release.set()
        await hung
    # the GPU whose call hung is not offered as soon as it answers (test_gpu_health.py)
    assert inv.hung() is None
    assert [g.health for g in inv.discover().gpus] == ["Healthy", "Unhealthy"]
    assert all(s.memory_used_bytes is not None for s in inv.sample())


async def test_healthz_stays_ok_while_nvml_hangs(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart does not help a hung driver (its first NVML call hangs too, and a thread stuck
    in the driver may keep the old process from ending): the rounds go on, /healthz says ok."""
    from webhook.node import loop
    monkeypatch.setattr(loop, "STALL_MIN_S", 1.0)
    nvml = two_a100s()
    release = threading.Event()
    nvml.devices[0].hang["nvmlDeviceGetName"] = release
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name="", audit_interval=0),
                  LIB, inventory=Inventory(nvml))
    await agent.start()
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run(stop))
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.sleep(2.5)  # past the stall limit
            assert nvml.hung.is_set()
            status, text = await _get(session, agent.metrics_port, "/healthz")
            assert status == 200, text
            status, text = await _get(session, agent.metrics_port, "/metrics")
            assert "gpuslice_nvml_hung 1.0" in text
            assert "gpuslice_nvml_available 0.0" in text  # the first discovery hangs
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(run, 5)
        await agent.close()


def test_a_slow_discovery_of_many_gpus_is_not_judged_hung(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each GPU's calls answer within the deadline, all of them together take longer (a big node
    without persistence mode): nothing is hung, and no GPU is shown Unhealthy meanwhile."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    first = inv.discover()
    assert [g.healthy for g in first.gpus] == [True, True]
    uuid = nvml.nvmlDeviceGetUUID

    def slow_uuid(handle: int) -> str:
        time.sleep(HUNG_S * 0.7)
        return uuid(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceGetUUID", slow_uuid)
    seen: list[object] = []
    done = threading.Event()

    def discover() -> None:
        seen.append(inv.discover())
        done.set()

    thread = threading.Thread(target=discover)
    thread.start()
    time.sleep(HUNG_S * 1.15)  # inside the second GPU's calls, past the deadline from the first
    assert inv.hung() is None
    assert [g.healthy for g in inv.last.gpus] == [True, True]
    assert done.wait(5)
    thread.join()
    result = seen[0]
    assert isinstance(result, type(first)) and [g.healthy for g in result.gpus] == [True, True]


async def test_a_restarted_agent_whose_first_discovery_is_slow_withdraws_no_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent restarts (a rollout) on a node whose GPUs answer slowly (no persistence
    mode): each GPU's calls within the deadline, the first discovery longer than the round
    waits for it. The round published ``Inventory.last`` as it was then, "not discovered yet":
    NVML unavailable, so the node's GPUs were withdrawn (annotation empty, nothing
    allocatable) until the next round, an interval later. Now a round publishes no discovery
    it has not made."""
    monkeypatch.setattr(inventory_module, "HUNG_S", 1.0)
    nvml = FakeNvml([FakeDevice(f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-000000000000")
                     for i in range(4)])
    settings = _settings(tmp_path, interval=60.0)
    async with FakeKube() as kube:
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                  "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}})
        async with kube.api_client() as api:
            before = Agent(settings, LIB, inventory=Inventory(nvml), api_client=api)
            await before.step()
            assert len(_published(kube)) == 4 and _allocatable(kube) == "40"
            name = nvml.nvmlDeviceGetName

            def slow_name(handle: int) -> bytes:
                time.sleep(0.5)  # within the deadline; 2 s for the four
                return name(handle)

            monkeypatch.setattr(nvml, "nvmlDeviceGetName", slow_name)
            nvml.nvmlShutdown()
            agent = Agent(settings, LIB, inventory=Inventory(nvml), api_client=api)
            delay = await agent.step()
            assert (len(_published(kube)), _allocatable(kube)) == (4, "40"), \
                f"the first round of a restarted agent published {len(_published(kube))} " \
                f"GPUs, {_allocatable(kube)} allocatable, while its discovery was still running"
            assert delay < settings.interval  # the next round comes soon
            while agent._discovering is not None:
                delay = await agent.step()
            assert (len(_published(kube)), _allocatable(kube)) == (4, "40")
            assert delay == settings.interval


@pytest.mark.parametrize("caller", ["sample", "processes", "process_utilisation"])
def test_a_call_behind_a_slow_discovery_waits_for_it_not_only_one_gpus_deadline(
        monkeypatch: pytest.MonkeyPatch, caller: str) -> None:
    """A discovery of four slow GPUs (each within the deadline, all four past it: a big node
    without persistence mode) holds NVML; a scrape (an audit's process lists, the compute
    sampler's poll) asks meanwhile. It waited only until the deadline of the GPU being queried
    when it asked, then answered as behind a hung call (no figures; lists that cannot be read;
    no samples, which starts the compute check's coverage again), though nothing hung. Now it
    waits while the calls go on from GPU to GPU, and gives up only on a hung one."""
    monkeypatch.setattr(inventory_module, "HUNG_S", 1.0)
    nvml = FakeNvml([FakeDevice(f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-000000000000")
                     for i in range(4)])
    inv = Inventory(nvml)
    assert len(inv.discover().healthy) == 4
    name = nvml.nvmlDeviceGetName
    asked = threading.Event()

    def slow_name(handle: int) -> bytes:
        asked.set()
        time.sleep(0.5)  # within the deadline; 2 s for the four
        return name(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceGetName", slow_name)
    thread = threading.Thread(target=inv.discover)
    thread.start()
    try:
        assert asked.wait(5)
        started = time.monotonic()
        got = getattr(inv, caller)(*(({},) if caller == "process_utilisation" else ()))
        waited = time.monotonic() - started
    finally:
        thread.join()
    assert inv.hung() is None
    figures = {"sample": lambda: [s.memory_total_bytes is not None for s in got],
               "processes": lambda: [p.processes is not None for p in got],
               "process_utilisation": lambda: [u.samples is not None for u in got]}[caller]()
    assert figures == [True] * 4, \
        f"{caller} behind a slow discovery (nothing hung) gave up after {waited:.1f} s: " \
        f"figures {figures}"
