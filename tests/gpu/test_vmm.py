"""Real GPU, VMM: PyTorch's expandable segments map 20 MiB pages made with cuMemCreate, so the
cap must follow cuMemCreate/cuMemMap/cuMemUnmap/cuMemRelease; and such an allocation shared
with another process of the container as a file descriptor.  Runs after the bar's rows
(conftest.ORDER): the others matter more if the time budget runs short."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.fills import Fills
from gpu.harness import CAP_MIB, GIB, MIB, Server, record, region_used
from gpu.nvmlwatch import Nvml

pytestmark = pytest.mark.gpu


def test_largest_allocation_with_expandable_segments(fills: Fills) -> None:
    fill = fills.check_largest("torch-expandable")
    outside = fill["outside"]["max_mib"]
    assert outside <= CAP_MIB, f"{outside:,.0f} MiB seen from outside > {CAP_MIB} MiB"


def test_memory_shared_as_a_vmm_handle_is_charged_once_more(nvml: Nvml, gpubench: Path,
                                                            lib: Path) -> None:
    """PyTorch's CUDA tensors shared between processes under expandable segments, and NCCL's
    P2P buffers, are ``cuMemCreate`` allocations exported as a file descriptor, imported and
    mapped by another process. The library charges the importer's mapping (the exporter's
    charge cannot be told from the descriptor: interposer README, "Imported VMM handles"), so
    one container pays twice, by design. Measured here: whether the driver's NVML counts the
    mapping for the importer too (then the agent's outside check, which sums NVML per process,
    counts it twice as well), and that the region holds it exactly once more (the reconcile
    must not add it a third time from NVML's figure) and gives it back at the unmap."""
    region = harness.new_region("vmm")
    env = harness.capped_env(region)
    shared = 2 * GIB
    sock = region.with_suffix(".sock")
    steps: dict[str, Any] = {}
    servers: list[Server] = []
    try:
        exporter = Server(gpubench, env)
        servers.append(exporter)
        importer = Server(gpubench, env)
        servers.append(importer)
        steps["export"] = exporter.ask(f"vmmexport {shared} {sock}")
        assert steps["export"].startswith("ok"), steps
        time.sleep(1.2)  # the samplers' reconciles (every 500 ms) settle both processes
        pids = {"exporter": exporter.proc.pid, "importer": importer.proc.pid}
        before = {k: nvml.pids_used({pid}) for k, pid in pids.items()}
        steps["region before"] = region_before = region_used(region)
        steps["import"] = importer.ask(f"vmmimport {sock} {shared}")
        assert steps["import"].startswith("ok"), steps
        time.sleep(1.5)
        after = {k: nvml.pids_used({pid}) for k, pid in pids.items()}
        steps["region after"] = region_after = region_used(region)
        steps["importer view"] = importer.ask("info")
        steps["unmap"] = importer.ask(f"free {steps['import'].split()[1]}")
        time.sleep(1.2)
        steps["region after the unmap"] = region_unmapped = region_used(region)
    finally:
        for server in servers:
            server.kill()
    grew = None if before["importer"] is None or after["importer"] is None else \
        after["importer"] - before["importer"]
    charged, back = region_after - region_before, region_unmapped - region_before
    ok = abs(charged - shared) < 64 * MIB and abs(back) < 64 * MIB
    nvml_text = "not listed here" if grew is None else f"{grew / MIB:+,.0f} MiB"
    record("vmm_import", f"importer NVML {nvml_text}, region {charged / MIB:+,.0f} MiB for "
           f"2,048 MiB shared, {back / MIB:+,.0f} after the unmap", ok, steps=steps,
           nvml_before=before, nvml_after=after)
    assert ok, steps
