"""Real GPU, compute share: bf16 8192x8192 matmul throughput under CUDA_DEVICE_SM_LIMIT
50/30/10 against the same program without the library, and PyTorch tiny-op cost with the
library and no limits (the runtime's cuGetProcAddress path).

Each limited run also reports the share of time its kernels took (the throttle's own
measurement, ``busy_ns`` in the region), the clock compensation it settled on
(``sm_scale_milli``), and the SM clock and board power seen from outside. The 30% run is
repeated with ``GPUSLICE_SM_LIMIT_MODE=time`` (no compensation) so both semantics are
measured side by side in one run, and with a host-to-device copy queued before each matmul
(copies between kernels are not the kernels' time).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.compute import matmul, throttle_view
from gpu.harness import median, record
from gpu.nvmlwatch import Nvml

pytestmark = pytest.mark.gpu

POINTS = 5
LIMITED_WARMUP_S = 4.0
# The copy queued before each matmul in the sm_30_copies row: about as long as the matmul, so
# that charging it as kernel time would halve the kernels' share.  An 8192x8192 bf16 matmul is
# 2 x 8192^3 = 1.1 TFLOP, about 1.6 ms at the H200's ~700 TFLOPS; a pinned host-to-device copy
# runs at about 50 GB/s over PCIe 5, so 64 MiB take about 1.3 ms.  At 30 % a matmul's cycle is
# 1.6 / 0.3 = 5.3 ms, room for the copy even at half that bandwidth.
COPY_MIB = 64


TINY_PAIRS = 3
TINY_ROUNDS = 40
TINY_BATCH = 3000


def lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def test_torch_tiny_ops_with_library_unlimited_within_5_percent(lib: Path) -> None:
    """PyTorch's own launch path (cuGetProcAddress) with the library and no limits.  One
    process's tiny ops drift by 20 % and more over a second, and two processes differ as much
    (the H200's 2026-12-04 run: 6.8-9.1 us/op without the library), so each pair of processes,
    one without and one with the library, takes turns on one pinned CPU and the GPU: 40 rounds
    of a 3000-op batch each, the order alternating.  A pair's ratio is that of the lower
    quartiles of its batches (the speed the op runs at when nothing else intrudes: what the
    hooks could slow); the row judges the median pair's, and shows the pairs' range."""
    pairs = harness.take_turns(
        harness.workload("turns", "--batch", str(TINY_BATCH)), 60, TINY_PAIRS, TINY_ROUNDS,
        "tiny")
    ratios = [lower_quartile(p["lib"]["tiny_ns_batches"])
              / lower_quartile(p["plain"]["tiny_ns_batches"]) for p in pairs]
    ratio = median(ratios)
    # the spread within a pair: each round's ratio (lib over plain), their quartiles
    per_round = sorted(w / p for pair in pairs for p, w in zip(
        pair["plain"]["tiny_ns_batches"], pair["lib"]["tiny_ns_batches"], strict=True))
    round_q = statistics.quantiles(per_round, n=4, method="inclusive")
    matmul_pct = median([100 * p["lib"]["tflops"] / p["plain"]["tflops"] for p in pairs])
    plain_us = median([lower_quartile(p["plain"]["tiny_ns_batches"]) for p in pairs]) / 1000
    ok = ratio <= 1.05
    # the summary's 64 columns: the ratio, the pairs' range, the rounds' middle half
    record("torch_tiny", f"{ratio:.3f}x (pairs {min(ratios):.3f}-{max(ratios):.3f}, turns "
           f"{round_q[0]:.2f}-{round_q[2]:.2f}) {plain_us:.2f}us/op mm {matmul_pct:.0f}%", ok,
           ratio=ratio, pair_ratios=ratios, round_quartiles=round_q, plain_us=plain_us,
           matmul_pct=matmul_pct, rounds=TINY_ROUNDS, batch=TINY_BATCH,
           pairs=pairs)
    assert ok, f"tiny torch ops cost {ratio:.3f}x with the library"


def _limited(nvml: Nvml, baseline: dict[str, Any], limit: int, mode: str | None
             ) -> tuple[float, str, dict[str, Any]]:
    region = harness.new_region(f"sm{limit}{mode or ''}")
    extra = {"GPUSLICE_SM_LIMIT_MODE": mode} if mode else None
    # measured from 4 s on: the clock compensation applies from about 1.5 s into a workload and
    # settles within about 2 s more; uncompensated seconds in the window read high
    limited = matmul(nvml, harness.capped_env(region, sm=limit, extra=extra), tiny=False,
                     warmup=LIMITED_WARMUP_S)
    view = throttle_view(region, limited)
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
    if limit == 30:  # the agent's outside compute check on the same two runs
        _outside_compute(data, baseline)
    assert ok, f"SM limit {limit}% gave {pct:.1f}% of the unlimited throughput"


def _outside_compute(data: dict[str, Any], baseline: dict[str, Any]) -> None:
    """What the agent's outside compute check reads (NVML's per-process utilisation, sampled as
    the agent does, over the measured seconds) for the run at 30 % and the unlimited one: the
    first must not be judged over its limit (30 + the default 10 points), the second must."""
    limited = data["limited"].get("nvml_share", {}).get("share_pct")
    plain = baseline.get("nvml_share", {}).get("share_pct")
    time_share = data["throttle"].get("time_share_pct")
    value = (f"NVML {limited}% at 30% (throttle's own {time_share}%); unlimited {plain}%")
    if limited is None or plain is None:
        record("outside_compute", value + " (no per-process figure)", None,
               limited=data["limited"].get("nvml_share"), plain=baseline.get("nvml_share"))
        return
    ok = limited <= 40 and plain > 40
    record("outside_compute", value, ok, limited=data["limited"].get("nvml_share"),
           plain=baseline.get("nvml_share"))


def test_sm_limit_time_mode_for_comparison(nvml: Nvml, baseline: dict[str, Any],
                                           lib: Path) -> None:
    """The plain time share (no clock compensation) at 30%: informational, side by side."""
    pct, value, data = _limited(nvml, baseline, 30, "time")
    record("sm_30_time", value, None, **data)
    assert pct > 0


def test_sm_limit_holds_beside_a_capture_held_open(nvml: Nvml, baseline: dict[str, Any],
                                                   lib: Path) -> None:
    """30% while another thread holds a global-mode graph capture open: launches cannot be
    measured by events then (a query would invalidate the capture); they are paced and charged
    from NVML's per-process utilisation.  The capture must end cleanly."""
    region = harness.new_region("sm30capture")
    limited = matmul(nvml, harness.capped_env(region, sm=30), tiny=False,
                     warmup=LIMITED_WARMUP_S, extra=["--hold-capture"])
    pct = 100 * limited["tflops"] / baseline["tflops"]
    capture = limited.get("capture")
    ok = abs(pct - 30) <= POINTS and capture == "ended"
    record("sm_30_capture_held", f"{pct:.1f}%; capture {capture}", ok, percent=pct,
           limited=limited, throttle=throttle_view(region, limited), baseline=baseline)
    assert ok, f"beside a held-open capture: {pct:.1f}% at 30%, capture {capture}"


def test_sm_limit_excludes_copies_between_kernels(nvml: Nvml, baseline: dict[str, Any],
                                                  lib: Path) -> None:
    """30% with an async host-to-device copy (``COPY_MIB`` from pinned memory,
    ``copy_(..., non_blocking=True)``) queued on the same stream before each matmul, against
    the baseline without copies.  The copies are not kernel time: the library's copy hooks
    mark the stream and its next launch ends the gap (interposer/src/gaps.c, "work between
    kernels"), so the matmuls still get 30% of the unlimited throughput.  Charged as kernel
    time (before that change, or should the runtime's copy reach the driver by a call the
    library does not hook) they would get about 30 x 1.6 / (1.6 + 1.3) = 17%, while the
    throttle's own GPU-time share still read 30%.  One 5 s run, no baseline of its own."""
    region = harness.new_region("sm30copies")
    limited = matmul(nvml, harness.capped_env(region, sm=30), tiny=False,
                     warmup=LIMITED_WARMUP_S, extra=["--copy-mib", str(COPY_MIB)])
    view = throttle_view(region, limited)
    pct = 100 * limited["tflops"] / baseline["tflops"]
    nvml_pct = limited.get("nvml_share", {}).get("share_pct")
    n = 8192  # work.py matmul's --size
    mm_ms = 2 * n**3 / (baseline["tflops"] * 1e12) * 1e3
    copy_ms = limited.get("copy_ms")
    # what the matmuls would get were each copy charged as kernel time: 30 % of the wall time
    # for copy and matmul together, the matmul's part of it
    if_charged = 30 * mm_ms / (mm_ms + copy_ms) if copy_ms else None
    ok = abs(pct - 30) <= POINTS
    record("sm_30_copies", f"{pct:.1f}%; GPU time {view.get('time_share_pct')}%, "
           f"x{view.get('scale')}; NVML {nvml_pct}%; copy {copy_ms}/mm {mm_ms:.2f} ms", ok,
           percent=pct, copy_mib=COPY_MIB, copy_ms=copy_ms, mm_ms=mm_ms,
           if_charged_pct=if_charged, nvml_share=limited.get("nvml_share"), throttle=view,
           limited=limited, baseline=baseline)
    assert ok, f"with a {COPY_MIB} MiB copy before each matmul: {pct:.1f}% at 30%"
