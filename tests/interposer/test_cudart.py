"""The real CUDA runtime's cuGetProcAddress requests, against the library.

The runtime (and PyTorch, CuPy, JAX through it) finds every driver function with
cuGetProcAddress_v2(symbol, &fn, cudaVersion, flags, &status), its whole table at
initialisation. ``data/cudart13_procaddr.txt`` holds the 440 requests CUDA 13.0's libcudart
made, recorded from the real runtime (interposer/tests/cudart_requests.py), with the export a
CUDA 13.0 driver hands out for each (derived from the toolkit's cudaTypedefs.h). A driver made
for the test ("model driver": every one of those exports, and a cuGetProcAddress that answers
each recorded request with its export, or with a trampoline that is not one) stands in for the
real one, which this machine lacks: the library must hand out its hook for every export it
hooks, and the driver's own answer for every other request. Where the real runtime is installed
(/usr/local/cuda/lib64/libcudart.so.13; CI has no CUDA toolkit) it runs against the model
driver under the library as well.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

DATA = Path(__file__).resolve().parent / "data" / "cudart13_procaddr.txt"
ROOT = Path(__file__).resolve().parents[2]
CUDART = Path(os.environ.get("GPUSLICE_CUDART", "/usr/local/cuda/lib64/libcudart.so.13"))
INCLUDE = Path(os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include"))
SUCCESS, NOT_FOUND = 0, 500
LEGACY, PER_THREAD = 1, 2  # CU_GET_PROC_ADDRESS_LEGACY_STREAM, _PER_THREAD_DEFAULT_STREAM

Request = tuple[str, int, int]


def recorded() -> list[tuple[str, int, int, str]]:
    rows = []
    for line in DATA.read_text().splitlines():
        if line.startswith("#"):
            continue
        symbol, version, flags, export = line.split()
        rows.append((symbol, int(version), int(flags), export))
    return rows


def recorded_sha256() -> str:
    return re.search(r"sha256 ([0-9a-f]{64})", DATA.read_text()).group(1)


def hooks() -> dict[str, tuple[str, int, int]]:
    """hooks.h's table: name -> (base, min_version, per_thread)."""
    table = (ROOT / "interposer" / "src" / "hooks.h").read_text()
    table = table[table.index("#define GS_CUDA_HOOKS(X)"):table.index("#define GS_CUDA_REALS(R)")]
    out = {}
    for entry in re.split(r"\bX\(", table.replace("\\\n", " "))[1:]:
        name = entry.split(",")[0].strip()
        base, version, per_thread = re.search(r"(cu\w+),\s*(\d+),\s*([01])\)\s*$",
                                              entry.strip()).groups()
        out[name] = (base, int(version), int(per_thread))
    return out


def recorder() -> ModuleType:
    path = ROOT / "interposer" / "tests" / "cudart_requests.py"
    spec = importlib.util.spec_from_file_location("cudart_requests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the model driver ------------------------------------------------------------------------

SPECIAL = r"""
API CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
API CUresult cuDriverGetVersion(int *v) { if (v) *v = 13000; return 0; }
API CUresult cuDeviceGetCount(int *n) { if (n) *n = 0; return 0; }
/* the runtime's private tables: none (it stops at initialisation, its table looked up) */
API CUresult cuGetExportTable(const void **t, const void *id) { (void)id; if (t) *t = 0; return 500; }
static CUresult answer(const char *symbol, void **pfn, int version, unsigned long long flags,
                       int *status)
{
    const char *tramp = getenv("MODEL_CUDA_TRAMPOLINES");
    if (!symbol || !pfn) return 1;
    *pfn = 0;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (table[i].version == version && table[i].per_thread == !!(flags & 2) &&
            strcmp(table[i].symbol, symbol) == 0) {
            *pfn = tramp && *tramp == '1' ? table[i].tramp : table[i].fn;
            if (status) *status = 0;
            return 0;
        }
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;
}
API CUresult cuGetProcAddress(const char *s, void **p, int v, unsigned long long f)
{
    return answer(s, p, v, f, 0);
}
API CUresult cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, int *st)
{
    return answer(s, p, v, f, st);
}
"""
SPECIAL_NAMES = {"cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuGetExportTable",
                 "cuGetProcAddress", "cuGetProcAddress_v2"}


def model_source(rows: list[tuple[str, int, int, str]]) -> str:
    """A libcuda.so.1 exporting every recorded export (stubs, never called: each returns a
    number of its own, so that no two fold into one address) and answering each recorded
    request (symbol, cudaVersion, per-thread flag) with it, or with a trampoline of its own
    (static: not an export) under MODEL_CUDA_TRAMPOLINES=1."""
    exports = sorted({export for *_, export in rows if export != "-"})
    lines = ["#include <stdlib.h>", "#include <string.h>", "typedef int CUresult;",
             '#define API __attribute__((visibility("default"), noinline))']
    lines += [f"API CUresult {name}(void) {{ return {800000 + i}; }}"
              for i, name in enumerate(exports) if name not in SPECIAL_NAMES]
    lines += [f"API CUresult {name}();" for name in sorted(SPECIAL_NAMES)]
    lines += [f"static CUresult tramp_{i}(void) {{ return {900000 + i}; }}"
              for i in range(len(exports))]
    lines.append("static const struct { const char *symbol; int version, per_thread; void *fn, "
                 "*tramp; } table[] = {")
    index = {name: i for i, name in enumerate(exports)}
    seen = set()
    for symbol, version, flags, export in rows:
        key = (symbol, version, bool(flags & PER_THREAD))
        if export == "-" or key in seen:
            continue
        seen.add(key)
        lines.append(f'    {{"{symbol}", {version}, {int(key[2])}, (void *){export}, '
                     f"(void *)tramp_{index[export]}}},")
    lines.append("};")
    return "\n".join(lines) + SPECIAL


@pytest.fixture(scope="module")
def model_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model driver's directory (libcuda.so.1 in it)."""
    out = tmp_path_factory.mktemp("modeldriver")
    source = out / "model.c"
    source.write_text(model_source(recorded()))
    # -Bsymbolic as a driver is (and the fake): its table must hold its own functions, not
    # the library's same-named hooks, which the dynamic linker would bind it to otherwise
    subprocess.run(["gcc", "-O0", "-fno-ipa-icf", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1", "-o", str(out / "libcuda.so.1"),
                    str(source)], check=True, capture_output=True, text=True)
    return out


def replay(lab, driver: Path, requests: list[Request], preload: bool = True,
           **extra: str) -> list[tuple[Request, int, int, str, str, str]]:
    """procreplay's answers: ((symbol, cudaVersion, flags), rc, status, file, name, offset)."""
    env = lab.env(LD_LIBRARY_PATH=f"{driver}:{lab.build / 'fake'}",
                  LD_PRELOAD=None if not preload else lab.base["LD_PRELOAD"], **extra)
    stdin = "".join(f"{s} {v} {f}\n" for s, v, f in requests)
    done = subprocess.run([str(lab.build / "tests" / "procreplay")], input=stdin, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    lab.check_sanitizers(done.stderr)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("dlsym cuGetProcAddress_v2 "
                        + ("libgpuslice.so" if preload else "libcuda.so.1")), lines[0]
    out = []
    for line in lines[1:]:
        symbol, version, flags, rc, status, file, name, offset = line.split()
        out.append(((symbol, int(version), int(flags)), int(rc), int(status), file, name, offset))
    assert [r[0] for r in out] == requests
    return out


# ---- the recorded list -----------------------------------------------------------------------


def test_the_recorded_requests_are_the_runtimes_whole_driver_table():
    # what CUDA 13.0's runtime asks at initialisation: 440 requests, 345 names (the first one
    # empty, with cudaVersion 0), each with the cudaVersion of the variant it was built for
    # (cuMemAlloc 3020, cuCtxSynchronize 2000 and 13000, ...) and flags 0 or the per-thread
    # flag, never CU_GET_PROC_ADDRESS_LEGACY_STREAM; 74 per-thread requests
    rows = recorded()
    assert len(rows) == 440 and rows[0] == ('""', 0, 0, "-")
    assert len({s for s, *_ in rows[1:]}) == 345
    assert {f for _, _, f, _ in rows} == {0, PER_THREAD}
    assert sum(1 for _, _, f, _ in rows if f == PER_THREAD) == 74
    assert all(e.endswith(("_ptsz", "_ptds")) for _, _, f, e in rows if f == PER_THREAD)
    assert ("cuGetExportTable", 3000, 0, "cuGetExportTable") in rows


def test_every_recorded_request_of_a_hooked_name_is_answered_with_a_hooked_export():
    # a request of a name the library hooks (any of its variants) whose answer, the export a
    # CUDA 13.0 driver hands out for it, is not hooked is a way around the cap or the limit
    # for every program that goes through the runtime: none of the 440
    table = hooks()
    bases = {base for base, _, _ in table.values()}
    rows = recorded()
    hooked = [r for r in rows if r[3] in table]
    assert [r for r in rows if r[0] in bases and r[3] not in table] == []
    assert len(hooked) == 140
    assert {"cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocManaged", "cuMemAllocPitch_v2",
            "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync_ptsz",
            "cuMemGetInfo_v2", "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx_ptsz",
            "cuGraphLaunch_ptsz", "cuCtxSynchronize_v2", "cuStreamSynchronize_ptsz",
            "cuGetProcAddress_v2"} <= {r[3] for r in hooked}


def test_the_recorded_exports_are_what_the_toolkits_headers_say():
    # the export column, derived once from cudaTypedefs.h, derived again (and every name one
    # that the headers declare or map to, or that the runtime itself carries)
    if not (INCLUDE / "cudaTypedefs.h").exists():
        pytest.skip("no CUDA headers on this machine")
    module = recorder()
    expected = module.derive(INCLUDE)
    known = module.known_names(INCLUDE, CUDART if CUDART.exists() else None)
    for symbol, version, flags, export in recorded()[1:]:
        assert expected(symbol, version, flags) == export, (symbol, version, flags)
        assert export in known, export


# ---- replayed against the library --------------------------------------------------------------


@pytest.mark.parametrize("trampolines", ["0", "1"], ids=["exports", "trampolines"])
def test_replaying_the_runtimes_requests_hands_out_every_hook(lab, model_driver, trampolines):
    # every recorded request, and each of flags 0 again with CU_GET_PROC_ADDRESS_LEGACY_STREAM
    # (what cudaGetDriverEntryPoint's cudaEnableLegacyStream asks for), through the library:
    # where the driver's answer is an export the library hooks, the hook of that very export;
    # anything else the driver's own answer, the same status.  With trampolines (addresses
    # that are not exports) the library picks the hook by name, version and flag: the same
    table = hooks()
    rows = recorded()
    export_of = {(s, v, f): e for s, v, f, e in rows}
    export_of |= {(s, v, LEGACY): e for s, v, f, e in rows if f == 0}
    requests = [(s, v, f) for s, v, f, _ in rows] + [(s, v, LEGACY) for s, v, f, _ in rows
                                                      if f == 0]
    driver = replay(lab, model_driver, requests, preload=False,
                    MODEL_CUDA_TRAMPOLINES=trampolines)
    ours = replay(lab, model_driver, requests, MODEL_CUDA_TRAMPOLINES=trampolines)
    hooked = bypassed = 0
    for (request, rc, status, file, name, offset), theirs in zip(ours, driver):
        export = export_of[request]
        assert (rc, status) == theirs[1:3], (request, theirs)
        if export == "-":
            assert (rc, status) == (NOT_FOUND, 1), request
            continue
        assert rc == SUCCESS and theirs[3] == "libcuda.so.1", (request, theirs)
        assert theirs[4] == ("-" if trampolines == "1" else export), (request, theirs)
        if export in table:
            hooked += 1
            bypassed += (file, name) != ("libgpuslice.so", export)
            assert (file, name) == ("libgpuslice.so", export), (request, file, name)
        else:
            assert (file, name, offset) == theirs[3:], (request, file, name, offset)
    twins = sum(1 for _, _, f, e in rows if f == 0 and e in table)
    assert (hooked, bypassed, twins) == (140 + twins, 0, 99)


# ---- the real runtime ------------------------------------------------------------------------


def real_runtime() -> None:
    if not CUDART.exists():
        pytest.skip(f"no CUDA runtime at {CUDART}")


def test_the_real_runtime_asks_what_was_recorded(built, tmp_path):
    # the runtime's requests, recorded again on the fake driver (FAKE_CUDA_PROCADDR_LOG): the
    # checked-in list while the runtime is the one it came from (its sha256), else only the
    # shape; the runtime stops at its private tables (cuGetExportTable), which the fake lacks
    real_runtime()
    requests, output = recorder().record(CUDART, built, tmp_path)
    assert ("cuInit", 2000, 0) in requests and ("cuGetExportTable", 3000, 0) in requests
    if recorder().sha256(CUDART) == recorded_sha256():
        assert "cudaFree 36" in output  # cudaErrorCallRequiresNewerDriver
        assert requests == [(s, v, f) for s, v, f, _ in recorded()]


def test_the_real_runtime_is_handed_every_hook(lab, model_driver, tmp_path):
    # the real libcudart on the model driver, under the library, libgsprocaddrlog.so before it
    # recording what the runtime is handed: its dlsym of cuGetProcAddress_v2 and cuGetProcAddress
    # (which it asks for again) got the library's, and every request the hook of what the
    # driver answers where the library hooks that, else the driver's own export
    real_runtime()
    probe = recorder().build_probe(CUDART, tmp_path)
    log = tmp_path / "handed"
    preload = lab.base["LD_PRELOAD"].split(":")
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsprocaddrlog.so"))
    done = lab.run_program([str(probe)], LD_LIBRARY_PATH=f"{model_driver}:{lab.build / 'fake'}",
                           LD_PRELOAD=":".join(preload), GSPROCADDR_LOG=str(log))
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "dlsym cuGetProcAddress_v2 libgpuslice.so cuGetProcAddress_v2"
    table = hooks()
    export_of = {(s, v, f): e for s, v, f, e in recorded()}
    seen = hooked = 0
    for line in lines[1:]:
        symbol, version, flags, rc, status, file, name = line.split()
        export = export_of.get((symbol, int(version), int(flags)), "-")
        if export == "-":
            assert (int(rc), int(status)) == (NOT_FOUND, 1), line
            continue
        seen += 1
        assert (int(rc), int(status)) == (SUCCESS, 0), line
        want = ("libgpuslice.so", export) if export in table else ("libcuda.so.1", export)
        hooked += export in table
        assert (file, name) == want, line
    if recorder().sha256(CUDART) == recorded_sha256():
        assert "cudaFree 500" in done.stdout  # the model's cuGetExportTable: no private tables
        assert (seen, hooked) == (439, 140)
    assert ("cuGetProcAddress 12000 0 0 0 libgpuslice.so cuGetProcAddress_v2") in lines
