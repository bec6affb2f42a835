"""Plumbing for the real-GPU checks: child processes, their environments, the time budget,
and the results file that ``summary.py`` turns into the table of scripts/gpu-check.sh.

Every GPU workload runs in its own child process with a timeout bounded by the run's
deadline (``GPUCHECK_DEADLINE``, seconds since the epoch), so one hang cannot eat the budget.
Children print their measurements as one line ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from gpu.nvmlwatch import Poller

MIB = 1 << 20
GIB = 1 << 30
CAP_MIB = 10240
CAP_ENV = "10g"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# GPUCHECK_LIB: run the same checks against another build (or HAMi-core's libvgpu.so).
LIB = Path(os.environ.get("GPUCHECK_LIB") or REPO / "interposer" / "build" / "libgpuslice.so")
WORKLOAD = HERE / "work.py"
WORK = Path(os.environ.get("GPUCHECK_WORK") or Path(tempfile.gettempdir()) / "gpucheck")
RESULTS = Path(os.environ.get("GPUCHECK_RESULTS") or WORK / "results.jsonl")

# Variables that would change what the library or the frameworks do; children start clean.
# PyTorch 2.9 reads PYTORCH_ALLOC_CONF first and PYTORCH_CUDA_ALLOC_CONF only without it
# (c10/core/AllocatorConfig.cpp): one left in the machine's environment would override the
# expandable-segments variant's PYTORCH_CUDA_ALLOC_CONF (which every 2.x reads).
_CLEARED_PREFIXES = ("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "GPUSLICE_",
                     "XLA_PYTHON_CLIENT_", "XLA_CLIENT_")
_CLEARED = ("LD_PRELOAD", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "LIBCUDA_LOG_LEVEL",
            "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUPY_GPU_MEMORY_LIMIT")


class ChildError(Exception):
    """A child workload failed, timed out or printed no result."""


def time_left() -> float:
    return float(os.environ.get("GPUCHECK_DEADLINE", "inf")) - time.time()


def budget(want: float) -> float:
    """A child's timeout: ``want`` seconds, less if the run's deadline is nearer."""
    left = time_left() - 3
    if left < 5:
        pytest.skip("time budget used up: not run")
    return min(want, left)


def plain_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child without the library."""
    env = {k: v for k, v in os.environ.items()
           if k not in _CLEARED and not k.startswith(_CLEARED_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    # a Python child killed by a signal prints every thread's Python stack: which thread died
    # (one with no Python frames is one of the library's or the driver's)
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra or {})
    return env


def new_region(name: str) -> Path:
    """A fresh region-file path: one per simulated container."""
    folder = WORK / "regions"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{uuid.uuid4().hex[:8]}.cache"


def capped_env(region: Path, mem: str | None = CAP_ENV, sm: int | None = None,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in a gpuslice container: the library preloaded."""
    env = plain_env(extra)
    env["LD_PRELOAD"] = str(LIB)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(region)
    if mem is not None:
        env["CUDA_DEVICE_MEMORY_LIMIT"] = mem
    if sm is not None:
        env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
    if os.environ.get("GPUCHECK_LOG_LEVEL"):
        env["LIBCUDA_LOG_LEVEL"] = os.environ["GPUCHECK_LOG_LEVEL"]
    # a child killed by a fatal signal writes which thread died and its native stack (crash.c)
    env["GPUSLICE_CRASH_REPORT"] = "1"
    return env


def parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise ChildError("no RESULT line in the output")


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-600:]


_FRAME = re.compile(r"^(?P<path>[^()\s]+)\((?P<sym>[^()+]*)\+(?P<off>0x[0-9a-f]+)\)\[0x[0-9a-f]+\]$")


def _symbolize(path: str, offset: int) -> str:
    """``function (file:line)`` of an offset in the library (built with -g), by addr2line (the
    return address less one: the call's line; functions inlined there first, ``<`` between);
    ``libgpuslice.so+0x…`` without it."""
    fallback = f"{Path(path).name}+{offset:#x}"
    tool = shutil.which("addr2line")
    if tool is None:
        return fallback
    try:
        out = subprocess.run([tool, "-f", "-i", "-e", path, f"{max(offset - 1, 0):#x}"],
                             check=False, capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return fallback
    named = [f"{fn} ({Path(at.split(' ')[0]).name})" for fn, at in zip(out[::2], out[1::2])
             if fn and fn != "??"]
    return " < ".join(named) or fallback


def crash_report(stderr: str, frames: int = 8) -> dict[str, Any] | None:
    """The library's report of a fatal signal (GPUSLICE_CRASH_REPORT, interposer/src/crash.c):
    the signal and the thread, and the thread's stack from the faulting frame on, each frame in
    the library named by addr2line, the others as ``file(symbol+offset)``; None without one."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    head = [ln.split("] crash: ", 1)[1] for ln in lines if "] crash: " in ln]
    if not head:
        return None
    stack: list[str] = []
    for ln in lines:
        m = _FRAME.match(ln)
        if m is None:
            continue
        path, sym, off = m["path"], m["sym"], int(m["off"], 16)
        stack.append(_symbolize(path, off) if Path(path).name.startswith("libgpuslice")
                     else f"{Path(path).name}({sym}+{off:#x})")
    # the first frames are the report's own: its handler, then the kernel's signal trampoline
    start = next((i + 2 for i, f in enumerate(stack) if f.startswith("crash_handler")), 0)
    return {"signal": head[0], "library": head[1:2], "stack": stack[start:start + frames],
            "frames_in_full": stack}


def _reported(stderr: str) -> bool:
    """Whether ``stderr`` holds the library's crash report (cheap: no addr2line)."""
    return "] crash: " in stderr


def _crash(stderr: str, report: dict[str, Any] | None = None) -> str:
    """A child killed by a signal: the library's report (the signal, the thread, where it died),
    the faulthandler's fatal error and the thread that died (its first frames, or ``<no Python
    frame>``: a thread of the library's or the driver's), then the library's last log lines; the
    plain tail where there is no such report."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    report = report or crash_report(stderr)
    native = [f"{report['signal']}: " + " < ".join(report["stack"][:5])] if report else []
    fatal = [ln for ln in lines if ln.startswith("Fatal Python error")]
    at = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if not fatal and at is None and not native:
        return _tail(stderr)
    died = lines[at:at + 3] if at is not None else []
    logged = [ln for ln in library_log(stderr, 4) if "] crash: " not in ln][-2:]
    return " | ".join(native + fatal[:1] + died + logged)[:900]


def exit_text(args: Any, status: int, stderr: str) -> str:
    """What a child's failed exit says: ``exit status N:`` and, for one killed by a signal, its
    crash report (kept whole in the results, where the summary names where it died), else the
    tail of its stderr."""
    if status >= 0:
        return f"exit status {status}: {_tail(stderr)}"
    report = crash_report(stderr)
    if report is not None:
        argv = args if isinstance(args, list) else [str(args)]
        _append({"kind": "crash", "child": " ".join(Path(str(a)).name for a in argv[:3]),
                 "report": report, "time": time.time()})
    return f"exit status {status}: {_crash(stderr, report)}"


def abort_for_report(proc: subprocess.Popen[str], stderr: Any) -> str:
    """A child that gave no answer in time: SIGABRT, so that under the library it writes where
    its main thread waits (crash.c) and a Python one every thread's stack; SIGKILL after 5 s.
    ``stderr``: a callable returning the child's stderr once it has ended.  Returns its crash
    report as :func:`exit_text` words it, or "" without one."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        err = stderr()
    except (OSError, ValueError):
        return ""
    return exit_text(proc.args, proc.returncode, err) if _reported(err) else ""


def run(args: list[str], env: dict[str, str], timeout: float,
        poller: Poller | None = None) -> dict[str, Any]:
    """Run a child to completion and return its RESULT; ChildError on any failure."""
    limit = budget(timeout)
    proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    if poller is not None:
        poller.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # SIGABRT first: under the library a stuck child writes where its main thread waits
        # (crash.c), and a Python one every thread's Python stack (the faulthandler)
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a child of the child (a compiler) holds the pipes
                out, err = "", "(no output: a process the child started kept its pipes open)"
        what = " ".join(Path(a).name for a in args[1:3])
        stuck = exit_text(args, proc.wait(), err) if _reported(err) else _tail(err)
        # cut by the run's deadline: the summary's command for a second call runs it again;
        # a child that hung for its own time ran (it would hang there too)
        cut = " at the time budget's end" if limit < timeout else ""
        raise ChildError(f"{what} timed out after {limit:.0f}s{cut}: {stuck}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise ChildError(exit_text(args, proc.returncode, err))
    try:
        result = parse_result(out)
    except (ChildError, ValueError) as exc:
        raise ChildError(f"{exc}: {_tail(out + err)}") from None
    lib_log = library_log(err)
    if lib_log:
        result.setdefault("library_log", lib_log)
    ticks = slice_ticks(err)
    if ticks:
        result.setdefault("slice_ticks", ticks)
    return result


def library_log(stderr: str, lines: int = 8) -> list[str]:
    """The library's last log lines (``gpuslice:``) in a child's stderr, debug lines left out."""
    return [ln for ln in stderr.splitlines()
            if ln.startswith("gpuslice:") and "] debug: " not in ln][-lines:]


def slice_ticks(stderr: str, lines: int = 40) -> list[str]:
    """The time-slice correction's per-tick debug lines (LIBCUDA_LOG_LEVEL=3: NVML's share for
    this process, the others', the device's, what the events measured), the last ``lines``:
    what NVML's per-process samples look like on the driver, which decides whether the
    correction can work there (interposer/README.md, time slices)."""
    return [ln for ln in stderr.splitlines() if "] debug: " in ln and ": ours " in ln][-lines:]


def pinned(args: list[str]) -> list[str]:
    """``args`` under ``taskset`` on one CPU this process may use (unchanged without taskset):
    launch costs differ more between two processes on different cores than the hooks cost."""
    taskset = shutil.which("taskset")
    cpus = sorted(os.sched_getaffinity(0))
    if taskset is None or len(cpus) < 2:
        return args
    return [taskset, "-c", str(cpus[len(cpus) // 2]), *args]


def alternate(args: list[str], timeout: float, rounds: int, label: str
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``rounds`` pinned runs each without and with the library (10 GiB cap, no SM limit),
    alternating which goes first; the i-th of each list form a pair."""
    with_lib_env = capped_env(new_region(label))
    plain: list[dict[str, Any]] = []
    with_lib: list[dict[str, Any]] = []
    args = pinned(args)
    for round_no in range(rounds):
        order = [("plain", plain_env()), ("lib", with_lib_env)]
        for name, env in order if round_no % 2 == 0 else order[::-1]:
            result = run(args, env, timeout)
            (plain if name == "plain" else with_lib).append(result)
    return plain, with_lib


class _Turn:
    """A ``work.py turns`` child: commands on stdin, one answer line each (stderr to a file,
    so that nothing the child logs can block it)."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, cwd=REPO)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def answer(self, deadline: float) -> str:
        """The next line that is not a framework's chatter, by ``deadline`` (monotonic)."""
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                stuck = abort_for_report(self.proc, self._stderr) or _tail(self._stderr())
                raise ChildError(f"{self.name}: no answer in time: {stuck}") from None
            if line is None:
                raise ChildError(f"{self.name}: "
                                 f"{exit_text(self.proc.args, self.proc.wait(), self._stderr())}")
            if line.split(" ", 1)[0] in ("ready", "tiny", "matmul", "RESULT"):
                return line

    def ask(self, command: str, deadline: float) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer(deadline)

    def finish(self, deadline: float) -> dict[str, Any]:
        result = parse_result(self.ask("end", deadline))
        lib_log = library_log(self._stderr())
        if lib_log:
            result.setdefault("library_log", lib_log)
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()


def take_turns(args: list[str], timeout: float, pairs: int, rounds: int, label: str,
               matmul: tuple[float, float] = (0.5, 1.0), discard: int = 4
               ) -> list[dict[str, Any]]:
    """``pairs`` pairs of processes, one without and one with the library (10 GiB cap, no SM
    limit), started side by side (their start-up is not measured) and then taking turns on
    the GPU and on one CPU: ``discard`` + ``rounds`` rounds of one tiny-op batch each, the
    order alternating (plain lib lib plain ...: a drift of the machine's state in time falls
    on both alike), then one matmul each.  Launch costs drift by more than the hooks cost
    between processes and within one over seconds; a turn lasts tens of milliseconds.
    Only the measuring thread is pinned (after start-up): the library's sampler thread (an
    NVML query every 0.5 s far from the cap) runs where the scheduler puts it, as in a
    container with more than one CPU.
    ``args``: a ``work.py turns`` command line, without ``--pin``.  Per pair:
    ``{"plain": RESULT, "lib": RESULT}``, each with its ``rounds`` batches (ns per op) and
    TFLOPS."""
    with_lib_env = capped_env(new_region(label))
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--pin", str(cpus[len(cpus) // 2])] if len(cpus) >= 2 else []
    out: list[dict[str, Any]] = []
    for pair_no in range(pairs):
        deadline = time.monotonic() + budget(timeout)
        children = {"plain": _Turn([*args, *pin], plain_env(), "plain"),
                    "lib": _Turn([*args, *pin], with_lib_env, "with the library")}
        try:
            for child in children.values():
                child.answer(deadline)  # ready
            batches: dict[str, list[float]] = {"plain": [], "lib": []}
            for round_no in range(discard + rounds):
                order = ["plain", "lib"] if (round_no + pair_no) % 2 == 0 else ["lib", "plain"]
                for name in order:
                    ns = float(children[name].ask("tiny", deadline).split()[1])
                    if round_no >= discard:
                        batches[name].append(ns)
            for name in (["plain", "lib"] if pair_no % 2 == 0 else ["lib", "plain"]):
                children[name].ask(f"matmul {matmul[0]} {matmul[1]}", deadline)
            results = {name: child.finish(deadline) for name, child in children.items()}
        finally:
            for child in children.values():
                child.kill()
        for name, result in results.items():
            result["tiny_ns_batches"] = batches[name]  # the measured rounds only
        out.append(results)
    return out


def workload(*args: str) -> list[str]:
    """The command line of a Python workload in work.py."""
    return [sys.executable, str(WORKLOAD), *args]


class Server:
    """A ``gpubench serve`` child driven line by line (one process of a container)."""

    def __init__(self, gpubench: Path, env: dict[str, str], poller: Poller | None = None,
                 timeout: float = 20, prefix: tuple[str, ...] = ()) -> None:
        """``prefix``: a command that runs gpubench (``unshare --pid --fork``, say): then
        ``proc`` is that command's process, and gpubench's pid is in the ``ready`` line."""
        self.proc = subprocess.Popen([*prefix, str(gpubench), "serve"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if poller is not None:
            poller.add(self.proc.pid)
        ready = self._next(timeout)
        if not ready.startswith("ready"):
            self.kill()
            raise ChildError(f"gpubench serve did not start: {ready}")
        self.pid = int(ready.split()[1])
        """gpubench's pid as it knows it (in its own PID namespace, under ``prefix``)."""

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=budget(timeout))
        except queue.Empty:
            stuck = abort_for_report(self.proc, lambda: self.proc.stderr.read()
                                     if self.proc.stderr else "")
            raise ChildError(f"gpubench serve gave no answer in {timeout:.0f}s: {stuck}"
                             ) from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise ChildError(f"gpubench serve: {exit_text(self.proc.args, self.proc.wait(), err)}")
        return line

    def send(self, command: str) -> None:
        """Send one command without waiting (see :meth:`receive`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = 20) -> str:
        return self._next(timeout)

    def ask(self, command: str, timeout: float = 20) -> str:
        self.send(command)
        return self._next(timeout)

    def alloc(self, nbytes: int) -> str:
        """'ok <idx>' or 'err <code> <name>'."""
        return self.ask(f"alloc {nbytes}")

    def quit(self, timeout: float = 20) -> int:
        self.ask("quit")
        return self.proc.wait(timeout=budget(timeout))

    def kill(self) -> None:
        """SIGKILL (no cleanup runs in the child), then reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def retry_alloc(server: Server, nbytes: int, within: float) -> tuple[str, float]:
    """Ask for ``nbytes`` until granted or ``within`` seconds pass: (last answer, seconds)."""
    start = time.monotonic()
    answer = server.alloc(nbytes)
    while not answer.startswith("ok") and time.monotonic() - start < within:
        time.sleep(0.05)
        answer = server.alloc(nbytes)
    return answer, time.monotonic() - start


def region_used(region: Path) -> int:
    """Bytes the region file charges to its first device (the container's budget, as the agent
    reads it)."""
    from webhook.node.region import read_region
    return int(read_region(region).devices[0].used_bytes)


def record(check: str, value: str, ok: bool | None, **data: Any) -> None:
    """Append one measured row to the results file (``ok`` None: informational)."""
    _append({"kind": "check", "check": check, "value": value, "ok": ok, "data": data,
             "time": time.time()})


def record_test(nodeid: str, outcome: str, message: str, seconds: float | None = None) -> None:
    """Append a test's outcome (the reason a check without a row failed or was skipped) and
    how long it took, set-up included (the session's shared runs fall to their first user)."""
    line: dict[str, Any] = {"kind": "test", "nodeid": nodeid, "outcome": outcome,
                            "message": message}
    if seconds is not None:
        line["seconds"] = round(seconds, 2)
    _append(line)


def record_env(name: str, data: dict[str, Any]) -> None:
    """Append a fact about the machine or the tools (GPU, driver, how gpubench was built)."""
    _append({"kind": "env", "name": name, "data": data})


def _append(line: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
