"""Real GPU, managed memory: what NVML's per-process figure counts of it, untouched and after a
kernel touched it, against what the library charges.

The library charges ``cuMemAllocManaged`` in full at the call (interposer README, "Managed memory
is charged to the device it was allocated on"). Its reconcile compares NVML's per-process figure
with what it charged, so it needs to know whether that figure counts managed memory: users of
nvtop and RMM report that it leaves managed memory out even when resident. Where it does, the
memory no hook sees (code, the driver's workspaces) can hide behind the managed charge, up to
its size; where it counts only what is resident, the same holds for the untouched part. Runs
after the bar's rows (conftest.ORDER): a few seconds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import GIB, MIB, Server, record, region_used
from gpu.nvmlwatch import Nvml

pytestmark = pytest.mark.gpu


def test_managed_memory_as_nvml_counts_it_and_as_the_region_charges_it(nvml: Nvml, gpubench: Path,
                                                                      lib: Path) -> None:
    region = harness.new_region("managed")
    size = GIB
    steps: dict[str, Any] = {}
    seen: dict[str, int | None] = {}
    device: dict[str, int] = {}
    charged: dict[str, int] = {}
    server = Server(gpubench, harness.capped_env(region))
    try:
        pids = {server.proc.pid}

        def look(label: str) -> None:
            time.sleep(1.2)  # the sampler's reconcile (every 500 ms) settles
            seen[label], device[label], charged[label] = (nvml.pids_used(pids), nvml.device_used(),
                                                          region_used(region))

        steps["alloc"] = server.ask("alloc 1048576")  # the context, and NVML lists the process
        assert steps["alloc"].startswith("ok"), steps
        look("before")
        steps["managed"] = server.ask(f"managed {size}")
        assert steps["managed"].startswith("ok"), steps
        idx = steps["managed"].split()[1]
        look("untouched")
        steps["touch"] = server.ask(f"touch {idx} {size}")  # cuMemsetD8Async on the device
        assert steps["touch"].startswith("ok"), steps
        look("touched")
        steps["free"] = server.ask(f"free {idx}")
        assert steps["free"].startswith("ok"), steps
        look("freed")
    finally:
        server.kill()

    def grew(figures: dict[str, Any], label: str) -> str:
        a, b = figures["before"], figures[label]
        return "not listed" if a is None or b is None else f"{(b - a) / MIB:+,.0f}"

    held = charged["touched"] - charged["before"]
    back = charged["freed"] - charged["before"]
    # charged once, in full, whatever NVML shows: the reconcile must not add a touched page again
    ok = abs(charged["untouched"] - charged["before"] - size) < 64 * MIB and \
        abs(held - size) < 64 * MIB and abs(back) < 64 * MIB
    record("managed_nvml", f"NVML per process {grew(seen, 'untouched')} MiB untouched, "
           f"{grew(seen, 'touched')} touched (device {grew(device, 'touched')}); region "
           f"{held / MIB:+,.0f} MiB for 1,024 managed, {back / MIB:+,.0f} after the free", ok,
           steps=steps, nvml_pids=seen, nvml_device=device, region=charged)
    assert ok, (steps, seen, device, charged)
