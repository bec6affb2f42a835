"""Real GPU, the cap as the outside world sees it: NVML in a process without the library,
watching every capped run of the session before it (conftest.ORDER: the fills of PyTorch, CuPy
and JAX to OOM, the views' nvidia-smi holder, the processes' runs); the rows that run after it
(JAX's default pool, graph memory, a green context, expandable segments) check their own
outside figure against the cap."""

from __future__ import annotations

import pytest
from gpu.fills import OUTSIDE, Fills
from gpu.harness import CAP_MIB, record

pytestmark = pytest.mark.gpu


def test_outside_usage_never_exceeds_cap(fills: Fills) -> None:
    fills.fill("torch")  # the reference run: 256 MiB chunks to OOM, then small ones
    runs = list(OUTSIDE)
    worst = max(runs, key=lambda run: run["max_mib"])
    by_run = {run["label"]: run["max_mib"] for run in runs}
    ok = worst["max_mib"] <= CAP_MIB
    record("outside_usage",
           f"{worst['max_mib']:,.0f} MiB max ({worst['label']}; {len(runs)} runs, "
           f"{worst['method']})", ok, worst=worst, runs=runs)
    assert ok, f"usage seen from outside reached {worst['max_mib']:,.0f} MiB: {by_run}"
