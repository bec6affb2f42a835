"""Every path a program takes to the driver is intercepted; everything else is left alone."""

from __future__ import annotations

import re
import subprocess
import sys

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


def test_dlsym_rtld_next_still_finds_the_next_definition(lab):
    out = lab.run_program([str(lab.build / "tests" / "rtldnext")])
    assert out.stdout.strip() == "b"


@pytest.mark.parametrize("argv", [["ls", "/"], ["sh", "-c", "echo hello; echo $((6*7))"],
                                  [sys.executable, "-c", "import json; print(json.dumps([1]))"]])
def test_programs_that_never_touch_cuda_do_not_notice_the_library(lab, argv):
    plain = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    under = lab.run_program(argv, LIBCUDA_LOG_LEVEL="3")
    assert under.returncode == plain.returncode == 0
    assert under.stdout == plain.stdout
    assert "gpuslice" not in under.stderr
    assert not lab.region_path.exists()  # no region, no files


def test_a_program_without_cuda_never_loads_libcuda(lab):
    out = lab.run_program([sys.executable, "-c",
                           "import ctypes; print(open('/proc/self/maps').read())"])
    assert "gpuslice" in out.stdout  # the library is there...
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


def test_our_nvml_memory_structs_match_pynvml(built):
    pynvml = pytest.importorskip("pynvml")
    layout = subprocess.run([str(built / "tests" / "region_layout"), "layout"],
                            capture_output=True, text=True, check=True).stdout
    ours = {}
    for line in layout.splitlines():
        name, *nums = line.split()
        if name.startswith("nvmlMemory"):
            ours[name] = tuple(int(n) for n in nums)
    for struct_name, ctype in (("nvmlMemory_t", pynvml.c_nvmlMemory_t),
                               ("nvmlMemory_v2_t", pynvml.c_nvmlMemory_v2_t)):
        for fname, _ in ctype._fields_:
            f = getattr(ctype, fname)
            assert ours[f"{struct_name}.{fname}"] == (f.offset, f.size), (struct_name, fname)
