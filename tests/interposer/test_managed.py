"""Webhook-managed containers (GPUSLICE_POD_UID set): env a tenant injects cannot loosen the slice.

The webhook writes CUDA_DEVICE_MEMORY_LIMIT or GPUSLICE_MEMORY_PERCENT, CUDA_DEVICE_SM_LIMIT
and the region path as explicit env entries, which win over ``envFrom``; anything else a
tenant's ConfigMap or Secret injects is still visible to the library. Without GPUSLICE_POD_UID
the HAMi-core semantics stay (indexed limits override, the byte limit wins).
"""

from __future__ import annotations

import pytest

GIB = 1 << 30
MIB = 1 << 20
MANAGED = {"GPUSLICE_POD_UID": "0b7f-uid", "GPUSLICE_CONTAINER": "main"}
RAISING = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_LIMIT_0": "8g",
           "CUDA_DEVICE_SM_LIMIT": "30", "CUDA_DEVICE_SM_LIMIT_0": "100"}


def warnings(res, word: str) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if "warning:" in ln and word in ln]


def test_managed_container_ignores_indexed_limits_and_warns_once(lab):
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", **RAISING, **MANAGED)
    assert res.values("meminfo")[1] == GIB
    assert res.values("nvml")[0] == GIB
    assert lab.region().devices[0].sm_limit == 30
    assert len(warnings(res, "CUDA_DEVICE_")) == 1, res.stderr


def test_indexed_limits_still_override_without_a_pod_uid(lab):
    res = lab.run("init", "ctx", "0", "meminfo", **RAISING)
    assert res.values("meminfo")[1] == 8 * GIB
    assert lab.region().devices[0].sm_limit == 0  # CUDA_DEVICE_SM_LIMIT_0=100: no limit
    assert not warnings(res, "CUDA_DEVICE_")


def test_managed_container_takes_the_smaller_of_byte_limit_and_percentage(lab):
    # a percentage pod (the webhook wrote 25%) with a byte limit injected from envFrom, and a
    # byte-limit pod with a percentage injected: neither injection can raise the cap
    injected = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_MEMORY_PERCENT="25",
                       CUDA_DEVICE_MEMORY_LIMIT="12g", **MANAGED)
    assert injected.values("meminfo")[1] == 4 * GIB
    assert len(warnings(injected, "GPUSLICE_MEMORY_PERCENT")) == 1
    injected = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_MEMORY_PERCENT="100",
                       CUDA_DEVICE_MEMORY_LIMIT="2g", **MANAGED)
    assert injected.values("meminfo")[1] == 2 * GIB
    zero = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_MEMORY_PERCENT="25",
                   CUDA_DEVICE_MEMORY_LIMIT="0", **MANAGED)
    assert zero.values("meminfo")[1] == 4 * GIB  # "0" (no cap) does not lift the percentage


def test_the_byte_limit_wins_over_the_percentage_without_a_pod_uid(lab):
    res = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_MEMORY_PERCENT="25",
                  CUDA_DEVICE_MEMORY_LIMIT="12g")
    assert res.values("meminfo")[1] == 12 * GIB


def test_managed_container_ignores_real_library_overrides(lab):
    # pointing the library at another "real" libcuda would take the driver away from the hooks;
    # managed, the driver's own library (here the fake on LD_LIBRARY_PATH) is used
    minimal = str(lab.build / "fake" / "minimal" / "libcuda.so.1")
    res = lab.run("init", "ctx", "0", "alloc", "2g", "meminfo", GPUSLICE_REAL_LIBCUDA=minimal,
                  GPUSLICE_REAL_LIBNVML=minimal, CUDA_DEVICE_MEMORY_LIMIT="1g", **MANAGED)
    assert res.rc("alloc") == 2  # refused by the cap, so the hooks reached the driver
    assert res.values("meminfo") == [GIB, GIB]
    assert len(warnings(res, "GPUSLICE_REAL_LIB")) == 2


def test_managed_container_keeps_the_default_reconcile_margin(lab):
    res = lab.run("init", "ctx", "0", "launchk", "1", "fill", "256m", "meminfo",
                  GPUSLICE_RECONCILE_MARGIN="0", CUDA_DEVICE_MEMORY_LIMIT="1g",
                  FAKE_CUDA_CTX_BYTES="100m", FAKE_CUDA_LAUNCH_BYTES="85m", **MANAGED)
    assert res.values("fill") == [3]  # 100 + 85 + 3 x 256 MiB: the 85 MiB were seen in time
    assert len(warnings(res, "GPUSLICE_RECONCILE_MARGIN")) == 1


@pytest.mark.parametrize("api", ["procaddr", "ptsz", "dlsym"])
@pytest.mark.parametrize("how", ["pod-uid", "limits-file"])
def test_a_real_library_override_naming_the_program_does_not_unhook_it_when_managed(lab, api, how):
    # the dlsym override trusted the file GPUSLICE_REAL_LIBCUDA / _LIBNVML named as the driver
    # even where the library ignored the variable: naming the program itself handed its own
    # lookups the driver's functions, and three allocations of 600 MiB passed a 1 GiB cap
    # (16 GiB shown, NVML's whole device too)
    me = lab.command()[0]
    env = dict(MANAGED) if how == "pod-uid" else {}
    if how == "limits-file":
        path = lab.tmp / "limits"
        path.write_text(f"CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_SHARED_CACHE={lab.region_path}\n")
        env["GPUSLICE_LIMITS_FILE"] = str(path)
    res = lab.run("init", "ctx", "0", "alloc", "600m", "alloc", "600m", "async", "600m", "meminfo",
                  "nvml", "0", api=api, GPUSLICE_REAL_LIBCUDA=me, GPUSLICE_REAL_LIBNVML=me,
                  CUDA_DEVICE_MEMORY_LIMIT="1g", **env)
    assert [rc for rc, _ in res.of("alloc")] == [0, 2]
    assert res.rc("async") == 2
    assert res.values("meminfo") == [GIB - 600 * MIB, GIB]
    assert res.values("nvml")[0] == GIB
    assert len(warnings(res, "GPUSLICE_REAL_LIB")) == 2
