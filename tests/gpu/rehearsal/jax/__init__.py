"""A stand-in for the JAX calls of ``tests/gpu/work.py`` (``probe`` and ``fill`` of ``jax``),
over the CUDA driver API through ctypes (``standin.py``), for rehearsing
``scripts/gpu-check.sh`` on the fake driver. Only on the rehearsal's ``PYTHONPATH``.

Buffers come from the allocator XLA's GPU client picks from the environment:
``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` makes one ``cuMemAlloc`` per buffer, freed when the
buffer is deleted; otherwise a BFC pool limited to ``XLA_CLIENT_MEM_FRACTION`` (or the older
``XLA_PYTHON_CLIENT_MEM_FRACTION``; 0.75) of the total ``cuMemGetInfo`` reports, allocated whole
at start unless ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (then grown by regions from 2 MiB, each
twice the last),
a region the driver refuses asked again 10 % smaller. A buffer that does not fit raises an error
that says ``RESOURCE_EXHAUSTED``, as XLA's does.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import standin
from standin import MIB, Arena, Block, round_up

from . import numpy  # noqa: F401 - ``import jax.numpy as jnp`` and ``jax.numpy``


class XlaRuntimeError(RuntimeError):
    pass


class _Allocator:
    MIN_REGION = 2 * MIB
    MAX_WASTE = 128 * MIB  # BFC splits a block when the rest is this much, or the block 2x

    def __init__(self) -> None:
        standin.init()
        # the variables as jaxlib reads them (xla_client.generate_pjrt_gpu_plugin_options): the
        # allocator's name in any case, XLA_CLIENT_MEM_FRACTION before the deprecated
        # XLA_PYTHON_CLIENT_MEM_FRACTION (both: an error), preallocation off for false, False, 0
        allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
        self.platform = allocator == "platform"
        fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION", "")
        deprecated = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
        if fraction and deprecated:
            raise ValueError("XLA_CLIENT_MEM_FRACTION is specified together with "
                             "XLA_PYTHON_CLIENT_MEM_FRACTION. (rehearsal stand-in)")
        self.limit = int(standin.mem_get_info()[1] * float(fraction or deprecated or "0.75"))
        self.arena = Arena(min_split=256, split=lambda size, want: (
            size >= 2 * want or size - want >= self.MAX_WASTE))
        self.peak = self.allocs = 0
        self._lock = threading.RLock()  # an array collected inside malloc frees under it
        preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "") not in (
            "false", "False", "0")
        self.region = self.limit if preallocate else self.MIN_REGION  # the next region's size
        if not self.platform and preallocate and not self._extend(256):
            raise XlaRuntimeError(f"RESOURCE_EXHAUSTED: could not preallocate {self.limit} "
                                  "bytes (rehearsal stand-in)")

    def _region(self, size: int) -> bool:
        ptr = standin.mem_alloc(size)
        if ptr is not None:
            self.arena.add(ptr, size)
        return ptr is not None

    def _extend(self, need: int) -> bool:
        """BFC's growth: a region of the next size (doubled until it holds ``need``, within the
        limit), 10 % smaller each time the driver refuses it, down to ``need``; the next region
        is twice as big."""
        grew = False
        while self.region < need:
            self.region *= 2
            grew = True
        size = min(self.region, self.limit - self.arena.reserved())
        while size >= need:
            if self._region(size):
                if not grew:
                    self.region *= 2
                return True
            size = int(size * 0.9) // 256 * 256  # down: a refused 256 B ends the loop
        return False

    def malloc(self, nbytes: int) -> Block:
        size = max(256, round_up(nbytes, 256))
        with self._lock:
            block = self.arena.take(size)
            if block is None and (self._region(size) if self.platform else self._extend(size)):
                block = self.arena.take(size)
            if block is None:
                raise XlaRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to "
                                      f"allocate {size} bytes. (rehearsal stand-in)")
            self.allocs += 1
            self.peak = max(self.peak, self.arena.in_use())
            return block

    def free(self, block: Block) -> None:
        with self._lock:
            self.arena.give(block)
            if self.platform:
                self.arena.release_idle(lambda s: standin.mem_free(s.base))

    def stats(self) -> dict[str, int] | None:
        if self.platform:
            return None  # the platform allocator keeps no statistics
        return {"num_allocs": self.allocs, "bytes_in_use": self.arena.in_use(),
                "peak_bytes_in_use": self.peak, "bytes_limit": self.limit, "bytes_reserved": 0,
                "pool_bytes": self.arena.reserved(),
                "largest_free_block_bytes": self.arena.largest_free()}


class Device:
    platform = "gpu"
    id = 0

    def __init__(self) -> None:
        self.allocator = _Allocator()

    def memory_stats(self) -> dict[str, int] | None:
        return self.allocator.stats()


_devices: list[Device] = []


def devices() -> list[Device]:
    if os.environ.get("JAX_PLATFORMS", "cuda") not in {"cuda", "gpu"}:
        raise RuntimeError("the rehearsal's JAX stand-in has only the cuda platform")
    if not _devices:
        _devices.append(Device())
    return list(_devices)


class Array(standin.Buffer):
    def __init__(self, shape: tuple[int, ...], itemsize: int) -> None:
        super().__init__(devices()[0].allocator, shape, itemsize)

    def block_until_ready(self) -> Array:
        standin.synchronize()
        return self

    def delete(self) -> None:
        self.release()


def _array(shape: Any, itemsize: int) -> Array:
    dims = tuple(int(n) for n in shape) if isinstance(shape, tuple | list) else (int(shape),)
    return Array(dims, itemsize)
