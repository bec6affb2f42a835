"""Real GPU, what the library costs when nothing is throttled: empty-kernel launches and
1 MiB cuMemAlloc + cuMemFree pairs through the driver API, with the library (10 GiB cap, no
SM limit) against no library, alternating runs and taking medians.

Launch costs differ more between two processes (which core, which NUMA node, the CPU's clock
at the time) than the hook costs, so every run is pinned to the same CPU and the ratio is the
median of each round's with/without pair rather than a ratio of medians."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu import harness
from gpu.harness import median, record

pytestmark = pytest.mark.gpu

ROUNDS = 5
LAUNCH_ROUNDS = 7


def test_launch_cost_with_library_unlimited_within_5_percent(gpubench: Path, lib: Path) -> None:
    plain, with_lib = harness.alternate([str(gpubench), "launch", "20000", "5", "100"], 20,
                                        LAUNCH_ROUNDS, "overhead")
    ratios = {}
    for key in ("cpu_ns", "sat_ns"):
        ratios[key] = median([w[key] / p[key] for p, w in zip(plain, with_lib, strict=True)])
    ok = all(ratio <= 1.05 for ratio in ratios.values())
    record("launch_cost",
           f"{ratios['cpu_ns']:.3f}x call ({median([r['cpu_ns'] for r in plain]):,.0f} ns "
           f"plain); {ratios['sat_ns']:.3f}x flood; {LAUNCH_ROUNDS} pairs", ok,
           ratios=ratios, plain=plain, with_lib=with_lib)
    assert ok, f"launch cost ratios with the library: {ratios}"


def test_alloc_free_pair_with_library_within_2us(gpubench: Path, lib: Path) -> None:
    plain, with_lib = harness.alternate(
        [str(gpubench), "allocfree", str(1 << 20), "3000", "5"], 20, ROUNDS, "overhead")
    base = median([r["pair_ns"] for r in plain])
    delta = median([r["pair_ns"] for r in with_lib]) - base
    ok = delta <= 2000
    record("alloc_free", f"{delta / 1000:+.2f} us ({base / 1000:.2f} us plain)", ok,
           delta_ns=delta, plain_ns=base, plain=plain, with_lib=with_lib)
    assert ok, f"a 1 MiB alloc+free pair costs {delta / 1000:+.2f} us more with the library"
