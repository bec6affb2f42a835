"""Real GPU, what the library costs when nothing is throttled: empty-kernel launches and
1 MiB cuMemAlloc + cuMemFree pairs through the driver API, with the library (10 GiB cap, no
SM limit) against no library, alternating runs and taking medians.

Launch costs differ more between two processes (which core, which NUMA node, the CPU's clock
at the time) than the hook costs, so every run is pinned to the same CPU and the ratio is the
median of each round's with/without pair rather than a ratio of medians."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import median, record

pytestmark = pytest.mark.gpu

ROUNDS = 5
LAUNCH_ROUNDS = 7


def _pinned(args: list[str]) -> list[str]:
    """``args`` under ``taskset`` on one CPU this process may use (unchanged without taskset)."""
    taskset = shutil.which("taskset")
    cpus = sorted(os.sched_getaffinity(0))
    if taskset is None or len(cpus) < 2:
        return args
    return [taskset, "-c", str(cpus[len(cpus) // 2]), *args]


def _alternate(args: list[str], timeout: float, rounds: int = ROUNDS
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``rounds`` runs each without and with the library, alternating which goes first."""
    with_lib_env = harness.capped_env(harness.new_region("overhead"))
    plain: list[dict[str, Any]] = []
    with_lib: list[dict[str, Any]] = []
    args = _pinned(args)
    for round_no in range(rounds):
        order = [("plain", harness.plain_env()), ("lib", with_lib_env)]
        for name, env in order if round_no % 2 == 0 else order[::-1]:
            result = harness.run(args, env, timeout)
            (plain if name == "plain" else with_lib).append(result)
    return plain, with_lib


def test_launch_cost_with_library_unlimited_within_5_percent(gpubench: Path, lib: Path) -> None:
    plain, with_lib = _alternate([str(gpubench), "launch", "20000", "5", "100"], 20,
                                 LAUNCH_ROUNDS)
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
    plain, with_lib = _alternate([str(gpubench), "allocfree", str(1 << 20), "3000", "5"], 20)
    base = median([r["pair_ns"] for r in plain])
    delta = median([r["pair_ns"] for r in with_lib]) - base
    ok = delta <= 2000
    record("alloc_free", f"{delta / 1000:+.2f} us ({base / 1000:.2f} us plain)", ok,
           delta_ns=delta, plain_ns=base, plain=plain, with_lib=with_lib)
    assert ok, f"a 1 MiB alloc+free pair costs {delta / 1000:+.2f} us more with the library"
