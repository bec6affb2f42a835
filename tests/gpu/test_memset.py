"""Real GPU, no library: do memsets occupy the GPU's multiprocessors as kernels do?

The compute limit charges kernels' GPU time; an async memset queued between two kernels is
charged with them (it may run as a kernel), but a memset on a stream that drained before its
next launch, and a stream of memsets alone, are not (interposer README, "Work between kernels
that no hook marks").  Whether that leaves SM time unpaced depends on how the driver runs a
memset: as a kernel (NVML then gives the process a share of SM time for it) or on a copy engine
(none).  One informational row, run last (conftest.ORDER): memsets of 1 GiB alone for 5 s while
the agent's compute sampler watches, as it would a container's."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu import harness
from gpu.harness import record
from gpu.nvmlwatch import Nvml, ShareWatch

pytestmark = pytest.mark.gpu

SECONDS = 5


def test_memsets_alone_as_nvml_sees_them(nvml: Nvml, gpubench: Path) -> None:
    with ShareWatch(float(SECONDS - 1)) as shares:
        result = harness.run([str(gpubench), "memset", "1024", str(SECONDS * 1000)],
                             harness.plain_env(), SECONDS + 20)
    seen = shares.summary()
    share = seen["share_pct"]
    share_text = "not judged" if share is None else f"{share:.0f} %"
    record("memset_share", f"{result['gb_per_s']:,.0f} GB/s of 1 GiB memsets alone; NVML's "
           f"share of SM time: {share_text}", None, result=result, nvml_share=seen)
