"""Real GPU, compute share: bf16 8192x8192 matmul throughput under CUDA_DEVICE_SM_LIMIT
50/30/10 against the same program without the library, and PyTorch tiny-op cost with the
library and no limits (the runtime's cuGetProcAddress path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import record

pytestmark = pytest.mark.gpu

SECONDS = "5"
POINTS = 5


def _matmul(env: dict[str, str], tiny: bool) -> dict[str, Any]:
    args = ["matmul", SECONDS] + (["--tiny", "20000"] if tiny else [])
    return harness.run(harness.workload(*args), env, 45)


@pytest.fixture(scope="module")
def baseline(nvml: Any) -> dict[str, Any]:
    """The same matmul (and tiny ops) with no library: 100%."""
    return _matmul(harness.plain_env(), tiny=True)


def test_torch_tiny_ops_with_library_unlimited_within_5_percent(
        baseline: dict[str, Any], lib: Path) -> None:
    unlimited = _matmul(harness.capped_env(harness.new_region("tiny")), tiny=True)
    ratio = unlimited["tiny_ns"] / baseline["tiny_ns"]
    matmul_pct = 100 * unlimited["tflops"] / baseline["tflops"]
    ok = ratio <= 1.05
    record("torch_tiny", f"{ratio:.3f}x ({baseline['tiny_ns'] / 1000:.2f} us/op plain); "
           f"matmul {matmul_pct:.1f}%", ok, ratio=ratio, baseline=baseline, unlimited=unlimited)
    assert ok, f"tiny torch ops cost {ratio:.3f}x with the library"


@pytest.mark.parametrize("limit", [50, 30, 10])
def test_sm_limit_caps_matmul_throughput(limit: int, baseline: dict[str, Any],
                                         lib: Path) -> None:
    env = harness.capped_env(harness.new_region(f"sm{limit}"), sm=limit)
    limited = _matmul(env, tiny=False)
    pct = 100 * limited["tflops"] / baseline["tflops"]
    ok = abs(pct - limit) <= POINTS
    record(f"sm_{limit}", f"{pct:.1f}% ({limited['tflops']:,.0f} of {baseline['tflops']:,.0f} "
           "TFLOP/s)", ok, percent=pct, limited=limited, baseline=baseline)
    assert ok, f"SM limit {limit}% gave {pct:.1f}% of the unlimited throughput"
