"""The Python mirror (webhook.node.region) and the C header describe the same bytes."""

from __future__ import annotations

import dataclasses
import random
import subprocess

import pytest

from webhook.node import region as mirror
from webhook.node.region import (
    DeviceSlot,
    ProcessUsage,
    Region,
    RegionError,
    encode_region,
    parse_region,
    read_region,
)

GIB = 1 << 30


def c_output(built) -> list[list[str]]:
    out = subprocess.run([str(built / "tests" / "region_layout"), "layout"], capture_output=True,
                         text=True, check=True).stdout
    # the NVML structs' lines are test_paths.py's (against pynvml)
    return [line.split() for line in out.splitlines() if not line.startswith("nvml")]


def c_layout(built) -> dict[str, tuple[int, ...]]:
    """``name -> (offset, size)`` of each field, ``struct -> (size,)`` of each struct."""
    return {words[0]: tuple(int(n) for n in words[1:])
            for words in c_output(built) if words[0] != "constant"}


def c_constants(built) -> dict[str, int]:
    return {words[1]: int(words[2]) for words in c_output(built) if words[0] == "constant"}


@pytest.mark.parametrize(("prefix", "fields"), [("R", mirror.HEADER_FIELDS),
                                                 ("D", mirror.DEVICE_FIELDS),
                                                 ("P", mirror.PROC_FIELDS)])
def test_every_field_has_the_same_offset_and_size_in_c_and_python(built, prefix, fields):
    c = {k.split(".", 1)[1]: v for k, v in c_layout(built).items() if k.startswith(prefix + ".")}
    py = mirror.field_layout(fields)
    if prefix == "R":  # the arrays after the header are described by DEVICE/PROC
        c.pop("devices")
        c.pop("procs")
    assert py == c


def test_sizes_and_constants_agree(built):
    c = c_layout(built)
    assert c["region"] == (mirror.REGION_SIZE,)
    assert c["device"] == (mirror.DEVICE.size,)
    assert c["proc"] == (mirror.PROC.size,)
    assert c["R.devices"] == (mirror.DEVICES_OFFSET, mirror.MAX_DEVICES * mirror.DEVICE.size)
    assert c["R.procs"] == (mirror.PROCS_OFFSET, mirror.MAX_PROCS * mirror.PROC.size)
    assert c_constants(built) == {"MAGIC": mirror.MAGIC, "VERSION": mirror.VERSION,
                      "MAX_DEVICES": mirror.MAX_DEVICES, "MAX_PROCS": mirror.MAX_PROCS,
                      "PROC_LIVE": mirror.PROC_LIVE, "TOKEN_BASE": mirror.TOKEN_BASE}


def test_a_region_written_by_c_is_read_by_python(built, tmp_path):
    path = tmp_path / "region"
    subprocess.run([str(built / "tests" / "region_layout"), "write", str(path)], check=True)
    region = read_region(path)
    assert (region.pod_uid, region.pod_name, region.namespace, region.container) == (
        "0b7f6c9e-1111-2222-3333-444455556666", "trainer-0", "ml", "main")
    assert region.devices == tuple(
        DeviceSlot(index=d + 2, uuid=f"GPU-{d:08d}-aaaa-bbbb-cccc-dddddddddddd",
                   limit_bytes=10 * GIB + d, used_bytes=3 * GIB + d, sm_limit=30 + d,
                   busy_ns=123456789 * (d + 1), sm_scale_milli=1000 + 100 * d,
                   idle_power_mw=90000)
        for d in range(2))
    # (a token noted, not held: nobody locks the file's byte)
    assert region.processes == (ProcessUsage(pid=4242, used_bytes=(GIB, 2 * GIB), host_pid=3000000,
                                             measured_ns=(5_000_000_000, 7), pidns=4026532000,
                                             start_time=123456, token=4242, slot=5,
                                             token_held=False),)


def test_a_region_written_by_python_is_read_by_c(built, tmp_path):
    path = tmp_path / "region"
    path.write_bytes(encode_region(Region(
        pod_uid="uid-1", pod_name="web-7", namespace="prod", container="app",
        devices=(DeviceSlot(index=0, uuid="GPU-x", limit_bytes=5 * GIB, used_bytes=GIB,
                            sm_limit=25, busy_ns=99, sm_scale_milli=1314),
                 DeviceSlot(index=3, uuid="GPU-y", limit_bytes=0, used_bytes=7, sm_limit=0,
                            busy_ns=0)),
        processes=(ProcessUsage(pid=11, used_bytes=(GIB, 7), host_pid=4_000_000,
                                measured_ns=(123, 1 << 40)),))))
    out = subprocess.run([str(built / "tests" / "region_layout"), "read", str(path)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [
        f"magic 1 version {mirror.VERSION} size {mirror.REGION_SIZE} count 2",
        "identity uid-1|web-7|prod|app",
        f"device GPU-x {5 * GIB} {GIB} 25 99 0 1314",
        "device GPU-y 0 7 0 0 3 0",
        f"proc 11 {GIB} 7 4000000 123 {1 << 40}",
    ]


def test_a_region_written_by_the_library_is_read_by_python(lab):
    lab.run("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "x"),
            CUDA_DEVICE_MEMORY_LIMIT="2g", GPUSLICE_CONTAINER="main")
    region = lab.region()
    assert region.container == "main"
    assert region.devices[0].uuid == lab.UUID_A
    assert region.devices[0].limit_bytes == 2 * GIB


def sample() -> bytes:
    return encode_region(Region(
        pod_uid="u", pod_name="p", namespace="n", container="c",
        devices=(DeviceSlot(index=0, uuid="GPU-1", limit_bytes=GIB, used_bytes=1, sm_limit=30,
                            busy_ns=5),),
        processes=(ProcessUsage(pid=7, used_bytes=(1,), host_pid=8, measured_ns=(9,)),)))


def test_round_trip_through_the_encoder():
    data = sample()
    assert len(data) == mirror.REGION_SIZE
    assert encode_region(parse_region(data)) == data


def as_version_1(data: bytes) -> bytes:
    """The same region in version 1's layout (process slots without host_pid / measured_ns)."""
    size = mirror.PROCS_OFFSET + mirror.MAX_PROCS * mirror.PROC_V1.size
    out = bytearray(data[:mirror.PROCS_OFFSET]) + bytearray(size - mirror.PROCS_OFFSET)
    out[8:16] = (1).to_bytes(4, "little") + size.to_bytes(4, "little")
    for i in range(mirror.MAX_PROCS):
        pid, state, ns, start, *rest = mirror.PROC.unpack_from(
            data, mirror.PROCS_OFFSET + i * mirror.PROC.size)
        mirror.PROC_V1.pack_into(out, mirror.PROCS_OFFSET + i * mirror.PROC_V1.size, pid, state,
                                 ns, start, *rest[:mirror.MAX_DEVICES])
    return bytes(out)


def test_a_version_1_region_of_a_container_started_before_an_upgrade_is_still_read():
    old = as_version_1(sample())
    assert len(old) < mirror.REGION_SIZE
    new = parse_region(sample())
    assert parse_region(old) == dataclasses.replace(new, processes=tuple(
        dataclasses.replace(p, host_pid=0, measured_ns=()) for p in new.processes))
    with pytest.raises(RegionError, match="truncated"):
        parse_region(old[:-1])


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:1000], "truncated"),
    (lambda b: b"\1" + b"\0" * 7 + b[8:], "bad magic"),
    # no magic yet (the library writes it last) or empty: being initialised, RegionNotReady
    (lambda b: b"\0" * 8 + b[8:], "being initialised"),
    (lambda b: b"", "being initialised"),
    (lambda b: b[:8] + (3).to_bytes(4, "little") + b[12:], "version"),
    (lambda b: b[:8] + (0).to_bytes(4, "little") + b[12:], "version"),
    (lambda b: b[:12] + (99).to_bytes(4, "little") + b[16:], "geometry"),
    (lambda b: b[:24] + (17).to_bytes(4, "little") + b[28:], "device_count"),
    (lambda b: b[:128] + b"x" * 64 + b[192:], "NUL"),
    (lambda b: b[:576] + b"\xff\xfe" + b[578:], "UTF-8"),
])
def test_a_damaged_region_raises_region_error(damage, message):
    with pytest.raises(RegionError, match=message):
        parse_region(damage(sample()))


def test_random_damage_never_raises_anything_but_region_error():
    rng = random.Random(1234)
    base = bytearray(sample())
    for _ in range(300):
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(0, 3200)] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[:rng.randrange(len(data))]
        try:
            parse_region(bytes(data))
        except RegionError:
            pass


def test_an_unreadable_path_raises_region_error(tmp_path):
    with pytest.raises(RegionError):
        read_region(tmp_path / "missing")
    with pytest.raises(RegionError):
        read_region(tmp_path)  # a directory


def test_encoding_rejects_what_does_not_fit():
    too_long = Region(pod_uid="u" * 64, pod_name="p", namespace="n", container="c", devices=(),
                      processes=())
    with pytest.raises(RegionError):
        encode_region(too_long)
    negative = Region(pod_uid="u", pod_name="p", namespace="n", container="c",
                      devices=(DeviceSlot(0, "GPU", -1, 0, 0, 0),), processes=())
    with pytest.raises(RegionError):
        encode_region(negative)
