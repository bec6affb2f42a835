"""Memory and events shared between processes through the legacy CUDA IPC API.

PyTorch's torch.multiprocessing (CUDA tensors sent to other processes), vLLM's custom
all-reduce and NCCL's P2P transport map another process's ``cuMemAlloc`` memory with
``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle`` and wait for its work with
``cuIpcGetEventHandle`` / ``cuIpcOpenEventHandle``.  The library hooks none of these: the
memory is the exporter's, charged once to the exporter's container, and the importer's mapping
takes none of its own (the fake's NVML lists nothing for it, as the H200's did: the GPU check's
``ipc_import`` row, importer +0 MiB).  These tests hold the library to that on every path a
program reaches the calls by, in one container and across two, and check that the calls answer
as the driver does.
"""

from __future__ import annotations

import pytest

MIB = 1 << 20
GIB = 1 << 30
OOM = 2
APIS = ["direct", "dlsym", "procaddr", "procaddr1", "ptsz"]


@pytest.mark.parametrize("api", APIS)
def test_an_imported_allocation_is_charged_once_to_the_exporter(lab, api):
    # exporter and importer in one container (one region) under a 1 GiB cap: the exporter's
    # 600 MiB are charged once; the importer opens the handle twice (the driver hands the same
    # pointer back and counts the opens), the sampler looks at NVML meanwhile, and the rest of
    # the cap (424 MiB with the exporter's 600 and nothing else) is still the importer's
    handle, done = str(lab.tmp / "handle"), str(lab.tmp / "done")
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g"}
    exporter = lab.start("init", "ctx", "0", "alloc", "600m", "ipcget", "0", handle, "waitfile", done,
                         "meminfo", "free", "0", "meminfo", **env)
    res = lab.run("waitfile", handle, "init", "ctx", "0", "ipcopen", handle, "ipcopen", handle,
                  "sleep", "1200", "meminfo", "phys", "alloc", "424m", "alloc", "2m", "free", "2",
                  "free", "0", "free", "1", "free", "0", "meminfo", "touch", done, api=api, **env)
    out = lab.finish(exporter)
    assert out.returncode == 0 and res.returncode == 0, out.stderr + res.stderr
    assert out.rc("ipcget") == 0
    assert [rc for rc, _ in res.of("ipcopen")] == [0, 0]
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert [rc for rc, _ in res.of("free")] == [0, 0, 0, 1]  # two opens, two closes, then none
    assert res.values("phys") == [0]  # the mapping took no memory of the importer's
    seen = [GIB - vals[0] for _, vals in res.of("meminfo")]
    assert seen == [600 * MIB, 600 * MIB]
    assert [GIB - vals[0] for _, vals in out.of("meminfo")] == [600 * MIB, 0]
    assert lab.used() == 0


@pytest.mark.parametrize("api", ["direct", "procaddr"])
def test_an_allocation_imported_from_another_container_is_not_charged_to_the_importer(lab, api):
    # the importer's container (its own region) gets nothing of the exporter's 600 MiB: its
    # whole 1 GiB cap stays its own, and the exporter's container keeps its charge
    handle, done = str(lab.tmp / "handle"), str(lab.tmp / "done")
    other = lab.tmp / "other-region"
    exporter = lab.start("init", "ctx", "0", "alloc", "600m", "ipcget", "0", handle, "waitfile", done,
                         "free", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="1g")
    res = lab.run("waitfile", handle, "init", "ctx", "0", "ipcopen", handle, "sleep", "1200", "meminfo",
                  "alloc", "1g", "meminfo", "free", "1", "free", "0", "meminfo", "touch", done, api=api,
                  CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(other))
    out = lab.finish(exporter)
    assert out.returncode == 0 and res.returncode == 0, out.stderr + res.stderr
    assert res.rc("ipcopen") == 0 and res.rc("alloc") == 0
    assert [GIB - vals[0] for _, vals in res.of("meminfo")] == [0, GIB, 0]
    assert [rc for rc, _ in res.of("free")] == [0, 0]
    assert [GIB - vals[0] for _, vals in out.of("meminfo")] == [0]
    assert lab.used() == 0


@pytest.mark.parametrize("api", APIS)
def test_the_ipc_calls_answer_as_the_driver_does(lab, api):
    # NULL outputs and handles that name nothing: the driver's own answers, with the library
    # as without it, on every path
    cmds = ("init", "ctx", "0", "alloc", "1m", "ipcnull", "ipcopen", str(lab.tmp / "missing"),
            "ipcget", "0", str(lab.tmp / "own"), "ipcopen", str(lab.tmp / "own"), "free", "0")
    res = lab.run(*cmds, api=api, CUDA_DEVICE_MEMORY_LIMIT="1g")
    bare = lab.run(*cmds, api=api, CUDA_DEVICE_MEMORY_LIMIT="1g", LD_PRELOAD=None)
    assert res.returncode == 0 and bare.returncode == 0, res.stderr + bare.stderr
    assert res.lines == bare.lines
    assert res.of("ipcnull") == [(1, [1, 1, 1, 1, 1])]
    # its own handle in its own process: CUDA_ERROR_INVALID_CONTEXT, as the driver answers
    assert res.rc("ipcget") == 0 and [rc for rc, _ in res.of("ipcopen")] == [1, 201]
    assert lab.used() == 0


@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr"])
def test_another_processs_event_is_waited_for_under_a_compute_limit(lab, api):
    # PyTorch's consumer waits for the producer's interprocess event before it reads a tensor
    # (cuStreamWaitEvent, then often cuEventSynchronize): the library's wait and
    # synchronisation hooks pass such an event through with the driver's answers
    handle, done = str(lab.tmp / "event"), str(lab.tmp / "done")
    exporter = lab.start("init", "ctx", "0", "ipcevent", handle, "waitfile", done,
                         CUDA_DEVICE_SM_LIMIT="30")
    res = lab.run("waitfile", handle, "init", "ctx", "0", "launch", "20", "ipcwait", handle, "launch",
                  "20", "touch", done, api=api, CUDA_DEVICE_SM_LIMIT="30")
    out = lab.finish(exporter)
    assert out.returncode == 0 and res.returncode == 0, out.stderr + res.stderr
    assert out.rc("ipcevent") == 0
    assert res.of("ipcwait") == [(0, [0, 0, 0])]
