"""Real GPU, VMM: PyTorch's expandable segments map 20 MiB pages made with cuMemCreate, so the
cap must follow cuMemCreate/cuMemMap/cuMemUnmap/cuMemRelease.  Runs after the bar's rows
(conftest.ORDER): the others matter more if the time budget runs short."""

from __future__ import annotations

import pytest
from gpu.fills import Fills
from gpu.harness import CAP_MIB

pytestmark = pytest.mark.gpu


def test_largest_allocation_with_expandable_segments(fills: Fills) -> None:
    fill = fills.check_largest("torch-expandable")
    outside = fill["outside"]["max_mib"]
    assert outside <= CAP_MIB, f"{outside:,.0f} MiB seen from outside > {CAP_MIB} MiB"
