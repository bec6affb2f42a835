"""GPU discovery through (fake) NVML: identity, health, a node without driver or GPUs."""

from __future__ import annotations

import ctypes.util
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from node.fakenvml import FUNCTIONS, GIB, MIB, FakeDevice, FakeNvml, two_a100s

from webhook.node.inventory import HEALTHY, RECOVER_ROUNDS, UNHEALTHY, Gpu, Inventory


def test_discovers_uuid_index_product_memory_and_health() -> None:
    d = Inventory(two_a100s()).discover()
    assert d.available and d.driver_version == "550.54.15"
    assert d.gpus == (
        Gpu("GPU-00000000-0000-0000-0000-000000000000", 0, "NVIDIA A100-SXM4-80GB", 81920,
            HEALTHY),
        Gpu("GPU-11111111-1111-1111-1111-111111111111", 1, "NVIDIA A100-SXM4-80GB", 81920,
            HEALTHY),
    )
    assert d.gpus[0].to_json() == {"uuid": "GPU-00000000-0000-0000-0000-000000000000",
                                   "index": 0, "product": "NVIDIA A100-SXM4-80GB",
                                   "memoryMiB": 81920, "health": "Healthy"}


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
                                  pynvml.NVML_ERROR_LIBRARY_NOT_FOUND])
def test_missing_driver_is_reported_not_raised_and_init_is_retried(code: int) -> None:
    nvml = FakeNvml([FakeDevice("GPU-a")], init_error=code)
    inv = Inventory(nvml)
    d = inv.discover()
    assert not d.available and d.gpus == ()
    assert "not loaded" in d.reason or "not found" in d.reason
    assert inv.sample() == []
    nvml.init_error = None  # the driver finished loading
    d = inv.discover()
    assert d.available and [g.uuid for g in d.gpus] == ["GPU-a"]
    assert nvml.init_calls == 2


def test_missing_driver_is_logged_once_not_every_round(caplog: pytest.LogCaptureFixture) -> None:
    inv = Inventory(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    with caplog.at_level(logging.WARNING, logger="webhook.node.inventory"):
        for _ in range(3):
            inv.discover()
    assert len([r for r in caplog.records if "no usable NVIDIA driver" in r.message]) == 1


def test_zero_gpus_is_available_and_empty() -> None:
    d = Inventory(FakeNvml([])).discover()
    assert d.available and d.gpus == () and d.healthy == ()


def test_a_gpu_whose_queries_fail_is_unhealthy() -> None:
    nvml = two_a100s()
    nvml.devices[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    d = Inventory(nvml).discover()
    assert [g.health for g in d.gpus] == [HEALTHY, UNHEALTHY]
    assert [g.uuid for g in d.healthy] == ["GPU-00000000-0000-0000-0000-000000000000"]


def test_retired_pages_pending_or_failed_remap_is_unhealthy() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", retired_pending=True),
                     FakeDevice("GPU-b", remap_failure=True), FakeDevice("GPU-c")])
    assert [g.health for g in Inventory(nvml).discover().gpus] == [UNHEALTHY, UNHEALTHY,
                                                                    HEALTHY]


@pytest.mark.parametrize(("device", "says"), [
    (FakeDevice("GPU-a", mig=(1, 1)), "MIG mode is enabled"),
    (FakeDevice("GPU-a", compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
     "EXCLUSIVE_PROCESS (one process at a time"),
    (FakeDevice("GPU-a", compute_mode=pynvml.NVML_COMPUTEMODE_PROHIBITED), "PROHIBITED"),
    (FakeDevice("GPU-a", compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
     "EXCLUSIVE_THREAD"),
])
def test_a_gpu_pods_cannot_share_is_unhealthy_and_says_what_to_change(
        device: FakeDevice, says: str) -> None:
    # a pod placed on a MIG-mode GPU finds no CUDA device; on an exclusive one every pod after
    # the first fails to create its context: nothing may be placed there
    nvml = FakeNvml([FakeDevice("GPU-ok"), device])
    gpus = Inventory(nvml).discover().gpus
    assert [g.health for g in gpus] == [HEALTHY, UNHEALTHY]
    assert gpus[0].problem == ""
    assert says in gpus[1].problem and "nvidia-smi -i GPU-a " in gpus[1].problem
    assert "problem" not in gpus[1].to_json()  # the annotation's fields are DESIGN.md's


def test_an_exclusive_process_gpu_is_offered_where_the_operator_says_pods_reach_mps() -> None:
    devices = [FakeDevice("GPU-a", compute_mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
               FakeDevice("GPU-b", compute_mode=pynvml.NVML_COMPUTEMODE_PROHIBITED),
               FakeDevice("GPU-c", mig=(1, 1))]
    refused = Inventory(FakeNvml(devices)).discover().gpus
    assert "agent.offerExclusiveProcessGpus" in refused[0].problem
    offered = Inventory(FakeNvml(devices), offer_exclusive_process=True).discover().gpus
    # only that mode: the others stay unusable whatever serves the pods
    assert [g.health for g in offered] == [HEALTHY, UNHEALTHY, UNHEALTHY]


@pytest.mark.parametrize("mig", [None, (0, 0), (0, 1)])
def test_a_gpu_without_mig_or_with_mig_only_pending_is_healthy(
        mig: tuple[int, int] | None) -> None:
    # pending (enabled at the next reset) changes nothing yet: the next round after the reset
    # sees it enabled
    assert Inventory(FakeNvml([FakeDevice("GPU-a", mig=mig)])).discover().gpus[0].healthy


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED,
                                  pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_probes_a_gpu_or_driver_lacks_do_not_count_against_it(code: int) -> None:
    # nvmlDeviceGetRemappedRows came with driver 450; MIG with the A100
    dev = FakeDevice("GPU-a", fail={fn: code for fn in (
        "nvmlDeviceGetMigMode", "nvmlDeviceGetComputeMode",
        "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows")})
    assert Inventory(FakeNvml([dev])).discover().gpus[0].healthy


@pytest.mark.parametrize("fn", ["nvmlDeviceGetMigMode", "nvmlDeviceGetComputeMode"])
def test_a_failing_mode_query_is_unhealthy(fn: str) -> None:
    dev = FakeDevice("GPU-a", fail={fn: pynvml.NVML_ERROR_GPU_IS_LOST})
    gpu = Inventory(FakeNvml([dev])).discover().gpus[0]
    assert not gpu.healthy and "query failed" in gpu.problem


def test_an_unhealthy_gpu_is_logged_when_its_problem_changes_not_every_round(
        caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", mig=(1, 1))])
    inv = Inventory(nvml)
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")

    def logged() -> list[str]:
        got = [r.getMessage() for r in caplog.records if "GPU" in r.getMessage()
               and r.getMessage() != "GPUs discovered"]
        caplog.clear()
        return got

    for _ in range(3):
        inv.discover()
    assert logged() == ["GPU unhealthy; nothing is placed on it"]
    nvml.devices[0].compute_mode = pynvml.NVML_COMPUTEMODE_PROHIBITED
    inv.discover()
    assert logged() == []  # still MIG: the first problem found is the one told
    nvml.devices[0].mig = (0, 0)
    inv.discover()
    inv.discover()
    assert logged() == ["GPU unhealthy; nothing is placed on it"]  # now the compute mode
    nvml.devices[0].compute_mode = pynvml.NVML_COMPUTEMODE_DEFAULT
    for _ in range(RECOVER_ROUNDS - 1):
        assert not inv.discover().gpus[0].healthy  # passes: offered after RECOVER_ROUNDS
    assert logged() == []
    assert inv.discover().gpus[0].healthy
    inv.discover()
    assert logged() == ["GPU healthy again"]


def test_health_probes_a_gpu_does_not_support_do_not_count_against_it() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", name="NVIDIA GeForce RTX 4090",
                                health_probes_supported=False)])
    assert Inventory(nvml).discover().gpus[0].health == HEALTHY


def test_a_gpu_without_readable_uuid_is_left_out() -> None:
    nvml = two_a100s()
    nvml.devices[0].fail["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_UNKNOWN
    d = Inventory(nvml).discover()
    assert [(g.index, g.uuid) for g in d.gpus] == [(1, "GPU-11111111-1111-1111-1111-111111111111")]


def test_count_failure_reports_unavailable() -> None:
    nvml = two_a100s()
    nvml.count_error = pynvml.NVML_ERROR_UNKNOWN
    d = Inventory(nvml).discover()
    assert not d.available and "cannot count GPUs" in d.reason


def test_sample_reports_memory_and_utilisation_and_none_for_failed_queries() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.devices[1].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    s = inv.sample()
    assert [(x.memory_used_bytes, x.memory_total_bytes, x.utilization_percent) for x in s] == [
        (5 * GIB, 80 * GIB, 40), (1 * GIB, 80 * GIB, None)]


def test_default_inventory_calls_the_pynvml_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = two_a100s()
    for name in FUNCTIONS:
        monkeypatch.setattr(pynvml, name, getattr(fake, name))
    d = Inventory().discover()
    assert len(d.gpus) == 2 and fake.init_calls == 1


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has an NVIDIA driver")
def test_real_pynvml_without_driver_reports_library_not_found() -> None:
    d = Inventory().discover()
    assert not d.available and "NVML library not found" in d.reason


def test_an_unhealthy_gpu_keeps_its_last_known_product_and_memory() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.devices[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    gpu = inv.discover().gpus[1]
    assert (gpu.health, gpu.product, gpu.memory_mib) == (UNHEALTHY, "NVIDIA A100-SXM4-80GB",
                                                         81920)


def _r535_node() -> FakeNvml:
    """One GPU with compute, graphics and MPS client processes (some of which NVML cannot say
    the memory of), on a driver of the R535 branch."""
    nvml = FakeNvml([FakeDevice("GPU-00000000-0000-0000-0000-000000000000",
                                processes={101: 1 * GIB, 102: 2 * GIB, 103: None, 104: 4 * GIB,
                                           105: 5 * GIB},
                                graphics={201: 64 * MIB, 202: 96 * MIB, 101: 3 * GIB},
                                mps={301: 7 * GIB, 302: 8 * GIB})], driver="535.183.01")
    nvml.r535 = True
    return nvml


def test_the_process_lists_of_an_r535_driver_are_read_with_their_32_byte_entries() -> None:
    """R535/R545 drivers fill the ``_v3`` process lists with 32-byte entries; the pynvml we
    ship reads 24-byte ones: only every fourth item was a real entry, the others garbage (pid 0
    holding the next process's pid in bytes, pid 4294967295, a pid made of a memory figure), and
    about three processes in four went missing. The agent tells the driver by its exports and
    reads them."""
    nvml = _r535_node()
    inv = Inventory(nvml)
    inv.discover()
    (got,) = inv.processes()
    assert got.processes == {101: 3 * GIB, 102: 2 * GIB, 103: None, 104: 4 * GIB, 105: 5 * GIB,
                             201: 64 * MIB, 202: 96 * MIB, 301: 7 * GIB, 302: 8 * GIB}
    # a later driver (both exports, the default) is read through pynvml's calls as before (read
    # with 32-byte entries, its list would be garbage)
    nvml = _r535_node()
    nvml.r535 = False
    inv = Inventory(nvml)
    inv.discover()
    assert inv.processes()[0].processes == got.processes
    # without the _v3 symbols (none of the R535 branch lacks them) the _v2 lists are read
    nvml = _r535_node()
    nvml.absent = {f"nvmlDeviceGet{kind}RunningProcesses_v3"
                   for kind in ("Compute", "Graphics", "MPSCompute")}
    inv = Inventory(nvml)
    inv.discover()
    assert inv.processes()[0].processes == got.processes
    # a board without graphics processes (NOT_SUPPORTED) still lists the others
    nvml = _r535_node()
    nvml.devices[0].graphics_supported = False
    inv = Inventory(nvml)
    inv.discover()
    assert inv.processes()[0].processes == {101: 1 * GIB, 102: 2 * GIB, 103: None, 104: 4 * GIB,
                                            105: 5 * GIB, 301: 7 * GIB, 302: 8 * GIB}


def test_an_r535_list_that_grew_between_its_two_calls_is_asked_for_again() -> None:
    """The list is sized by a first call (twice as many entries and five more); processes
    that start before the second call and overflow that answer INSUFFICIENT_SIZE: asked again
    once, as the utilisation queries are. A failing list still fails the GPU's processes."""
    nvml = _r535_node()
    inv = Inventory(nvml)
    inv.discover()
    dev = nvml.devices[0]

    def start_twenty() -> None:
        dev.processes.update({1000 + i: (i + 1) * MIB for i in range(20)})

    nvml.between_calls = start_twenty
    got = inv.processes()[0].processes
    assert got is not None and len(got) == 5 + 20 + 4 and got[1019] == 20 * MIB
    dev.fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_UNKNOWN
    assert inv.processes()[0].processes is None


ROOT = Path(__file__).resolve().parents[2]
FAKE_BUILD = ROOT / "interposer" / "build"
_LIST = """
import json
from webhook.node.inventory import Inventory
inv = Inventory()
found = inv.discover()
assert found.available, found.reason
print(json.dumps(inv.processes()[0].processes))
"""


@pytest.fixture(scope="module")
def fake_machine() -> Path:
    """The C fakes of the interposer's tests: the driver, NVML (a later driver's and an R535
    one's) and the probe that holds memory on the fake GPU."""
    targets = ["build/fake/libcuda.so.1", "build/fake/libnvidia-ml.so.1",
               "build/fake/r535/libnvidia-ml.so.1", "build/tests/gsprobe"]
    proc = subprocess.run(["make", "-s", "-C", str(ROOT / "interposer"), *targets],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return FAKE_BUILD


@pytest.fixture
def holders(fake_machine: Path, tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[int, int]]]:
    """Five processes holding 100 to 500 MiB on the fake GPU (no interposer): the environment
    the fakes read, and host pid -> bytes held."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDA_", "GPUSLICE_", "FAKE_", "LD_"))}
    env.update(FAKE_CUDA_STATE=str(tmp_path / "state"),
               FAKE_CUDA_DEVICES="GPU-aaaaaaaa-0000-1111-2222-333333333333=16g",
               LD_LIBRARY_PATH=str(fake_machine / "fake"))
    procs = [subprocess.Popen([str(fake_machine / "tests" / "gsprobe"), "init", "ctx", "0",
                               "alloc", f"{n}00m", "touch", str(tmp_path / f"held{n}"),
                               "waitfile", str(tmp_path / "go")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for n in range(1, 6)]
    try:
        deadline = time.monotonic() + 20
        while not all((tmp_path / f"held{n}").exists() for n in range(1, 6)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        yield env, {p.pid: n * 100 * MIB for n, p in enumerate(procs, 1)}
    finally:
        (tmp_path / "go").touch()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.parametrize("nvml", ["r535", "."], ids=["r535", "later"])
def test_the_real_pynvml_on_an_r535_or_later_nvml_lists_every_process_right(
        holders: tuple[dict[str, str], dict[int, int]], nvml: str) -> None:
    """The ctypes layout itself, against the C fake NVML (the interposer's): the R535 build
    fills ``_v3`` with 32-byte entries and exports ConfComputeMemSizeInfo without
    RunningProcessDetailList; the default one is a later driver. The agent, with the real
    pynvml loading the fake as libnvidia-ml.so.1 (in a child process: pynvml loads the library
    once), lists the five processes with their memory on both: read with the other entry size,
    either list would be garbage past its first entry."""
    env, held = holders
    env = {**env, "LD_LIBRARY_PATH": str(FAKE_BUILD / "fake" / nvml)}
    proc = subprocess.run([sys.executable, "-c", _LIST], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {int(pid): used for pid, used in json.loads(proc.stdout).items()} == held


@pytest.mark.parametrize("lost_at", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName"])
def test_a_gpu_lost_mid_run_spares_the_others_and_comes_back_after_a_reset(lost_at: str) -> None:
    """GPU 1 falls off the bus between rounds: every query of it fails from ``lost_at`` on.
    It is left out (no handle) or unhealthy with its last size; GPU 0 stays healthy; sampling,
    process lists and utilisation go on for GPU 0; after a reset GPU 1 is healthy again, once
    it has passed RECOVER_ROUNDS discoveries in a row."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    dev = nvml.devices[1]
    for fn in FUNCTIONS:
        if fn.startswith("nvmlDevice") and (fn != "nvmlDeviceGetHandleByIndex"
                                             or lost_at == fn):
            dev.fail[fn] = pynvml.NVML_ERROR_GPU_IS_LOST
    if lost_at == "nvmlDeviceGetName":
        dev.fail.pop("nvmlDeviceGetUUID")  # the handle and UUID still read
    d = inv.discover()
    assert d.available and [g.uuid for g in d.healthy] == [nvml.devices[0].uuid]
    if lost_at == "nvmlDeviceGetHandleByIndex":
        assert [g.uuid for g in d.gpus] == [nvml.devices[0].uuid]
    else:
        assert [(g.health, g.memory_mib) for g in d.gpus] == [(HEALTHY, 81920),
                                                                 (UNHEALTHY, 81920)]
    samples = inv.sample()
    assert samples[0].memory_used_bytes == 5 * GIB
    assert all(s.memory_used_bytes is None for s in samples[1:])
    lists = inv.processes()
    assert lists[0].processes == {} and all(p.processes is None for p in lists[1:])
    inv.process_utilisation({})
    dev.fail.clear()  # nvidia-smi -r
    for _ in range(RECOVER_ROUNDS - 1):  # passes: offered once it has for RECOVER_ROUNDS
        d = inv.discover()
        assert [g.health for g in d.gpus] == [HEALTHY, UNHEALTHY]
        assert "recovering" in d.gpus[1].problem
    d = inv.discover()
    assert [g.health for g in d.gpus] == [HEALTHY, HEALTHY]


def test_a_gpu_that_cannot_be_addressed_is_logged_once_not_every_round(
        caplog: pytest.LogCaptureFixture) -> None:
    """A GPU fallen off the bus stays so until the node is serviced (days): it was warned
    about every round (every 30 s), unlike every other GPU problem."""
    nvml = two_a100s()
    nvml.devices[1].fail["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_GPU_IS_LOST
    inv = Inventory(nvml)
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")

    def logged() -> list[str]:
        got = [r.getMessage() for r in caplog.records if "address" in r.getMessage()]
        caplog.clear()
        return got

    for _ in range(5):
        inv.discover()
    assert logged() == ["GPU cannot be addressed; left out"]
    del nvml.devices[1].fail["nvmlDeviceGetHandleByIndex"]  # reset
    inv.discover()
    assert logged() == ["GPU can be addressed again"]
    nvml.devices[1].fail["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_GPU_IS_LOST
    inv.discover()
    inv.discover()
    assert logged() == ["GPU cannot be addressed; left out"]  # lost again: told again


def test_an_index_the_driver_no_longer_lists_is_forgotten_with_its_addressing_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    """GPU 1 could not be addressed, then the driver listed one GPU only (the board taken out).
    A GPU at index 1 later is a new board: healthy at once and not "addressed again" (kept, the
    index made the new board serve a recovery that was never its own)."""
    nvml = two_a100s()
    nvml.devices[1].fail["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_GPU_IS_LOST
    inv = Inventory(nvml)
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    assert [g.uuid for g in inv.discover().gpus] == [nvml.devices[0].uuid]
    nvml.devices.pop()
    inv.discover()
    nvml.devices.append(FakeDevice("GPU-33333333-3333-3333-3333-333333333333"))
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    assert "GPU can be addressed again" not in [r.getMessage() for r in caplog.records]


def test_a_hang_is_told_once_when_it_is_first_seen_and_a_node_without_gpus_is_unavailable_meanwhile(
        caplog: pytest.LogCaptureFixture) -> None:
    """The hang's bookkeeping without a thread stuck in NVML: the call running is made to look
    HUNG_S old. Its first sighting warns (once); a discovery that found no GPU cannot mark one
    of them, so NVML counts as unavailable while the call hangs."""
    import time

    from webhook.node import inventory as inventory_module
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    inv = Inventory(FakeNvml([]))
    found = inv.discover()
    assert found.available and found.gpus == ()
    assert "NVML answers again" not in caplog.text  # nothing hung before
    inv._busy_since = time.monotonic() - inventory_module.HUNG_S - 1
    assert inv.hung() is not None and inv.hung() is not None
    told = ("NVML call hung (a GPU fallen off the bus?): the GPU it queries is published "
            "Unhealthy, and no NVML call is made until it returns")
    assert [r.getMessage() for r in caplog.records if "hung" in r.getMessage()] == [told]
    last = inv.last
    assert not last.available and last.reason == inventory_module.HUNG_PROBLEM
    inv._busy_since = None
    assert inv.hung() is None and inv.last.available


def test_a_call_that_hung_outside_a_discovery_and_answered_leaves_its_gpu_unhealthy_then_recovering(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape's call to GPU 1 ran HUNG_S and answered: the next discovery finds GPU 1 Unhealthy
    (as it was published while hung), and it recovers as any other. The hang's bookkeeping is
    reset when the calls end: a second hang is told again. ``time.monotonic`` is held still."""
    from webhook.node import inventory as inventory_module
    now = [500.0]
    monkeypatch.setattr(inventory_module.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    inv = Inventory(two_a100s())
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    for _ in range(2):
        with inv._calling() as held:
            assert held
            inv._query(1)
            now[0] += inventory_module.HUNG_S  # exactly HUNG_S: hung
            assert inv.hung() == inventory_module.HUNG_S
        assert inv.hung() is None
    told = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert [m.split(" (")[0].split(":")[0] for m in told] == [
        "NVML call hung", "NVML answers again", "NVML call hung", "NVML answers again"]
    d = inv.discover()
    assert [g.health for g in d.gpus] == [HEALTHY, UNHEALTHY]
    assert "its NVML calls hung" in d.gpus[1].problem
    for _ in range(RECOVER_ROUNDS - 1):
        assert inv.discover().gpus[1].problem.startswith("recovering: its NVML calls hung")
    assert inv.discover().gpus[1].health == HEALTHY
    # the calls turn from GPU 0, whose call hung and answered, to GPU 1: GPU 0's hang is noted
    # as they turn (the time counts from the turn, per GPU)
    with inv._calling():
        inv._query(0)
        now[0] += inventory_module.HUNG_S
        inv._query(1)
    assert [g.health for g in inv.discover().gpus] == [UNHEALTHY, HEALTHY]


def test_discovered_says_whether_a_discovery_has_ended_whatever_it_found() -> None:
    """The agent's rounds read it: behind a slow first discovery, ``last`` is a placeholder
    (the round publishes nothing); behind a later one, the last discovery stands."""
    nvml = two_a100s()
    inv = Inventory(nvml)
    assert not inv.discovered and inv.last.reason == "not discovered yet"
    nvml.count_error = pynvml.NVML_ERROR_UNKNOWN
    assert not inv.discover().available
    assert inv.discovered  # ended, NVML unavailable: NVML's word, not a placeholder
    nvml.count_error = None
    assert inv.discover().available and inv.discovered


def test_close_shuts_nvml_down_and_later_samples_ask_nothing_of_it() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    assert [s.memory_total_bytes for s in inv.sample()] == [80 * GIB, 80 * GIB]
    assert inv.close() is True and not nvml.initialised
    calls = nvml.calls
    assert inv.sample() == [] and inv.process_utilisation({}) == []
    assert nvml.calls == calls


def test_close_gives_up_after_its_timeout_while_a_call_holds_nvml() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    with inv._calling() as held:  # a call running (as one hung on a GPU would)
        assert held
        assert inv.close(timeout=0.05) is False
        assert nvml.initialised  # left as it is
    assert inv.close(timeout=0.05) is True and not nvml.initialised


def test_a_gpu_that_cannot_be_addressed_when_sampled_is_listed_without_figures() -> None:
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    nvml.devices[1].fail["nvmlDeviceGetHandleByIndex"] = pynvml.NVML_ERROR_GPU_IS_LOST
    got = inv.sample()
    assert [(s.gpu.index, s.memory_used_bytes, s.memory_total_bytes, s.utilization_percent)
            for s in got][1] == (1, None, None, None)
    assert got[0].memory_total_bytes == 80 * GIB


def test_a_failing_xid_event_wait_is_told_once_per_distinct_error(
        caplog: pytest.LogCaptureFixture) -> None:
    inv = Inventory(two_a100s())
    inv.discover()
    assert inv._events is not None
    caplog.set_level(logging.INFO, logger="webhook.node.inventory")
    inv._events.freed = True  # every wait now fails (NVML_ERROR_INVALID_ARGUMENT)
    for _ in range(3):
        assert [g.health for g in inv.discover().gpus] == [HEALTHY, HEALTHY]
    assert [r.getMessage() for r in caplog.records if "XID" in r.getMessage()] == [
        "reading XID events failed; tried again next round"]


def test_a_driver_whose_exports_cannot_be_told_is_read_as_a_later_one() -> None:
    """The lookup of R550's export fails with an error other than "not found": which branch the
    driver is cannot be told, so its lists are read as pynvml reads them (read with 32-byte
    entries, a later driver's list is garbage), and it is asked again next time."""
    nvml = _r535_node()
    nvml.r535 = False
    real = nvml._nvmlGetFunctionPointer

    def lookup(name: str) -> object:
        if name == "nvmlDeviceGetRunningProcessDetailList":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return real(name)

    nvml._nvmlGetFunctionPointer = lookup  # type: ignore[method-assign]
    inv = Inventory(nvml)
    inv.discover()
    assert inv.processes()[0].processes == {
        101: 3 * GIB, 102: 2 * GIB, 103: None, 104: 4 * GIB, 105: 5 * GIB, 201: 64 * MIB,
        202: 96 * MIB, 301: 7 * GIB, 302: 8 * GIB}
    assert inv._r535 is None  # not decided: asked again


def test_a_utilisation_query_that_hung_and_answered_is_pinned_on_its_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The outside compute check's queries run GPU by GPU, each noted as the one queried: GPU 1's
    sample query ran HUNG_S and answered, and the next discovery finds GPU 1 (only) Unhealthy."""
    from webhook.node import inventory as inventory_module
    now = [100.0]
    monkeypatch.setattr(inventory_module.time, "monotonic", lambda: now[0])
    nvml = two_a100s()
    inv = Inventory(nvml)
    inv.discover()
    real = nvml.nvmlDeviceGetSamples

    def slow_on_gpu1(handle: int, kind: int, since: int) -> object:
        if handle == 1:
            now[0] += inventory_module.HUNG_S
        return real(handle, kind, since)

    monkeypatch.setattr(nvml, "nvmlDeviceGetSamples", slow_on_gpu1)
    assert len(inv.process_utilisation({})) == 2
    assert [g.health for g in inv.discover().gpus] == [HEALTHY, UNHEALTHY]
