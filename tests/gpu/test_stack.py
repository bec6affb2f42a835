"""Real GPU, a launch's stack near the cap (interposer/src/lmem.c, README "Near the cap: a
launch's stack"): a kernel with 16 KiB of local memory per thread makes the driver grow the
context's stack reservation at its launch (per-thread size x every thread the device runs at
once: about 4 GiB on an H100 or H200), which no allocation call shows. gpubench stackgrow
JIT-compiles it, fills device memory to within 160 MiB of a 2 GiB cap and launches it once, then
a kernel with no local memory, while NVML is read from outside: the library must refuse the
launch with CUDA_ERROR_OUT_OF_MEMORY (or let it through with the growth charged, within the
cap), and the small kernel must still run. The same run without the library and without the
fill measures what the launch really grows by."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu import harness
from gpu.harness import record
from gpu.nvmlwatch import Nvml, Poller

pytestmark = pytest.mark.gpu

CAP_MIB = 2048
FREE_MIB = 160
"""What the fill leaves free: inside the library's reconcile margin (256 MiB), so the device is
near its cap and launches are judged."""
NOISE_MIB = 2
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def test_a_launch_that_grows_the_stack_near_the_cap(nvml: Nvml, gpubench: Path, lib: Path) -> None:
    """Under the library: outside usage <= the cap, the big launch refused with out-of-memory
    (or granted with its growth charged and the view still <= the cap), the small kernel run."""
    plain = harness.run([str(gpubench), "stackgrow", "-"], harness.plain_env(), 60)
    env = harness.capped_env(harness.new_region("stack"), mem=f"{CAP_MIB}m")
    with Poller(nvml, "stack") as poller:
        got = harness.run([str(gpubench), "stackgrow", str(FREE_MIB)], env, 60, poller=poller)
    outside = poller.summary()
    growth = plain["used_launched"] - plain["used_filled"]  # the driver's own, no library
    threads = plain["sms"] * plain["threads_per_sm"]
    local_kib = plain["big_local"] / 1024
    alone = "granted" if plain["big_rc"] == 0 else plain["big_error"]
    shown = (f"{local_kib:,.0f} KiB/thread x {threads:,}: no library {alone}, +{growth:,.0f} MiB "
             f"(stack {plain['stack_before']:,} -> {plain['stack_after']:,} B)")
    if plain["big_rc"] != 0 or plain["big_local"] <= plain["stack_before"]:
        # the launch grows nothing here (or fails without the library): nothing to judge
        record("launch_stack", f"not measured: {shown}", None, plain=plain, with_lib=got,
               outside=outside)
        pytest.skip(f"the big-local kernel grows no stack without the library: {shown}")
    charged = got["used_launched"] - got["used_filled"]
    refused = got["big_rc"] == OOM
    granted = (got["big_rc"] == 0 and got["big_sync_rc"] == 0
               and charged >= growth - NOISE_MIB and got["used_launched"] <= CAP_MIB)
    checks = {
        "filled to near the cap": got["used_filled"] >= CAP_MIB - FREE_MIB - 64 - NOISE_MIB,
        "refused with out-of-memory, or granted and charged": refused or granted,
        "nothing grown when refused": not refused or got["stack_after"] == got["stack_before"],
        "small kernel still runs": got["lean_rc"] == 0 and got["lean_sync_rc"] == 0,
        "outside <= cap": outside["max_mib"] <= CAP_MIB,
    }
    failed = [name for name, good in checks.items() if not good]
    verdict = (got["big_error"] if got["big_rc"] else
               f"granted, +{charged:,.0f} MiB charged")
    record("launch_stack",
           f"{verdict} at {got['used_filled']:,.0f}/{CAP_MIB:,} MiB; {shown}; small kernel "
           f"rc {got['lean_rc']}; outside {outside['max_mib']:,.0f}"
           + (f"; wrong: {failed}" if failed else ""), not failed,
           checks=checks, growth_mib=growth, big_rc=got["big_rc"], big_error=got["big_error"],
           outside_peak_mib=outside["max_mib"], plain=plain, with_lib=got, outside=outside)
    assert not failed, f"launch stack: {failed} ({got}; no library {plain})"

