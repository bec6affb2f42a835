"""Fixtures of the real-GPU checks (opt-in with ``--gpu``; run by scripts/gpu-check.sh).

Session fixtures: the real NVML (skips every test where there is no NVIDIA GPU), the built
interposer, the ``gpubench`` driver-API tool compiled here with gcc, and the shared fill
runs. Each test's outcome goes to the results file so that the summary can give a failing
check its reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gpu import gpubench as bench
from gpu import harness
from gpu.compute import matmul
from gpu.fills import Fills
from gpu.nvmlwatch import Nvml

# The order the checks run in, so that a run cut short by its time budget (285 s, for checks
# estimated from the last H200 runs' timings at 280-330 s) loses the least: the issue's bar first
# (memory, views, processes, the outside usage summed over every capped run before it, the
# launch and alloc+free costs, the SM limits, the tiny-op cost), then the node agent's NVML
# calls (test_agent.py: a second or two, not issue 3's, never run on a GPU before), then the
# stream-ordered pool rows (two gpubench runs, a few seconds, whose growth figure decides the
# library's GS_POOL_CHUNK), then the other rows, the newest last (PyTorch expandable segments, a busy co-tenant). A test takes the rank
# of the first entry its node id starts with ("file" or "file::test"); ties keep the files'
# order.
ORDER = ("test_memory.py::test_largest_allocation_within_context_footprint_of_cap",
         "test_memory.py::test_torch_oom_is_catchable_and_frees_return_the_budget",
         "test_views.py", "test_processes.py", "test_usage.py", "test_overhead.py",
         "test_compute.py::test_sm_limit_caps_matmul_throughput",
         "test_compute.py::test_torch_tiny_ops_with_library_unlimited_within_5_percent",
         "test_agent.py", "test_pool.py", "test_memory.py",
         # new on 2026-12-07: a launch that grows the stack near the cap (lmem.c; two gpubench
         # runs, a PTX JIT and a second or so each), beside the other memory rows
         "test_stack.py",
         "test_compute.py::test_sm_limit_time_mode_for_comparison",
         "test_compute.py::test_sm_limit_holds_beside_a_capture_held_open",
         "test_vmm.py::test_largest_allocation_with_expandable_segments", "test_cotenant.py",
         # new on 2026-12-04 (the copy hooks): after the rows that have waited two runs for a
         # figure (the co-tenant correction above all), so that a budget cut leaves it for the
         # second call the summary prints
         "test_compute.py::test_sm_limit_excludes_copies_between_kernels", "test_compute.py",
         # new on 2026-12-05: what NVML counts of an imported VMM handle, and whether memsets
         # take SM time (a few seconds each)
         "test_vmm.py", "test_memset.py",
         # new on 2026-12-07: what the driver takes for BC1, BC7 and NV12 arrays against their
         # charge (two gpubench runs, a few seconds)
         "test_arrays.py",
         # new on 2026-12-07 (later): what NVML counts of managed memory (a few seconds)
         "test_managed.py")
_state = {"recording": False}
_setup_s: dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    _state["recording"] = bool(config.getoption("--gpu", default=False))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    slots = [i for i, item in enumerate(items) if Path(str(item.fspath)).parent == here]

    def rank(item: pytest.Item) -> int:
        name = f"{Path(str(item.fspath)).name}::{item.originalname}"
        return next((i for i, entry in enumerate(ORDER)
                     if name == entry or name.startswith(entry + "::")), len(ORDER))

    ordered = sorted((items[i] for i in slots), key=rank)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _state["recording"] or "tests/gpu/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "setup":
        _setup_s[report.nodeid] = report.duration
    if report.when != "call" and report.outcome == "passed":
        return
    seconds = report.duration + (_setup_s.pop(report.nodeid, 0.0) if report.when == "call" else 0)
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr or "")
    harness.record_test(report.nodeid, report.outcome, message.strip()[:400], seconds)


@pytest.fixture(scope="session")
def nvml() -> Nvml:
    try:
        import pynvml
    except ImportError as exc:
        pytest.skip(f"needs a real GPU: pynvml missing ({exc})")
    try:
        found = Nvml()
    except (pynvml.NVMLError, RuntimeError, OSError) as exc:
        pytest.skip(f"needs a real GPU: NVML unavailable ({type(exc).__name__}: {exc})")
    harness.record_env("gpu", found.describe())
    return found


@pytest.fixture(scope="session")
def lib(nvml: Nvml) -> Path:
    if os.environ.get("GPUCHECK_BUILD_FAILED") and not os.environ.get("GPUCHECK_LIB"):
        pytest.fail(f"the build failed (make -C interposer lib): {harness.LIB}, if there, is an "
                    "earlier build's, not checked")
    if not harness.LIB.is_file():
        pytest.fail(f"{harness.LIB} missing: the build failed (make -C interposer lib)")
    return harness.LIB


@pytest.fixture(scope="session")
def gpubench(nvml: Nvml) -> Path:
    try:
        path, how = bench.build_gpubench(harness.WORK / "gpubench")
    except bench.BuildError as exc:
        pytest.fail(f"gpubench did not build: {exc}")
    harness.record_env("gpubench", {"path": str(path), "build": how})
    return path


@pytest.fixture(scope="session")
def fills(nvml: Nvml, lib: Path) -> Fills:
    return Fills(nvml)


@pytest.fixture(scope="session")
def baseline(nvml: Nvml) -> dict[str, Any]:
    """The bf16 matmul (and tiny ops) with no library: 100% (test_compute, test_cotenant)."""
    return matmul(nvml, harness.plain_env(), tiny=True)
