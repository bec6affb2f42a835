"""The agent on a real NVIDIA GPU (opt-in: ``pytest --gpu``; run by scripts/gpu-check.sh).

What the fakes cannot show: that the pynvml calls the agent makes (XID events included) work
against a real driver, that a real GPU is discovered healthy with its real UUID and memory,
that the published annotation parses with the extender's reader, and that /metrics reports
the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.metrics import AgentCollector, AgentStatus, make_registry
from webhook.node.publish import desired_state

pytestmark = pytest.mark.gpu


def test_real_gpus_are_discovered_healthy_and_published_in_the_extenders_format(
        tmp_path: Path) -> None:
    from webhook.placement.inventory import parse_inventory
    inv = Inventory()
    try:
        d = inv.discover()
        assert d.available, d.reason
        assert d.gpus, "the driver is loaded but no GPU was found"
        for g in d.gpus:
            assert g.uuid.startswith("GPU-") and g.product and g.memory_mib > 1024
            assert g.healthy, g
        want = desired_state(d, AgentSettings(node_name="gpu-check"))
        assert [g.uuid for g in parse_inventory(want.annotation)] == [g.uuid for g in d.gpus]
        assert want.resources["nvidia.com/gpu"] == str(10 * len(d.gpus))
        samples = inv.sample()
        assert all(s.memory_total_bytes and s.memory_total_bytes >= s.gpu.memory_mib << 20
                   for s in samples)
        text = generate_latest(make_registry(AgentCollector(inv, tmp_path, AgentStatus())))
        assert b"gpuslice_nvml_available 1.0" in text
        assert f'uuid="{d.gpus[0].uuid}"'.encode() in text
        assert b"gpuslice_gpu_utilization_percent{" in text
    finally:
        inv.close()


def test_real_gpus_are_registered_for_xid_events_and_read_without_waiting() -> None:
    """The event calls work against the real driver: every GPU that reports XID events is
    registered, and a discovery reads them at once (no XID can be caused here: that an event
    names its GPU by the handle registered is not shown; the UUID is asked otherwise)."""
    import time
    inv = Inventory()
    try:
        inv.discover()
        assert inv._events is not None, "the driver made no event set"
        watched = set(inv._watched.values())
        assert watched | inv._unwatched == {g.uuid for g in inv.last.gpus}
        started = time.monotonic()
        d = inv.discover()
        assert time.monotonic() - started < 5
        assert all(g.healthy for g in d.gpus), d
    finally:
        inv.close()
