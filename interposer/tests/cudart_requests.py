"""The CUDA runtime's cuGetProcAddress requests, recorded from the real libcudart (developer tool).

    python3 interposer/tests/cudart_requests.py [--cudart PATH] [--include DIR] > \\
        tests/interposer/data/cudart13_procaddr.txt

Builds a small program against the real runtime (``--cudart``, default
/usr/local/cuda/lib64/libcudart.so.13; no CUDA header needed), runs it on the fake driver
(build/fake, ``make -C interposer fakes`` first) with ``FAKE_CUDA_PROCADDR_LOG`` and writes every
request the runtime made, in order, with the export a driver of the toolkit's CUDA version hands
out for it (``derive``: from cudaTypedefs.h and cuda.h of ``--include``). The runtime looks its
whole driver table up at initialisation, before it asks for the driver's private tables
(cuGetExportTable), which the fake does not have: it stops there (cudaErrorCallRequiresNewerDriver)
and the requests are all made by then. tests/interposer/test_cudart.py replays the list against
the library; ``derive`` is also what it checks the list's export column with.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

INTERPOSER = Path(__file__).resolve().parents[1]
CUDART = Path("/usr/local/cuda/lib64/libcudart.so.13")
INCLUDE = Path("/usr/local/cuda/include")
PER_THREAD = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

# A program of the runtime's common calls; its own prototypes, so only the library is needed.
PROBE = r"""
#include <stddef.h>
#include <stdio.h>
int cudaDriverGetVersion(int *v);
int cudaGetDeviceCount(int *n);
int cudaFree(void *p);
int cudaMalloc(void **p, size_t n);
int cudaMallocManaged(void **p, size_t n, unsigned int flags);
int cudaMallocPitch(void **p, size_t *pitch, size_t w, size_t h);
int cudaMallocAsync(void **p, size_t n, void *stream);
int cudaFreeAsync(void *p, void *stream);
int cudaMemGetInfo(size_t *free, size_t *total);
int cudaDeviceSynchronize(void);
int main(void)
{
    int v = 0, n = 0;
    void *p = NULL;
    size_t a = 0, b = 0;
    printf("cudaDriverGetVersion %d %d\n", cudaDriverGetVersion(&v), v);
    printf("cudaGetDeviceCount %d %d\n", cudaGetDeviceCount(&n), n);
    printf("cudaFree %d\n", cudaFree(NULL));
    printf("cudaMalloc %d\n", cudaMalloc(&p, 1 << 20));
    printf("cudaMallocManaged %d\n", cudaMallocManaged(&p, 1 << 20, 1));
    printf("cudaMallocPitch %d\n", cudaMallocPitch(&p, &a, 1000, 10));
    printf("cudaMallocAsync %d\n", cudaMallocAsync(&p, 1 << 20, (void *)2 /* per-thread */));
    printf("cudaFreeAsync %d\n", cudaFreeAsync(p, (void *)2));
    printf("cudaMemGetInfo %d\n", cudaMemGetInfo(&a, &b));
    printf("cudaDeviceSynchronize %d\n", cudaDeviceSynchronize());
    return 0;
}
"""


def build_probe(cudart: Path, out: Path) -> Path:
    """The probe program, linked against ``cudart`` (found at run time through an rpath)."""
    source = out / "cudartprobe.c"
    source.write_text(PROBE)
    binary = out / "cudartprobe"
    subprocess.run(["gcc", "-O1", "-o", str(binary), str(source), str(cudart),
                    f"-Wl,-rpath,{cudart.parent}"], check=True, capture_output=True, text=True)
    return binary


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def derive(include: Path = INCLUDE) -> Callable[[str, int, int], str | None]:
    """expected(symbol, cudaVersion, flags): the export a driver of these headers' CUDA version
    hands out for that request, or None where it has none.  cudaTypedefs.h (and the other
    *Typedefs.h) declare PFN_<symbol>_v<version>[_ptsz|_ptds] for every signature the name has
    had: the n-th plain one is <symbol>, <symbol>_v2, ... (cuGraphInstantiate from 12.0 on is
    cuGraphInstantiateWithFlags, cuda.h's own rename); a per-thread one is the plain variant of
    the same signature (the newest plain one not newer than it) with its suffix.  A request gets
    the newest plain variant not newer than its cudaVersion, and with the per-thread flag the
    newest per-thread variant not newer than it, where there is one."""
    text = "".join(p.read_text(errors="replace") for p in sorted(include.glob("cuda*Typedefs.h")))
    variants: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for base, version, suffix in re.findall(r"PFN_(cu\w+?)_v(\d+)(_ptsz|_ptds)?\)", text):
        variants[base].append((int(version), suffix))
    renamed = {("cuGraphInstantiate", 12000): "cuGraphInstantiateWithFlags"}

    def plain_name(base: str, version: int) -> str:
        if (base, version) in renamed:
            return renamed[(base, version)]
        plains = sorted({v for v, s in variants[base] if not s and (base, v) not in renamed})
        index = plains.index(version)
        return base if index == 0 else f"{base}_v{index + 1}"

    def expected(symbol: str, version: int, flags: int) -> str | None:
        usable = [(v, s) for v, s in variants.get(symbol, []) if v <= version]
        plains = [v for v, s in usable if not s]
        if not plains:
            return None
        name = plain_name(symbol, max(plains))
        threaded = [(v, s) for v, s in usable if s]
        if flags & PER_THREAD and threaded:
            version_pt, suffix = max(threaded)
            name = plain_name(symbol, max(v for v in plains if v <= version_pt)) + suffix
        return name

    return expected


def known_names(include: Path, cudart: Path | None) -> set[str]:
    """Names a driver of these headers exports: the headers' declarations and the names their
    #defines map to (with the per-thread macros' suffixes), and the names the runtime carries."""
    names: set[str] = set()
    for header in include.glob("*.h"):
        text = header.read_text(errors="replace")
        names |= set(re.findall(r"CUresult\s+CUDAAPI\s+(cu\w+)\s*\(", text))
        names |= set(re.findall(r"#define\s+cu\w+\s+(cu\w+)\s*$", text, re.MULTILINE))
        for kind, api in re.findall(r"__CUDA_API_(PTDS|PTSZ)\((cu\w+)\)", text):
            names |= {api, f"{api}_{kind.lower()}"}
    if cudart and cudart.exists():
        names |= {n.decode() for n in re.findall(rb"cu[A-Z]\w+", cudart.read_bytes())}
    return names


def parse_log(text: str) -> list[tuple[str, int, int]]:
    """The fake's FAKE_CUDA_PROCADDR_LOG lines: (symbol, cudaVersion, flags)."""
    out = []
    for line in text.splitlines():
        _entry, symbol, version, flags, _rc, _name = line.split()
        out.append((symbol, int(version), int(flags)))
    return out


def record(cudart: Path, build: Path, work: Path) -> tuple[list[tuple[str, int, int]], str]:
    """Run the probe on the fake driver: the runtime's requests, and the probe's output."""
    probe = build_probe(cudart, work)
    log = work / "procaddr.log"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDA_", "GPUSLICE_", "FAKE_", "LD_"))}
    env.update({"LD_LIBRARY_PATH": str(build / "fake"), "FAKE_CUDA_STATE": str(work / "state"),
                "FAKE_CUDA_PROCADDR_LOG": str(log)})
    done = subprocess.run([str(probe)], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    return parse_log(log.read_text()), done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cudart", type=Path, default=CUDART)
    parser.add_argument("--include", type=Path, default=INCLUDE)
    args = parser.parse_args()
    expected = derive(args.include)
    known = known_names(args.include, args.cudart)
    with tempfile.TemporaryDirectory() as tmp:
        requests, output = record(args.cudart, INTERPOSER / "build", Path(tmp))
    wheel = sorted(p.name.removesuffix(".dist-info") for p in
                   args.cudart.resolve().parent.parent.glob("dist-info/nvidia_cuda_runtime-*"))
    print(f"# cuGetProcAddress_v2 requests of {args.cudart.name} "
          f"({', '.join(wheel + [f'sha256 {sha256(args.cudart)}'])}),")
    print("# in the order it made them at initialisation; interposer/tests/cudart_requests.py")
    print("# recorded them on the fake driver (the probe got: "
          + "; ".join(" ".join(line.split()[:2]) for line in output.splitlines()[2:4]) + ").")
    print("# symbol cudaVersion flags export: the export a driver of the toolkit's version")
    print(f"# ({args.include}) hands out for it, derived from cudaTypedefs.h; - for none.")
    for symbol, version, flags in requests:
        name = expected(symbol, version, flags) if symbol != '""' else None
        if name is not None and name not in known:
            print(f"warning: {name} is not a name the headers know", file=sys.stderr)
        print(symbol, version, flags, name or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
