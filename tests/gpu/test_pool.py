"""Real GPU, stream-ordered allocations (cuMemAllocAsync from device 0's default pool): how the
driver grows a pool, which the library assumes (interposer/src/pool.c's ``GS_POOL_CHUNK``: an
allocation that must grow its pool reserves up to the next 32 MiB, the fake driver's chunk; the
H200's is unmeasured), and a 2 GiB cap filled by such allocations, watched from outside.
Two gpubench runs, a few seconds; they run right after the bar's rows (conftest.ORDER)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from gpu import harness
from gpu.fills import SLACK_MIB
from gpu.harness import record
from gpu.nvmlwatch import Nvml, Poller

pytestmark = pytest.mark.gpu

GS_POOL_CHUNK_MIB = 32
"""interposer/src/pool.c's GS_POOL_CHUNK, in MiB: the growth the library reserves for."""
GROW_MIB = (1, 1, 8, 40, 100)
"""poolgrow's requests, each held: 1, 2, 10, 50 and 150 MiB in the pool."""
POOL_CAP_MIB = 2048
FILL_STEPS = "64,16,4,1"
"""poolfill's sizes in MiB, largest first, each until refused."""


def _mib(values: list[float]) -> str:
    return "/".join(f"{v:,.0f}" for v in values)


def test_pool_growth_steps_without_the_library(gpubench: Path) -> None:
    """Informational: the default pool's reserved size as it grows and after freeing; the
    figure that decides GS_POOL_CHUNK (32 MiB assumed)."""
    got = harness.run([str(gpubench), "poolgrow", ",".join(map(str, GROW_MIB))],
                      harness.plain_env(), 30)
    start = got["start_mib"]
    held = [float(sum(GROW_MIB[: i + 1])) for i in range(len(GROW_MIB))]
    reserved = [r - start for r in got["reserved_mib"]]
    steps = [b - a for a, b in zip([0.0, *reserved], reserved, strict=False)]
    model = [math.ceil(h / GS_POOL_CHUNK_MIB) * GS_POOL_CHUNK_MIB for h in held]
    as_model = all(abs(r - m) < 0.5 for r, m in zip(reserved, model, strict=True))
    verdict = (f"as {GS_POOL_CHUNK_MIB} MiB chunks" if as_model
               else f"not {GS_POOL_CHUNK_MIB} MiB chunks: {_mib(model)}")
    record("pool_chunk",
           f"{_mib(reserved)} MiB for {_mib(held)} held ({verdict}); freed+synced "
           f"{got['after_sync_mib'] - start:,.0f}, trimmed {got['after_trim_mib'] - start:,.0f}",
           None, held_mib=held, reserved_mib=reserved, growth_steps_mib=steps,
           chunk_model_mib=model, as_chunk_model=as_model, result=got)


def test_pool_fill_by_stream_ordered_allocations_stays_under_cap(
        nvml: Nvml, gpubench: Path, lib: Path) -> None:
    """cuMemAllocAsync to a 2 GiB cap, 64 MiB then smaller: refused at the cap, the total within
    the context's footprint and 64 MiB of it, never past it from outside, all back once freed."""
    env = harness.capped_env(harness.new_region("pool"), mem=f"{POOL_CAP_MIB}m")
    with Poller(nvml, "pool") as poller:
        got = harness.run([str(gpubench), "poolfill", FILL_STEPS], env, 30, poller=poller)
    outside = poller.summary()
    ctx, total = got["used_before"], got["total_mib"]
    floor = POOL_CAP_MIB - ctx - SLACK_MIB
    checks = {
        "each size refused at the cap": not got["guard_hit"] and all(
            rc == 2 for rc in got["refused_rc"]),
        f"total >= cap - ctx - {SLACK_MIB} MiB": total >= floor,
        "view within the cap": got["used_peak"] <= POOL_CAP_MIB,
        # what the trim left in the pool (nothing, if the driver gives it all back) stays charged
        "frees and the trim return it": got["used_after"] - ctx <= got["reserved_after_mib"] + 2,
        "outside <= cap": outside["max_mib"] <= POOL_CAP_MIB,
    }
    failed = [name for name, good in checks.items() if not good]
    record("pool_async",
           f"{total:,.0f} MiB (>= {floor:,.0f}; context {ctx:,.0f}, pool {got['reserved_peak_mib']:,.0f}"
           f"), outside {outside['max_mib']:,.0f}" + (f"; wrong: {failed}" if failed else ""),
           not failed, checks=checks, result=got, outside=outside)
    assert not failed, f"pool fill: {failed} ({got}, outside {outside})"
