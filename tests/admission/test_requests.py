"""A container's GPU request as read from its resources: the edges of what is accepted.

The shapes and messages users see are in ``cases/*.yaml``; these pin the values at the limits,
which mutation testing (``scripts/mutants.py``) showed no case reached.
"""

from __future__ import annotations

from typing import Any

import pytest

from webhook.admission.requests import MAX_SANE_MEMORY_MIB, GpuRequest, read_request
from webhook.settings import settings_from_mapping

SETTINGS = settings_from_mapping({})


def read(limits: dict[str, Any], max_gpu_memory_mib: int | None = None
         ) -> tuple[GpuRequest | None, list[str]]:
    reasons: list[str] = []
    request = read_request({"name": "main", "resources": {"limits": limits}}, SETTINGS,
                           max_gpu_memory_mib, reasons)
    return request, reasons


def test_gpumem_up_to_the_largest_sane_figure_is_read():
    request, reasons = read({"nvidia.com/gpumem": str(MAX_SANE_MEMORY_MIB)})
    assert reasons == [] and request is not None and request.memory_mib == MAX_SANE_MEMORY_MIB
    over = MAX_SANE_MEMORY_MIB + 1
    request, reasons = read({"nvidia.com/gpumem": str(over)})
    expected = (f"nvidia.com/gpumem is {over} (= {over} MiB), more than any GPU has; it counts "
                "MiB, e.g. 8000 for about 8 GB")
    assert request is None and reasons == [expected]


def test_gpumem_up_to_the_clusters_largest_gpu_is_read():
    assert read({"nvidia.com/gpumem": "81559"}, max_gpu_memory_mib=81559)[0] is not None
    request, reasons = read({"nvidia.com/gpumem": "81560"}, max_gpu_memory_mib=81559)
    assert request is None and "the largest GPU in the cluster has 81559 MiB" in reasons[0]


@pytest.mark.parametrize("count", ["1", "2", "16"])
def test_whole_gpus_keep_their_count(count):
    # no memory or compute given: whole GPUs, as many as asked (placement picks that many)
    request, reasons = read({"nvidia.com/gpu": count})
    assert reasons == [] and request == GpuRequest(
        count=int(count), memory_mib=None, memory_percent=100, cores=100, count_given=True)


@pytest.mark.parametrize("zero", [0, "0", "0.0", "0k"])
def test_a_zero_count_in_any_spelling_asks_for_no_gpu(zero):
    assert read({"nvidia.com/gpu": zero}) == (None, [])
