"""What the library costs per launch and per alloc+free pair, on the fake driver (developer tool).

    python3 interposer/tests/costs.py [--lib PATH ...] [--runs N]

For no library and each ``--lib`` (default: build/libgpuslice.so), prints
  * instructions per operation (valgrind --tool=callgrind, whole process; the difference of two
    runs with different operation counts, so start-up cancels): an empty-kernel launch with a
    10 GiB cap and no SM limit, a 1 MiB cuMemAlloc+cuMemFree pair far from the cap, and the
    same pair within the reconcile margin of the cap;
  * wall-clock medians of gsprobe's launchbench / allocbench over ``--runs`` alternating runs.
Instruction counts repeat exactly from run to run; the wall-clock figures on a shared machine
do not, so compare medians of several runs. The fake driver's own work is the same for every
library, so differences between columns are the library's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
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
    "2 MiB VMM page create+map+release+unmap": ([], lambda n: ["vmmbench", str(n), "2m"],
                                                {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
}


def env_for(lib: str | None, tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LD_LIBRARY_PATH": str(BUILD / "fake"),
           "FAKE_CUDA_KERNEL_US": "0", "FAKE_CUDA_CTX_BYTES": "100m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp / "region"),
           "FAKE_CUDA_STATE": str(tmp / "state"), **extra}
    # without the library, preload a library the program loads anyway: the environment keeps
    # its size (the fake driver calls getenv on every call, whose cost grows with it)
    env["LD_PRELOAD"] = lib or "libdl.so.2"
    return env


def instructions(lib: str | None, cmds: list[str], extra: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "cg.out"
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                               PROBE, "init", "ctx", "0", *cmds],
                              env=env_for(lib, tmp, extra), capture_output=True, text=True,
                              check=True, timeout=600)
        match = re.search(r"Collected : (\d+)", proc.stderr)
        if not match:
            raise RuntimeError(proc.stderr[-500:])
        return int(match.group(1))


def per_op(lib: str | None, case: str, n1: int = 2000, n2: int = 12000) -> float:
    before, measured, extra = CASES[case]
    a = instructions(lib, [*before, *measured(n1)], extra)
    b = instructions(lib, [*before, *measured(n2)], extra)
    return (b - a) / (n2 - n1)


def wall(lib: str | None, cmds: list[str], extra: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc = subprocess.run([PROBE, "init", "ctx", "0", *cmds], env=env_for(lib, tmp, extra),
                              capture_output=True, text=True, check=True, timeout=120)
    last = proc.stdout.strip().splitlines()[-1].split()
    return float(last[2])  # launchbench / allocbench: "<cmd> <rc> <ns per op> ..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", action="append", help="library to measure (repeatable)")
    parser.add_argument("--runs", type=int, default=9, help="wall-clock runs per library")
    args = parser.parse_args()
    libs: list[str | None] = [None, *(args.lib or [str(BUILD / "libgpuslice.so")])]
    names = ["none", *[str(lib) for lib in libs[1:]]]

    print("instructions per operation (callgrind, whole process)")
    for case in CASES:
        cells = [f"{per_op(lib, case):8.1f}" for lib in libs]
        print(f"  {case:34s} " + "  ".join(cells))
    wall_cases = {
        "launch ns (launchbench)": (["launchbench", "20000"], {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
        "1 MiB alloc+free ns, far": (["allocbench", "5000", "1m"],
                                     {"CUDA_DEVICE_MEMORY_LIMIT": "10g"}),
    }
    print(f"wall-clock medians of {args.runs} alternating runs")
    for case, (cmds, extra) in wall_cases.items():
        samples: dict[int, list[float]] = {i: [] for i in range(len(libs))}
        for run in range(args.runs):
            order = list(range(len(libs)))
            for i in order if run % 2 == 0 else order[::-1]:
                samples[i].append(wall(libs[i], cmds, extra))
        cells = [f"{statistics.median(samples[i]):8.1f}" for i in range(len(libs))]
        print(f"  {case:34s} " + "  ".join(cells))
    print("columns: " + ", ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
