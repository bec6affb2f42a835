"""Real GPU, another tenant: the 30% matmul while another container (no library, no limit) runs
the same matmul on the same GPU.  Informational, and run last.

The throttle measures GPU time with events of its own process; if the GPU time-slices between
the two processes, an interval also holds the other tenant's slices, and the limited tenant
would get less than its 30%.  This row measures that: its throughput against the solo
baseline (30% if the slices are not charged to it), and the share of time its throttle
measured.
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

LEAD_S = 4  # the other tenant is busy this long before ours starts, and after it ends


def test_sm_limit_beside_a_busy_tenant(nvml: Nvml, baseline: dict[str, Any], lib: Path) -> None:
    other = subprocess.Popen(harness.workload("matmul", str(int(SECONDS) + 3 * LEAD_S)),
                             env=harness.plain_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=harness.REPO)
    try:
        time.sleep(LEAD_S)
        region = harness.new_region("cotenant")
        ours = matmul(nvml, harness.capped_env(region, sm=30), tiny=False)
    finally:
        try:
            out, _ = other.communicate(timeout=harness.budget(4 * LEAD_S + 30))
        except subprocess.TimeoutExpired:
            other.kill()
            out, _ = other.communicate()
    theirs = harness.parse_result(out) if other.returncode == 0 else {}
    pct = 100 * ours["tflops"] / baseline["tflops"]
    view = throttle_view(region, ours)
    record("sm_30_cotenant",
           f"{pct:.1f}% of solo; GPU time {view.get('time_share_pct')}%; other tenant "
           f"{100 * theirs.get('tflops', 0) / baseline['tflops']:.0f}%", None,
           percent=pct, throttle=view, ours=ours, theirs=theirs, baseline=baseline)
    assert ours["tflops"] > 0
