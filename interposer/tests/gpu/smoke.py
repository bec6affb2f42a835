"""Developer smoke check of libgpuslice.so on a real NVIDIA GPU (not part of CI).

Run by interposer/tests/gpu/smoke.sh after the build. Each section prints KEY=VALUE lines and
never stops the others. Needs PyTorch, pynvml and the real driver; no network.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIB = ROOT / "interposer" / "build" / "libgpuslice.so"
PROBE = "/tmp/gsprobe-real"
MIB = 1 << 20
GIB = 1 << 30
WORK = Path(tempfile.mkdtemp(prefix="gs-smoke-"))


def out(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def section(fn):
    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a smoke check reports and goes on
            out(f"{fn.__name__}.error", traceback.format_exc(limit=3).replace("\n", " | "))
        out(f"{fn.__name__}.seconds", round(time.monotonic() - t0, 1))
    return run


def region_module():
    spec = importlib.util.spec_from_file_location("gs_region", ROOT / "webhook/node/region.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gs_region"] = mod
    spec.loader.exec_module(mod)
    return mod


def env_with(region: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE", "GPUSLICE"))}
    env.update({"LD_PRELOAD": str(LIB), "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region),
                "LIBCUDA_LOG_LEVEL": "1"})
    env.update(extra)
    return env


def nvml():
    import pynvml
    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)


def hook_table() -> list[tuple[str, str, int, int]]:
    text = (ROOT / "interposer/src/hooks.h").read_text()
    cuda = text[text.index("#define GS_CUDA_HOOKS(X)"):text.index("#define GS_CUDA_REALS(R)")]
    entries = []
    for chunk in cuda.split("X(")[1:]:
        name = chunk.split(",", 1)[0].strip()
        m = re.findall(r"(\w+),\s*(\d+),\s*([01])\)", chunk)
        base, ver, pt = m[-1]
        entries.append((name, base, int(ver), int(pt)))
    return entries


@section
def procaddr_identity() -> None:
    """Does cuGetProcAddress hand out the exported addresses (what our lookup relies on)?"""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    gp = cuda.cuGetProcAddress_v2
    gp.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                   ctypes.POINTER(ctypes.c_int)]
    same, differ, missing = [], [], []
    for name, base, ver, pt in hook_table():
        ptr, status = ctypes.c_void_p(), ctypes.c_int()
        rc = gp(base.encode(), ctypes.byref(ptr), max(ver, 11030 if "ptsz" in name else ver),
                2 if pt else 0, ctypes.byref(status))
        try:
            exported = ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
        except AttributeError:
            exported = None
        if rc != 0 or exported is None:
            missing.append(f"{name}:{rc}")
        elif ptr.value == exported:
            same.append(name)
        else:
            differ.append(name)
    out("procaddr.same", len(same))
    out("procaddr.differ", ",".join(differ) or "-")
    out("procaddr.missing", ",".join(missing) or "-")
    drv = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(drv))
    out("driver.cuda_version", drv.value)


@section
def physical_granularity() -> None:
    """What small and odd-sized cuMemAlloc calls really cost (NVML used memory deltas)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    ctx = ctypes.c_void_p()
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cuda.cuCtxSetCurrent(ctx)
    pynvml, h = nvml()
    alloc = cuda.cuMemAlloc_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    free = cuda.cuMemFree_v2
    free.argtypes = [ctypes.c_uint64]
    for count, size in ((1000, 4096), (200, 512 * 1024), (200, MIB), (100, MIB + 1),
                        (100, 3 * MIB), (50, 2 * MIB + 1), (20, 100 * MIB + 3)):
        time.sleep(0.2)
        before = pynvml.nvmlDeviceGetMemoryInfo(h).used
        ptrs = []
        for _ in range(count):
            p = ctypes.c_uint64()
            assert alloc(ctypes.byref(p), size) == 0
            ptrs.append(p.value)
        time.sleep(0.2)
        after = pynvml.nvmlDeviceGetMemoryInfo(h).used
        for p in ptrs:
            free(p)
        out(f"granularity.{size}", f"{(after - before) / count:.0f} bytes each ({count} allocs)")


@section
def overhead() -> None:
    """1 MiB alloc+free pair and empty-kernel launch, with and without the library."""
    region = WORK / "bench-region"
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for label, env in (("without", base), ("with", env_with(region, CUDA_DEVICE_MEMORY_LIMIT="10240m"))):
        pairs, launches, drained = [], [], []
        for _ in range(3):
            res = subprocess.run(check=False, args=[PROBE, "init", "ctx", "0", "allocbench", "20000", "1m",
                                  "launchbench", "200000"], env=env, capture_output=True, text=True,
                                 timeout=120)
            vals = {ln.split()[0]: ln.split()[1:] for ln in res.stdout.splitlines()}
            pairs.append(int(vals["allocbench"][1]))
            launches.append(int(vals["launchbench"][1]))
            drained.append(int(vals["launchbench"][2]))
        out(f"overhead.alloc_free_1MiB_ns.{label}", min(pairs))
        out(f"overhead.launch_ns.{label}", min(launches))
        out(f"overhead.launch_drained_ns.{label}", min(drained))


TORCH_FILL = r"""
import os, sys, time, torch
marker, go = sys.argv[1], sys.argv[2]
free, total = torch.cuda.mem_get_info()
print("meminfo", free, total, flush=True)
chunks, allocated = [], 0
for size in (256 << 20, 64 << 20, 8 << 20, 2 << 20):
    while True:
        try:
            chunks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            allocated += size
        except torch.cuda.OutOfMemoryError:
            break
print("allocated", allocated, flush=True)
print("reserved", torch.cuda.memory_reserved(), flush=True)
free, total = torch.cuda.mem_get_info()
print("meminfo_full", free, total, flush=True)
open(marker, "w").close()
for _ in range(600):
    if os.path.exists(go):
        break
    time.sleep(0.05)
"""

TORCH_COMPUTE_THEN_FILL = r"""
import os, sys, time, torch
marker, go = sys.argv[1], sys.argv[2]
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = (a @ a).float().softmax(-1).sum()
x = torch.randn(8, 64, 128, 128, device="cuda")
y = torch.nn.functional.conv2d(x, torch.randn(64, 64, 3, 3, device="cuda"), padding=1)
torch.cuda.synchronize()
del a, x, y
time.sleep(0.6)
chunks, allocated = [], 0
for size in (256 << 20, 64 << 20, 8 << 20, 2 << 20):
    while True:
        try:
            chunks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            allocated += size
        except torch.cuda.OutOfMemoryError:
            break
print("allocated", allocated, flush=True)
open(marker, "w").close()
for _ in range(600):
    if os.path.exists(go):
        break
    time.sleep(0.05)
"""

CUPY_FILL = r"""
import cupy
chunks, allocated = [], 0
print("meminfo", *cupy.cuda.runtime.memGetInfo(), flush=True)
for size in (256 << 20, 16 << 20, 2 << 20):
    while True:
        try:
            chunks.append(cupy.empty(size, dtype=cupy.uint8))
            allocated += size
        except cupy.cuda.memory.OutOfMemoryError:
            break
print("allocated", allocated, flush=True)
"""

JAX_FILL = r"""
import jax, jax.numpy as jnp
print("devices", jax.devices(), flush=True)
chunks, allocated = [], 0
for n in (1 << 28, 1 << 24, 1 << 20):
    while True:
        try:
            chunks.append(jnp.ones((n,), dtype=jnp.float32).block_until_ready())
            allocated += 4 * n
        except Exception as exc:
            last = type(exc).__name__
            break
print("allocated", allocated, last, flush=True)
print("stats", {k: v for k, v in jax.devices()[0].memory_stats().items() if "limit" in k or "peak" in k})
"""

TORCH_SECOND = r"""
import torch
try:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    print("second", "got-1GiB", flush=True)
except Exception as exc:
    print("second", type(exc).__name__, str(exc).splitlines()[0][:120], flush=True)
"""


@section
def torch_memory() -> None:
    region = WORK / "mem-region"
    pynvml, h = nvml()
    baseline = pynvml.nvmlDeviceGetMemoryInfo(h).used
    marker, go = WORK / "filled", WORK / "go"
    script = WORK / "fill.py"
    script.write_text(TORCH_FILL)
    env = env_with(region, CUDA_DEVICE_MEMORY_LIMIT="10240m")
    child = subprocess.Popen([sys.executable, str(script), str(marker), str(go)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_used = 0
    deadline = time.monotonic() + 180
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        peak_used = max(peak_used, pynvml.nvmlDeviceGetMemoryInfo(h).used - baseline)
        time.sleep(0.02)
    time.sleep(0.3)
    peak_used = max(peak_used, pynvml.nvmlDeviceGetMemoryInfo(h).used - baseline)
    procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    out("torch.outside_process_used_MiB", (procs.get(child.pid) or 0) // MIB)
    out("torch.outside_device_used_delta_peak_MiB", peak_used // MIB)
    reg = region_module().read_region(region)
    out("torch.region_used_MiB", reg.devices[0].used_bytes // MIB)
    smi = subprocess.run(check=False, args=["nvidia-smi", "--query-gpu=memory.total,memory.used,memory.free",
                          "--format=csv,noheader"], env=env, capture_output=True, text=True,
                         timeout=60)
    out("torch.nvidia_smi_inside", smi.stdout.strip() or smi.stderr.strip()[:200])
    smi_plain = subprocess.run(check=False, args=["nvidia-smi"], env=env, capture_output=True, text=True, timeout=60)
    mem_line = [ln for ln in smi_plain.stdout.splitlines() if "MiB /" in ln]
    out("torch.nvidia_smi_inside_table", mem_line[0].strip() if mem_line else smi_plain.stderr[:200])
    second_script = WORK / "second.py"
    second_script.write_text(TORCH_SECOND)
    second = subprocess.run(check=False, args=[sys.executable, str(second_script)], env=env, capture_output=True,
                            text=True, timeout=120)
    out("torch.second_process", second.stdout.strip().replace("\n", " ") or second.stderr[-300:])
    go.touch()
    stdout, stderr = child.communicate(timeout=60)
    for line in stdout.splitlines():
        key, *vals = line.split()
        out(f"torch.{key}", " ".join(vals))
    if child.returncode:
        out("torch.child_stderr", stderr[-500:].replace("\n", " | "))
    reg = region_module().read_region(region)
    out("torch.region_used_after_exit", reg.devices[0].used_bytes)
    mirror = region_module()
    offset = mirror.DEVICES_OFFSET + mirror.field_layout(mirror.DEVICE_FIELDS)["ctx_footprint_bytes"][0]
    ctx_fp = int.from_bytes(region.read_bytes()[offset:offset + 8], "little")
    out("torch.ctx_footprint_measured_MiB", round(ctx_fp / MIB, 1))


def fill_and_watch(name: str, source: str, env: dict[str, str], args: list[str]) -> None:
    """Run a fill script; report its peak real usage from outside and what it got."""
    pynvml, h = nvml()
    baseline = pynvml.nvmlDeviceGetMemoryInfo(h).used
    script = WORK / f"fill_{name}.py"  # never the name of the module it imports
    script.write_text(source)
    child = subprocess.Popen([sys.executable, str(script), *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, peak_proc = 0, 0
    marker = Path(args[0]) if args else None
    deadline = time.monotonic() + 240
    while child.poll() is None and time.monotonic() < deadline:
        peak = max(peak, pynvml.nvmlDeviceGetMemoryInfo(h).used - baseline)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == child.pid and p.usedGpuMemory:
                peak_proc = max(peak_proc, p.usedGpuMemory)
        if marker and marker.exists():
            time.sleep(0.3)
            peak = max(peak, pynvml.nvmlDeviceGetMemoryInfo(h).used - baseline)
            Path(args[1]).touch()
            marker = None
        time.sleep(0.02)
    stdout, stderr = child.communicate(timeout=60)
    out(f"{name}.outside_device_used_delta_peak_MiB", peak // MIB)
    out(f"{name}.outside_process_used_peak_MiB", peak_proc // MIB)
    for line in stdout.splitlines():
        out(f"{name}.{line.split()[0]}", " ".join(line.split()[1:])[:300])
    if child.returncode:
        out(f"{name}.stderr", stderr[-600:].replace("\n", " | "))


@section
def frameworks() -> None:
    env = env_with(WORK / "fw-region", CUDA_DEVICE_MEMORY_LIMIT="10240m")
    fill_and_watch("torch_compute", TORCH_COMPUTE_THEN_FILL, env,
                   [str(WORK / "tc-filled"), str(WORK / "tc-go")])
    fill_and_watch("cupy", CUPY_FILL, env_with(WORK / "cupy-region", CUDA_DEVICE_MEMORY_LIMIT="10240m"), [])
    fill_and_watch("jax", JAX_FILL, env_with(WORK / "jax-region", CUDA_DEVICE_MEMORY_LIMIT="10240m"), [])


TORCH_MATMUL = r"""
import sys, time, torch
n, seconds = 8192, float(sys.argv[1])
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
print("t0", time.monotonic(), flush=True)
t0 = time.perf_counter(); iters = 0
while time.perf_counter() - t0 < seconds:
    for _ in range(4):
        torch.matmul(a, b, out=c)
    iters += 4
    torch.cuda.synchronize() if iters % 64 == 0 else None
torch.cuda.synchronize()
dt = time.perf_counter() - t0
print("t1", time.monotonic(), flush=True)
print("tflops", 2 * n ** 3 * iters / dt / 1e12, flush=True)
"""


@section
def throttle() -> None:
    script = WORK / "mm.py"
    script.write_text(TORCH_MATMUL)
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    runs = [("none", base, 4.0), ("unlimited_lib", env_with(WORK / "t0"), 4.0)]
    for limit in (10, 30, 50):
        runs.append((f"sm{limit}", env_with(WORK / f"t{limit}", CUDA_DEVICE_SM_LIMIT=str(limit)), 6.0))
    results = {}
    pynvml, h = nvml()
    for label, env, seconds in runs:
        child = subprocess.Popen([sys.executable, str(script), str(seconds)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        clocks, power, util, stamps = [], [], [], []
        while child.poll() is None:
            clocks.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            power.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
            util.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            stamps.append(time.monotonic())
            time.sleep(0.1)
        stdout, stderr = child.communicate()
        res = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        busy = [c for c, u in zip(clocks, util) if u > 0]
        out(f"throttle.{label}.sm_clock_MHz_median_busy", sorted(busy)[len(busy) // 2] if busy else 0)
        out(f"throttle.{label}.power_W_max", round(max(power), 0) if power else 0)
        marks = {ln.split()[0]: float(ln.split()[1]) for ln in res.stdout.splitlines()
                 if ln.startswith(("t0", "t1"))}
        window = [u for u, t in zip(util, stamps) if marks and marks["t0"] + 1.0 <= t <= marks.get("t1", 0)]
        out(f"throttle.{label}.nvml_util_mean_in_window",
            round(sum(window) / len(window), 1) if window else "n/a")
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("tflops")]
        results[label] = float(line[0].split()[1]) if line else None
        out(f"throttle.{label}.tflops", results[label] if line else res.stderr[-300:])
    if results.get("none"):
        for label, value in results.items():
            if value:
                out(f"throttle.{label}.percent_of_none", round(100 * value / results["none"], 1))


if __name__ == "__main__":
    out("python", sys.version.split()[0])
    wanted = os.environ.get("GS_SMOKE_SECTIONS", "procaddr_identity,overhead,torch_memory,"
                                                  "frameworks,throttle").split(",")
    for name in wanted:
        globals()[name]()
    print(json.dumps({"done": True}))
