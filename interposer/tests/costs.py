"""What the library costs per launch and per alloc+free pair, on the fake driver (developer tool).

    python3 interposer/tests/costs.py [--lib PATH ...] [--runs N] [--per-op-only | --startup-only]

For no library and each ``--lib`` (default: build/libgpuslice.so), prints
  * instructions per operation (valgrind --tool=callgrind, whole process; the difference of two
    runs with different operation counts, so start-up cancels): an empty-kernel launch with a
    10 GiB cap and no SM limit, a 1 MiB cuMemAlloc+cuMemFree pair far from the cap, and the
    same pair within the reconcile margin of the cap, a 1 MiB cuMemAllocAsync+cuMemFreeAsync pair
    from the default pool, a cuMemGetInfo_v2 and an nvmlDeviceGetMemoryInfo call, a 2 MiB VMM
    page and a 1 MiB array made and released; and the instructions of a whole run of
    ``/bin/true`` (the "none" column preloads libdl, a library every process has anyway);
  * instructions per call of each hook a framework's tiny op reaches, as the CUDA runtime finds
    it through cuGetProcAddress (the launches, plain and _ptsz, the synchronisations and an async
    copy, which ends a gap under a limit;
    ``--tiny-op-only`` prints only these);
  * wall-clock medians of gsprobe's launchbench / allocbench over ``--runs`` alternating runs;
  * start-up, as wall-clock medians over the same runs: 200 execs of ``/bin/true`` one after the
    other (a process that never touches CUDA, with the library preloaded as in a container;
    dominated by the exec itself, the instruction count above is the finer figure), and
    a storm of ``--storm`` processes (at most 250) started at once that each initialise the
    driver, make a 20 MiB context and ask for 64 MiB under a cap that holds the contexts and
    half the allocations: all in one container, and five to a container (the shape of a busy
    node).  The MiB granted are printed beside the caps: the race is checked, not only timed.
Instruction counts repeat exactly from run to run; the wall-clock figures on a shared machine
do not, so compare medians of several runs. The fake driver's own work is the same for every
library, so differences between columns are the library's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

BUILD = Path(__file__).resolve().parents[1] / "build"
PROBE = str(BUILD / "tests" / "gsprobe")

# name: (probe commands before the measured ones, measured command builder, env)
CASES = {
    "launch (no SM limit)": ([], lambda n: ["launch", str(n)], {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "1 MiB alloc+free, far from cap": ([], lambda n: ["allocbench", str(n), "1m"],
                                       {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "1 MiB alloc+free, near cap": (["alloc", "800m"], lambda n: ["allocbench", str(n), "1m"],
                                   {"CUDA_DEVICE_MEMORY_LIMIT": "1g"}),
    "1 MiB cuMemAllocAsync+cuMemFreeAsync, pool": ([], lambda n: ["asyncpairs", str(n), "1m"],
                                                    {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "cuMemGetInfo_v2": ([], lambda n: ["meminfos", str(n)], {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "nvmlDeviceGetMemoryInfo": ([], lambda n: ["nvmlmeminfos", str(n)],
                                {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "2 MiB VMM page create+map+release+unmap": ([], lambda n: ["vmmbench", str(n), "2m"],
                                                {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    "1 MiB array create+destroy (256x256 float4)": ([], lambda n: ["arraybench", str(n), "256", "256"],
                                                    {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
}

# The entry points a framework's tiny op can reach per op or per synchronisation, each as the
# CUDA runtime finds it (cuGetProcAddress_v2 at CUDA 13.0; "ptsz": with the per-thread default
# stream flag, which hands out the _ptsz variants), with a 10 GiB cap and no SM limit:
# name: (gsprobe --api mode, measured command builder)
TINY_OP_CASES = {
    "cuLaunchKernel via cuGetProcAddress": ("procaddr", lambda n: ["launch", str(n)]),
    "cuLaunchKernel_ptsz via cuGetProcAddress": ("ptsz", lambda n: ["launch", str(n)]),
    "cuLaunchKernelEx via cuGetProcAddress": ("procaddr", lambda n: ["launchex", str(n)]),
    "cuLaunchKernelEx_ptsz via cuGetProcAddress": ("ptsz", lambda n: ["launchex", str(n)]),
    "cuCtxSynchronize via cuGetProcAddress": ("procaddr", lambda n: ["ctxsyncs", str(n)]),
    "cuStreamSynchronize via cuGetProcAddress": ("procaddr", lambda n: ["streamsyncs", str(n)]),
    "cuStreamSynchronize_ptsz via cuGetProcAddress": ("ptsz", lambda n: ["streamsyncs", str(n)]),
    "cuMemcpyHtoDAsync_v2 via cuGetProcAddress": ("procaddr", lambda n: ["copies", str(n)]),
    "cuMemcpyHtoDAsync_v2_ptsz via cuGetProcAddress": ("ptsz", lambda n: ["copies", str(n)]),
}


def env_for(lib: str | None, tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_LIBRARY_PATH": str(BUILD / "fake"),
           "FAKE_CUDA_KERNEL_US": "0", "FAKE_CUDA_CTX_BYTES": "100m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / "region"),
           "FAKE_CUDA_STATE": str(tmp / "state"), **extra}
    # without the library, preload a library the program loads anyway: the environment keeps
    # its size (the fake driver calls getenv on every call, whose cost grows with it).  Through
    # a link of the same name in tmp for every column: the environment's strings then lie at
    # the same addresses, and libc's strncmp, which getenv calls, takes a path that depends on
    # their alignment (the same library preloaded from /tmp/h132-costs/... and from a path two
    # characters shorter read 5,385 and 5,283 instructions per alloc+free pair)
    link = tmp / "preload.so"
    if not link.is_symlink():
        link.symlink_to(os.path.abspath(lib) if lib else libdl_path())
    env["LD_PRELOAD"] = str(link)
    return env


def libdl_path() -> str:
    """Where libdl.so.2 is (the "none" column's preload), as this process loaded it."""
    ctypes.CDLL("libdl.so.2")
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("/libdl.so.2"):
                return line.split()[-1]
    raise RuntimeError("libdl.so.2 not found")


def instructions(lib: str | None, cmds: list[str], extra: dict[str, str],
                 api: str = "direct") -> int:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "cg.out"
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                               PROBE, "--api", api, "init", "ctx", "0", *cmds],
                              env=env_for(lib, tmp, extra), capture_output=True, text=True,
                              check=True, timeout=600)
        match = re.search(r"Collected : (\d+)", proc.stderr)
        if not match:
            raise RuntimeError(proc.stderr[-500:])
        return int(match.group(1))


def exec_instructions(lib: str | None) -> int:
    """Instructions of one whole run of /bin/true, a program that never touches CUDA."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cg.out"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_PRELOAD": lib or "libdl.so.2"}
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                               "/bin/true"], env=env, capture_output=True, text=True, check=True,
                              timeout=120)
    match = re.search(r"Collected : (\d+)", proc.stderr)
    if not match:
        raise RuntimeError(proc.stderr[-500:])
    return int(match.group(1))


def per_op(lib: str | None, case: str, n1: int = 2000, n2: int = 12000) -> float:
    before, measured, extra = CASES[case]
    a = instructions(lib, [*before, *measured(n1)], extra)
    b = instructions(lib, [*before, *measured(n2)], extra)
    return (b - a) / (n2 - n1)


def tiny_op_cost(lib: str | None, case: str, n1: int = 2000, n2: int = 12000) -> float:
    api, measured = TINY_OP_CASES[case]
    extra = {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}
    a = instructions(lib, measured(n1), extra, api)
    b = instructions(lib, measured(n2), extra, api)
    return (b - a) / (n2 - n1)


def wall(lib: str | None, cmds: list[str], extra: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc = subprocess.run([PROBE, "init", "ctx", "0", *cmds], env=env_for(lib, tmp, extra),
                              capture_output=True, text=True, check=True, timeout=120)
    last = proc.stdout.strip().splitlines()[-1].split()
    return float(last[2])  # launchbench / allocbench: "<cmd> <rc> <ns per op> ..."


def execs(lib: str | None, n: int = 200) -> float:
    """Microseconds per exec of a program that never touches CUDA."""
    with tempfile.TemporaryDirectory() as d:
        env = env_for(lib, Path(d), {})
        start = time.perf_counter()
        for _ in range(n):
            subprocess.run(["/bin/true"], env=env, check=True)
        return (time.perf_counter() - start) / n * 1e6


def storm(lib: str | None, n: int, containers: int = 1) -> tuple[float, int, int]:
    """Milliseconds until n processes started at once, spread over ``containers`` regions,
    have each attached, made a 20 MiB context and had the answer to a 64 MiB allocation under
    a cap per container that holds its contexts and half its allocations; then the MiB they
    were granted and the sum of the caps.  Every process holds what it got until all have
    answered, so with the library the grants must fill the caps to within one allocation."""
    per = n // containers
    cap = per * 20 + per // 2 * 64
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        envs = []
        for c in range(containers):
            (tmp / str(c)).mkdir()
            envs.append(env_for(lib, tmp / str(c), {
                "CUDA_DEVICE_MEMORY_LIMIT": f"{cap}m", "FAKE_CUDA_CTX_BYTES": "20m",
                "FAKE_CUDA_STATE": str(tmp / "state"),  # one fake GPU under every container
                "FAKE_CUDA_DEVICES": "GPU-00000000-1111-2222-3333-444444444444=1024g"}))
        start = time.perf_counter()
        procs = [subprocess.Popen([PROBE, "init", "ctx", "0", "alloc", "64m", "sleep", "60000"],
                                  env=envs[i % containers], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
                 for i in range(per * containers)]
        granted = 0
        try:
            for p in procs:
                assert p.stdout is not None
                for line in p.stdout:
                    word, rc = line.split()[:2]
                    if word in ("ctx", "alloc") and rc == "0":
                        granted += 20 if word == "ctx" else 64
                    if word == "alloc":
                        break
            took = (time.perf_counter() - start) * 1e3
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return took, granted, cap * containers


def per_operation(libs: list[str | None], runs: int) -> None:
    print("instructions per operation (callgrind, whole process)")
    for case in CASES:
        cells = [f"{per_op(lib, case):8.1f}" for lib in libs]
        print(f"  {case:44s} " + "  ".join(cells))
    for case in TINY_OP_CASES:
        cells = [f"{tiny_op_cost(lib, case):8.1f}" for lib in libs]
        print(f"  {case:44s} " + "  ".join(cells))
    cells = [f"{exec_instructions(lib):8d}" for lib in libs]
    print(f"  {'exec of /bin/true (whole run)':44s} " + "  ".join(cells))
    wall_cases = {
        "launch ns (launchbench)": (["launchbench", "20000"], {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
        "1 MiB alloc+free ns, far": (["allocbench", "5000", "1m"],
                                     {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    }
    print(f"wall-clock medians of {runs} alternating runs")
    for case, (cmds, extra) in wall_cases.items():
        samples: dict[int, list[float]] = {i: [] for i in range(len(libs))}
        for run in range(runs):
            order = list(range(len(libs)))
            for i in order if run % 2 == 0 else order[::-1]:
                samples[i].append(wall(libs[i], cmds, extra))
        cells = [f"{statistics.median(samples[i]):8.1f}" for i in range(len(libs))]
        print(f"  {case:44s} " + "  ".join(cells))


def start_up(libs: list[str | None], runs: int, n: int) -> None:
    storms = {f"storm, {n} processes, 1 container, ms": 1,
              f"storm, {n} processes, {n // 5} containers, ms": n // 5}
    startup: dict[str, list[list[float]]] = {"exec of /bin/true, us": [[] for _ in libs],
                                             **{case: [[] for _ in libs] for case in storms}}
    grants: list[set[str]] = [set() for _ in libs]
    for run in range(runs):
        order = list(range(len(libs)))
        for i in order if run % 2 == 0 else order[::-1]:
            startup["exec of /bin/true, us"][i].append(execs(libs[i]))
            for case, containers in storms.items():
                took, granted, caps = storm(libs[i], n, containers)
                startup[case][i].append(took)
                grants[i].add(f"{granted}/{caps}")
    print(f"start-up: wall-clock medians of {runs} alternating runs")
    for case, samples in startup.items():
        cells = [f"{statistics.median(s):8.1f}" for s in samples]
        print(f"  {case:44s} " + "  ".join(cells))
    # without the library nothing is capped: every allocation is granted
    print(f"  {'storm: MiB granted / caps':44s} " + "  ".join(" ".join(sorted(g)) for g in grants))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", action="append", help="library to measure (repeatable)")
    parser.add_argument("--runs", type=int, default=9, help="wall-clock runs per library")
    parser.add_argument("--storm", type=int, default=100, help="processes started at once")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up figures")
    parser.add_argument("--per-op-only", action="store_true",
                        help="only the per-operation figures (instructions and wall-clock), no start-up")
    parser.add_argument("--tiny-op-only", action="store_true",
                        help="only the instructions of the hooks a framework's tiny op reaches")
    args = parser.parse_args()
    libs: list[str | None] = [None, *(args.lib or [str(BUILD / "libgpuslice.so")])]
    names = ["none", *[str(lib) for lib in libs[1:]]]

    if args.tiny_op_only:
        print("instructions per call (callgrind, whole process)")
        for case in TINY_OP_CASES:
            cells = [f"{tiny_op_cost(lib, case):8.1f}" for lib in libs]
            print(f"  {case:44s} " + "  ".join(cells))
        print("columns: " + ", ".join(names))
        return 0
    if not args.startup_only:
        per_operation(libs, args.runs)
    if not args.per_op_only:
        start_up(libs, args.runs, args.storm)
    print("columns: " + ", ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
