"""Every path a program takes to the driver is intercepted; everything else is left alone."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MIB = 1 << 20
GIB = 1 << 30
OOM = 2
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801
NVML_ERROR_FUNCTION_NOT_FOUND = 13
APIS = ["direct", "dlsym", "procaddr", "procaddr1", "ptsz"]


@pytest.mark.parametrize("api", APIS)
def test_each_interposition_path_enforces_the_cap_and_the_view(lab, api):
    res = lab.run("init", "ctx", "0", "alloc", "600m", "alloc", "600m", "async", "200m",
                  "meminfo", "totalmem", "0", "free", "0", "meminfo", api=api,
                  CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert res.rc("async") == 0
    infos = [vals for _, vals in res.of("meminfo")]
    assert infos == [[GIB - 600 * MIB - 224 * MIB, GIB], [GIB - 224 * MIB, GIB]]  # pool: 7 chunks
    assert res.values("totalmem") == [GIB]


@pytest.mark.parametrize("api", APIS)
def test_the_cuda_2_entry_points_are_charged_and_show_the_capped_view(lab, api):
    # the driver still exports CUDA 2.x's cuMemAlloc, cuMemGetInfo, ... (32-bit pointers and
    # sizes): dlsym("cuMemAlloc") and cuGetProcAddress at an old cudaVersion hand them out.
    # Unhooked, two 600 MiB allocations passed a 1 GiB cap and the view showed the device
    # (saturated at 4 GiB).  cuMemFree_v2 finds a CUDA 2.x allocation's record too (the fake
    # driver frees it either way; a real one may insist on its own generation).
    res = lab.run("legacy", "1", "init", "ctx", "0", "alloc", "600m", "alloc", "600m",
                  "pitch", "1000", "3000", "array", "1024", "1024", "array3d", "256", "256", "64",
                  "meminfo", "totalmem", "0", "legacy", "0", "free", "0", "legacy", "1",
                  "free", "1", "free", "2", "free", "3", "meminfo", "nullargs1", api=api,
                  CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert res.rc("pitch") == res.rc("array") == res.rc("array3d") == 0
    assert [rc for rc, _ in res.of("free")] == [0] * 4
    # pitch 1024 x 3000 rows (4 MiB in 2 MiB pages), float4 1024 x 1024, uint8 256 x 256 x 64
    held = 600 * MIB + 4 * MIB + 16 * MIB + 4 * MIB
    infos = [vals for _, vals in res.of("meminfo")]
    assert infos == [[GIB - held, GIB], [GIB, GIB]]
    assert res.values("totalmem") == [GIB]
    assert res.of("nullargs1") == [(CUDA_ERROR_INVALID_VALUE, [CUDA_ERROR_INVALID_VALUE] * 6)]


def test_the_cuda_2_views_saturate_rather_than_wrap(lab):
    # an 8 GiB cap does not fit in 32 bits: 4 GiB - 1, as the driver's own 32-bit figures
    # (a plain cast showed 0 bytes free of 0)
    res = lab.run("legacy", "1", "init", "ctx", "0", "meminfo", "totalmem", "0",
                  CUDA_DEVICE_MEMORY_LIMIT="8g")
    assert res.values("meminfo") == [0xFFFFFFFF, 0xFFFFFFFF]
    assert res.values("totalmem") == [0xFFFFFFFF]


def test_a_context_of_cuda_2_gets_the_cap_without_the_later_entry_points(lab):
    # FAKE_CUDA_API_VERSIONS: as cuda.h warns, a context made by CUDA 2.x's cuCtxCreate (a
    # "3010 context") refuses 3.2's calls and CUDA 2.x's calls fail in any other.  The 32-bit
    # view took its figures from cuMemGetInfo_v2 and showed the device's when it failed
    res = lab.run("legacy", "1", "init", "ctxcreate", "0", "alloc", "600m", "alloc", "600m",
                  "meminfo", "totalmem", "0", "free", "0", "meminfo", "ctxdestroy", "0",
                  CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_API_VERSIONS="1",
                  FAKE_CUDA_CTX_BYTES="100m")
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert [vals for _, vals in res.of("meminfo")] == [[GIB - 700 * MIB, GIB],
                                                       [GIB - 100 * MIB, GIB]]
    assert res.values("totalmem") == [GIB]
    assert res.rc("free") == res.rc("ctxdestroy") == 0


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["v2", "cuda-2"])
def test_a_pitch_wider_than_reserved_past_the_cap_is_freed_with_its_own_generation(lab, legacy):
    # the driver's pitch (4 KiB here) is known only after the call; past the cap the
    # allocation is freed again and refused.  A CUDA 2.x allocation was freed with
    # cuMemFree_v2, which its 3010 context refuses: 39 MiB stayed allocated past the cap
    ctx = ["ctxcreate", "0"] if legacy == "1" else ["ctx", "0"]
    res = lab.run("legacy", legacy, "init", *ctx, "alloc", "1000m", "pitch", "1000", "10000",
                  "meminfo", "phys", CUDA_DEVICE_MEMORY_LIMIT="1130m", FAKE_CUDA_API_VERSIONS="1",
                  FAKE_CUDA_CTX_BYTES="100m", FAKE_CUDA_PITCH_ALIGN="4096")
    assert res.rc("alloc") == 0
    assert res.rc("pitch") == OOM
    assert res.values("phys") == [1100 * MIB]
    assert res.values("meminfo") == [30 * MIB, 1130 * MIB]


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["v2", "cuda-2"])
def test_a_pitch_narrower_than_reserved_is_charged_the_drivers_pitch(lab, legacy):
    # the rows are reserved at 512 bytes before the call; a driver whose pitch is narrower (256
    # bytes here) gets the difference back at once: 256-byte rows x 1 Mi rows hold 256 MiB,
    # reserved as 512 MiB.  Returning the wrong difference (the sum, found by mutation testing:
    # no test had a pitch below 512 bytes) went unnoticed
    ctx = ["ctxcreate", "0"] if legacy == "1" else ["ctx", "0"]
    res = lab.run("legacy", legacy, "init", *ctx, "pitch", "200", "1048576", "meminfo", "phys", "pitch", "200",
                  "1048576", "pitch", "200", "1048576", "meminfo", "phys", "free", "0", "meminfo",
                  CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_API_VERSIONS="1", FAKE_CUDA_PITCH_ALIGN="256")
    # charged 512 MiB each (as reserved), the third would have been refused
    assert [rc for rc, _ in res.of("pitch")] == [0, 0, 0]
    assert res.values("phys", 0) == [256 * MIB]
    assert [vals for _, vals in res.of("meminfo")] == [[768 * MIB, GIB], [256 * MIB, GIB], [512 * MIB, GIB]]
    assert res.values("phys", 1) == [768 * MIB]


def test_the_older_context_entry_points_charge_and_return_what_a_context_held(lab):
    # cuCtxCreate / cuCtxDestroy (CUDA 2.x) and cuDevicePrimaryCtxRelease / _Reset (7.0):
    # the footprint of a created context is charged; destroying it, releasing the primary
    # context's last reference or resetting it returns it and what was allocated in it
    res = lab.run("legacy", "1", "init", "ctxcreate", "0", "meminfo", "alloc", "200m",
                  "ctxdestroy", "0", "ctx", "0", "alloc", "200m", "release", "0", "ctx", "0",
                  "alloc", "300m", "reset", "0", "ctx", "0", "meminfo", "phys",
                  CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_CTX_BYTES="100m")
    assert [rc for rc, _ in res.of("alloc")] == [0, 0, 0]
    assert res.rc("ctxdestroy") == res.rc("release") == res.rc("reset") == 0
    assert [vals for _, vals in res.of("meminfo")] == [[GIB - 100 * MIB, GIB]] * 2
    assert res.values("phys") == [100 * MIB]


def test_driver_addresses_that_are_not_exports_are_hooked_by_name(lab):
    # the fake hands out trampolines for cuMemAlloc_v2 / cuMemFree_v2 / cuMemGetInfo_v2
    res = lab.run("init", "ctx", "0", "alloc", "600m", "alloc", "600m", "free", "0", "meminfo",
                  api="procaddr", CUDA_DEVICE_MEMORY_LIMIT="1g",
                  FAKE_CUDA_PROCADDR_TRAMPOLINE="1")
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert res.values("meminfo") == [GIB, GIB]


def test_null_out_parameters_are_invalid_values_not_crashes(lab):
    for api in ("direct", "procaddr"):
        res = lab.run("init", "ctx", "0", "nullargs", api=api, CUDA_DEVICE_MEMORY_LIMIT="1g")
        assert res.returncode == 0
        assert res.of("nullargs") == [(CUDA_ERROR_INVALID_VALUE, [CUDA_ERROR_INVALID_VALUE] * 9)]


def test_missing_real_functions_answer_not_supported(lab):
    minimal = str(lab.build / "fake" / "minimal" / "libcuda.so.1")
    res = lab.run("init", "ctx", "0", "alloc", "1m", "meminfo", "totalmem", "0", "launch", "1",
                  "nvml", "0", "nvml2", "0", GPUSLICE_REAL_LIBCUDA=minimal,
                  GPUSLICE_REAL_LIBNVML=minimal, CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert res.returncode == 0
    for cmd in ("init", "ctx", "alloc", "meminfo", "totalmem", "launch"):
        assert res.rc(cmd) == CUDA_ERROR_NOT_SUPPORTED, cmd
    assert res.rc("nvml") == NVML_ERROR_FUNCTION_NOT_FOUND
    assert res.rc("nvml2") == NVML_ERROR_FUNCTION_NOT_FOUND
    # and CUDA 2.x's entry points
    res = lab.run("legacy", "1", "alloc", "1m", "free", "0", "meminfo", "totalmem", "0", "pitch", "64", "64",
                  "array", "16", "16", "array3d", "16", "16", "16", "ctxcreate", "0", "attach",
                  "detach", "-1", "ctxdestroy", "0", "release", "0", "reset", "0",
                  GPUSLICE_REAL_LIBCUDA=minimal, CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert res.returncode == 0
    for cmd in ("alloc", "meminfo", "totalmem", "pitch", "array", "array3d", "ctxcreate", "attach",
                "detach", "ctxdestroy", "release", "reset"):
        assert res.rc(cmd) == CUDA_ERROR_NOT_SUPPORTED, cmd


def test_dlsym_rtld_next_still_finds_the_next_definition(lab):
    out = lab.run_program([str(lab.build / "tests" / "rtldnext")])
    assert out.stdout.strip() == "b"


def test_a_tracer_preloaded_before_the_library_reaches_the_driver_through_it(lab):
    # the tracer wraps cuMemAlloc_v2 and forwards with dlsym(RTLD_NEXT): it must get our hook
    # (which charges and calls the driver), not its own function back (endless recursion
    # before: the hook table took the first definition of the name, the tracer's)
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgstracer.so"))
    res = lab.run("init", "ctx", "0", "alloc", "100m", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="1g",
                  LD_PRELOAD=":".join(preload))
    assert res.rc("alloc") == 0, res.stdout + res.stderr
    assert res.values("meminfo") == [GIB - 100 * MIB, GIB]  # charged
    assert "tracer 1" in res.stderr


def test_dlsym_answers_for_driver_names_only_when_the_driver_is_there(lab):
    # a program without libcuda: RTLD_DEFAULT / RTLD_NEXT find no cuInit (before, our exports
    # were found), nor does the handle of dlopen(NULL), the global scope Python's
    # ctypes.CDLL(None) looks in (it found our cuInit, and calling it loaded the driver), and a
    # stub library's own cuInit is what dlsym on its handle returns (before, our hook, which
    # then took the stub for the driver).  With the driver loaded globally, the handle of
    # dlopen(NULL) gets the hook, as RTLD_DEFAULT does.
    stub = lab.build / "tests" / "libgscudastub.so"
    argv = [str(lab.build / "tests" / "nocuda"), str(stub), str(lab.build / "fake" / "libcuda.so.1")]
    plain = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    under = lab.run_program(argv)
    assert plain.stdout.split("\n")[:2] == ["nocuda 0 0 0 999", "loaded 1 1 0"]
    assert under.stdout.split("\n")[:2] == ["nocuda 0 0 0 999", "loaded 1 1 1"], under.stderr
    python = lab.run_program([sys.executable, "-c",
                              "import ctypes; print(hasattr(ctypes.CDLL(None), 'cuInit'))"])
    assert python.stdout.strip() == "False", python.stderr


@pytest.mark.parametrize("argv", [["ls", "/"], ["sh", "-c", "echo hello; echo $((6*7))"],
                                  [sys.executable, "-c", "import json; print(json.dumps([1]))"]])
def test_programs_that_never_touch_cuda_do_not_notice_the_library(lab, argv):
    plain = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    under = lab.run_program(argv, LIBCUDA_LOG_LEVEL="3")
    assert under.returncode == plain.returncode == 0
    assert under.stdout == plain.stdout
    assert "gpuslice" not in under.stderr
    assert not lab.region_path.exists()  # no region, no files


@pytest.mark.parametrize("value", ["debug", "-1", "2x"])
def test_a_log_level_the_library_cannot_use_is_said_at_the_first_cuda_call_only(lab, value):
    # it was ignored without a word; said in the constructor, every `ls` would say it too
    quiet = lab.run_program(["sh", "-c", "echo hello"], LIBCUDA_LOG_LEVEL=value)
    assert quiet.returncode == 0 and "gpuslice" not in quiet.stderr
    res = lab.run("init", "ctx", "0", "alloc", "1m", LIBCUDA_LOG_LEVEL=value, CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert res.rc("alloc") == 0
    assert res.stderr.count(f"ignoring LIBCUDA_LOG_LEVEL value '{value}' (expected 0..3)") == 1, res.stderr


@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr"])
def test_a_driver_that_looks_up_its_own_functions_through_dlsym_gets_them(lab, api):
    # build/shim/libcuda.so.1 finds cuInit and cuMemAlloc_v2 of the driver it loads through
    # dlsym, as WSL2's libcuda does.  Handed our hooks, it called itself through them until
    # the stack ran out (SIGSEGV); the driver's own lookups now get the driver's functions,
    # and the program's still get the hooks: the allocation is charged once.
    path = f"{lab.build / 'shim'}:{lab.build / 'fake'}"
    res = lab.run("init", "ctx", "0", "alloc", "100m", "meminfo", api=api, LD_LIBRARY_PATH=path,
                  CUDA_DEVICE_MEMORY_LIMIT="1g", timeout=30)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.rc("init") == 0 and res.rc("alloc") == 0
    assert res.values("meminfo") == [GIB - 100 * MIB, GIB]


def test_a_program_without_cuda_binds_only_what_the_library_runs_at_load(built):
    # loaded into every process of the container: its libc imports are bound on first call
    # (-z lazy), not all ~70 at each exec (66,000 instructions per /bin/true, callgrind)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_DEBUG": "bindings",
           "LD_PRELOAD": str(built / "libgpuslice.so")}
    proc = subprocess.run(["/bin/true"], check=True, env=env, capture_output=True, text=True,
                          timeout=60)
    ours = re.findall(r"binding file \S*libgpuslice\.so \[0\] to \S+ \[0\]: normal symbol `(\w+)'",
                      proc.stderr)
    assert "secure_getenv" in ours  # the constructor's, bound as it runs
    assert len(ours) <= 8, ours


def fork_growth_kib(proc: subprocess.CompletedProcess[str]) -> int:
    """tests/next/forkrss: the child's RssAnon right after the fork, less the parent's."""
    assert proc.returncode == 0, proc.stderr
    _, parent, child = proc.stdout.split()
    return int(child) - int(parent)


def test_a_fork_in_a_program_without_cuda_does_not_fault_in_the_librarys_tables(lab):
    # the child fork handlers cleared the library's tables (485 KiB of stream table alone) in
    # every fork of every program of the container: 530 KiB of RssAnon more per child (and
    # 0.4 ms).  A parent that never reached the driver has nothing to clear
    forkrss = str(lab.build / "tests" / "forkrss")
    plain = subprocess.run([forkrss], check=False, capture_output=True, text=True, timeout=60)
    under = lab.run_program([forkrss])
    assert fork_growth_kib(under) - fork_growth_kib(plain) < 200, (plain.stdout, under.stdout)


def test_a_program_without_cuda_never_loads_libcuda(lab):
    out = lab.run_program([sys.executable, "-c",
                           "import ctypes; print(open('/proc/self/maps').read())"])
    assert "/libgpuslice" in out.stdout  # the library is there...
    assert "libcuda" not in out.stdout and "libnvidia-ml" not in out.stdout  # ...and idle


def hook_names(build) -> set[str]:
    text = (build.parent / "src" / "hooks.h").read_text()
    cuda = text[text.index("#define GS_CUDA_HOOKS(X)"):text.index("#define GS_CUDA_REALS(R)")]
    nvml = text[text.index("#define GS_NVML_HOOKS(N)"):text.index("#define GS_NVML_REALS(R)")]
    return set(re.findall(r"\bX\((\w+),", cuda)) | set(re.findall(r"\bN\((\w+),", nvml))


@pytest.mark.parametrize("variant", ["libgpuslice.so", "asan/libgpuslice.so"])
def test_the_library_exports_exactly_the_hook_table(built, variant):
    out = subprocess.run(["nm", "-D", "--defined-only", str(built / variant)],
                         capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[1] in "TtWiV"}
    exported = {name.split("@")[0] for name in exported}
    assert exported == hook_names(built) | {"dlsym", "gpuslice_version"}
    assert len(hook_names(built)) >= 40


@pytest.mark.parametrize("variant", ["libgpuslice.so", "asan/libgpuslice.so", "tsan/libgpuslice.so"])
def test_thread_locals_are_read_without_a_call(built, variant):
    # initial-exec TLS: the region lock's bookkeeping reads thread-locals on every allocation;
    # through __tls_get_addr each read cost ~20 instructions (180 per alloc+free pair)
    out = subprocess.run(["nm", "-D", "--undefined-only", str(built / variant)],
                         capture_output=True, text=True, check=True).stdout
    assert "__tls_get_addr" not in out
    flags = subprocess.run(["readelf", "-d", str(built / variant)],
                           capture_output=True, text=True, check=True).stdout
    assert "STATIC_TLS" in flags


def test_the_library_reports_its_version(built):
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "lib.gpuslice_version.restype = ctypes.c_char_p; print(lib.gpuslice_version().decode())")
    out = subprocess.run([sys.executable, "-c", code, str(built / "libgpuslice.so")],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "0.1.0"


def test_our_cuda_declarations_match_the_toolkit_headers(built):
    # struct layouts and constants compared at run time; every CUDA hook's signature compiled
    # against cuda.h's own declaration (a mismatch would not have built)
    checker = built / "tests" / "abi_check"
    if not checker.exists():
        pytest.skip("no CUDA headers on this machine: the ABI check was not built")
    out = subprocess.run([str(checker)], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout
    match = re.fullmatch(r"ok \d+ facts, (\d+) hook signatures", out.stdout.strip())
    assert match, out.stdout
    cuda_hooks = {name for name in hook_names(built) if name.startswith("cu")}
    assert int(match.group(1)) == len(cuda_hooks)


def test_our_nvml_structs_and_constants_match_pynvml(built):
    # cuda_abi.h restates NVML's structs without nvml.h; NVIDIA's Python binding (nvidia-ml-py)
    # states them too.  The fake NVML is built from the same header, so a wrong layout (or
    # code) passes every fake-driver test and fails only against the real library
    pynvml = pytest.importorskip("pynvml")
    layout = subprocess.run([str(built / "tests" / "region_layout"), "layout"],
                            capture_output=True, text=True, check=True).stdout
    ours, sizes, consts = {}, {}, {}
    for line in layout.splitlines():
        name, *rest = line.split()
        if name.startswith("nvml") and "." in name:
            ours[name] = tuple(int(n) for n in rest)
        elif name == "nvmlsize":
            sizes[rest[0]] = int(rest[1])
        elif name == "nvmlconst":
            consts[rest[0]] = int(rest[1])
    structs = (("nvmlMemory_t", pynvml.c_nvmlMemory_t),
               ("nvmlMemory_v2_t", pynvml.c_nvmlMemory_v2_t),
               # what nvmlDeviceGetComputeRunningProcesses_v3 fills (pynvml's _v3 struct)
               ("nvmlProcessInfo_t", pynvml.c_nvmlProcessInfo_v3_t),
               ("nvmlUtilization_t", pynvml.c_nvmlUtilization_t),
               ("nvmlProcessUtilizationSample_t", pynvml.c_nvmlProcessUtilizationSample_t))
    for struct_name, ctype in structs:
        fields = [fname for fname, _ in ctype._fields_]
        assert {k.split(".", 1)[1] for k in ours if k.startswith(struct_name + ".")} == set(fields), \
            struct_name
        for fname in fields:
            f = getattr(ctype, fname)
            assert ours[f"{struct_name}.{fname}"] == (f.offset, f.size), (struct_name, fname)
        if struct_name in sizes:  # an array of them is walked with our size
            assert sizes[struct_name] == ctypes.sizeof(ctype), struct_name
    assert len(sizes) == 3 and len(consts) == 8
    for const, value in consts.items():
        assert getattr(pynvml, const) == value, const


@pytest.mark.parametrize(("version", "export"), [(11040, "cuGraphInstantiate_v2"),
                                                 (12080, "cuGraphInstantiateWithFlags")])
def test_a_trampolined_graph_instantiate_gets_the_hook_of_the_same_signature(lab, version, export):
    # from CUDA 12.0 the name means cuGraphInstantiateWithFlags (3 arguments, not 5): a driver
    # handing out a trampoline for it got the 5-argument hook before
    res = lab.run("init", "procaddr", "cuGraphInstantiate", str(version), export,
                  FAKE_CUDA_PROCADDR_TRAMPOLINE="1")
    assert res.of("procaddr") == [(0, [1])]


def test_a_trampoline_for_a_variant_newer_than_the_table_is_not_hooked_by_name(lab):
    # FAKE_CUDA_PROCADDR_FUTURE: from 13010 the fake's cuGetProcAddress("cuMemGetInfo") is a
    # cuMemGetInfo_v3(free, total, device) handed out as a trampoline.  Chosen by name it got
    # the two-argument cuMemGetInfo_v2 hook; past the table's version the name decides only
    # where the driver gives the same address at 13000 (cuMemAlloc, cuGraphInstantiate do)
    res = lab.run("init", "procaddr", "cuMemGetInfo", "13010", "cuMemGetInfo_v2",
                  "procaddr", "cuMemAlloc", "13010", "cuMemAlloc_v2",
                  "procaddr", "cuMemGetInfo", "13000", "cuMemGetInfo_v2",
                  "procaddr", "cuGraphInstantiate", "13010", "cuGraphInstantiateWithFlags",
                  FAKE_CUDA_PROCADDR_TRAMPOLINE="1", FAKE_CUDA_PROCADDR_FUTURE="1")
    assert res.of("procaddr") == [(0, [0]), (0, [1]), (0, [1]), (0, [1])]
    assert "may be newer than the library's hooks" in res.stderr


@pytest.mark.parametrize("trampoline", [None, "1"], ids=["export", "trampoline"])
def test_cuda_13s_context_synchronize_gets_its_own_hook(lab, trampoline):
    # at 13.0 cuGetProcAddress("cuCtxSynchronize") is cuCtxSynchronize_v2(ctx): handed out
    # unhooked, it skipped the measurement after a synchronisation (test_throttle.py -k
    # last_work); a driver's trampoline for it got the hook of cuCtxSynchronize(void), chosen by
    # name, which dropped the context argument.  NULL means the current context (cuda.h)
    res = lab.run("init", "ctx", "0", "ctxsync13", "ctxsyncnull", "procaddr", "cuCtxSynchronize",
                  "13000", "cuCtxSynchronize_v2", "procaddr", "cuCtxSynchronize", "12080",
                  "cuCtxSynchronize", api="procaddr", FAKE_CUDA_PROCADDR_TRAMPOLINE=trampoline)
    assert res.of("ctxsync13") == res.of("ctxsyncnull") == [(0, [1])]  # 1: the library's
    assert res.of("procaddr") == [(0, [1]), (0, [1])]


def test_a_trampoline_for_a_function_without_its_per_thread_variant_gets_the_hook_it_has(lab):
    # a per-thread request for cuStreamBeginCapture, which this (fake) driver exports only as
    # cuStreamBeginCapture_v2, handed out as a trampoline: chosen by name, the library took the
    # table's cuStreamBeginCapture_v2_ptsz hook, whose driver function it never found, and every
    # capture failed with 801 (the driver's own function works).  Its plain counterpart now
    res = lab.run("init", "ctx", "0", "hold", "2", "unhold", api="ptsz",
                  FAKE_CUDA_PROCADDR_TRAMPOLINE="1", LIBCUDA_LOG_LEVEL="4")
    assert res.rc("hold") == 0 and res.rc("unhold") == 0
    assert "cuGetProcAddress(cuStreamBeginCapture, 13000): driver address not an export, hooked by name " \
           "as cuStreamBeginCapture_v2\n" in res.stderr


def test_the_hook_table_has_every_variant_the_toolkit_lists_for_a_hooked_name(built):
    # cudaTypedefs.h declares PFN_<name>_v<cudaVersion>[_ptsz] for each signature
    # cuGetProcAddress(name) has had: each of a hooked name's must be a hook with that
    # min_version, or cuGetProcAddress at that version hands out an unhooked function (and a
    # trampoline for it got the hook of an older signature).  cuCtxSynchronize_v13000 was missing
    header = Path(os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")) / "cudaTypedefs.h"
    if not header.exists():
        pytest.skip("no CUDA headers on this machine")
    table = (built.parent / "src" / "hooks.h").read_text()
    table = table[table.index("#define GS_CUDA_HOOKS(X)"):table.index("#define GS_CUDA_REALS(R)")]
    have = set()
    for entry in re.split(r"\bX\(", table.replace("\\\n", " "))[1:]:
        base, version, per_thread = re.search(r"(cu\w+),\s*(\d+),\s*([01])\)\s*$",
                                              entry.strip()).groups()
        have.add((base, int(version), int(per_thread)))
    bases = {base for base, _, _ in have}
    listed = {(base, int(version), int(bool(pt))) for base, version, pt in
              re.findall(r"PFN_(cu\w+?)_v(\d+)(_ptsz|_ptds)?\)", header.read_text())
              if base in bases}
    assert listed - have == set()


def test_the_gpu_checks_serve_protocol_runs_on_the_fake_driver(lab, tmp_path):
    # tests/gpu drives `gpubench serve` line by line (harness.Server): allocations under and
    # over the cap, the capped view, and the IPC commands (a handle as 128 hex digits; one
    # that is not is refused, and serving goes on; the import itself, from another process,
    # runs in test_gpu_check_rehearsal.py)
    source = Path(__file__).resolve().parents[1] / "gpu" / "native" / "gpubench.c"
    binary = tmp_path / "gpubench"
    subprocess.run(["gcc", "-DGPUBENCH_DLOPEN", "-O1", "-Wall", "-Werror", "-std=gnu11", "-o",
                    str(binary), str(source), "-ldl"], check=True)
    script = "alloc 536870912\nipcget 0\nipcopen 00\nalloc 2147483648\ninfo\nfree 0\nfree 0\nquit\n"
    done = subprocess.run([str(binary), "serve"], input=script, env=lab.env(
        CUDA_DEVICE_MEMORY_LIMIT="1g"), capture_output=True, text=True, timeout=60, check=False)
    lab.check_sanitizers(done.stderr)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ready ") and lines[1] == "ok 0"
    assert re.fullmatch(r"ipc [0-9a-f]{128}", lines[2]) and lines[3].startswith("err 1 ")
    assert lines[4].startswith(f"err {OOM} ")
    free, total = map(int, lines[5].split()[1:])
    assert (free, total) == (GIB // 2, GIB)  # the fake's context takes nothing by default
    assert lines[6] == "ok" and lines[7].startswith("err 1 ") and lines[8:] == ["bye"]


@pytest.mark.parametrize("versions", [None, "1"], ids=["mixing", "strict-versions"])
def test_the_gpu_checks_legacy_probe_sees_the_cap_on_the_fake_driver(lab, tmp_path, versions):
    # tests/gpu's gpubench reaches CUDA 2.x's entry points by dlsym as an old program would,
    # in the primary context and in one of CUDA 2.x's cuCtxCreate; its GPU check relies on
    # this run's shape.  With strict versions the primary context refuses them (201)
    source = Path(__file__).resolve().parents[1] / "gpu" / "native" / "gpubench.c"
    binary = tmp_path / "gpubench"
    subprocess.run(["gcc", "-DGPUBENCH_DLOPEN", "-O1", "-Wall", "-Werror", "-std=gnu11", "-o",
                    str(binary), str(source), "-ldl"], check=True)
    done = lab.run_program([str(binary), "legacy", "1024"], CUDA_DEVICE_MEMORY_LIMIT="2g",
                           FAKE_CUDA_API_VERSIONS=versions)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert res["exported"] and res["big_rc"] == OOM
    if versions:
        assert res["alloc_rc"] == res["info_rc"] == 201 and res["held"] == res["before"]
    else:
        assert res["alloc_rc"] == 0 and res["free_rc"] == 0
        assert res["held"] - res["before"] == GIB and res["with_big"] == GIB
        assert (res["free32"], res["total32"]) == (GIB, 2 * GIB)
    assert res["after"] == res["before"]
    assert (res["primary_api"], res["old_api"]) == (3020, 3010)
    assert res["create_rc"] == res["old_alloc_rc"] == res["old_info_rc"] == res["destroy_rc"] == 0
    assert (res["old_free32"], res["old_total32"]) == (2 * GIB - 64 * MIB, 2 * GIB)
    # the v1 pointer freed by cuMemFree_v2, or (refused in a 3010 context) by cuMemFree
    assert (res["v2_free_rc"], res["v1_free_rc"]) == ((201, 0) if versions else (0, -1))


@pytest.mark.parametrize("version", ["GLIBC_2.34", "GLIBC_2.2.5"])
def test_a_dlsym_wrapper_forwarding_with_dlvsym_still_reaches_the_library(lab, version):
    # a tool preloaded before the library that wraps dlsym and forwards with
    # dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.x"), as HAMi-core does: a versioned lookup skips an
    # unversioned definition, so it forwarded to libc's dlsym, the runtime's (here gsprobe's)
    # dlsym(libcuda, "cuGetProcAddress_v2") got the driver's, and two 600 MiB allocations
    # passed a 1 GiB cap.  Our dlsym is exported under glibc's versions as well now
    if platform.machine() != "x86_64" and version == "GLIBC_2.2.5":
        pytest.skip("GLIBC_2.2.5 is x86_64's first version")
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsdlwrap.so"))
    res = lab.run("init", "ctx", "0", "alloc", "600m", "alloc", "600m", "meminfo", api="procaddr",
                  CUDA_DEVICE_MEMORY_LIMIT="1g", LD_PRELOAD=":".join(preload),
                  GSDLWRAP_VERSION=version)
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM], res.stderr
    assert res.values("meminfo") == [GIB - 600 * MIB, GIB]
    calls, libc = re.search(r"dlwrap (\d+) (\d)", res.stderr).groups()
    assert int(calls) >= 2 and libc == "0"  # the wrapper was used, and forwarded to us


def test_programs_start_under_a_dlsym_wrapper_and_the_library(lab):
    # the same wrapper in programs that never touch CUDA: our dlsym forwards every other name
    # to libc's (found with dlvsym from the library: never itself)
    preload = lab.base["LD_PRELOAD"].split(":")
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsdlwrap.so"))
    stub = lab.build / "tests" / "libgscudastub.so"
    under = lab.run_program([str(lab.build / "tests" / "nocuda"), str(stub)],
                            LD_PRELOAD=":".join(preload))
    assert under.stdout.strip() == "nocuda 0 0 0 999", under.stderr
    code = "import ctypes; print(ctypes.CDLL(None).getpid() > 0)"
    under = lab.run_program([sys.executable, "-c", code], LD_PRELOAD=":".join(preload))
    assert under.returncode == 0 and under.stdout.strip() == "True", under.stderr


@pytest.mark.parametrize("api", APIS)
def test_a_second_copy_of_the_library_in_the_process_charges_nothing_twice(lab, api):
    # the library preloaded twice from two files (a copy in the image named by LD_PRELOAD beside
    # /etc/ld.so.preload's, or two versions): the first copy's RTLD_NEXT lookup of dlsym found the
    # second copy's dlsym, which handed the first copy the second's hooks as the driver's
    # functions, so each allocation was charged twice (300 MiB held: 600 charged under a 1 GiB
    # cap, the next 300 MiB refused) and the two copies took each other's registration away
    preload = lab.base["LD_PRELOAD"].split(":")
    copy = lab.tmp / "copy" / "libgpuslice.so"
    copy.parent.mkdir()
    shutil.copy(preload[-1], copy)
    res = lab.run("init", "ctx", "0", "alloc", "300m", "meminfo", "alloc", "300m", "meminfo",
                  "free", "0", "free", "1", "meminfo", api=api, CUDA_DEVICE_MEMORY_LIMIT="1g",
                  LD_PRELOAD=":".join([*preload, str(copy)]))
    assert res.returncode == 0, res.stderr
    assert [rc for rc, _ in res.of("alloc")] == [0, 0]
    assert [vals for _, vals in res.of("meminfo")] == [
        [GIB - 300 * MIB, GIB], [GIB - 600 * MIB, GIB], [GIB, GIB]]
    assert lab.used() == 0
    assert "reclaimed" not in res.stderr


COMPAT_PROGRAM = """
import ctypes, sys
c = ctypes.CDLL(sys.argv[1])
ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
rcs = [c.cuInit(0), c.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), c.cuCtxSetCurrent(ctx)]
rcs += [c.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(300 << 20)) for _ in range(4)]
free, total = ctypes.c_size_t(), ctypes.c_size_t()
rcs.append(c.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
print(*rcs, free.value >> 20, total.value >> 20)
"""


def test_a_forward_compatibility_driver_opened_by_its_path_is_the_one_hooked(lab):
    # an image's cuda-compat libcuda.so.1 (/usr/local/cuda/compat), opened by its full path
    # beside the host's driver that the loader path finds: the hooks call the file the program
    # opened (a context made in one driver is not another's), and the cap holds
    compat = lab.tmp / "compat" / "libcuda.so.1"
    compat.parent.mkdir()
    shutil.copy(lab.build / "fake" / "libcuda.so.1", compat)
    out = lab.run_program([sys.executable, "-c", COMPAT_PROGRAM, str(compat)],
                          CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"] * 6 + [str(OOM), "0", "124", "1024"]
