"""Build the ``gpubench`` driver-API tool (native/gpubench.c) on the GPU machine, gcc alone.

Preferred: linked against the machine's real libcuda.so.1, so that its driver calls are
plain symbol calls (the path most C programs take). Fallback: the same program resolving
the driver with dlopen + dlsym (the path the interposer's dlsym hook serves).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "gpubench.c"
_LIB_DIRS = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


class BuildError(Exception):
    """No way of building gpubench worked."""


def find_libcuda() -> Path | None:
    """The file the loader maps for libcuda.so.1 here, or a well-known copy of it."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and "/libcuda.so" in fields[-1]:
                return Path(fields[-1])
    for folder in _LIB_DIRS:
        candidate = Path(folder) / "libcuda.so.1"
        if candidate.exists():
            return candidate
    return None


def build_gpubench(out: Path) -> tuple[Path, str]:
    """Compile gpubench to ``out``; returns the path and how it was built."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("no C compiler (gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = ["-O2", "-Wall", "-std=gnu11", "-pthread", "-o", str(out), str(SOURCE)]
    attempts: list[tuple[str, list[str]]] = []
    libcuda = find_libcuda()
    if libcuda is not None:
        attempts.append((f"linked to {libcuda}", [cc, *flags, str(libcuda), "-ldl"]))
    attempts.append(("dlopen + dlsym", [cc, "-DGPUBENCH_DLOPEN", *flags, "-ldl"]))
    errors = []
    for how, cmd in attempts:
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{how}: {exc}")
            continue
        if done.returncode == 0:
            return out, how
        errors.append(f"{how}: {done.stderr.strip()[-300:]}")
    raise BuildError("; ".join(errors))
