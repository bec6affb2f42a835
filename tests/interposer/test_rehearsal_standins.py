"""The GPU check's rehearsal stands PyTorch, CuPy and JAX in with ``tests/gpu/rehearsal``: these
tests hold the stand-ins to the way those frameworks take memory from the driver, which is what
their rehearsed rows exercise in the library (the segments PyTorch's caching allocator asks
for, expandable segments' ``cuMemCreate`` pages, CuPy's pool, JAX's preallocated BFC pool),
under the library on the fake driver (release and ASan/UBSan builds), with a 1 GiB cap."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import GIB, MIB, ROOT, Lab, charge

STANDINS = ROOT / "tests" / "gpu" / "rehearsal"

PRELUDE = """
import json, standin
def used():
    free, total = standin.mem_get_info()
    return (total - free) >> 20
out = {}
"""

TORCH = PRELUDE + """
import torch
MiB = 1 << 20
def empty(mib):
    return torch.empty(mib * MiB, dtype=torch.uint8, device="cuda")
def now():
    return [used(), torch.cuda.memory_reserved() >> 20]
out["start"] = used()
token = torch.zeros(1, device="cuda")  # 512 B of a 2 MiB small segment (or page)
a, b, c, d = empty(12), empty(3), empty(6), empty(24)
out["four"] = now()
del a, b, c, d
out["freed"] = now()  # kept for the next
torch.cuda.empty_cache()
out["emptied"] = now()
cached = [empty(100) for _ in range(8)]
del cached
out["cached"] = now()
f = empty(500)  # from the cache, or once the cache is emptied
out["after_cached"] = now()
del f
torch.cuda.empty_cache()
g, h = empty(400), empty(400)
del g  # cached: 500 fits only once it is given back (an expandable range's hole)
out["before_retry"] = now()
i = empty(500)
out["retried"] = now()
del h, i
torch.cuda.empty_cache()
chunks, oom = [], None
try:
    while True:
        chunks.append(empty(100))
except torch.cuda.OutOfMemoryError as exc:
    oom = str(exc)
out["full"] = [len(chunks), *now(), oom[:40]]
chunks.clear()
torch.cuda.empty_cache()
out["after"] = now()
print(json.dumps(out))
"""


def run(lab: Lab, script: str, **env: str) -> dict[str, list[int] | int]:
    proc = lab.run_program([sys.executable, "-c", script], CUDA_DEVICE_MEMORY_LIMIT="1g",
                           FAKE_CUDA_CTX_BYTES="100m", PYTHONPATH=str(STANDINS),
                           GPUCHECK_REHEARSAL="1", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_caching_allocator_segments_retry_and_oom(lab: Lab) -> None:
    got = run(lab, TORCH)
    start = got["start"]
    # 2 (small) + 12 + 20 (3 and 6 share it) + 24: the segments PyTorch asks the driver for
    assert got["four"] == [start + 58, 58]
    assert got["freed"] == [start + 58, 58]  # freed tensors stay in the cache
    assert got["emptied"] == [start + 2, 2]  # the token's small segment is still in use
    assert got["cached"] == [start + 802, 802]
    # eight 100 MiB segments cannot hold 500: refused under the cap, the cache is emptied and
    # the segment asked for again
    assert got["after_cached"] == [start + 502, 502]
    assert got["before_retry"] == [start + 802, 802]
    assert got["retried"] == [start + 902, 902]  # the freed 400 MiB segment went first
    count, full, reserved, message = got["full"]
    assert count == (1024 - start - 2) // 100 and full <= 1024  # the cap, less the context
    assert reserved == full - start  # all the driver holds for it is its segments
    assert message.startswith("CUDA out of memory. Tried to allocate")
    assert got["after"] == [start + 2, 2]  # nothing kept of the refused segment
    assert lab.used() == 0  # the process has exited: its region entry went with it


@pytest.mark.parametrize("conf", [
    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    # PyTorch 2.9's name, read first (c10/core/AllocatorConfig.cpp): it wins over the old one
    {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
     "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}], ids=["cuda", "alloc-wins"])
def test_torch_expandable_segments_map_pages_and_leave_holes(lab: Lab,
                                                             conf: dict[str, str]) -> None:
    got = run(lab, TORCH, **conf)
    start = got["start"]
    # a 2 MiB small page; 20 MiB pages mapped only as far as the free end lacks: 12 and 3 in
    # the first, 6 needs one more, 24 one more again (60, not the 80 of mapping each request)
    assert got["four"] == [start + 62, 62]
    assert got["freed"] == [start + 62, 62]
    assert got["emptied"] == [start + 2, 2]  # every free page unmapped and released
    assert got["cached"] == [start + 802, 802]
    assert got["after_cached"] == [start + 802, 802]  # 500 carved from the 800 mapped and free
    assert got["before_retry"] == [start + 802, 802]
    # 500 more fit neither the freed 400 nor the rest of the range (1.125x the 1 GiB device):
    # a second range is reserved, its pages refused under the cap (released, never mapped);
    # emptying the cache unmaps the freed 400, a hole, and the 500 are mapped in the second
    assert got["retried"] == [start + 902, 902]
    count, full, reserved, message = got["full"]
    assert count == (1024 - start - 2) // 100 and full <= 1024
    assert reserved == full - start
    assert message.startswith("CUDA out of memory")
    assert got["after"] == [start + 2, 2]


TORCH_CHECKS = PRELUDE + """
import torch
a = torch.zeros(4, device="cuda")
try:
    torch.mm(a, a, a)
    out["positional_out"] = "accepted"
except TypeError:
    out["positional_out"] = "TypeError"
graph, side, other = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.cuda.Stream()
try:
    graph.capture_begin()
    out["default_stream"] = "accepted"
except RuntimeError as exc:
    out["default_stream"] = str(exc)
with torch.cuda.stream(side):
    graph.capture_begin()
    a.add_(1)
with torch.cuda.stream(other):
    try:
        graph.capture_end()
        out["other_stream"] = "accepted"
    except RuntimeError as exc:
        out["other_stream"] = str(exc)
with torch.cuda.stream(side):
    graph.capture_end()
out["ended"] = True
print(json.dumps(out))
"""


def test_torch_refuses_what_pytorch_refuses(lab: Lab) -> None:
    """work.py's torch calls as PyTorch takes them: ``mm``'s ``out`` by keyword only, a graph
    captured on a stream of its own and ended on it (torch's checks, before the driver)."""
    got = run(lab, TORCH_CHECKS)
    assert got["positional_out"] == "TypeError"
    assert str(got["default_stream"]).startswith("CUDA graphs must be captured on a non-default")
    assert str(got["other_stream"]).startswith("Capture must end on the same stream")
    assert got["ended"] is True


def test_cupy_pool_retries_after_freeing_blocks_and_collecting(lab: Lab) -> None:
    got = run(lab, PRELUDE + """
import cupy, gc
gc.disable()  # only the pool's own collection may free the cycle below
MiB = 1 << 20
pool = cupy.get_default_memory_pool()
def now():
    return [used(), pool.total_bytes() >> 20]
out["start"] = used()
a = cupy.empty(3 * MiB, dtype=cupy.uint8)
del a
b = cupy.empty(MiB, dtype=cupy.uint8)  # carved from the cached 3 MiB block
out["reuse"] = now()
cached = [cupy.empty(100 * MiB, dtype=cupy.uint8) for _ in range(8)]
del cached
c = cupy.empty(500 * MiB, dtype=cupy.uint8)  # only once the idle blocks are freed
out["freed_then"] = now()
del c
pool.free_all_blocks()
class Cycle:
    pass
cycle = Cycle()
cycle.me, cycle.array = cycle, cupy.empty(700 * MiB, dtype=cupy.uint8)
del cycle  # garbage only a collection frees
d = cupy.empty(500 * MiB, dtype=cupy.uint8)
out["collected_then"] = now()
del d
pool.free_all_blocks()
chunks, oom = [], None
try:
    while True:
        chunks.append(cupy.empty(100 * MiB, dtype=cupy.uint8))
except cupy.cuda.memory.OutOfMemoryError as exc:
    oom = str(exc)
out["full"] = [len(chunks), used(), oom[:30]]
chunks.clear()
del b
pool.free_all_blocks()
out["after"] = now()
print(json.dumps(out))
""")
    start = got["start"]
    assert got["reuse"] == [start + 4, 3]  # 3 MiB charged as 4 (2 MiB rounding), held once
    assert got["freed_then"] == [start + 504, 503]  # the eight idle 100 MiB blocks went
    assert got["collected_then"] == [start + 504, 503]  # the cycle's 700 MiB collected, freed
    count, full, message = got["full"]
    assert count == (1024 - start - 4) // 100 and full <= 1024
    assert message.startswith("Out of memory allocating")
    assert got["after"] == [start, 0]


@pytest.mark.parametrize("allocator", ["bfc", "backoff", "backoff-newer-name", "growth",
                                       "growth-0", "platform", "platform-upper-case"])
def test_jax_allocators_take_what_xla_takes(lab: Lab, allocator: str) -> None:
    # the variables as jaxlib reads them (xla_client.generate_pjrt_gpu_plugin_options)
    env = {"bfc": {}, "backoff": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"},
           "backoff-newer-name": {"XLA_CLIENT_MEM_FRACTION": "0.95"},
           "growth": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
           "growth-0": {"XLA_PYTHON_CLIENT_PREALLOCATE": "0"},
           "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
           "platform-upper-case": {"XLA_PYTHON_CLIENT_ALLOCATOR": "PLATFORM"}}[allocator]
    allocator = allocator.split("-")[0]
    got = run(lab, PRELUDE + """
import jax, jax.numpy as jnp
out["start"] = used()
dev = jax.devices()[0]
out["ready"] = used()
x = jnp.zeros((300 << 20,), dtype=jnp.uint8).block_until_ready()
out["held"] = used()
out["stats"] = dev.memory_stats()
try:
    jnp.zeros((900 << 20,), dtype=jnp.uint8)
except Exception as exc:
    out["error"] = str(exc)[:40]
x.delete()
out["deleted"] = used()
print(json.dumps(out))
""", **env)
    start = got["start"]
    assert got["error"].startswith("RESOURCE_EXHAUSTED")
    stats = got["stats"]
    if allocator == "bfc":  # 768 MiB of the 1 GiB slice, taken at start, kept
        assert got["ready"] == got["held"] == got["deleted"] == start + 768
        assert stats["bytes_limit"] == 768 * MIB and stats["pool_bytes"] == 768 * MIB
        assert stats["bytes_in_use"] == 300 * MIB
    elif allocator == "backoff":  # 973 MiB do not fit beside the context: 10 % less does
        limit = int(GIB * 0.95)
        pool = int(limit * 0.9) // 256 * 256
        assert stats["bytes_limit"] == limit and stats["pool_bytes"] == pool
        assert got["ready"] == got["held"] == start + charge(pool) // MIB
    elif allocator == "growth":  # regions from 2 MiB, doubled until 300 fit: 512, kept
        assert (got["ready"], got["held"], got["deleted"]) == (start, start + 512, start + 512)
        assert stats["bytes_limit"] == 768 * MIB and stats["pool_bytes"] == 512 * MIB
    else:  # a driver allocation per buffer, freed with it
        assert (got["ready"], got["held"], got["deleted"]) == (start, start + 300, start)
        assert stats is None


def test_standins_refuse_to_load_outside_the_rehearsal(lab: Lab) -> None:
    for module in ("torch", "cupy", "jax"):
        proc = lab.run_program([sys.executable, "-c", f"import {module}"],
                               PYTHONPATH=str(STANDINS), GPUCHECK_REHEARSAL=None)
        assert proc.returncode != 0 and "rehearsal's stand-in" in proc.stderr, proc.stderr
    smi = lab.run_program([str(STANDINS / "bin" / "nvidia-smi")], GPUCHECK_REHEARSAL=None)
    assert smi.returncode != 0 and "rehearsal's stand-in" in smi.stderr
