"""The GPU check's rehearsal stands PyTorch, CuPy and JAX in with ``tests/gpu/rehearsal``: these
tests hold the stand-ins to the way those frameworks take memory from the driver, which is what
their rehearsed rows exercise in the library (the segments PyTorch's caching allocator asks
for, expandable segments' ``cuMemCreate`` pages, CuPy's pool, JAX's preallocated BFC pool),
under the library on the fake driver (release and ASan/UBSan builds), with a 1 GiB cap."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import MIB, ROOT, Lab

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
out["start"] = used()
token = torch.zeros(1, device="cuda")  # 512 B of a 2 MiB small segment
a = torch.empty(12 << 20, dtype=torch.uint8, device="cuda")  # its own segment
b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # a 20 MiB segment
c = torch.empty(6 << 20, dtype=torch.uint8, device="cuda")  # the same segment
out["three"] = [used(), torch.cuda.memory_reserved() >> 20]
del a, b, c
out["freed"] = [used(), torch.cuda.memory_reserved() >> 20]  # kept for the next
torch.cuda.empty_cache()
out["emptied"] = [used(), torch.cuda.memory_reserved() >> 20]
chunks, oom = [], None
try:
    while True:
        chunks.append(torch.empty(100 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError as exc:
    oom = str(exc)
out["full"] = [len(chunks), used(), torch.cuda.memory_reserved() >> 20, oom[:40]]
chunks.clear()
torch.cuda.empty_cache()
out["after"] = [used(), torch.cuda.memory_reserved() >> 20]
print(json.dumps(out))
"""


def run(lab: Lab, script: str, **env: str) -> dict[str, list[int] | int]:
    proc = lab.run_program([sys.executable, "-c", script], CUDA_DEVICE_MEMORY_LIMIT="1g",
                           FAKE_CUDA_CTX_BYTES="100m", PYTHONPATH=str(STANDINS),
                           GPUCHECK_REHEARSAL="1", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_caching_allocator_segments_and_oom(lab: Lab) -> None:
    got = run(lab, TORCH)
    start = got["start"]
    # 2 (small) + 12 + 20: the segments PyTorch would ask the driver for, charged as such
    assert got["three"] == [start + 34, 34]
    assert got["freed"] == [start + 34, 34]  # freed tensors stay in the cache
    assert got["emptied"] == [start + 2, 2]  # the token's small segment is still in use
    count, full, reserved, message = got["full"]
    assert count == (1024 - start - 2) // 100 and full <= 1024  # the cap, less the context
    assert reserved == full - start  # all the driver holds for it is its segments
    assert message.startswith("CUDA out of memory. Tried to allocate")
    assert got["after"] == [start + 2, 2]  # nothing kept of the refused segment
    assert lab.used() == 0  # the process has exited: its region entry went with it


def test_torch_expandable_segments_map_pages(lab: Lab) -> None:
    got = run(lab, TORCH, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    start = got["start"]
    # a 2 MiB small page; the large range maps one 20 MiB page for the 12 MiB and 3 MiB
    # tensors and a second for the 6 MiB one (12 + 3 + 6 > 20)
    assert got["three"] == [start + 42, 42]
    assert got["freed"] == [start + 42, 42]
    assert got["emptied"] == [start + 2, 2]  # the free pages at the end unmapped and released
    count, full, _, message = got["full"]
    assert count == (1024 - start - 2) // 100 and full <= 1024
    assert message.startswith("CUDA out of memory")
    assert got["after"] == [start + 2, 2]


def test_cupy_pool_keeps_blocks_until_freed_and_raises_its_oom(lab: Lab) -> None:
    got = run(lab, PRELUDE + """
import cupy
pool = cupy.get_default_memory_pool()
out["start"] = used()
a = cupy.empty(3 << 20, dtype=cupy.uint8)
del a
b = cupy.empty(1 << 20, dtype=cupy.uint8)  # carved from the cached 3 MiB block
out["reuse"] = [used(), pool.total_bytes() >> 20]
chunks, oom = [], None
try:
    while True:
        chunks.append(cupy.empty(100 << 20, dtype=cupy.uint8))
except cupy.cuda.memory.OutOfMemoryError as exc:
    oom = str(exc)
out["full"] = [len(chunks), used(), oom[:30]]
chunks.clear()
del b
pool.free_all_blocks()
out["after"] = [used(), pool.total_bytes()]
print(json.dumps(out))
""")
    start = got["start"]
    assert got["reuse"] == [start + 4, 3]  # 3 MiB charged as 4 (2 MiB rounding), held once
    count, full, message = got["full"]
    assert count == (1024 - start - 4) // 100 and full <= 1024
    assert message.startswith("Out of memory allocating")
    assert got["after"] == [start, 0]


@pytest.mark.parametrize("allocator", ["bfc", "platform"])
def test_jax_pool_preallocates_three_quarters_of_the_slice(lab: Lab, allocator: str) -> None:
    env = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"} if allocator == "platform" else {}
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
    if allocator == "bfc":  # 768 MiB of the 1 GiB slice, taken at start, kept
        assert got["ready"] == got["held"] == got["deleted"] == start + 768
        stats = got["stats"]
        assert stats["bytes_limit"] == 768 * MIB and stats["pool_bytes"] == 768 * MIB
        assert stats["bytes_in_use"] == 300 * MIB
    else:  # a driver allocation per buffer, freed with it
        assert (got["ready"], got["held"], got["deleted"]) == (start, start + 300, start)
        assert got["stats"] is None


def test_standins_refuse_to_load_outside_the_rehearsal(lab: Lab) -> None:
    for module in ("torch", "cupy", "jax"):
        proc = lab.run_program([sys.executable, "-c", f"import {module}"],
                               PYTHONPATH=str(STANDINS), GPUCHECK_REHEARSAL=None)
        assert proc.returncode != 0 and "rehearsal's stand-in" in proc.stderr, proc.stderr
    smi = lab.run_program([str(STANDINS / "bin" / "nvidia-smi")], GPUCHECK_REHEARSAL=None)
    assert smi.returncode != 0 and "rehearsal's stand-in" in smi.stderr
