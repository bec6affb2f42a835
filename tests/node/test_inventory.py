"""GPU discovery through (fake) NVML: identity, health, a node without driver or GPUs."""

from __future__ import annotations

import ctypes.util
import logging

import pynvml
import pytest
from node.fakenvml import FUNCTIONS, GIB, FakeDevice, FakeNvml, two_a100s

from webhook.node.inventory import HEALTHY, UNHEALTHY, Gpu, Inventory


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
    inv.discover()
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
