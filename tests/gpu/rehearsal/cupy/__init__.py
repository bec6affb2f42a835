"""A stand-in for the CuPy calls of ``tests/gpu/work.py`` (``probe`` and ``fill`` of ``cupy``),
over the CUDA driver API through ctypes (``standin.py``), for rehearsing
``scripts/gpu-check.sh`` on the fake driver. Only on the rehearsal's ``PYTHONPATH``.

Arrays come from a pool shaped like CuPy's default memory pool: requests rounded to 512 bytes,
served best-fit from the blocks it keeps (split when they are bigger), else by one
``cuMemAlloc`` of the rounded size; a refused allocation frees every idle block and is tried
again, then once more after a garbage collection, before ``cupy.cuda.memory.OutOfMemoryError``.
"""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace
from typing import Any

import standin
from standin import Arena, Block, round_up

uint8, float64 = "uint8", "float64"
_BYTES = {uint8: 1, float64: 8}


class OutOfMemoryError(MemoryError):
    pass


class MemoryPool:
    def __init__(self) -> None:
        self._arena = Arena(min_split=512)
        self._lock = threading.RLock()  # an array collected inside malloc frees under it

    def malloc(self, nbytes: int) -> Block:
        size = max(512, round_up(nbytes, 512))
        with self._lock:
            block = self._arena.take(size) or self._grow(size)
            if block is None:
                self._free_all()
                block = self._grow(size)
            if block is None:  # arrays only garbage collection would free, then once more
                gc.collect()
                self._free_all()
                block = self._grow(size)
            if block is None:
                raise OutOfMemoryError(
                    f"Out of memory allocating {size:,} bytes (allocated so far: "
                    f"{self._arena.in_use():,} bytes). (rehearsal stand-in)")
            return block

    def _grow(self, size: int) -> Block | None:
        ptr = standin.mem_alloc(size)
        if ptr is None:
            return None
        self._arena.add(ptr, size)
        return self._arena.take(size)

    def free(self, block: Block) -> None:
        with self._lock:
            self._arena.give(block)

    def _free_all(self) -> None:
        self._arena.release_idle(lambda s: standin.mem_free(s.base))

    def free_all_blocks(self) -> None:
        with self._lock:
            self._free_all()

    def total_bytes(self) -> int:
        return self._arena.reserved()

    def used_bytes(self) -> int:
        return self._arena.in_use()


_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _pool


class ndarray(standin.Buffer):
    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        super().__init__(_pool, shape, _BYTES[dtype])
        self.dtype = dtype


def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in shape) if isinstance(shape, tuple | list) else (int(shape),)


def empty(shape: Any, dtype: str = float64) -> ndarray:
    return ndarray(_shape(shape), dtype)


def zeros(shape: Any, dtype: str = float64) -> ndarray:
    return ndarray(_shape(shape), dtype)


class _Device:
    def synchronize(self) -> None:
        standin.synchronize()


cuda = SimpleNamespace(
    Device=_Device,
    memory=SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    runtime=SimpleNamespace(memGetInfo=standin.mem_get_info),
)
