"""GPU workloads for the real-GPU checks, each run as its own child process.

    work.py probe FRAMEWORK            initialise the framework, allocate a token, hold
    work.py fill FRAMEWORK CHUNKS      allocate chunks (MiB, largest first) until OOM, report
    work.py matmul SECONDS             bf16 matmul throughput (and tiny-op launch cost; or
                                       beside a graph capture held open: --hold-capture;
                                       with a host-to-device copy before each: --copy-mib)
    work.py turns                      tiny-op batches and matmuls on command (stdin), in
                                       turns with another process (harness.take_turns)

FRAMEWORK is torch, cupy or jax. Each prints one line ``RESULT {json}``. The parent decides
whether the interposer is preloaded; this file imports only the framework it is asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


class Framework:
    """What the fill needs of a framework; subclasses wrap torch, cupy, jax."""

    def alloc(self, nbytes: int) -> Any:
        raise NotImplementedError

    def is_oom(self, exc: Exception) -> bool:
        raise NotImplementedError

    def reserved(self, allocated: int) -> int:
        """Bytes the framework holds from the driver (its pool), given ``allocated``."""
        raise NotImplementedError

    def release(self, chunks: list[Any]) -> None:
        """Drop ``chunks`` and hand the memory back to the driver."""
        raise NotImplementedError

    def view(self) -> dict[str, Any]:
        """The memory view the framework reports (the interposer's, when preloaded)."""
        raise NotImplementedError

    def prepare(self, sizes: list[int]) -> None:
        """Make the first allocation of each size need no more device memory than itself."""


class Torch(Framework):
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.token = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    def is_oom(self, exc: Exception) -> bool:
        return isinstance(exc, self.torch.cuda.OutOfMemoryError)

    def reserved(self, allocated: int) -> int:
        return int(self.torch.cuda.memory_reserved())

    def release(self, chunks: list[Any]) -> None:
        chunks.clear()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()

    def view(self) -> dict[str, Any]:
        free, total = self.torch.cuda.mem_get_info()
        return {"free": free, "total": total}


class Cupy(Framework):
    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.pool = cupy.get_default_memory_pool()
        self.token = cupy.zeros(1)
        cupy.cuda.Device().synchronize()

    def alloc(self, nbytes: int) -> Any:
        return self.cupy.empty(nbytes, dtype=self.cupy.uint8)

    def is_oom(self, exc: Exception) -> bool:
        return isinstance(exc, self.cupy.cuda.memory.OutOfMemoryError)

    def reserved(self, allocated: int) -> int:
        return int(self.pool.total_bytes())

    def release(self, chunks: list[Any]) -> None:
        chunks.clear()
        self.pool.free_all_blocks()

    def view(self) -> dict[str, Any]:
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return {"free": free, "total": total}


class Jax(Framework):
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp
        self.device = jax.devices()[0]
        self.token = jnp.zeros(1).block_until_ready()

    def alloc(self, nbytes: int) -> Any:
        return self.jnp.zeros((nbytes,), dtype=self.jnp.uint8).block_until_ready()

    def is_oom(self, exc: Exception) -> bool:
        text = str(exc)
        return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()

    def prepare(self, sizes: list[int]) -> None:
        for nbytes in sizes:  # compile each shape's program now, not at the cap
            self.alloc(nbytes).delete()

    def reserved(self, allocated: int) -> int:
        stats = self.device.memory_stats() or {}
        return int(stats.get("pool_bytes") or allocated)

    def release(self, chunks: list[Any]) -> None:
        for chunk in chunks:
            chunk.delete()
        chunks.clear()

    def view(self) -> dict[str, Any]:
        stats = self.device.memory_stats() or {}
        keys = ("bytes_in_use", "bytes_limit", "bytes_reserved", "pool_bytes",
                "peak_bytes_in_use", "largest_free_block_bytes")
        return {k: stats[k] for k in keys if k in stats}


FRAMEWORKS: dict[str, type[Framework]] = {"torch": Torch, "cupy": Cupy, "jax": Jax}


def nvml_view() -> dict[str, Any]:
    """Device 0 as NVML shows it inside this process (the interposer's view if preloaded)."""
    try:
        import pynvml
    except ImportError as exc:
        return {"error": f"ImportError: {exc}"}
    try:
        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    except pynvml.NVMLError as exc:  # reported, not fatal: the check decides
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"total": int(info.total), "used": int(info.used), "free": int(info.free)}


def nvml_self() -> float | None:
    """MiB this process holds on device 0 by NVML's process list (passed through by the
    interposer: the driver's own figure), or None where NVML cannot say."""
    try:
        import os

        import pynvml

        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:  # noqa: BLE001 - ImportError, pynvml.NVMLError...: no figure
        return None
    used = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
    return used[0] / MIB if used and isinstance(used[0], int) and used[0] > 0 else None


def start(name: str) -> tuple[Framework, float]:
    t0 = time.monotonic()
    fw = FRAMEWORKS[name]()
    return fw, time.monotonic() - t0


def cmd_probe(args: argparse.Namespace) -> dict[str, Any]:
    fw, init_s = start(args.framework)
    result = {"reserved": fw.reserved(0), "init_s": round(init_s, 2), "view": fw.view()}
    time.sleep(args.hold)
    return result


def cmd_fill(args: argparse.Namespace) -> dict[str, Any]:
    fw, init_s = start(args.framework)
    sizes = [int(c) for c in args.chunks.split(",")]
    fw.prepare([mib * MIB for mib in sizes])
    view_before = fw.view()
    view_before["nvml_self_mib"] = nvml_self()
    chunks: list[Any] = []
    allocated, ooms, guard_hit = 0, [], False
    for mib in sizes:
        while not guard_hit:
            if allocated + mib * MIB > args.guard_mib * MIB:
                guard_hit = True
                break
            try:
                chunks.append(fw.alloc(mib * MIB))
            except Exception as exc:
                if not fw.is_oom(exc):
                    raise
                first = (str(exc).strip().splitlines() or [""])[0]
                ooms.append({"chunk_mib": mib, "type": type(exc).__name__, "message": first[:300]})
                break
            allocated += mib * MIB
    peak = {"allocated": allocated, "reserved": fw.reserved(allocated), "view": fw.view(),
            "nvml": nvml_view(), "chunks": len(chunks)}
    time.sleep(args.hold)  # hold the peak so the outside watch surely sees it
    fw.release(chunks)
    after: dict[str, Any] = {"view": fw.view(), "nvml_self_mib": nvml_self()}
    try:  # the program keeps running after OOM and the freed budget is usable again
        fw.release([fw.alloc(GIB)])
        after["alloc_1gib_ok"] = True
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding, reported
        after["alloc_1gib_ok"] = False
        after["alloc_1gib_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"framework": args.framework, "init_s": round(init_s, 2), "before": view_before,
            "peak": peak, "ooms": ooms, "guard_hit": guard_hit, "after": after}


def cmd_matmul(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {}
    if args.tiny:
        x = torch.zeros(1, device="cuda")
        for _ in range(1000):
            x.add_(1)
        torch.cuda.synchronize()
        reps = []
        for _ in range(args.tiny_reps):
            t0 = time.perf_counter()
            for _ in range(args.tiny):
                x.add_(1)
            torch.cuda.synchronize()
            reps.append((time.perf_counter() - t0) / args.tiny * 1e9)
        result["tiny_ns_reps"] = [round(r, 1) for r in reps]
        result["tiny_ns"] = statistics.median(reps)
    n = args.size
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    copy = copies(args.copy_mib, result) if args.copy_mib else None

    def burst(k: int = 4) -> None:
        for _ in range(k):
            if copy is not None:  # queued on the same stream, right before the matmul
                copy()
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()

    started = time.perf_counter()
    end = started + args.warmup
    while time.perf_counter() < end:
        burst()
    while args.start_at and time.time() < args.start_at:  # processes side by side: one window
        burst()
    result["measure_start_epoch"] = round(time.time(), 3)
    if args.hold_capture:
        result.update(beside_open_capture(a, b, c, args.seconds))
        result["matmul_wall_s"] = round(time.perf_counter() - started, 3)
        return result
    iters, windows = 0, []
    t0 = last = time.perf_counter()
    last_iters = 0
    while True:
        burst()
        iters += 4
        now = time.perf_counter()
        if now - last >= 1.0:
            windows.append(round(2 * n**3 * (iters - last_iters) / (now - last) / 1e12, 1))
            last, last_iters = now, iters
        if now - t0 >= args.seconds:
            break
    elapsed = time.perf_counter() - t0
    result.update(iters=iters, seconds=round(elapsed, 3),
                  tflops=2 * n**3 * iters / elapsed / 1e12, windows_tflops=windows,
                  matmul_wall_s=round(time.perf_counter() - started, 3))
    return result


def copies(mib: int, result: dict[str, Any]) -> Callable[[], None]:
    """An async host-to-device copy of ``mib`` MiB from pinned memory on the current stream
    (``copy_(..., non_blocking=True)``: the runtime's cudaMemcpyAsync, a driver async copy the
    library hooks), as a data loader queues its next batch before each step; the function that
    queues one.  Times one copy alone first (``copy_ms``: 8 back to back, the GPU drained
    before and after), to compare with a matmul's time."""
    import torch

    nbytes = mib * MIB
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dev.copy_(host, non_blocking=True)

    copy()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(8):
        copy()
    torch.cuda.synchronize()
    result.update(copy_mib=mib, copy_ms=round((time.perf_counter() - t0) / 8 * 1e3, 3))
    return copy


def cmd_turns(args: argparse.Namespace) -> dict[str, Any]:
    """Tiny ops and matmuls measured in turns with another process, driven line by line on
    stdin (``harness.take_turns``): after ``ready``, ``tiny`` times one batch of ``--batch``
    tiny ops (ns per op, the GPU drained at its end), ``matmul W S`` warms up W seconds and
    measures S (TFLOPS), ``end`` prints the RESULT.  Each answer is one line; the other
    process waits meanwhile, so the two alternate on the GPU and on the CPU this one pins its
    measuring thread to (``--pin``) after starting, which both do side by side."""
    import sys

    import torch

    n = args.size
    x = torch.zeros(1, device="cuda")
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.mm(a, b, out=c)  # the BLAS handle and its workspace: not in a measured turn
    if args.pin >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.pin})  # this thread only: the one that launches
    for _ in range(args.batch):
        x.add_(1)
    torch.cuda.synchronize()
    batches: list[float] = []
    tflops: list[float] = []
    print("ready", flush=True)
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "tiny":
            t0 = time.perf_counter()
            for _ in range(args.batch):
                x.add_(1)
            torch.cuda.synchronize()
            batches.append(round((time.perf_counter() - t0) / args.batch * 1e9, 1))
            print(f"tiny {batches[-1]}", flush=True)
        elif word == "matmul":
            warmup, seconds = float(rest[0]), float(rest[1])
            end = time.perf_counter() + warmup
            while time.perf_counter() < end:
                torch.mm(a, b, out=c)
                torch.cuda.synchronize()
            iters, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(4):
                    torch.mm(a, b, out=c)
                torch.cuda.synchronize()
                iters += 4
            tflops.append(2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)
            print(f"matmul {tflops[-1]:.1f}", flush=True)
        elif word == "end":
            break
    return {"tiny_ns_batches": batches, "batch": args.batch,
            "tflops": tflops[-1] if tflops else None}


def beside_open_capture(a: Any, b: Any, c: Any, seconds: float) -> dict[str, Any]:
    """Matmuls launched for ``seconds`` on a stream of their own while another thread holds a
    global-mode graph capture open (PyTorch's default mode: no event query, no synchronisation
    anywhere meanwhile).  Throughput counts until all of them have run, after the capture ends;
    ``capture`` says whether it ended cleanly (the library must not invalidate it)."""
    import threading

    import torch

    ready, release, out = threading.Event(), threading.Event(), {"capture": "not begun"}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the stream's first matmul may allocate: not under capture
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()

    def holder() -> None:
        try:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            x = torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    x.add_(1)
                    out["capture"] = "open"
                    ready.set()
                    release.wait(seconds + 60)
                finally:
                    graph.capture_end()
            out["capture"] = "ended"
        except Exception as exc:  # noqa: BLE001 - reported: an invalidated capture is the finding
            out["capture"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            ready.set()

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    ready.wait(30)
    iters = 0
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        while time.perf_counter() - t0 < seconds:
            torch.mm(a, b, out=c)
            iters += 1
    launched_s = time.perf_counter() - t0
    release.set()
    thread.join(60)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n = a.shape[0]
    return {"iters": iters, "seconds": round(elapsed, 3), "launched_s": round(launched_s, 3),
            "tflops": 2 * n**3 * iters / elapsed / 1e12, "capture": out["capture"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe")
    probe.add_argument("framework", choices=sorted(FRAMEWORKS))
    probe.add_argument("--hold", type=float, default=0.4)
    fill = sub.add_parser("fill")
    fill.add_argument("framework", choices=sorted(FRAMEWORKS))
    fill.add_argument("chunks", help="chunk sizes in MiB, largest first: 256,64,12,1")
    fill.add_argument("--guard-mib", type=int, default=12288,
                      help="stop without OOM past this much (a cap that does not hold)")
    fill.add_argument("--hold", type=float, default=0.4)
    mm = sub.add_parser("matmul")
    mm.add_argument("seconds", type=float)
    mm.add_argument("--warmup", type=float, default=1.5)
    mm.add_argument("--start-at", type=float, default=0.0,
                    help="warm up until this time (epoch s) too, so side-by-side runs share a window")
    mm.add_argument("--size", type=int, default=8192)
    mm.add_argument("--tiny", type=int, default=0, help="tiny ops per rep (0: skip)")
    mm.add_argument("--tiny-reps", type=int, default=5)
    mm.add_argument("--hold-capture", action="store_true",
                    help="measure beside a graph capture held open in another thread")
    mm.add_argument("--copy-mib", type=int, default=0,
                    help="an async copy of this many MiB from pinned host memory before each "
                         "matmul, on the same stream (0: none)")
    turns = sub.add_parser("turns")
    turns.add_argument("--batch", type=int, default=3000, help="tiny ops per timed batch")
    turns.add_argument("--size", type=int, default=8192)
    turns.add_argument("--pin", type=int, default=-1, help="CPU to measure on (-1: any)")
    args = parser.parse_args()
    run = {"probe": cmd_probe, "fill": cmd_fill, "matmul": cmd_matmul,
           "turns": cmd_turns}[args.cmd]
    print("RESULT " + json.dumps(run(args), default=str), flush=True)


if __name__ == "__main__":
    main()
