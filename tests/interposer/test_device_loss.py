"""A GPU NVML cannot reach while CUDA still lists it (fallen off the bus: NVML_ERROR_GPU_IS_LOST),
and NVML that does not initialise at all (the host's driver upgraded under running containers:
LIB_RM_VERSION_MISMATCH; DRIVER_NOT_LOADED): every device keeps its own cap, in the region and
in what cuMemGetInfo says, and nothing crashes."""

from __future__ import annotations

import pytest

GIB = 1 << 30
CUDA_ERROR_OUT_OF_MEMORY = 2


def two_gpus(lab) -> dict[str, str]:
    """HAMi-core's per-device limits (device 0: 2 GiB, device 1: 5 GiB), no container-wide one."""
    return {"FAKE_CUDA_DEVICES": f"{lab.UUID_A}=16g,{lab.UUID_B}=16g",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "2g", "CUDA_DEVICE_MEMORY_LIMIT_1": "5g"}


@pytest.mark.parametrize("lost", ["A", "B"])
def test_a_gpu_nvml_lost_keeps_its_own_cap(lab, lost):
    """Before: the device NVML could not reach took index (NVML's count of the others) + its
    CUDA ordinal: GPU-B (index 1) became index 2, for which no limit is set: uncapped; GPU-A
    (index 0) became index 1 and took GPU-B's 5 GiB."""
    uuid = lab.UUID_A if lost == "A" else lab.UUID_B
    res = lab.run("init", "ctx", "0", "meminfo", "ctx", "1", "meminfo", "alloc", "6g",
                  FAKE_NVML_LOST=uuid, **two_gpus(lab))
    assert res.returncode == 0, res.stderr
    assert [v[1] for _, v in res.of("meminfo")] == [2 * GIB, 5 * GIB]
    assert res.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY  # over device 1's 5 GiB
    by_uuid = {d.uuid: d for d in lab.region().devices}
    assert (by_uuid[lab.UUID_A].index, by_uuid[lab.UUID_A].limit_bytes) == (0, 2 * GIB)
    assert (by_uuid[lab.UUID_B].index, by_uuid[lab.UUID_B].limit_bytes) == (1, 5 * GIB)


@pytest.mark.parametrize("code", [9, 18])  # DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH
def test_nvml_that_does_not_initialise_leaves_every_cap(lab, code):
    res = lab.run("init", "ctx", "0", "meminfo", "alloc", "3g", "ctx", "1", "meminfo",
                  "alloc", "4g", "alloc", "2g", "nvml", "0",
                  FAKE_NVML_INIT_ERROR=str(code), **two_gpus(lab))
    assert res.returncode == 0, res.stderr
    assert [v[1] for _, v in res.of("meminfo")] == [2 * GIB, 5 * GIB]
    assert [rc for rc, _ in res.of("alloc")] == [CUDA_ERROR_OUT_OF_MEMORY, 0,
                                                 CUDA_ERROR_OUT_OF_MEMORY]
    assert res.rc("nvml") != 0  # the program's own NVML calls fail as the driver's do


def test_a_container_wide_cap_holds_on_a_gpu_nvml_lost(lab):
    res = lab.run("init", "ctx", "0", "meminfo", "alloc", "2g", "ctx", "1", "meminfo",
                  FAKE_NVML_LOST=lab.UUID_A, CUDA_DEVICE_MEMORY_LIMIT="1g",
                  FAKE_CUDA_DEVICES=f"{lab.UUID_A}=16g,{lab.UUID_B}=16g")
    assert [v[1] for _, v in res.of("meminfo")] == [GIB, GIB]
    assert res.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY


UUID_C = "GPU-cccccccc-0000-1111-2222-333333333333"


@pytest.mark.parametrize("visible, lost, caps", [
    ("2,0", "C", [5, 2]),      # reordered: the lost GPU first, named by its index
    ("1,0", "A", [3, 2]),      # the lost GPU second
    ("2", "C", [5]),           # a subset of the lost GPU alone
    ("2,1", "BC", [5, 3]),     # two lost, each named by its index
    ("1,2", "BC", [3, 5]),
    ("UUID_C,UUID_A", "C", [5, 2]),  # named by UUID: the lowest index NVML could not read
])
def test_a_gpu_nvml_lost_keeps_its_cap_under_visible_devices(lab, visible, lost, caps):
    uuids = {"A": lab.UUID_A, "B": lab.UUID_B, "C": UUID_C}
    visible = visible.replace("UUID_C", UUID_C).replace("UUID_A", lab.UUID_A)
    cmds = []
    for i in range(len(caps)):
        cmds += ["ctx", str(i), "meminfo"]
    res = lab.run("init", *cmds, CUDA_VISIBLE_DEVICES=visible,
                  FAKE_NVML_LOST=",".join(uuids[x] for x in lost),
                  FAKE_CUDA_DEVICES=f"{lab.UUID_A}=16g,{lab.UUID_B}=16g,{UUID_C}=16g",
                  CUDA_DEVICE_MEMORY_LIMIT_0="2g", CUDA_DEVICE_MEMORY_LIMIT_1="3g",
                  CUDA_DEVICE_MEMORY_LIMIT_2="5g")
    assert res.returncode == 0, res.stderr
    assert [v[1] // GIB for _, v in res.of("meminfo")] == caps
