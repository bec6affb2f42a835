"""What the container is told: cuMemGetInfo, cuDeviceTotalMem and NVML show the slice.

Also the device index <-> UUID mapping (CUDA_VISIBLE_DEVICES reorders and subsets) and the
environment's limit syntax.
"""

from __future__ import annotations

import pytest

from webhook.node.region import DeviceSlot, ProcessUsage, Region, encode_region

MIB = 1 << 20
GIB = 1 << 30
NVML_ERROR_INVALID_ARGUMENT = 2
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


def test_views_report_the_cap_as_total_and_the_containers_usage_as_used(lab):
    res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", "totalmem", "0", "nvml", "0",
                  "nvml2", "0", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.values("meminfo") == [9 * GIB, 10 * GIB]
    assert res.values("totalmem") == [10 * GIB]
    total, used, free = res.values("nvml")
    assert (total, used, free) == (10 * GIB, GIB, 9 * GIB)
    assert res.values("nvml2") == [10 * GIB, 0, GIB, 9 * GIB]  # total reserved used free


def test_usage_of_every_process_of_the_container_is_in_the_view(lab):
    holder = lab.start("init", "ctx", "0", "alloc", "3g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="10g")
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", "nvml", "0",
                  CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.values("meminfo") == [6 * GIB, 10 * GIB]
    assert res.values("nvml")[1] == 4 * GIB
    (lab.tmp / "go").touch()
    lab.finish(holder)


def test_nvidia_smi_like_process_without_cuda_sees_the_slice(lab):
    holder = lab.start("init", "ctx", "0", "alloc", "2g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="10g")
    lab.wait_for(lab.tmp / "held")
    # NVML only, through dlsym on a dlopen'ed libnvidia-ml (as nvidia-smi does)
    res = lab.run("nvml", "0", "nvml2", "0", api="dlsym", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.values("nvml") == [10 * GIB, 2 * GIB, 8 * GIB]
    assert res.values("nvml2") == [10 * GIB, 0, 2 * GIB, 8 * GIB]
    (lab.tmp / "go").touch()
    lab.finish(holder)
    # it did not register itself as a process of the container
    assert [p.pid for p in lab.region().processes] == []


def test_an_nvml_only_program_shutting_nvml_down_finds_it_shut_down(lab):
    # the library's own look at the devices gives its NVML reference back: the program's
    # nvmlShutdown balancing its nvmlInit leaves NVML uninitialised, as without the library
    # (it answered queries still: the library's reference kept it up)
    res = lab.run("nvml", "0", "nvmlshutdown", api="dlsym", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.values("nvml")[0] == 10 * GIB
    assert res.rc("nvmlshutdown") == 0 and res.values("nvmlshutdown") == [1]  # UNINITIALIZED


def test_views_never_underflow_when_usage_exceeds_the_cap(lab):
    # a region whose usage is above its cap (e.g. a context charged after the fact)
    lab.region_path.write_bytes(encode_region(Region(
        pod_uid="u", pod_name="p", namespace="n", container="c",
        devices=(DeviceSlot(index=0, uuid=lab.UUID_A, limit_bytes=GIB, used_bytes=3 * GIB,
                            sm_limit=0, busy_ns=0),),
        processes=(ProcessUsage(pid=1, used_bytes=(3 * GIB,)),))))
    # pid 1 lives in another pid namespace than ours only on a host; in a sandbox it may be ours:
    # the views must hold in either case
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", "nvml2", "0",
                  CUDA_DEVICE_MEMORY_LIMIT="1g")
    free, total = res.values("meminfo")
    assert total == GIB and 0 <= free <= GIB
    total, used, free = res.values("nvml")
    assert total == GIB and used <= total and free == total - used
    total, _reserved, used, free = res.values("nvml2")
    assert total == GIB and used <= total and free == total - used


def test_free_memory_is_never_more_than_the_device_really_has(lab):
    # another tenant (no library) holds 15 GiB of the 16 GiB device
    other = lab.start("init", "ctx", "0", "alloc", "15g", "touch", str(lab.tmp / "held"),
                      "waitfile", str(lab.tmp / "go"), LD_PRELOAD=None)
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.values("meminfo") == [GIB, 10 * GIB]
    (lab.tmp / "go").touch()
    lab.finish(other)


def test_no_limit_leaves_the_views_as_the_driver_reports_them(lab):
    res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", "totalmem", "0", "nvml", "0")
    assert res.values("meminfo") == [15 * GIB, 16 * GIB]
    assert res.values("totalmem") == [16 * GIB]
    assert res.values("nvml")[0] == 16 * GIB


def test_memory_percent_resolves_against_the_devices_real_total(lab):
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", GPUSLICE_MEMORY_PERCENT="25",
                  FAKE_CUDA_DEVICES=f"{lab.UUID_A}=80g")
    assert res.values("meminfo") == [20 * GIB, 20 * GIB]
    assert res.values("nvml")[0] == 20 * GIB


def test_memory_percent_resolves_against_nvmls_total_like_the_node_inventory(lab):
    # on an H200 NVML's total (143,771 MiB) is 615 MiB above cuDeviceTotalMem's (143,156); the
    # agent publishes NVML's and the extender resolves gpumem-percentage against it, in whole
    # MiB rounded down: the cap is the same whole MiB (8,253.5 MiB before, half a MiB more
    # than the extender reserved; tests/interposer/test_pipeline.py)
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", GPUSLICE_MEMORY_PERCENT="10",
                  FAKE_CUDA_DEVICES=f"{lab.UUID_A}=80g", FAKE_NVML_TOTAL_EXTRA="615m")
    cap = (80 * 1024 + 615) * 10 // 100 * MIB
    assert res.values("meminfo") == [cap, cap]
    assert res.values("nvml")[0] == cap


def test_memory_percent_falls_back_to_the_drivers_total_without_nvml(lab):
    minimal = str(lab.build / "fake" / "minimal" / "libcuda.so.1")  # an "NVML" without symbols
    res = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_MEMORY_PERCENT="10",
                  GPUSLICE_REAL_LIBNVML=minimal, FAKE_CUDA_DEVICES=f"{lab.UUID_A}=80g",
                  FAKE_NVML_TOTAL_EXTRA="615m")
    assert res.values("meminfo") == [8 * GIB, 8 * GIB]


def test_limit_suffixes_follow_hami_syntax(lab):
    for value, expected in [("2048m", 2 * GIB), ("3g", 3 * GIB), ("1048576k", GIB),
                            (str(5 * GIB), 5 * GIB)]:
        res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT=value)
        assert res.values("meminfo")[1] == expected, value


@pytest.mark.parametrize(("env", "cap"), [
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2G"}, 2 * GIB),                    # HAMi-core: either case
    ({"CUDA_DEVICE_MEMORY_LIMIT": "3072M"}, 3 * GIB),
    ({"CUDA_DEVICE_MEMORY_LIMIT": "1048576K"}, GIB),
    ({"CUDA_DEVICE_MEMORY_LIMIT": str(3 * GIB)}, 3 * GIB),           # no suffix: bytes
    ({"CUDA_DEVICE_MEMORY_LIMIT": "8000m"}, 8000 << 20),            # what HAMi's plugin writes
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_0": "3G"}, 3 * GIB),  # index wins
    ({"CUDA_DEVICE_MEMORY_LIMIT_0": "4g"}, 4 * GIB),                 # index alone
    ({"CUDA_DEVICE_MEMORY_LIMIT": "0"}, 16 * GIB),                    # 0: no limit, as HAMi-core
], ids=["G", "M", "K", "bytes", "plugin-m", "indexed-over-global", "indexed-alone", "zero"])
def test_memory_limits_written_for_hami_core_mean_the_same_here(lab, env, cap):
    res = lab.run("init", "ctx", "0", "meminfo", **env)
    assert res.values("meminfo")[1] == cap, res.stderr


def test_an_unparsable_limit_is_reported_and_ignored(lab):
    res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="lots")
    assert res.values("meminfo")[1] == 16 * GIB
    assert "gpuslice:" in res.stderr and "CUDA_DEVICE_MEMORY_LIMIT" in res.stderr


def two_gpus(lab) -> dict[str, str]:
    return {"FAKE_CUDA_DEVICES": f"{lab.UUID_A}=16g,{lab.UUID_B}=16g",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "2g", "CUDA_DEVICE_MEMORY_LIMIT_1": "5g"}


def test_per_device_limits_follow_the_device_when_cuda_visible_devices_reorders(lab):
    env = two_gpus(lab)
    plain = lab.run("init", "ctx", "0", "meminfo", "ctx", "1", "meminfo", "totalmem", "0",
                    "totalmem", "1", **env)
    assert [v[1] for _, v in plain.of("meminfo")] == [2 * GIB, 5 * GIB]
    swapped = lab.run("init", "ctx", "0", "meminfo", "ctx", "1", "meminfo", "totalmem", "0",
                      "totalmem", "1", CUDA_VISIBLE_DEVICES="1,0", **env)
    assert [v[1] for _, v in swapped.of("meminfo")] == [5 * GIB, 2 * GIB]
    assert [v[0] for _, v in swapped.of("totalmem")] == [5 * GIB, 2 * GIB]


def test_a_subset_of_devices_charges_the_right_device(lab):
    env = two_gpus(lab)
    holder = lab.start("init", "ctx", "0", "alloc", "1g", "totalmem", "0", "touch",
                       str(lab.tmp / "held"), "waitfile", str(lab.tmp / "go"),
                       CUDA_VISIBLE_DEVICES="1", **env)
    lab.wait_for(lab.tmp / "held")
    by_uuid = {d.uuid: d for d in lab.region().devices}
    assert by_uuid[lab.UUID_B].used_bytes == GIB and by_uuid[lab.UUID_B].limit_bytes == 5 * GIB
    assert by_uuid[lab.UUID_A].used_bytes == 0 and by_uuid[lab.UUID_A].limit_bytes == 2 * GIB
    # processes with different CUDA_VISIBLE_DEVICES share the same per-device budget
    other = lab.run("init", "ctx", "0", "meminfo", "ctx", "1", "meminfo", **env)
    assert [v for _, v in other.of("meminfo")] == [[2 * GIB, 2 * GIB], [4 * GIB, 5 * GIB]]
    (lab.tmp / "go").touch()
    assert lab.finish(holder).values("totalmem") == [5 * GIB]


def test_nvml_null_out_parameter_is_an_invalid_argument_not_a_crash(lab):
    res = lab.run("nvmlnull", CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert res.of("nvmlnull") == [(NVML_ERROR_INVALID_ARGUMENT, [NVML_ERROR_INVALID_ARGUMENT])]


def test_the_region_carries_the_containers_identity_and_limits(lab):
    lab.run("init", "ctx", "0", "alloc", "1g", "sleep", "0", CUDA_DEVICE_MEMORY_LIMIT="4g",
            CUDA_DEVICE_SM_LIMIT="30", GPUSLICE_POD_UID="0b7f-uid", GPUSLICE_POD_NAME="trainer-0",
            GPUSLICE_POD_NAMESPACE="ml", GPUSLICE_CONTAINER="main")
    region = lab.region()
    assert (region.pod_uid, region.pod_name, region.namespace, region.container) == (
        "0b7f-uid", "trainer-0", "ml", "main")
    dev = region.devices[0]
    assert (dev.index, dev.uuid, dev.limit_bytes, dev.sm_limit) == (0, lab.UUID_A, 4 * GIB, 30)
    assert region.processes == ()  # the process exited and returned its usage
    assert dev.used_bytes == 0


def test_without_nvml_an_integer_cuda_visible_devices_still_picks_the_right_limit(lab):
    minimal = str(lab.build / "fake" / "minimal" / "libcuda.so.1")  # an "NVML" without symbols
    res = lab.run("init", "ctx", "0", "meminfo", CUDA_VISIBLE_DEVICES="1",
                  GPUSLICE_REAL_LIBNVML=minimal, **two_gpus(lab))
    assert res.values("meminfo") == [5 * GIB, 5 * GIB]
    assert [d.uuid for d in lab.region().devices] == [lab.UUID_B]


def test_nvml_never_reports_more_free_than_the_device_has(lab):
    # another container holds 13 GiB of the 16 GiB device: our 8 GiB cap with 1 GiB used leaves
    # 7 GiB by the cap, but only 2 GiB are free on the device (cuMemGetInfo said so; NVML said
    # 7 GiB before)
    other = lab.start("init", "ctx", "0", "alloc", "13g", "touch", str(lab.tmp / "held"),
                      "waitfile", str(lab.tmp / "go"),
                      CUDA_DEVICE_MEMORY_SHARED_CACHE=str(lab.tmp / "other-region"))
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", "nvml", "0", "nvml2", "0",
                  CUDA_DEVICE_MEMORY_LIMIT="8g")
    (lab.tmp / "go").touch()
    assert lab.finish(other).rc("alloc") == 0
    free = res.values("meminfo")[0]
    assert free == 2 * GIB
    # the 5 GiB of the cap the device cannot give are in v1's used (it includes what is
    # reserved: used + free = total) and in v2's reserved (reserved + used + free = total);
    # before, both said used 1 GiB, free 2 GiB of 8 GiB, 5 GiB nowhere
    assert res.values("nvml") == [8 * GIB, 6 * GIB, free]
    assert res.values("nvml2") == [8 * GIB, 5 * GIB, GIB, free]  # total reserved used free


@pytest.mark.parametrize(("env", "cap"), [
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_0": "2gb"}, 2),  # bad per-device
    ({"CUDA_DEVICE_MEMORY_LIMIT": " 2g "}, 2),                                     # YAML spacing
    ({"GPUSLICE_MEMORY_PERCENT": " 25"}, 4),
    ({"GPUSLICE_MEMORY_PERCENT": "+25"}, 16),                                      # rejected
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2 g"}, 16),                                     # rejected
    # HAMi-core takes a per-device value only above 0 (an indexed 0 lifted the cap: 16 GiB)
    ({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_0": "0"}, 2),
    ({"CUDA_DEVICE_MEMORY_LIMIT_0": "0", "CUDA_DEVICE_MEMORY_LIMIT_1": "3g"}, 16),  # none for it
], ids=["bad-indexed-falls-back", "spaces-trimmed", "percent-spaces", "percent-sign", "inner-space",
        "zero-indexed-falls-back", "zero-indexed-alone"])
def test_limit_values_are_read_strictly_and_a_bad_per_device_one_keeps_the_container_cap(lab, env,
                                                                                        cap):
    res = lab.run("init", "ctx", "0", "meminfo", **env)
    assert res.values("meminfo")[1] == cap * GIB, res.stderr


@pytest.mark.parametrize(("env", "limit"), [
    ({"CUDA_DEVICE_SM_LIMIT": "30"}, 30),
    ({"CUDA_DEVICE_SM_LIMIT": " 30 "}, 30),                                # YAML spacing
    ({"CUDA_DEVICE_SM_LIMIT": "30%"}, 30),
    ({"CUDA_DEVICE_SM_LIMIT": "30", "CUDA_DEVICE_SM_LIMIT_0": "20"}, 20),  # per device
    ({"CUDA_DEVICE_SM_LIMIT": "30", "CUDA_DEVICE_SM_LIMIT_0": "0"}, 30),   # 0: not set
    ({"CUDA_DEVICE_SM_LIMIT": "30", "CUDA_DEVICE_SM_LIMIT_0": "x"}, 30),   # bad: falls back
    ({"CUDA_DEVICE_SM_LIMIT": "30k"}, 0),                                  # rejected: no limit
    ({"CUDA_DEVICE_SM_LIMIT": "100"}, 0),
    ({"CUDA_DEVICE_SM_LIMIT": "0"}, 0),
], ids=["plain", "spaces", "percent-sign", "indexed", "zero-indexed", "bad-indexed", "suffix",
        "all", "zero"])
def test_compute_limit_values_are_read_like_the_memory_limits(lab, env, limit):
    # a value with spaces, or a per-device one that is 0 or unreadable, turned the limit off
    lab.run("init", "sleep", "0", **env)
    assert lab.region().devices[0].sm_limit == limit


@pytest.mark.parametrize(("env", "limit"), [
    ({"CUDA_DEVICE_SM_LIMIT": "150"}, 0),
    ({"CUDA_DEVICE_SM_LIMIT": "101%"}, 0),
    ({"CUDA_DEVICE_SM_LIMIT": "30", "CUDA_DEVICE_SM_LIMIT_0": "150"}, 30),
], ids=["above-100", "above-100-percent-sign", "indexed-above-100"])
def test_a_compute_limit_above_100_is_an_error_not_a_silent_lift(lab, env, limit):
    # 150 was taken as "no limit" without a word, and a per-device 150 lifted the container's 30 %
    # (the documented range is 0..100; an unreadable per-device value keeps the container-wide one)
    res = lab.run("init", "sleep", "0", **env)
    assert lab.region().devices[0].sm_limit == limit
    value = next(v for k, v in env.items() if v != "30")
    assert any("gpuslice:" in line and "error" in line and f"'{value}'" in line and "0..100" in line
               for line in res.stderr.splitlines()), res.stderr


@pytest.mark.parametrize("nvml", ["r535", "."], ids=["r535", "later"])
def test_the_process_list_of_an_r535_driver_is_read_with_its_own_entry_size(lab, nvml):
    # R535/R545 drivers fill nvmlDeviceGetComputeRunningProcesses_v3's list with 32-byte entries
    # (nvmlProcessInfo_v3_t of nvml.h 12.2); read as 24-byte ones, every entry past the first is
    # garbage. Beside another tenant listed first, the process never found itself: the code its
    # kernel loaded (85 MiB, outside the hooks) was never charged, and its view said so
    other = lab.start("init", "ctx", "0", "alloc", "2g", "touch", str(lab.tmp / "other"),
                      "waitfile", str(lab.tmp / "go"), LD_PRELOAD=None,
                      FAKE_CUDA_CTX_BYTES="100m")
    lab.wait_for(lab.tmp / "other")
    real = str(lab.build / "fake" / nvml / "libnvidia-ml.so.1")
    proc = lab.start("init", "ctx", "0", "launchk", "1", "alloc", "800m", "meminfo", "touch",
                     str(lab.tmp / "held"), "waitfile", str(lab.tmp / "go"),
                     GPUSLICE_REAL_LIBNVML=real, CUDA_DEVICE_MEMORY_LIMIT="1g",
                     FAKE_CUDA_CTX_BYTES="100m", FAKE_CUDA_LAUNCH_BYTES=f"{85 * MIB}")
    lab.wait_for(lab.tmp / "held")
    outside = lab.run("nvml", "0", LD_PRELOAD=None).values("nvml")[1]
    region = lab.used()
    (lab.tmp / "go").touch()
    res = lab.finish(proc)
    lab.finish(other)
    mine = outside - 2 * GIB - 100 * MIB
    assert mine == 100 * MIB + 85 * MIB + 800 * MIB
    assert region == mine, res.stderr
    free, total = res.values("meminfo")
    assert total - free == mine


def test_a_whole_gpu_slice_reads_in_nvml_as_the_driver_answers(lab):
    # an H200-like device: NVML's total is 615 MiB above CUDA's, reserved by the driver; a
    # 100 % slice's cap is NVML's total.  The driver's answers with 1 GiB in use: v2 total
    # 16 GiB + 615 MiB, reserved 615 MiB, used 1 GiB, free 15 GiB; v1 used 1 GiB + 615 MiB.
    # Before, the view said reserved 0 (v2) and used 1 GiB (v1): 615 MiB of the total were
    # nowhere, and nvidia-smi -q's Reserved + Used + Free did not make its Total
    h200 = {"FAKE_NVML_TOTAL_EXTRA": "615m", "FAKE_NVML_RESERVED": "615m",
            "GPUSLICE_MEMORY_PERCENT": "100"}
    res = lab.run("init", "ctx", "0", "alloc", "1g", "nvml", "0", "nvml2", "0", **h200)
    outside = lab.run("init", "ctx", "0", "alloc", "1g", "nvml", "0", "nvml2", "0",
                      LD_PRELOAD=None, **h200)
    total = 16 * GIB + 615 * MIB
    assert res.values("nvml2") == [total, 615 * MIB, GIB, 15 * GIB]
    assert res.values("nvml") == [total, GIB + 615 * MIB, 15 * GIB]
    assert res.values("nvml2") == outside.values("nvml2")
    assert res.values("nvml") == outside.values("nvml")


def test_every_nvml_answer_adds_up_while_the_container_allocates_and_frees(lab):
    # another process of the container allocates and frees 8 GiB of the 16 GiB device over and
    # over (a 16 GiB cap: free is bounded by the device's); an NVML-only reader's every answer
    # must add up.  The driver's figures and the region's are read a moment apart: a free
    # between them gave used 0 (the region) with free 8 GiB (the driver, before the free), 8 GiB
    # of the 16 nowhere
    stop = lab.tmp / "stop"
    churn = lab.start("init", "ctx", "0", "churn", "8g", str(stop),
                      CUDA_DEVICE_MEMORY_LIMIT="16g")
    try:
        res = lab.run("nvmlloop", "20000", "0", api="dlsym", CUDA_DEVICE_MEMORY_LIMIT="16g")
    finally:
        stop.touch()
    churned = lab.finish(churn)
    assert churned.rc("churn") == 0 and churned.values("churn")[0] > 0
    assert res.rc("nvmlloop") == 0
    bad1, bad2 = res.values("nvmlloop")[:2]
    assert (bad1, bad2) == (0, 0), res.values("nvmlloop")


def test_memory_percent_resolves_per_device_against_each_devices_total(lab):
    # two devices of different sizes: 25 % is a quarter of each one's own NVML total, in every
    # view, whatever CUDA_VISIBLE_DEVICES shows and in an NVML-only process alike
    env = {"FAKE_CUDA_DEVICES": f"{lab.UUID_A}=16g,{lab.UUID_B}=80g",
           "FAKE_NVML_TOTAL_EXTRA": "615m", "GPUSLICE_MEMORY_PERCENT": "25"}
    cap_a, cap_b = (16 * 1024 + 615) // 4 * MIB, (80 * 1024 + 615) // 4 * MIB  # whole MiB
    res = lab.run("init", "ctx", "0", "meminfo", "ctx", "1", "meminfo", "totalmem", "0",
                  "totalmem", "1", "nvml", "0", "nvml", "1", **env)
    assert [v for _, v in res.of("meminfo")] == [[cap_a, cap_a], [cap_b, cap_b]]
    assert [v[0] for _, v in res.of("totalmem")] == [cap_a, cap_b]
    assert [v[0] for _, v in res.of("nvml")] == [cap_a, cap_b]
    only_b = lab.run("init", "ctx", "0", "meminfo", "nvml", "1", CUDA_VISIBLE_DEVICES="1", **env)
    assert only_b.values("meminfo") == [cap_b, cap_b] and only_b.values("nvml")[0] == cap_b
    smi = lab.run("nvml", "0", "nvml", "1", api="dlsym", **env)
    assert [v[0] for _, v in smi.of("nvml")] == [cap_a, cap_b]
    assert {d.uuid: d.limit_bytes for d in lab.region().devices} == {lab.UUID_A: cap_a,
                                                                     lab.UUID_B: cap_b}


def test_nvml_before_cuda_and_nvml_alone_in_a_container_without_a_region_yet(lab):
    # nvidia-smi first, in a container whose region does not exist yet: it sees the cap and
    # makes the region (the container's devices and caps) without registering in it
    assert not lab.region_path.exists()
    smi = lab.run("nvml", "0", "nvml2", "0", api="dlsym", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert smi.values("nvml") == [4 * GIB, 0, 4 * GIB]
    assert smi.values("nvml2") == [4 * GIB, 0, 0, 4 * GIB]
    region = lab.region()
    assert region.processes == () and region.devices[0].limit_bytes == 4 * GIB
    # a program that asks NVML before it starts CUDA: the same view, then its own usage in it
    res = lab.run("nvml", "0", "init", "ctx", "0", "alloc", "1g", "nvml", "0", "nvml2", "0",
                  "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.values("nvml", 0) == [4 * GIB, 0, 4 * GIB]
    assert res.values("nvml", 1) == [4 * GIB, GIB, 3 * GIB]
    assert res.values("nvml2") == [4 * GIB, 0, GIB, 3 * GIB]
    assert res.values("meminfo") == [3 * GIB, 4 * GIB]
    assert lab.used() == 0  # it returned its usage at exit: it had registered


@pytest.mark.parametrize("api", ["direct", "procaddr", "legacy"])
def test_one_omitted_meminfo_output_gets_the_other_capped_as_the_driver_does(lab, api):
    # libnvoptix (OptiX's denoiser, shipped with the driver) asks cuMemGetInfo_v2(NULL, &total)
    # and llama.cpp asked cudaMemGetInfo(&free, NULL): the driver answers the one asked for
    # (HAMi-core #321, #333; llama.cpp #20499), so a refusal here fails OptiX's initialisation
    # in the container only; both omitted stays the driver's own error
    cmds = ["init", "ctx", "0", "alloc", "1g", "meminfo1", "meminfo", "nullargs"]
    if api == "legacy":
        res = lab.run("legacy", "1", *cmds[:-1], "nullargs1", CUDA_DEVICE_MEMORY_LIMIT="3g")
    else:
        res = lab.run(*cmds, api=api, CUDA_DEVICE_MEMORY_LIMIT="3g")
    assert res.returncode == 0, res.stderr
    assert res.of("meminfo1") == [(0, [3 * GIB, 0, 2 * GIB])]
    assert res.values("meminfo") == [2 * GIB, 3 * GIB]
    null = res.of("nullargs1" if api == "legacy" else "nullargs")[0]
    assert null[1][0] == 1  # cuMemGetInfo[_v2](NULL, NULL): CUDA_ERROR_INVALID_VALUE


def test_processes_seeing_different_gpus_as_device_0_by_uuid_charge_each_its_own(lab):
    # two processes of one container, each with CUDA_VISIBLE_DEVICES naming another GPU by UUID:
    # both call it device 0, and each allocation belongs to the GPU of that UUID (HAMi #1218,
    # HAMi #320: there both were charged to the container's first GPU)
    env = two_gpus(lab)
    procs = [lab.start("init", "ctx", "0", "alloc", size, "touch", str(lab.tmp / f"held{i}"),
                       "waitfile", str(lab.tmp / "go"), CUDA_VISIBLE_DEVICES=uuid, **env)
             for i, (uuid, size) in enumerate([(lab.UUID_B, "300m"), (lab.UUID_A, "100m")])]
    for i in range(2):
        lab.wait_for(lab.tmp / f"held{i}")
    by_uuid = {d.uuid: d.used_bytes for d in lab.region().devices}
    assert by_uuid == {lab.UUID_A: 100 * MIB, lab.UUID_B: 300 * MIB}
    seen = lab.run("init", "ctx", "0", "meminfo", CUDA_VISIBLE_DEVICES=lab.UUID_B, **env)
    assert seen.values("meminfo") == [5 * GIB - 300 * MIB, 5 * GIB]
    (lab.tmp / "go").touch()
    for proc in procs:
        assert lab.finish(proc).returncode == 0


def test_more_gpus_than_the_region_has_slots_are_named_not_passed_over_silently(lab):
    # A container that sees 18 GPUs (given some other way: the webhook grants at most 16): the
    # region has 16 slots, and devices 16 and 17 get none, so they run with no cap. The first
    # 16 stay capped; the two left are named once at discovery (before: not a word).
    uuids = [f"GPU-{i:08x}-0000-1111-2222-333333333333" for i in range(18)]
    env = {"FAKE_CUDA_DEVICES": ",".join(f"{u}=16g" for u in uuids), "CUDA_DEVICE_MEMORY_LIMIT": "1g"}
    res = lab.run("init", "ctx", "0", "alloc", "2g", "ctx", "15", "alloc", "2g", "ctx", "17",
                  "alloc", "2g", **env)
    assert [rc for rc, _ in res.of("alloc")] == [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY,
                                                  CUDA_SUCCESS]
    assert [d.uuid for d in lab.region().devices] == uuids[:16]
    said = [line for line in res.stderr.splitlines() if "more than the 16 gpuslice can cap" in line]
    assert len(said) == 1, res.stderr
    assert "sees 18 GPUs" in said[0] and "2 of them" in said[0] and uuids[16] in said[0]
    assert "NO memory or compute cap" in said[0]
