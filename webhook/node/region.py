"""Read (and, for tests, write) a container's region file: the Python mirror of the C layout.

The interposer (``interposer/include/gpuslice_region.h``) keeps one region per container: the
pod/container identity, per GPU the cap, the usage summed over the container's processes, the
compute limit and the GPU time the throttle measured, and per process its usage per GPU. The
agent reads it for metrics; it never writes it. ``tests/interposer/test_region_layout.py``
checks that every offset and size below matches the C header.

The reader takes no lock: a field that a process is changing may be read mid-change (each
64-bit field is read whole). Anything that does not parse as a region raises
:class:`RegionError`, never ``struct.error`` or ``UnicodeDecodeError``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

MAGIC = 0x4543494C53555047  # b"GPUSLICE" as a little-endian u64
VERSION = 1
MAX_DEVICES = 16
MAX_PROCS = 1024
UUID_LEN = 64
POD_NAME_LEN = 256
ID_LEN = 64
LOCK_BYTES = 64
PROC_LIVE = 1

# struct gpuslice_region
HEADER = struct.Struct("<QIIIIII32x")  # magic version size max_devices max_procs device_count flags
LOCK_OFFSET = 64
POD_UID_OFFSET = 128
POD_NAME_OFFSET = POD_UID_OFFSET + ID_LEN
NAMESPACE_OFFSET = POD_NAME_OFFSET + POD_NAME_LEN
CONTAINER_OFFSET = NAMESPACE_OFFSET + ID_LEN
DEVICES_OFFSET = CONTAINER_OFFSET + ID_LEN
# struct gpuslice_device: uuid limit used total busy vt ctx_footprint sm_limit index reserved[2]
DEVICE = struct.Struct(f"<{UUID_LEN}sQQQQQQII8x")
PROCS_OFFSET = DEVICES_OFFSET + MAX_DEVICES * DEVICE.size
# struct gpuslice_proc: pid state pidns start_time used[16] reserved
PROC = struct.Struct(f"<iIQQ{MAX_DEVICES}Q8x")
REGION_SIZE = PROCS_OFFSET + MAX_PROCS * PROC.size


class RegionError(Exception):
    """The file is not a readable region: truncated, bad magic/version, or inconsistent."""


@dataclass(frozen=True)
class DeviceSlot:
    """One GPU of the container. ``limit_bytes`` 0 means no cap; ``sm_limit`` 0 no compute limit."""

    index: int
    uuid: str
    limit_bytes: int
    used_bytes: int
    sm_limit: int
    busy_ns: int


@dataclass(frozen=True)
class ProcessUsage:
    """A live process of the container and its usage per device slot (same order as devices)."""

    pid: int
    used_bytes: tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """The parsed region: identity, devices and live processes."""

    pod_uid: str
    pod_name: str
    namespace: str
    container: str
    devices: tuple[DeviceSlot, ...]
    processes: tuple[ProcessUsage, ...]


def _text(raw: bytes, what: str) -> str:
    end = raw.find(b"\0")
    if end < 0:
        raise RegionError(f"{what} is not NUL-terminated")
    try:
        return raw[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegionError(f"{what} is not UTF-8") from exc


def _encode_text(value: str, size: int, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) >= size or b"\0" in raw:
        raise RegionError(f"{what} does not fit {size - 1} bytes without NUL")
    return raw.ljust(size, b"\0")


def parse_region(data: bytes) -> Region:
    """Parse the bytes of a region file (see :func:`read_region`)."""
    if len(data) < REGION_SIZE:
        raise RegionError(f"region is truncated: {len(data)} bytes, need {REGION_SIZE}")
    magic, version, size, max_devices, max_procs, count, _flags = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RegionError(f"bad magic {magic:#x}")
    if version != VERSION:
        raise RegionError(f"unsupported region version {version} (this reader knows {VERSION})")
    if (size, max_devices, max_procs) != (REGION_SIZE, MAX_DEVICES, MAX_PROCS):
        raise RegionError(f"inconsistent geometry size={size} devices={max_devices} "
                          f"procs={max_procs}")
    if count > MAX_DEVICES:
        raise RegionError(f"device_count {count} exceeds {MAX_DEVICES}")
    devices = []
    for i in range(count):
        uuid, limit, used, _total, busy, _vt, _ctx, sm, index = DEVICE.unpack_from(
            data, DEVICES_OFFSET + i * DEVICE.size)
        if sm > 100:
            raise RegionError(f"device {i}: sm_limit {sm} out of range")
        devices.append(DeviceSlot(index=index, uuid=_text(uuid, f"device {i} uuid"),
                                  limit_bytes=limit, used_bytes=used, sm_limit=sm,
                                  busy_ns=busy))
    processes = []
    for i in range(MAX_PROCS):
        pid, state, _ns, _start, *used = PROC.unpack_from(data, PROCS_OFFSET + i * PROC.size)
        if state != PROC_LIVE:
            continue
        if pid <= 0:
            raise RegionError(f"process slot {i}: live with pid {pid}")
        processes.append(ProcessUsage(pid=pid, used_bytes=tuple(used[:count])))
    return Region(
        pod_uid=_text(data[POD_UID_OFFSET:POD_UID_OFFSET + ID_LEN], "pod_uid"),
        pod_name=_text(data[POD_NAME_OFFSET:POD_NAME_OFFSET + POD_NAME_LEN], "pod_name"),
        namespace=_text(data[NAMESPACE_OFFSET:NAMESPACE_OFFSET + ID_LEN], "namespace"),
        container=_text(data[CONTAINER_OFFSET:CONTAINER_OFFSET + ID_LEN], "container"),
        devices=tuple(devices),
        processes=tuple(processes),
    )


def read_region(path: str | os.PathLike[str]) -> Region:
    """Read and parse the region file at ``path``; :class:`RegionError` if it is not one."""
    try:
        with open(path, "rb") as f:
            data = f.read(REGION_SIZE)
    except OSError as exc:
        raise RegionError(f"cannot read region {os.fspath(path)!r}: {exc.strerror}") from exc
    return parse_region(data)


def encode_region(region: Region) -> bytes:
    """The exact C layout of ``region`` (lock zeroed, unknown fields 0), for tests and fixtures."""
    try:
        return _encode(region)
    except struct.error as exc:
        raise RegionError(f"value does not fit the layout: {exc}") from exc


def _encode(region: Region) -> bytes:
    if len(region.devices) > MAX_DEVICES:
        raise RegionError(f"more than {MAX_DEVICES} devices")
    if len(region.processes) > MAX_PROCS:
        raise RegionError(f"more than {MAX_PROCS} processes")
    buf = bytearray(REGION_SIZE)
    HEADER.pack_into(buf, 0, MAGIC, VERSION, REGION_SIZE, MAX_DEVICES, MAX_PROCS,
                     len(region.devices), 0)
    buf[POD_UID_OFFSET:POD_UID_OFFSET + ID_LEN] = _encode_text(region.pod_uid, ID_LEN, "pod_uid")
    buf[POD_NAME_OFFSET:POD_NAME_OFFSET + POD_NAME_LEN] = _encode_text(
        region.pod_name, POD_NAME_LEN, "pod_name")
    buf[NAMESPACE_OFFSET:NAMESPACE_OFFSET + ID_LEN] = _encode_text(
        region.namespace, ID_LEN, "namespace")
    buf[CONTAINER_OFFSET:CONTAINER_OFFSET + ID_LEN] = _encode_text(
        region.container, ID_LEN, "container")
    for i, dev in enumerate(region.devices):
        if not 0 <= dev.sm_limit <= 100:
            raise RegionError(f"device {i}: sm_limit {dev.sm_limit} out of range")
        DEVICE.pack_into(buf, DEVICES_OFFSET + i * DEVICE.size,
                         _encode_text(dev.uuid, UUID_LEN, "uuid"), dev.limit_bytes,
                         dev.used_bytes, 0, dev.busy_ns, 0, 0, dev.sm_limit, dev.index)
    for i, proc in enumerate(region.processes):
        if len(proc.used_bytes) > MAX_DEVICES:
            raise RegionError(f"process {proc.pid}: more than {MAX_DEVICES} usage values")
        used = list(proc.used_bytes) + [0] * (MAX_DEVICES - len(proc.used_bytes))
        PROC.pack_into(buf, PROCS_OFFSET + i * PROC.size, proc.pid, PROC_LIVE, 0, 0, *used)
    return bytes(buf)
