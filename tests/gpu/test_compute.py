"""Real GPU, compute share: bf16 8192x8192 matmul throughput under CUDA_DEVICE_SM_LIMIT
50/30/10 against the same program without the library, and PyTorch tiny-op cost with the
library and no limits (the runtime's cuGetProcAddress path).

Each limited run also reports the share of time its kernels took (the throttle's own
measurement, ``busy_ns`` in the region), the clock compensation it settled on
(``sm_scale_milli``), and the SM clock and board power seen from outside. The 30% run is
repeated with ``GPUSLICE_SM_LIMIT_MODE=time`` (no compensation) so both semantics are
measured side by side in one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import record
from gpu.nvmlwatch import ClockWatch, Nvml

from webhook.node.region import RegionError, read_region

pytestmark = pytest.mark.gpu

SECONDS = "5"
POINTS = 5


def _matmul(nvml: Nvml, env: dict[str, str], tiny: bool) -> dict[str, Any]:
    args = ["matmul", SECONDS] + (["--tiny", "20000"] if tiny else [])
    with ClockWatch(nvml) as watch:
        result = harness.run(harness.workload(*args), env, 45)
    result["clock"] = watch.summary()
    return result


def _throttle_view(region: Path, result: dict[str, Any]) -> dict[str, Any]:
    """What the throttle measured: the kernels' share of wall time, and its clock scale."""
    try:
        dev = read_region(region).devices[0]
    except (OSError, RegionError, IndexError) as exc:
        return {"error": str(exc)}
    wall = float(result.get("matmul_wall_s") or 0)
    return {"time_share_pct": round(100 * dev.busy_ns / 1e9 / wall, 1) if wall else None,
            "scale": dev.sm_scale_milli / 1000 if dev.sm_scale_milli else 1.0,
            "idle_power_w": dev.idle_power_mw / 1000}


@pytest.fixture(scope="module")
def baseline(nvml: Nvml) -> dict[str, Any]:
    """The same matmul (and tiny ops) with no library: 100%."""
    return _matmul(nvml, harness.plain_env(), tiny=True)


def test_torch_tiny_ops_with_library_unlimited_within_5_percent(
        nvml: Nvml, baseline: dict[str, Any], lib: Path) -> None:
    unlimited = _matmul(nvml, harness.capped_env(harness.new_region("tiny")), tiny=True)
    ratio = unlimited["tiny_ns"] / baseline["tiny_ns"]
    matmul_pct = 100 * unlimited["tflops"] / baseline["tflops"]
    ok = ratio <= 1.05
    record("torch_tiny", f"{ratio:.3f}x ({baseline['tiny_ns'] / 1000:.2f} us/op plain); "
           f"matmul {matmul_pct:.1f}%", ok, ratio=ratio, baseline=baseline, unlimited=unlimited)
    assert ok, f"tiny torch ops cost {ratio:.3f}x with the library"


def _limited(nvml: Nvml, baseline: dict[str, Any], limit: int, mode: str | None
             ) -> tuple[float, str, dict[str, Any]]:
    region = harness.new_region(f"sm{limit}{mode or ''}")
    extra = {"GPUSLICE_SM_LIMIT_MODE": mode} if mode else None
    limited = _matmul(nvml, harness.capped_env(region, sm=limit, extra=extra), tiny=False)
    view = _throttle_view(region, limited)
    pct = 100 * limited["tflops"] / baseline["tflops"]
    clock, base_clock = limited["clock"], baseline["clock"]
    value = (f"{pct:.1f}%; GPU time {view.get('time_share_pct')}%, x{view.get('scale')}; "
             f"{clock.get('sm_mhz_busy')} MHz ({base_clock.get('sm_mhz_busy')} unlimited)")
    return pct, value, {"percent": pct, "throttle": view, "limited": limited,
                        "baseline": baseline}


@pytest.mark.parametrize("limit", [50, 30, 10])
def test_sm_limit_caps_matmul_throughput(limit: int, nvml: Nvml, baseline: dict[str, Any],
                                         lib: Path) -> None:
    pct, value, data = _limited(nvml, baseline, limit, None)
    ok = abs(pct - limit) <= POINTS
    record(f"sm_{limit}", value, ok, **data)
    assert ok, f"SM limit {limit}% gave {pct:.1f}% of the unlimited throughput"


def test_sm_limit_time_mode_for_comparison(nvml: Nvml, baseline: dict[str, Any],
                                           lib: Path) -> None:
    """The plain time share (no clock compensation) at 30%: informational, side by side."""
    pct, value, data = _limited(nvml, baseline, 30, "time")
    record("sm_30_time", value, None, **data)
    assert pct > 0
