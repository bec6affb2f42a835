"""The bf16 matmul workload of the compute checks: one run under NVML's clock watch, and what the
throttle measured in its region (shared by test_compute and test_cotenant)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu import harness
from gpu.nvmlwatch import ClockWatch, Nvml, ShareWatch

from webhook.node.region import RegionError, read_region

SECONDS = "5"


def matmul(nvml: Nvml, env: dict[str, str], tiny: bool, warmup: float = 1.5,
           extra: list[str] | None = None) -> dict[str, Any]:
    args = ["matmul", SECONDS, "--warmup", str(warmup)] + (["--tiny", "20000"] if tiny else [])
    args += extra or []
    # the agent's outside compute check, over the measured seconds (the last of the run)
    with ClockWatch(nvml) as watch, ShareWatch(float(SECONDS)) as shares:
        result = harness.run(harness.workload(*args), env, 45)
    result["clock"] = watch.summary()
    result["nvml_share"] = shares.summary()
    return result


def throttle_view(region: Path, result: dict[str, Any]) -> dict[str, Any]:
    """What the throttle measured: the kernels' share of wall time, and its clock scale."""
    try:
        dev = read_region(region).devices[0]
    except (OSError, RegionError, IndexError) as exc:
        return {"error": str(exc)}
    wall = float(result.get("matmul_wall_s") or 0)
    return {"time_share_pct": round(100 * dev.busy_ns / 1e9 / wall, 1) if wall else None,
            "scale": dev.sm_scale_milli / 1000 if dev.sm_scale_milli else 1.0,
            "idle_power_w": dev.idle_power_mw / 1000}
