"""``scripts/gpu-check.sh`` end to end on the fake driver: the GPU check is the one thing that
runs on the scarce H200 time, once per session at best, so its own plumbing (the build, the
harness's children and deadline, gpubench, the NVML watches, the agent's outside checks, the
summary and the files under ``$OUT``) is rehearsed here on every CI run, in two runs of the
script:

- the rows whose workload is gpubench (the C driver-API tool): caps, views, processes, costs;
- the compute rows (``test_compute.py``, ``test_cotenant.py``), whose workload is a PyTorch
  matmul: here ``tests/gpu/rehearsal/torch``, a stand-in for the few PyTorch calls it makes,
  over the driver API, launching the fake GPU's kernels through the library's hooks.

The memory rows that fill the cap with PyTorch, CuPy and JAX need those frameworks on a GPU and
are not asked for. The fake's figures are not the bar's: the functional rows' verdicts are
asserted (a cap, a refusal, a capture that ended), the timing rows only measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpu import summary

from .conftest import BUILD, ROOT, UUID_A

TESTS = ["tests/gpu/test_processes.py", "tests/gpu/test_overhead.py",
         "tests/gpu/test_memory.py::test_cuda_2_entry_points_are_charged",
         "tests/gpu/test_memory.py::test_green_context_is_charged",
         "tests/gpu/test_views.py::test_memory_percent_resolves_against_real_total",
         "tests/gpu/test_views.py::test_the_limits_file_wins_over_a_lifted_environment"]
"""Every test whose workload is gpubench alone."""
FUNCTIONAL = {"legacy_entry_points", "green_ctx", "memory_percent", "limits_file", "two_procs",
              "race", "outside_check", "ipc_import"}
"""Rows whose verdict the fake decides as a GPU would (caps, refusals, views, NVML per process;
the fake's IPC import takes no memory of its own, which is what ipc_import asks of the real
driver). The launch and alloc+free costs are the fake's own (a 250 ns fake launch, a 2 µs fake
allocation): measured, not judged here."""


def gpu_check(tmp_path: Path, tests: list[str], **fake: str) -> tuple[str, dict[str, Any]]:
    """Run scripts/gpu-check.sh on the fake driver; its log and the rows of gpu-check.json."""
    out = tmp_path / "out"
    keep = ("PATH", "HOME", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update({
        "OUT": str(out), "PYTHON": str(ROOT / ".venv" / "bin" / "python"),
        "LD_LIBRARY_PATH": str(BUILD / "fake"),  # the fake libcuda.so.1, libnvidia-ml.so.1
        "FAKE_CUDA_STATE": str(tmp_path / "fakestate"),  # NVML's per-process view
        "FAKE_CUDA_DEVICES": f"{UUID_A}=16g",
        # a context holds memory, so NVML lists each process; the green context's row takes
        # a primary context under 256 MiB for one that was not charged (the H200's: 524 MiB)
        "FAKE_CUDA_CTX_BYTES": "300m",
        # the default (285 s) holds the compute run about twice over on 2 idle cores; a loaded
        # CI machine gets more before rows are skipped for time
        "GPUCHECK_BUDGET_S": "420",
        "GPUCHECK_TESTS": " ".join(tests), "TMPDIR": str(tmp_path), **fake,
    })
    if not Path(env["PYTHON"]).is_file():
        env["PYTHON"] = "python3"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, cwd="/",
                          check=False, capture_output=True, text=True, timeout=480)
    log = done.stdout + done.stderr
    # the rows of the tests not asked for show ERROR ("not run"), so the status is 1
    assert done.returncode == 1, log
    assert "interposer/build/libgpuslice.so" in log  # built (or found up to date) and listed
    assert "driver 580.00.00-fake" in log  # the summary names the GPU NVML found
    report = json.loads((out / "gpu-check.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert len(rows) == len(summary.ROWS)
    # every measurement went to $OUT as it was made, for a run cut off by the device's limit
    measured = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {m["check"] for m in measured if m.get("kind") == "check"} >= {
        c for c, r in rows.items() if r["status"] != "ERROR"}
    assert (out / "gpu-check.log").stat().st_size > 0
    return log, {"rows": rows, "versions": report["versions"], "measured": measured}


@pytest.mark.slow
def test_gpu_check_runs_its_gpubench_rows_on_the_fake_driver(built: Path, tmp_path: Path) -> None:
    log, report = gpu_check(tmp_path, TESTS)
    rows = report["rows"]
    for check in FUNCTIONAL:
        assert rows[check]["status"] == "PASS", (check, rows[check], log[-3000:])
    assert rows["outside_check"]["value"] == "1,324 MiB, 2,348 MiB"  # each pid: context + allocation
    assert rows["ipc_import"]["value"].startswith("importer NVML +0 MiB, region +0 MiB")
    for check, says in (("launch_cost", "x call"), ("alloc_free", " us plain)")):
        assert rows[check]["status"] in {"PASS", "FAIL"}, rows[check]  # measured, not judged
        assert says in rows[check]["value"], rows[check]
    assert rows["sm_30"]["status"] == "ERROR"  # a framework row, not asked for
    assert rows["sm_30"]["value"] == "not run (see the log)"
    assert report["versions"]["gpubench"]["build"]  # how gpubench was built, for the record


COMPUTE = {"sm_50", "sm_30", "sm_10", "sm_30_time", "outside_compute", "sm_30_capture_held",
           "torch_tiny", "sm_30_cotenant", "sm_30_cotenant_raw", "sm_30_two_procs",
           "sm_30_four_procs"}


@pytest.mark.slow
def test_gpu_check_runs_its_compute_rows_on_the_fake_driver(built: Path, tmp_path: Path) -> None:
    log, report = gpu_check(
        tmp_path, ["tests/gpu/test_compute.py", "tests/gpu/test_cotenant.py"],
        PYTHONPATH=str(ROOT / "tests" / "gpu" / "rehearsal"), GPUCHECK_REHEARSAL="1",  # the stand-in torch
        FAKE_CUDA_KERNEL_US="2000",  # a matmul's kernel
        FAKE_GPU_SHARED="1",  # the processes share one GPU that time-slices them
        FAKE_NVML_POWER_LIMIT_MW="700000")  # NVML's utilisation, per process too
    rows = report["rows"]
    for check in COMPUTE:  # measured: a figure, not "not run" or a child's error
        assert rows[check]["status"] in {"PASS", "FAIL", "INFO"}, (check, rows[check], log[-3000:])
    assert rows["sm_30_capture_held"]["value"].endswith("capture ended")  # not invalidated
    # the agent's sampler beside each run read a share for both, with the raw streams kept
    assert re.fullmatch(r"NVML [0-9.]+% at 30% \(throttle's own [0-9.]+%\); unlimited [0-9.]+%",
                        rows["outside_compute"]["value"]), rows["outside_compute"]
    assert re.search(r"; charging [0-9]+/1000 of the measured GPU time$",
                     rows["sm_30_cotenant"]["value"]), rows["sm_30_cotenant"]
    # and the raw per-process queries that are to settle NVML's semantics on the GPU
    watched = next(m for m in report["measured"] if m.get("check") == "outside_compute")
    for run in ("limited", "plain"):
        probes = watched["data"][run]["probes"]
        assert probes and all(isinstance(p["all"], dict) and isinstance(p["last_2s"], dict)
                              for p in probes), probes
        assert any(v["n"] >= 1 for p in probes for v in p["all"].values()), probes
    assert rows["sm_30_two_procs"]["value"].count("+") == 1
    assert rows["sm_30_four_procs"]["value"].count("+") == 3
    assert rows["two_procs"]["status"] == "ERROR"  # a gpubench row, not asked for here
