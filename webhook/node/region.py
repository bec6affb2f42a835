"""Read (and, for tests, write) a container's region file: the Python mirror of the C layout.

The interposer (``interposer/include/gpuslice_region.h``) keeps one region per container: the
pod/container identity, per GPU the cap, the usage summed over the container's processes, the
compute limit and the GPU time the throttle measured, and per process its usage per GPU (and,
from version 2, its host pid and the GPU time its launches measured, which the processes of the
container read for the compute limit's time-slice correction; the agent does not). The agent
reads it for metrics; it never writes it. Version 1 regions are still read. ``tests/interposer/test_region_layout.py``
checks that every offset and size below matches the C header.

The reader takes no lock: a field that a process is changing may be read mid-change (each
64-bit field is read whole). A live process slot may be a dead process's (killed, or ended
without its exit handlers) until a process of the container sweeps it: :func:`read_region`
notes whether each slot's liveness token is held, the cheap half of the interposer's judgement
(``interposer/src/liveness.c``); :mod:`webhook.node.liveness` makes the rest. Anything that
does not parse as a region raises :class:`RegionError`, never ``struct.error`` or
``UnicodeDecodeError``; a region being initialised (empty, or its magic not written yet)
raises its subclass :class:`RegionNotReady`.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass, field, replace

from webhook.node.files import NotPlainFile, open_plain_file, read_fd

MAGIC = 0x4543494C53555047  # b"GPUSLICE" as a little-endian u64
VERSION = 2
OLDEST_VERSION = 1  # version 1 (process slots without host_pid / measured_ns) is still read
MAX_DEVICES = 16
MAX_PROCS = 1024
UUID_LEN = 64
POD_NAME_LEN = 256
ID_LEN = 64
LOCK_BYTES = 64
PROC_LIVE = 1
TOKEN_BASE = 1 << 30
"""A slot's liveness token: an open-file-description lock on byte ``TOKEN_BASE + slot index``
of the region file, held by the process that registered in the slot (exec closes it)."""

# The C structs, field by field: (name, struct format).  Padding fields start with "_".
HEADER_FIELDS = (
    ("magic", "Q"), ("version", "I"), ("size", "I"), ("max_devices", "I"), ("max_procs", "I"),
    ("device_count", "I"), ("flags", "I"), ("boot_id", "16s"), ("reclaimed_ns", "Q"),
    ("_reserved0", "8x"),
    ("lock", f"{LOCK_BYTES}x"), ("pod_uid", f"{ID_LEN}s"), ("pod_name", f"{POD_NAME_LEN}s"),
    ("pod_namespace", f"{ID_LEN}s"), ("container", f"{ID_LEN}s"),
)
DEVICE_FIELDS = (
    ("uuid", f"{UUID_LEN}s"), ("limit_bytes", "Q"), ("used_bytes", "Q"), ("total_bytes", "Q"),
    ("busy_ns", "Q"), ("throttle_vt_ns", "Q"), ("ctx_footprint_bytes", "Q"), ("sm_limit", "I"),
    ("index", "I"), ("sm_scale_milli", "I"), ("idle_power_mw", "I"),
)
PROC_FIELDS = (
    ("pid", "i"), ("state", "I"), ("pidns", "Q"), ("start_time", "Q"),
    ("used_bytes", f"{MAX_DEVICES}Q"), ("host_pid", "I"), ("token", "I"),
    ("measured_ns", f"{MAX_DEVICES}Q"),
)
# Version 1: the same up to used_bytes, then 8 reserved bytes (regions of containers started
# before an upgrade of the node)
PROC_FIELDS_V1 = PROC_FIELDS[:5] + (("_reserved", "8x"),)


def _struct(fields: tuple[tuple[str, str], ...]) -> struct.Struct:
    return struct.Struct("<" + "".join(fmt for _, fmt in fields))


def field_layout(fields: tuple[tuple[str, str], ...]) -> dict[str, tuple[int, int]]:
    """``{field: (offset, size)}`` of a field table, padding fields left out."""
    layout, offset = {}, 0
    for name, fmt in fields:
        size = struct.calcsize("<" + fmt)
        if not name.startswith("_"):
            layout[name] = (offset, size)
        offset += size
    return layout


HEADER = _struct(HEADER_FIELDS)
DEVICE = _struct(DEVICE_FIELDS)
PROC = _struct(PROC_FIELDS)
PROC_V1 = _struct(PROC_FIELDS_V1)
DEVICES_OFFSET = HEADER.size
PROCS_OFFSET = DEVICES_OFFSET + MAX_DEVICES * DEVICE.size
REGION_SIZE = PROCS_OFFSET + MAX_PROCS * PROC.size
_SIZES = {1: PROCS_OFFSET + MAX_PROCS * PROC_V1.size, VERSION: REGION_SIZE}
_PROCS = {1: PROC_V1, VERSION: PROC}


class RegionError(Exception):
    """The file is not a readable region: truncated, bad magic/version, or inconsistent."""


class RegionNotReady(RegionError):
    """The file is a region being initialised: empty (created, not yet sized) or without its
    magic (sized, zeroed, fields being written: the library writes the magic last, under the
    file's flock). Not a corrupt region: what a reader meets while a container's first process
    starts, or while a region from an earlier boot is reset."""


@dataclass(frozen=True)
class DeviceSlot:
    """One GPU of the container. ``limit_bytes`` 0 means no cap; ``sm_limit`` 0 no compute limit.

    ``sm_scale_milli`` is the compute limit's clock compensation in 1/1000 (GPU time is charged
    this many times over; 0 = not estimated, i.e. 1000); ``idle_power_mw`` the lowest board power
    the library saw with the GPU idle (0 = not seen), which that estimate starts from.
    """

    index: int
    uuid: str
    limit_bytes: int
    used_bytes: int
    sm_limit: int
    busy_ns: int
    sm_scale_milli: int = 0
    idle_power_mw: int = 0


@dataclass(frozen=True)
class ProcessUsage:
    """A live process slot of the container and its usage per device slot (same order as
    devices): a process that registered and has not been seen gone by the container's own
    processes, which may have died since (see :mod:`webhook.node.liveness`).

    ``host_pid`` is the pid NVML lists it under (0 = not known, or a version-1 region; it may be
    the container's pid where the driver gives those); ``measured_ns`` the GPU time its launches
    measured per device slot (empty in version 1). Its identity: ``pid`` in the container's PID
    namespace, ``pidns`` that namespace's inode, ``start_time`` its start (ticks since boot;
    0 = not known); ``token`` = ``pid`` when it took a liveness token (0: none, e.g. on NFS).
    ``slot`` is its index in the region (None when encoding: the next one); ``token_held``
    whether :func:`read_region` found the token held (None: no token, or not asked).
    """

    pid: int
    used_bytes: tuple[int, ...]
    host_pid: int = 0
    measured_ns: tuple[int, ...] = ()
    pidns: int = 0
    start_time: int = 0
    token: int = 0
    slot: int | None = None
    token_held: bool | None = None


@dataclass(frozen=True)
class Region:
    """The parsed region: identity, devices and live processes."""

    pod_uid: str
    pod_name: str
    namespace: str
    container: str
    devices: tuple[DeviceSlot, ...]
    processes: tuple[ProcessUsage, ...]
    inode: int = field(default=0, compare=False)
    """The region file's inode number (:func:`read_region`; 0 otherwise)."""


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
    if not data or (len(data) >= 8 and data[:8] == bytes(8)):
        raise RegionNotReady("region is being initialised (empty, or no magic yet)")
    if len(data) < HEADER.size:
        raise RegionError(f"region is truncated: {len(data)} bytes, less than its header")
    (magic, version, size, max_devices, max_procs, count, _flags, _boot, _reclaimed, pod_uid,
     pod_name, namespace, container) = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise RegionError(f"bad magic {magic:#x}")
    if version not in _SIZES:
        raise RegionError(f"unsupported region version {version} (this reader knows "
                          f"{OLDEST_VERSION} to {VERSION})")
    need, proc_struct = _SIZES[version], _PROCS[version]
    if len(data) < need:
        raise RegionError(f"region is truncated: {len(data)} bytes, need {need}")
    if (size, max_devices, max_procs) != (need, MAX_DEVICES, MAX_PROCS):
        raise RegionError(f"inconsistent geometry size={size} devices={max_devices} "
                          f"procs={max_procs}")
    if count > MAX_DEVICES:
        raise RegionError(f"device_count {count} exceeds {MAX_DEVICES}")
    devices = []
    for i in range(count):
        uuid, limit, used, _total, busy, _vt, _ctx, sm, index, scale, idle = DEVICE.unpack_from(
            data, DEVICES_OFFSET + i * DEVICE.size)
        if sm > 100:
            raise RegionError(f"device {i}: sm_limit {sm} out of range")
        devices.append(DeviceSlot(index=index, uuid=_text(uuid, f"device {i} uuid"),
                                  limit_bytes=limit, used_bytes=used, sm_limit=sm,
                                  busy_ns=busy, sm_scale_milli=scale,
                                  idle_power_mw=idle))
    processes = []
    for i in range(MAX_PROCS):
        pid, state, pidns, start, *rest = proc_struct.unpack_from(
            data, PROCS_OFFSET + i * proc_struct.size)
        used = rest[:MAX_DEVICES]
        host_pid, token, measured = (rest[MAX_DEVICES], rest[MAX_DEVICES + 1],
                                     tuple(rest[MAX_DEVICES + 2:][:count])) \
            if version >= 2 else (0, 0, ())
        if state != PROC_LIVE or pid <= 0:
            # (live without a pid: a slot being registered whose state store was seen before
            # its pid's; the library's sweep passes it by too)
            continue
        processes.append(ProcessUsage(pid=pid, used_bytes=tuple(used[:count]), host_pid=host_pid,
                                      measured_ns=measured, pidns=pidns, start_time=start,
                                      token=token, slot=i))
    return Region(
        pod_uid=_text(pod_uid, "pod_uid"),
        pod_name=_text(pod_name, "pod_name"),
        namespace=_text(namespace, "namespace"),
        container=_text(container, "container"),
        devices=tuple(devices),
        processes=tuple(processes),
    )


def read_region(path: str | os.PathLike[str]) -> Region:
    """Read and parse the region file at ``path``; :class:`RegionError` if it is not one.

    The file lies in a directory its container can write: a symbolic link, FIFO or device node
    planted there is neither followed nor opened (:func:`webhook.node.files.read_plain_file`).
    Each slot with a token gets ``token_held`` (:func:`token_held`), asked after the read: a
    slot taken since by another process shows that one's token, which counts the slot as live
    (the safe side)."""
    try:
        fd = open_plain_file(path, follow=False)
    except NotPlainFile as exc:
        raise RegionError(f"region {exc}") from exc
    except OSError as exc:
        raise RegionError(f"cannot read region {os.fspath(path)!r}: {exc.strerror}") from exc
    try:
        try:
            data = read_fd(fd, REGION_SIZE)
            inode = os.fstat(fd).st_ino
        except OSError as exc:
            raise RegionError(f"cannot read region {os.fspath(path)!r}: {exc.strerror}") from exc
        region = parse_region(data)
        processes = tuple(
            replace(p, token_held=token_held(fd, p.slot))
            if p.token == p.pid and p.slot is not None else p for p in region.processes)
        return replace(region, processes=processes, inode=inode)
    finally:
        os.close(fd)


# struct flock: l_type, l_whence, (padding), l_start, l_len, l_pid, (padding): 32 bytes on
# x86_64 and aarch64 alike
_FLOCK = struct.Struct("@hhqqi4x")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)


def token_held(fd: int, slot: int) -> bool | None:
    """Whether some process holds slot ``slot``'s liveness token (a lock on byte
    ``TOKEN_BASE + slot`` of the region file open at ``fd``); None if the query fails.

    An ``F_OFD_GETLK`` query: it takes no lock and never waits (a lock held by a container's
    process cannot stall a scrape), and needs only a read-only descriptor."""
    request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, TOKEN_BASE + slot, 1, 0)
    try:
        answer = fcntl.fcntl(fd, _F_OFD_GETLK, request)
    except OSError:
        return None
    return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)


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
                     len(region.devices), 0, bytes(16), 0,
                     _encode_text(region.pod_uid, ID_LEN, "pod_uid"),
                     _encode_text(region.pod_name, POD_NAME_LEN, "pod_name"),
                     _encode_text(region.namespace, ID_LEN, "namespace"),
                     _encode_text(region.container, ID_LEN, "container"))
    for i, dev in enumerate(region.devices):
        if not 0 <= dev.sm_limit <= 100:
            raise RegionError(f"device {i}: sm_limit {dev.sm_limit} out of range")
        DEVICE.pack_into(buf, DEVICES_OFFSET + i * DEVICE.size,
                         _encode_text(dev.uuid, UUID_LEN, "uuid"), dev.limit_bytes,
                         dev.used_bytes, 0, dev.busy_ns, 0, 0, dev.sm_limit, dev.index,
                         dev.sm_scale_milli, dev.idle_power_mw)
    taken: set[int] = set()
    for i, proc in enumerate(region.processes):
        at = i if proc.slot is None else proc.slot
        if not 0 <= at < MAX_PROCS or at in taken:
            raise RegionError(f"process {proc.pid}: slot {at} out of range or taken twice")
        taken.add(at)
        if len(proc.used_bytes) > MAX_DEVICES:
            raise RegionError(f"process {proc.pid}: more than {MAX_DEVICES} usage values")
        if len(proc.measured_ns) > MAX_DEVICES:
            raise RegionError(f"process {proc.pid}: more than {MAX_DEVICES} measured values")
        used = list(proc.used_bytes) + [0] * (MAX_DEVICES - len(proc.used_bytes))
        measured = list(proc.measured_ns) + [0] * (MAX_DEVICES - len(proc.measured_ns))
        PROC.pack_into(buf, PROCS_OFFSET + at * PROC.size, proc.pid, PROC_LIVE, proc.pidns,
                       proc.start_time, *used, proc.host_pid, proc.token, *measured)
    return bytes(buf)
