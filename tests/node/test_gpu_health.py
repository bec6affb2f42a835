"""A GPU's health over the agent's rounds: a GPU whose health flaps is not offered on its
healthy rounds, and one that reported a critical XID error stays unhealthy."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from fakekube import FakeKube
from node.fakenvml import FakeDevice, two_a100s
from node.test_shutdown import _settings as shutdown_settings
from prometheus_client import generate_latest

from webhook import names
from webhook.node import inventory as inventory_module
from webhook.node.config import AgentSettings
from webhook.node.inventory import (
    APPLICATION_XIDS,
    DEPARTED_KEPT,
    HEALTHY,
    HUNG_PROBLEM,
    RECOVER_ROUNDS,
    UNHEALTHY,
    Inventory,
)
from webhook.node.loop import Agent, Backoff

NODE = "gpu-node-1"
LIB = b"\x7fELF" + b"interposer" * 50
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def _settings(tmp_path: Path, **kw: object) -> AgentSettings:
    return shutdown_settings(tmp_path, **{"audit_interval": 0, **kw})


def _node(kube: FakeKube) -> None:
    kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
              "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}})


class _Clock:
    """The inventory module's monotonic clock, moved on by the test (``advance``) as the
    agent's waits between rounds would."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = 0.0
        monkeypatch.setattr(inventory_module, "time", SimpleNamespace(
            monotonic=lambda: time.monotonic() + self.offset, time=time.time))

    def now(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def _published(kube: FakeKube) -> dict[str, str]:
    node = kube.get("nodes", NODE) or {}
    gpus = json.loads(node.get("metadata", {}).get("annotations", {}).get(
        names.ANN_NODE_GPUS) or "[]")
    return {g["uuid"]: g["health"] for g in gpus}


@pytest.mark.parametrize("flaky", ["nvmlDeviceGetRemappedRows", "nvmlDeviceGetHandleByIndex"])
async def test_a_flapping_gpu_is_not_offered_on_its_healthy_rounds(
        tmp_path: Path, flaky: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 1's health probe (or its handle: then it is left out) fails every other round (a
    flaky board, a failing riser). Each flip was two node patches (annotation, resources), and
    the scheduler placed pods on it in every round it passed; now it stays Unhealthy until it
    has passed RECOVER_ROUNDS rounds in a row, so its resources are patched once; once it is
    steady, it is offered again (at its RECOVER_ROUNDS-th round at the interval)."""
    clock = _Clock(monkeypatch)
    nvml = two_a100s()
    async with FakeKube() as kube:
        _node(kube)
        async with kube.api_client() as api:
            agent = Agent(_settings(tmp_path), LIB, inventory=Inventory(nvml), api_client=api)

            async def step() -> None:
                clock.advance(await agent.step())  # (the wait for the next round)

            await step()
            assert _published(kube)[GPU1] == HEALTHY
            kube.requests.clear()
            offered = 0
            rounds = 11
            for n in range(rounds):
                if n % 2 == 0:  # fails in this round's discovery, passes in the next
                    nvml.devices[1].fail_once[flaky] = pynvml.NVML_ERROR_UNKNOWN
                await step()
                offered += _published(kube).get(GPU1) == HEALTHY
            patches = len(kube.requests_to("PATCH", f"/nodes/{NODE}"))
            resources = len(kube.requests_to("PATCH", f"/nodes/{NODE}/status$"))
            assert (offered, resources) == (0, 1), \
                f"flapping GPU offered in {offered} of {rounds} rounds, {patches} node " \
                f"patches ({resources} of the resources)"
            if flaky != "nvmlDeviceGetHandleByIndex":  # (left out, then listed Unhealthy)
                assert patches == 2
            # steady again: offered after RECOVER_ROUNDS healthy rounds in a row, not before
            states = []
            for _ in range(RECOVER_ROUNDS + 1):
                await step()
                states.append(_published(kube)[GPU1])
            assert states == [UNHEALTHY] * (RECOVER_ROUNDS - 1) + [HEALTHY] * 2


def test_a_gpu_the_driver_stops_listing_is_judged_as_before_when_it_is_back() -> None:
    """GPU 1 went Unhealthy, then the driver stopped listing it for a while: back and passing
    its checks, it is still recovering (Unhealthy), as before it went. What the inventory keeps
    of GPUs gone is bounded, though: once more than DEPARTED_KEPT are remembered (boards
    replaced one after another at index 1), it goes, and GPU 1 back is as a GPU never seen
    (`test_longrun.py -k replaced`: an entry per board ever seen was kept)."""
    nvml = two_a100s()
    inv = Inventory(nvml)

    def health() -> dict[str, str]:
        return {g.uuid: g.health for g in inv.discover().gpus}

    gpu1 = nvml.devices[1]
    for forgotten in (False, True):
        gpu1.retired_pending = True
        assert health()[GPU1] == UNHEALTHY
        nvml.devices.pop()
        assert GPU1 not in health()
        if forgotten:
            for i in range(DEPARTED_KEPT + 1):
                nvml.devices[1:] = [FakeDevice(f"GPU-{i:08d}-2222-2222-2222-222222222222")]
                health()
            nvml.devices.pop()
        gpu1.retired_pending = False
        nvml.devices.append(gpu1)
        assert health()[GPU1] == (HEALTHY if forgotten else UNHEALTHY)


async def test_a_recovering_gpu_is_offered_no_sooner_than_documented_when_rounds_back_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 1 fails a probe once during an API outage: the agent's rounds back off from 1 s
    (1, 2, 4 s...), so it passed its RECOVER_ROUNDS clean rounds 6 s after the first and was
    offered (at the next publish), where the documentation says about 2 minutes (its third
    clean round at the default interval): a GPU flapping every few seconds was offered as
    often. Now it also needs (RECOVER_ROUNDS - 1) intervals since its first clean round."""
    clock = _Clock(monkeypatch)
    nvml = two_a100s()
    settings = _settings(tmp_path, interval=60.0)
    async with FakeKube() as kube:
        _node(kube)
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(nvml), api_client=api)
            agent.backoff = Backoff(cap=settings.interval, rng=lambda: 1.0)
            assert await agent.step() == settings.interval
            kube.down = True
            nvml.devices[1].fail_once["nvmlDeviceGetRemappedRows"] = pynvml.NVML_ERROR_UNKNOWN
            delay = await agent.step()
            assert not agent.inventory.last.gpus[1].healthy
            first_clean, rounds = 0.0, []
            while len(rounds) < 20:
                clock.advance(delay)
                delay = await agent.step()
                first_clean = first_clean or clock.now()
                rounds.append(clock.now() - first_clean)
                if agent.inventory.last.gpus[1].healthy:
                    break
            offered_after = rounds[-1]
            assert len(rounds) >= RECOVER_ROUNDS
            assert offered_after >= (RECOVER_ROUNDS - 1) * settings.interval, \
                f"offered {offered_after:.0f} s after its first clean round (rounds at " \
                f"{[round(r) for r in rounds]} s), documented: about " \
                f"{(RECOVER_ROUNDS - 1) * settings.interval:.0f} s"


# ----- critical XID errors -----

def _told(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_critical_xid_makes_its_gpu_unhealthy_until_the_agent_restarts(
        caplog: pytest.LogCaptureFixture) -> None:
    """GPU 1 reports XID 79 (fallen off the bus) while its queries still answer: it was
    published Healthy round after round (new pods placed on it). Now it is Unhealthy from the
    next discovery on, naming the XID, told once, and stays so (as NVIDIA's device plugin: the
    GPU needs a reset, which NVML does not show) until the agent restarts. The events are read
    without waiting (a timeout of 0 ms)."""
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    nvml = two_a100s()
    inv = Inventory(nvml)
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    assert nvml.xid(1, 79) == 1, "the GPUs were not registered for XID events"
    gpus = inv.discover().gpus
    assert [g.health for g in gpus] == [HEALTHY, UNHEALTHY], "a critical XID went unnoticed"
    assert "XID 79" in gpus[1].problem and "fallen off the bus" in gpus[1].problem
    nvml.xid(1, 79)  # the driver repeats it
    nvml.xid(1, 48)
    for _ in range(RECOVER_ROUNDS + 2):  # its queries pass: it stays Unhealthy
        gpus = inv.discover().gpus
        assert [g.health for g in gpus] == [HEALTHY, UNHEALTHY]
        assert "XID 79" in gpus[1].problem
    assert _told(caplog, "GPU unhealthy") == 1
    assert _told(caplog, "critical XID") == 1  # the 48 that came after, once
    assert nvml.waits and set(nvml.waits) == {0}, "a discovery waited for XID events"
    # the agent restarts (after the GPU's reset)
    again = Inventory(nvml)
    assert [g.health for g in again.discover().gpus] == [HEALTHY, HEALTHY]


class _OtherHandle(int):
    """A handle to the same GPU that is not the same object, nor equal to NVML's."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


@pytest.mark.parametrize("lost", [False, True])
def test_an_xid_whose_handle_is_not_the_registered_one_is_told_by_its_uuid(
        lost: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The event's device handle is not the one registered: its GPU is found by its UUID, or,
    where that cannot be read, no GPU is marked (told once)."""
    nvml = two_a100s()
    nvml.event_handle = _OtherHandle
    inv = Inventory(nvml)
    inv.discover()
    nvml.xid(1, 79)
    if lost:
        nvml.devices[1].fail_once["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_GPU_IS_LOST
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY if lost else UNHEALTHY]
    assert _told(caplog, "GPU that cannot be told") == lost


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_do_not_count_against_the_gpu(xid: int) -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.xid(0, xid)
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]


def test_the_operator_skips_more_xids_or_turns_the_check_off() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml, skip_xids={48, 63})
    inv.discover()
    nvml.xid(0, 48)
    nvml.xid(1, 63)
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    nvml.xid(1, 94)
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, UNHEALTHY]
    off = two_a100s()
    inv = Inventory(off, xid_check=False)
    inv.discover()
    assert off.xid(1, 79) == 0 and off.event_sets == [] and off.waits == []
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]


@pytest.mark.parametrize("lacks", ["driver", "set", "supported", "register", "types"])
def test_a_gpu_or_driver_without_xid_events_is_not_held_against(
        lacks: str, caplog: pytest.LogCaptureFixture) -> None:
    """A driver without the event calls, or a GPU that cannot report XIDs (NOT_SUPPORTED):
    healthy as before, told once."""
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    nvml = two_a100s()
    dev = nvml.devices[1]
    if lacks == "driver":
        nvml.absent.add("nvmlEventSetCreate")
    elif lacks == "set":
        nvml.absent.add("nvmlEventSetWait_v2")
    elif lacks == "supported":
        dev.fail["nvmlDeviceGetSupportedEventTypes"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    elif lacks == "register":
        dev.fail["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    else:
        dev.event_types = pynvml.nvmlEventTypePState
    inv = Inventory(nvml)
    for _ in range(3):
        assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    assert _told(caplog, "XID") == 1, [r.getMessage() for r in caplog.records]
    if lacks in ("supported", "register", "types"):  # the other GPU is still watched
        nvml.xid(0, 79)
        assert [g.health for g in inv.discover().gpus] == [UNHEALTHY, HEALTHY]


def test_xid_events_are_read_again_after_nvml_is_initialised_again() -> None:
    """The driver unloaded (NVML shut down: its event set freed) and loaded again: the GPUs
    are registered again in a new set."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.count_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert not inv.discover().available
    assert [s.freed for s in nvml.event_sets] == [True]
    nvml.count_error = None
    inv.discover()
    assert nvml.xid(1, 95) == 1
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, UNHEALTHY]


async def test_a_hung_xid_read_is_judged_hung_like_any_nvml_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The event read queries no one GPU: hung, every GPU is Unhealthy until it returns."""
    monkeypatch.setattr(inventory_module, "HUNG_S", 0.3)
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.wait_hang = release = threading.Event()
    hung = asyncio.create_task(asyncio.to_thread(inv.discover))
    try:
        await asyncio.to_thread(nvml.hung.wait, 5)
        await asyncio.sleep(0.5)
        assert [g.problem for g in inv.last.gpus] == [HUNG_PROBLEM] * 2
    finally:
        nvml.wait_hang = None
        release.set()
        await hung
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]


async def test_a_critical_xid_is_published_and_exported(tmp_path: Path) -> None:
    nvml = two_a100s()
    async with FakeKube() as kube:
        _node(kube)
        async with kube.api_client() as api:
            agent = Agent(_settings(tmp_path), LIB, inventory=Inventory(nvml), api_client=api)
            await agent.step()
            nvml.xid(1, 48)
            await agent.step()
            assert _published(kube) == {nvml.devices[0].uuid: HEALTHY, GPU1: UNHEALTHY}
            node = kube.get("nodes", NODE) or {}
            assert node["status"]["allocatable"]["nvidia.com/gpu"] == "10"
    text = generate_latest(agent.registry).decode()
    (line,) = [x for x in text.splitlines()
               if x.startswith("gpuslice_gpu_unhealthy_reason{") and GPU1 in x]
    assert "XID 48" in line and "double-bit ECC" in line and line.endswith(" 1.0")


def test_the_agent_passes_its_xid_settings_to_its_inventory(tmp_path: Path) -> None:
    agent = Agent(_settings(tmp_path, skip_xids=(48, 79)), LIB)
    assert agent.inventory._xid_skip == APPLICATION_XIDS | {48, 79}
    agent = Agent(_settings(tmp_path, xid_check=False), LIB)
    assert agent.inventory._xid_skip is None


async def test_a_gpu_whose_calls_hung_is_not_offered_as_soon_as_they_return(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 1's health probe hangs past HUNG_S, then returns (a GPU dropping off the bus now
    and then): while it hangs the GPU is Unhealthy (``last``), but the discovery it held up
    ended with it Healthy, so a GPU hanging every other round was offered every other round.
    Now that discovery finds it Unhealthy, and it is offered after RECOVER_ROUNDS more."""
    monkeypatch.setattr(inventory_module, "HUNG_S", 0.3)
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    release = threading.Event()
    nvml.devices[1].hang["nvmlDeviceGetRemappedRows"] = release
    held = asyncio.create_task(asyncio.to_thread(inv.discover))
    try:
        await asyncio.to_thread(nvml.hung.wait, 5)
        await asyncio.sleep(0.5)
        assert [g.health for g in inv.last.gpus] == [HEALTHY, UNHEALTHY]
    finally:
        del nvml.devices[1].hang["nvmlDeviceGetRemappedRows"]
        release.set()
        ended = await held
    assert [g.health for g in ended.gpus] == [HEALTHY, UNHEALTHY], \
        "the discovery a hung call held up offered the GPU as soon as the call returned"
    assert "hung" in ended.gpus[1].problem
    for _ in range(RECOVER_ROUNDS - 1):
        assert [g.health for g in inv.discover().gpus] == [HEALTHY, UNHEALTHY]
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]


@pytest.mark.parametrize("caller", ["sample", "processes"])
async def test_a_gpu_whose_scrape_or_audit_call_hung_is_not_offered_as_soon_as_it_returns(
        monkeypatch: pytest.MonkeyPatch, caller: str) -> None:
    """GPU 1 hangs past HUNG_S in a call of the metrics scrape (or the audit's process lists),
    not of a discovery: the agent's discovery meanwhile found it Unhealthy (``last``), and the
    one after the call returned found it Healthy, so a GPU hanging in every other scrape was
    offered every other round. Now it recovers as from any other problem."""
    monkeypatch.setattr(inventory_module, "HUNG_S", 0.3)
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    fn = ("nvmlDeviceGetUtilizationRates" if caller == "sample"
          else "nvmlDeviceGetComputeRunningProcesses")
    release = threading.Event()
    nvml.devices[1].hang[fn] = release
    held = asyncio.create_task(asyncio.to_thread(getattr(inv, caller)))
    try:
        await asyncio.to_thread(nvml.hung.wait, 5)
        await asyncio.sleep(0.5)
        during = await asyncio.to_thread(inv.discover)
        assert [g.health for g in during.gpus] == [HEALTHY, UNHEALTHY]
    finally:
        del nvml.devices[1].hang[fn]
        release.set()
        await held
    rounds = [[g.health for g in inv.discover().gpus] for _ in range(RECOVER_ROUNDS + 1)]
    assert rounds == [[HEALTHY, UNHEALTHY]] * RECOVER_ROUNDS + [[HEALTHY, HEALTHY]], \
        "a GPU whose call hung outside a discovery was offered as soon as the call returned"


def test_an_event_set_that_could_not_be_made_once_is_made_at_the_next_discovery(
        caplog: pytest.LogCaptureFixture) -> None:
    """nvmlEventSetCreate fails once with an error other than NOT_SUPPORTED (UNKNOWN: out of
    file descriptors, say). It was taken as a driver without XID events: no GPU was checked for
    them until NVML was initialised again (in practice the agent's restart), a GPU reporting
    XID 79 published Healthy. Now it is tried again, as a failed registration is."""
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    nvml = two_a100s()
    make = nvml.nvmlEventSetCreate
    failures = [pynvml.NVML_ERROR_UNKNOWN]

    def flaky() -> object:
        if failures:
            raise pynvml.NVMLError(failures.pop())
        return make()

    nvml.nvmlEventSetCreate = flaky  # type: ignore[method-assign]
    inv = Inventory(nvml)
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    inv.discover()
    assert nvml.xid(1, 79) == 1, "the GPUs were never registered for XID events"
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, UNHEALTHY]
    assert _told(caplog, "reports no XID events") == 0


def test_what_is_kept_of_gpus_gone_goes_only_past_the_bound_and_goes_whole() -> None:
    """GPU 1 (Unhealthy) went, then DEPARTED_KEPT other boards came and went at index 1, the
    last still there: with GPU 1, DEPARTED_KEPT GPUs gone at once, all kept. One board more and
    everything kept of the GPUs gone goes: size, problem and recovery alike, and GPU 1 back is
    as a GPU never seen."""
    boards = DEPARTED_KEPT
    nvml = two_a100s()
    inv = Inventory(nvml)

    def health() -> dict[str, str]:
        return {g.uuid: g.health for g in inv.discover().gpus}

    gpu1 = nvml.devices[1]
    gpu1.retired_pending = True
    assert health()[GPU1] == UNHEALTHY
    assert GPU1 in inv._known and GPU1 in inv._problems
    nvml.devices.pop()
    gpu1.retired_pending = False
    for extra in (False, True):
        for i in range(boards if not extra else 1):
            nvml.devices[1:] = [FakeDevice(f"GPU-{i + 100 * extra:08d}-2222-2222-2222-222222222222")]
            health()
        if not extra:
            assert GPU1 in inv._known and GPU1 in inv._problems  # DEPARTED_KEPT at most: kept
    gone = {GPU1, *(f"GPU-{i:08d}-2222-2222-2222-222222222222" for i in range(boards))}
    kept = gone & (inv._known.keys() | inv._problems.keys() | inv._recovering.keys())
    assert kept == set()
    nvml.devices[1:] = [gpu1]
    assert health()[GPU1] == HEALTHY  # back as a GPU never seen


def test_a_recovering_gpu_is_offered_at_its_third_clean_round_exactly_recover_s_after_its_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds of the recovery, with the inventory's clock held still between rounds: the
    third clean round at exactly ``recover_s`` after the first offers the GPU; a moment
    earlier it does not. Without a least time, the problem says nothing of one."""
    now = [1000.0]
    monkeypatch.setattr(inventory_module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                                  time=time.time))
    for recover_s in (60.0, 0.0):
        nvml = two_a100s()
        inv = Inventory(nvml, recover_s=recover_s)
        nvml.devices[1].retired_pending = True
        assert inv.discover().gpus[1].health == UNHEALTHY
        nvml.devices[1].retired_pending = False
        problems = []
        for step in (0.0, recover_s / 2, max(0.0, recover_s / 2 - 0.5)):  # the third: 0.5 s short
            now[0] += step
            problems.append(inv.discover().gpus[1].problem)
        assert all(p.startswith("recovering: ") for p in problems[:2]), problems
        assert (" and for " in problems[0]) == bool(recover_s), problems[0]
        assert (" and for 60 s" in problems[0]) == bool(recover_s), problems[0]
        if recover_s:
            assert problems[2].startswith("recovering: ")
            now[0] += 0.5
            assert inv.discover().gpus[1].health == HEALTHY  # exactly recover_s: offered
        else:
            assert problems[2] == ""  # three clean rounds, no least time


def test_a_gpu_is_told_unhealthy_once_and_healthy_again_in_the_round_that_offers_it(
        caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")

    def told() -> list[str]:
        got = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU ")]
        caplog.clear()
        return got

    inv.discover()
    assert told() == []
    nvml.devices[1].retired_pending = True
    for _ in range(3):
        assert inv.discover().gpus[1].health == UNHEALTHY
    assert told() == ["GPU unhealthy; nothing is placed on it"]
    nvml.devices[1].retired_pending = False
    for _ in range(RECOVER_ROUNDS - 1):
        assert inv.discover().gpus[1].health == UNHEALTHY
        assert told() == []
    assert inv.discover().gpus[1].health == HEALTHY
    assert told() == ["GPU healthy again"]
    inv.discover()
    assert told() == []
