"""Real GPU, another tenant: the 30% matmul while another container (no library, no limit) runs
the same matmul on the same GPU.  Run last.

Without MPS the GPU time-slices between the two processes, and an interval between two of the
throttle's events also holds the other tenant's slices.  The library charges only the share
NVML's per-process utilisation gives the process (interposer/src/slices.c); with
GPUSLICE_SM_TIMESLICE_CORRECTION=off it charges the events' time as measured.  Both runs
happen beside the same busy tenant: corrected, the limited tenant should get 30% of its solo
throughput (the GPU is at full load, so its full-load clock applies); uncorrected, about half
of that.  The second row is informational: what the correction is worth on this GPU.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.compute import SECONDS, matmul, throttle_view
from gpu.harness import record
from gpu.nvmlwatch import Nvml

pytestmark = pytest.mark.gpu

LEAD_S = 4  # the other tenant is busy this long before ours starts
RUN_S = 20  # the longest one of our matmul runs takes, start-up included


def test_sm_limit_beside_a_busy_tenant(nvml: Nvml, baseline: dict[str, Any], lib: Path) -> None:
    other_s = LEAD_S + 2 * RUN_S
    other = subprocess.Popen(harness.workload("matmul", str(other_s)),
                             env=harness.plain_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=harness.REPO)
    runs: dict[str, dict[str, Any]] = {}
    try:
        time.sleep(LEAD_S)
        for mode in ("nvml", "off"):
            if other.poll() is not None:
                break  # the other tenant is gone: what follows would be a solo run
            region = harness.new_region(f"cotenant-{mode}")
            env = harness.capped_env(region, sm=30,
                                     extra={"GPUSLICE_SM_TIMESLICE_CORRECTION": mode})
            ours = matmul(nvml, env, tiny=False, warmup=3)  # the correction settles in ~2 s
            runs[mode] = {"pct": 100 * ours["tflops"] / baseline["tflops"],
                          "throttle": throttle_view(region, ours), "ours": ours}
    finally:
        other.kill()
        out, _ = other.communicate(timeout=30)
    assert "nvml" in runs, f"the other tenant ended early: {out[-300:]}"
    for mode, check in (("nvml", "sm_30_cotenant"), ("off", "sm_30_cotenant_raw")):
        if mode not in runs:
            continue
        got = runs[mode]
        ok = 25 <= got["pct"] <= 35 if mode == "nvml" else None
        record(check, f"{got['pct']:.1f}% of solo; events measured "
                      f"{got['throttle'].get('time_share_pct')}% of the time", ok,
               percent=got["pct"], throttle=got["throttle"], ours=got["ours"], baseline=baseline,
               seconds=SECONDS)
    assert 25 <= runs["nvml"]["pct"] <= 35, f"{runs['nvml']['pct']:.1f}% beside a busy tenant"


def test_sm_limit_shared_by_two_processes(nvml: Nvml, baseline: dict[str, Any], lib: Path) -> None:
    """Two processes of one container (one region) at 30%, side by side: together 30% of the
    solo throughput.  They wait for the same budget and launch together, so without the
    correction each one's intervals also hold the other's kernels (on the fake GPU: 19.7%)."""
    region = harness.new_region("two-procs")
    env = harness.capped_env(region, sm=30)
    args = harness.workload("matmul", SECONDS, "--warmup", "3")
    procs = [subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=harness.REPO)
             for _ in range(2)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=harness.budget(RUN_S + 15))
            assert proc.returncode == 0, err[-400:]
            results.append(harness.parse_result(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    each = [100 * r["tflops"] / baseline["tflops"] for r in results]
    pct = sum(each)
    ok = 25 <= pct <= 35
    record("sm_30_two_procs", f"{pct:.1f}% of solo together ({each[0]:.1f} + {each[1]:.1f})", ok,
           percent=pct, results=results, baseline=baseline,
           throttle=throttle_view(region, results[0]))
    assert ok, f"{pct:.1f}% for two processes at 30%"
