"""The agent's region reader and the fixture writer at their edges.

A mutation run of ``webhook/node/region.py`` (``scripts/mutants.py``, all 58 mutants against
the node and region-layout tests) left these untested: a region of the most devices and
processes the layout holds, the 8 zero bytes of a region being initialised, slots named twice,
the reader's file descriptor, a process without a liveness token, and the inode kept out of
equality.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from webhook.node.region import (
    MAX_DEVICES,
    MAX_PROCS,
    REGION_SIZE,
    DeviceSlot,
    ProcessUsage,
    Region,
    RegionError,
    RegionNotReady,
    encode_region,
    parse_region,
    read_region,
)


def region(devices: int = 1, processes: tuple[ProcessUsage, ...] = ()) -> Region:
    slots = tuple(DeviceSlot(index=i, uuid=f"GPU-{i:08x}", limit_bytes=(i + 1) << 30,
                             used_bytes=i << 20, sm_limit=50, busy_ns=7 * i)
                  for i in range(devices))
    return Region("uid-1", "pod", "ns", "main", slots, processes)


def test_the_most_devices_and_processes_the_layout_holds_round_trip():
    procs = tuple(ProcessUsage(pid=100 + i, used_bytes=tuple(range(MAX_DEVICES)),
                               measured_ns=tuple(range(MAX_DEVICES)))
                  for i in range(MAX_PROCS))
    full = region(MAX_DEVICES, procs)
    parsed = parse_region(encode_region(full))
    assert len(parsed.devices) == MAX_DEVICES and parsed.devices == full.devices
    assert len(parsed.processes) == MAX_PROCS
    assert parsed.processes[-1].used_bytes == tuple(range(MAX_DEVICES))
    assert parsed.processes[-1].measured_ns == tuple(range(MAX_DEVICES))


@pytest.mark.parametrize("bad", [
    region(MAX_DEVICES + 1),
    region(1, tuple(ProcessUsage(pid=i + 1, used_bytes=(0,)) for i in range(MAX_PROCS + 1))),
    region(1, (ProcessUsage(pid=1, used_bytes=(0,) * (MAX_DEVICES + 1)),)),
    region(1, (ProcessUsage(pid=1, used_bytes=(0,), measured_ns=(0,) * (MAX_DEVICES + 1)),)),
    region(1, (ProcessUsage(pid=1, used_bytes=(0,), slot=3), ProcessUsage(pid=2, used_bytes=(0,), slot=3))),
    region(1, (ProcessUsage(pid=1, used_bytes=(0,), slot=MAX_PROCS),)),
], ids=["devices", "processes", "usage-values", "measured-values", "slot-twice", "slot-past-the-end"])
def test_what_the_layout_cannot_hold_is_refused(bad):
    with pytest.raises(RegionError):
        encode_region(bad)


def test_a_region_with_one_device_more_than_the_layout_is_refused():
    data = bytearray(encode_region(region(MAX_DEVICES)))
    count_at = 4 + 4 + 8 + 4 + 4  # magic, version, size, max_devices, max_procs (u32 u32 u64 u32 u32)
    assert int.from_bytes(data[count_at:count_at + 4], "little") == MAX_DEVICES
    data[count_at:count_at + 4] = (MAX_DEVICES + 1).to_bytes(4, "little")
    with pytest.raises(RegionError, match="exceeds"):
        parse_region(bytes(data))


@pytest.mark.parametrize("size", [0, 8, 64, REGION_SIZE])
def test_zeroes_are_a_region_being_initialised(size):
    # created and sized, the magic not yet written (the library writes it last)
    with pytest.raises(RegionNotReady):
        parse_region(bytes(size))


def test_reading_leaves_no_descriptor_open(tmp_path: Path):
    path = tmp_path / "region"
    path.write_bytes(encode_region(region(2)))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        read_region(path)
    assert len(os.listdir("/proc/self/fd")) == before


def test_only_a_process_with_a_liveness_token_is_asked_about_it(tmp_path: Path):
    procs = (ProcessUsage(pid=5, used_bytes=(0,), token=0),    # no token (NFS, say)
             ProcessUsage(pid=6, used_bytes=(0,), token=6))    # took one; nobody holds it now
    path = tmp_path / "region"
    path.write_bytes(encode_region(region(1, procs)))
    read = read_region(path)
    assert [p.token_held for p in read.processes] == [None, False]


def test_the_inode_does_not_make_two_equal_regions_differ(tmp_path: Path):
    data = encode_region(region(2))
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "b").write_bytes(data)
    a, b = read_region(tmp_path / "a"), read_region(tmp_path / "b")
    assert a.inode != b.inode and a == b
