"""A region file written over while the container runs.

Every process of a container can write its region file (it is shared, mode 0666). What a
tenant writes there must never lift the cap and must never crash or hang a process that merely
reads it: a device count past the table, a device table full of other devices, a damaged lock, a
slot that names no process, a compute clock set far ahead. The library repairs what it can and
otherwise falls back to a region of the process's own (no memory at all for a pod's process).
"""

from __future__ import annotations

import os
import struct
import time

import pytest

from webhook.node import region as layout

GIB = 1 << 30
CUDA_ERROR_OUT_OF_MEMORY = 2
HEADER = layout.field_layout(layout.HEADER_FIELDS)
DEVICE = layout.field_layout(layout.DEVICE_FIELDS)
PROC = layout.field_layout(layout.PROC_FIELDS)
MUTEX_KIND = 16  # glibc x86-64 pthread_mutex_t: __lock, __count, __owner, __nusers, __kind


def write(lab, offset: int, fmt: str, *values) -> None:
    """Overwrite bytes of the region in place (the file keeps its boot id: no reset)."""
    with open(lab.region_path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<" + fmt, *values))


def device_field(slot: int, name: str) -> int:
    return layout.DEVICES_OFFSET + slot * layout.DEVICE.size + DEVICE[name][0]


def proc_field(slot: int, name: str) -> int:
    return layout.PROCS_OFFSET + slot * layout.PROC.size + PROC[name][0]


def holder(lab, *then: str, **env: str):
    """A process of the container holding 1 GiB until ``go`` appears, then running ``then``."""
    proc = lab.start("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "held"),
                     "waitfile", str(lab.tmp / "go"), *then, **env)
    lab.wait_for(lab.tmp / "held")
    return proc


def let_go(lab, proc):
    (lab.tmp / "go").touch()
    res = lab.finish(proc)
    assert res.returncode == 0, res.stderr
    return res


def limits_file(lab) -> dict[str, str | None]:
    path = lab.tmp / "limits"
    path.write_text(f"CUDA_DEVICE_MEMORY_LIMIT=4g\nCUDA_DEVICE_MEMORY_SHARED_CACHE={lab.region_path}\n")
    return {"GPUSLICE_LIMITS_FILE": str(path), "CUDA_DEVICE_MEMORY_LIMIT": None}


# how a process gets its 4 GiB cap: its env alone, a pod's env (managed), a pod's limits file
MODES = {
    "env": {"CUDA_DEVICE_MEMORY_LIMIT": "4g"},
    "pod": {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "GPUSLICE_POD_UID": "u-1"},
    "file": None,
}


def mode_env(lab, mode: str) -> dict[str, str | None]:
    return dict(MODES[mode]) if MODES[mode] is not None else limits_file(lab)


def test_a_device_count_past_the_table_is_read_within_it(lab):
    # the count is kept while another process is attached; every loop over it stops at the table
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_SM_LIMIT": "30"}
    proc = holder(lab, **env)
    for count in (17, 2300, 0xFFFFFFFF):
        write(lab, HEADER["device_count"][0], "I", count)
        res = lab.run("init", "ctx", "0", "alloc", "1g", "launch", "3", "sync", "meminfo", timeout=30, **env)
        assert res.returncode == 0, (count, res.stderr)
        assert res.rc("alloc") == 0 and res.rc("launch") == 0
    let_go(lab, proc)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_device_table_full_of_other_devices_lifts_no_cap(lab, mode):
    env = mode_env(lab, mode)
    proc = holder(lab, **env)
    for slot in range(layout.MAX_DEVICES):
        write(lab, device_field(slot, "uuid"), "64s", f"GPU-not-here-{slot}".encode())
    write(lab, HEADER["device_count"][0], "I", layout.MAX_DEVICES)
    res = lab.run("init", "ctx", "0", "alloc", "6g", "alloc", "1g", "meminfo", timeout=30, **env)
    let_go(lab, proc)
    assert res.returncode == 0, res.stderr
    assert "region has no room for device" in res.stderr
    assert res.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY  # before: granted, no cap at all
    # its own region: a pod's process is granted nothing, a plain process its own cap
    assert res.rc("alloc", 1) == (0 if mode == "env" else CUDA_ERROR_OUT_OF_MEMORY)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_damaged_lock_is_reinitialised(lab, mode):
    env = mode_env(lab, mode)
    lab.run("init", **env)
    write(lab, HEADER["lock"][0] + MUTEX_KIND, "I", 0xFFFF)  # pthread_mutex_lock: EINVAL
    write(lab, HEADER["device_count"][0], "I", 0)            # the device must be added under it
    res = lab.run("init", "ctx", "0", "alloc", "6g", "alloc", "1g", "meminfo", timeout=30, **env)
    assert res.returncode == 0, res.stderr
    assert "region lock damaged: reinitialising it" in res.stderr
    assert res.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY  # before: the device had no slot, no cap
    assert res.rc("alloc", 1) == 0  # the shared region works again
    assert res.values("meminfo")[1] == 4 * GIB  # the view's total is the cap, not the device


def test_a_live_slot_without_a_process_is_reclaimed(lab):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "4g"}
    lab.run("init", **env)
    pidns = os.stat("/proc/self/ns/pid").st_ino
    for pid in (0, -1):  # kill(0, 0) and kill(-1, 0) ask about process groups, which exist
        slot = 7 + pid
        write(lab, proc_field(slot, "pid"), "iIQQ", pid, layout.PROC_LIVE, pidns, 0)
        write(lab, proc_field(slot, "used_bytes"), "Q", GIB + GIB // 2)
    write(lab, device_field(0, "used_bytes"), "Q", 3 * GIB)
    res = lab.run("init", "ctx", "0", "alloc", "2g", **env)
    assert res.rc("alloc") == 0, res.stderr  # before: 3 GiB held for good by nobody


def test_a_limits_file_that_is_not_a_plain_file_is_distrusted_not_waited_on(lab):
    path = lab.tmp / "limits"
    os.mkfifo(path)  # opening it for reading would wait for a writer
    res = lab.run("init", "ctx", "0", timeout=20, GPUSLICE_LIMITS_FILE=str(path),
                  FAKE_CUDA_CTX_BYTES="100m")
    assert "cannot be trusted: it is not a plain file" in res.stderr
    assert res.rc("ctx") == CUDA_ERROR_OUT_OF_MEMORY  # a distrusted file grants nothing


def test_a_compute_clock_set_far_ahead_is_reset(release_lab):
    lab = release_lab
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_SM_LIMIT": "30", "FAKE_CUDA_KERNEL_US": "1000"}
    for ahead in (10**15, 2**64 - 1):  # 11 days; the largest value (the sum would wrap)
        (lab.tmp / "go").unlink(missing_ok=True)
        (lab.tmp / "held").unlink(missing_ok=True)
        proc = lab.start("init", "ctx", "0", "launch", "5", "touch", str(lab.tmp / "held"),
                         "waitfile", str(lab.tmp / "go"), "launch", "50", "sync", **env)
        lab.wait_for(lab.tmp / "held")
        write(lab, device_field(0, "throttle_vt_ns"), "Q", min(time.monotonic_ns() + ahead, 2**64 - 1))
        res = let_go(lab, proc)
        assert "compute limit's clock was" in res.stderr and "reset" in res.stderr
        assert res.rc("launch", 1) == 0


HAMI_CORE_REGION_FLAG = 19920718
"""HAMi-core's shared cache starts with this int32 (its initialized_flag) once set up."""


def test_a_hami_core_shared_cache_at_the_region_path_is_left_alone(lab):
    # CUDA_DEVICE_MEMORY_SHARED_CACHE is HAMi-core's name too: the same environment can name a
    # file HAMi-core's processes use.  It was taken for a fresh region and written over (HAMi's
    # flag, its semaphore and its usage table gone under its live processes).
    hami = struct.pack("<i", HAMI_CORE_REGION_FLAG) + bytes(range(256)) * 64
    lab.region_path.write_bytes(hami)
    res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert lab.region_path.read_bytes() == hami
    assert res.rc("alloc") == 0 and res.values("meminfo") == [3 * GIB, 4 * GIB]  # its own cap
    assert any("HAMi-core" in line and str(lab.region_path) in line
               for line in res.stderr.splitlines()), res.stderr


def test_a_hami_core_shared_cache_grants_a_pods_process_nothing(lab):
    hami = struct.pack("<i", HAMI_CORE_REGION_FLAG) + bytes(4096)
    lab.region_path.write_bytes(hami)
    res = lab.run("init", "ctx", "0", "alloc", "1g", **mode_env(lab, "pod"))
    assert lab.region_path.read_bytes() == hami
    assert res.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY
