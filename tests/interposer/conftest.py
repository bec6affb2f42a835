"""Fixtures for the interposer tests: build once, then run C probes under LD_PRELOAD.

Every probe runs against the fake driver and NVML (``interposer/tests/fake``), with the
release library, the ASan/UBSan one or the ThreadSanitizer one (``variant``). Under a
sanitizer its runtime (``libasan.so``, ``libtsan.so``) is preloaded first so the instrumented
interposer can load into uninstrumented programs; a sanitizer report on stderr fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from webhook.node.region import Region, read_region

ROOT = Path(__file__).resolve().parents[2]
INTERPOSER = ROOT / "interposer"
BUILD = INTERPOSER / "build"
GIB = 1 << 30
MIB = 1 << 20
UUID_A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
UUID_B = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
                   "WARNING: ThreadSanitizer")
CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY = 0, 1, 2
CUDA_ERROR_NOT_SUPPORTED = 801
NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_FUNCTION_NOT_FOUND = 2, 13


def charge(nbytes: int) -> int:
    """What the interposer charges for an allocation (mirror of gs_charge_size)."""
    if nbytes <= MIB:
        return (nbytes + 511) // 512 * 512
    return (nbytes + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


@pytest.fixture(scope="session")
def built() -> Path:
    """``make -C interposer all`` once per session (incremental, seconds when up to date)."""
    proc = subprocess.run(["make", "-s", "-C", str(INTERPOSER), "all"], check=False,
                          capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return BUILD


def runtime(name: str) -> str:
    """Path of gcc's sanitizer runtime ``name`` (preloaded before the instrumented library)."""
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()


@dataclass
class Result:
    """One probe run: ``lines`` are ``(command, rc, values)`` in output order."""

    returncode: int
    stdout: str
    stderr: str
    lines: list[tuple[str, int, list[int]]] = field(default_factory=list)

    def of(self, command: str) -> list[tuple[int, list[int]]]:
        return [(rc, vals) for cmd, rc, vals in self.lines if cmd == command]

    def rc(self, command: str, nth: int = 0) -> int:
        return self.of(command)[nth][0]

    def values(self, command: str, nth: int = 0) -> list[int]:
        return self.of(command)[nth][1]


def parse(stdout: str) -> list[tuple[str, int, list[int]]]:
    lines = []
    for raw in stdout.splitlines():
        parts = raw.split()
        if len(parts) >= 2 and parts[1].lstrip("-").isdigit():
            lines.append((parts[0], int(parts[1]), [int(p) for p in parts[2:]]))
    return lines


class Lab:
    """A container's worth of processes sharing one region, on a fake machine."""

    UUID_A = UUID_A
    UUID_B = UUID_B
    charge = staticmethod(charge)

    def __init__(self, tmp: Path, variant: str) -> None:
        self.tmp = tmp
        self.variant = variant
        self.build = BUILD
        self.region_path = tmp / "region"
        self.base = {k: v for k, v in os.environ.items()
                     if not k.startswith(("CUDA_", "GPUSLICE_", "FAKE_", "LIBCUDA_", "LD_", "ASAN",
                                          "UBSAN"))}
        self.base.update({
            "LD_LIBRARY_PATH": str(BUILD / "fake"),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(self.region_path),
            "FAKE_CUDA_STATE": str(tmp / "fakestate"),
            "FAKE_CUDA_DEVICES": f"{UUID_A}=16g",
            "LIBCUDA_LOG_LEVEL": "1",
        })
        if variant == "asan":
            self.base["LD_PRELOAD"] = f"{runtime('libasan.so')}:{BUILD / 'asan' / 'libgpuslice.so'}"
            self.base["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1"
            self.base["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
        elif variant == "tsan":
            self.base["LD_PRELOAD"] = f"{runtime('libtsan.so')}:{BUILD / 'tsan' / 'libgpuslice.so'}"
            # signal-unsafe calls are the test programs' own (SIGKILL tests), not the library's
            self.base["TSAN_OPTIONS"] = "report_signal_unsafe=0"
        else:
            self.base["LD_PRELOAD"] = str(BUILD / "libgpuslice.so")
        self.procs: list[subprocess.Popen[str]] = []

    def env(self, **extra: str | None) -> dict[str, str]:
        env = dict(self.base)
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def command(self, *cmds: str, api: str = "direct") -> list[str]:
        return [str(BUILD / "tests" / "gsprobe"), "--api", api, *cmds]

    def run(self, *cmds: str, api: str = "direct", env: dict[str, str] | None = None,
            timeout: float = 60, **extra: str | None) -> Result:
        proc = subprocess.run(self.command(*cmds, api=api), check=False,
                              env=env or self.env(**extra),
                              capture_output=True, text=True, timeout=timeout)
        self.check_sanitizers(proc.stderr)
        return Result(proc.returncode, proc.stdout, proc.stderr, parse(proc.stdout))

    def run_program(self, argv: list[str], timeout: float = 60,
                    **extra: str | None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, check=False, env=self.env(**extra), capture_output=True,
                              text=True,
                              timeout=timeout)
        self.check_sanitizers(proc.stderr)
        return proc

    def stress(self, iterations: int = 400, **extra: str | None) -> tuple[int, int, int]:
        """``tests/stress.c``: threads allocating near a 1 GiB cap, loading code, launching on
        several streams and running graphs that allocate, all at once.  Returns (calls that
        failed with anything but out-of-memory, the region's charge, what the fake driver
        holds for the process) once every thread has freed what it allocated."""
        env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "FAKE_CUDA_CTX_BYTES": "100m",
               "FAKE_CUDA_MODULE_BYTES": "256k", "FAKE_CUDA_LAUNCH_BYTES": "256k", **extra}
        proc = self.run_program([str(self.build / "tests" / "stress"), str(iterations)], **env)
        assert proc.returncode == 0, proc.stderr
        _, errors, charged, physical = proc.stdout.split()
        return int(errors), int(charged), int(physical)

    def start(self, *cmds: str, api: str = "direct", **extra: str | None
              ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.command(*cmds, api=api), env=self.env(**extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[str], timeout: float = 60) -> Result:
        out, err = proc.communicate(timeout=timeout)
        self.check_sanitizers(err)
        return Result(proc.returncode, out, err, parse(out))

    @staticmethod
    def check_sanitizers(stderr: str) -> None:
        for mark in SANITIZER_MARKS:
            assert mark not in stderr, stderr

    def region(self) -> Region:
        return read_region(self.region_path)

    def used(self, slot: int = 0) -> int:
        return self.region().devices[slot].used_bytes

    # One thread's (or process's) step ordered inside another's driver call by files, not by
    # fixed sleeps: the fake sleeps at the call's FAKE_CUDA_SLEEP point, creates a mark file as
    # the sleep starts and goes on once a go file exists ("{}" in the fake's paths: the point's
    # name).  A sleep of 100 ms to let the other thread get there, inside a call held 300 ms,
    # ordered them only while the machine kept up.
    HOLD_MS = 5000  # the most a call held for another's step lasts

    def held(self, *points: str, ms: int = HOLD_MS) -> dict[str, str]:
        """The environment that holds each driver call ``point`` (``name``, or ``name:nth`` for
        the nth such call only) until its go (``inside``, the same ``point``), ``ms`` at most."""
        sleep = ",".join(f"{name}:{ms}{':' + nth if nth else ''}"
                         for name, _, nth in (point.partition(":") for point in points))
        return {"FAKE_CUDA_SLEEP": sleep, "FAKE_CUDA_SLEEP_MARK": str(self.tmp / "in-{}"),
                "FAKE_CUDA_SLEEP_UNTIL": str(self.tmp / "go-{}")}

    def inside(self, point: str, *step: str) -> list[str]:
        """Probe commands that take ``step`` once another thread is inside the held call
        ``point``, then let that call go on."""
        return ["waitfile", str(self.tmp / f"in-{point}"), *step, "touch", str(self.tmp / f"go-{point}")]

    def bg_inside(self, point: str) -> list[str]:
        """Probe commands before a background thread's that start it once the main thread is
        inside the held call ``point``.  That call goes on after its ``ms``: where the library
        makes the thread's own call wait for it (a context's reset), no go can come from the
        thread."""
        return ["bgafter", str(self.tmp / f"in-{point}")]

    def cotenant_under_our_pid(self) -> tuple[subprocess.Popen[str], dict[str, str]]:
        """A process of another container (600 MiB beside its 100 MiB context, in a region of
        its own) that NVML, listing host pids (every process's pid + 100000), lists under the
        next probe's getpid(); and that probe's environment for it."""
        env = {"FAKE_CUDA_CTX_BYTES": "100m", "FAKE_NVML_PID_OFFSET": "100000"}
        other = self.start("init", "ctx", "0", "alloc", "600m", "touch", str(self.tmp / "other"),
                           "sleep", "3000", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.tmp / "other-region"),
                           **env)
        self.wait_for(self.tmp / "other")
        return other, {**env, "FAKE_NVML_PID_AS_MINE": str(other.pid)}

    def wait_for(self, path: Path, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.005)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(params=["release", "asan"])
def lab(request: pytest.FixtureRequest, built: Path, tmp_path: Path) -> Iterator[Lab]:
    """A fresh fake machine and region, with the release or the ASan/UBSan library."""
    lab = Lab(tmp_path, request.param)
    yield lab
    lab.cleanup()


@pytest.fixture
def release_lab(built: Path, tmp_path: Path) -> Iterator[Lab]:
    """Like ``lab``, release build only (timing-sensitive or slow tests)."""
    lab = Lab(tmp_path, "release")
    yield lab
    lab.cleanup()


@pytest.fixture
def asan_lab(built: Path, tmp_path: Path) -> Iterator[Lab]:
    """Like ``lab``, ASan/UBSan build only."""
    lab = Lab(tmp_path, "asan")
    yield lab
    lab.cleanup()


@pytest.fixture
def tsan_lab(built: Path, tmp_path: Path) -> Iterator[Lab]:
    """Like ``lab``, ThreadSanitizer build (threads of one process racing)."""
    lab = Lab(tmp_path, "tsan")
    yield lab
    lab.cleanup()
