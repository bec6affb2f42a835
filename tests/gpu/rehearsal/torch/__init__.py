"""A stand-in for the PyTorch calls of ``tests/gpu/work.py`` (``matmul``; ``probe`` and ``fill``
of ``torch``), over the CUDA driver API through ctypes (``standin.py``), for rehearsing
``scripts/gpu-check.sh`` on the fake driver (``tests/interposer/test_gpu_check_rehearsal.py``).
Only on that test's ``PYTHONPATH``; never on a GPU machine, where the real PyTorch runs.

Tensors come from a caching allocator shaped like PyTorch's (``standin.py``): requests rounded
to 512 bytes, small ones (up to 1 MiB) carved from 2 MiB segments, up to 10 MiB from 20 MiB
segments, larger ones from a segment of their own rounded to 2 MiB; a freed tensor's block is
kept for the next until ``empty_cache``; a request the driver refuses empties the cache and is
tried once more before ``torch.cuda.OutOfMemoryError``. With
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (or ``PYTORCH_ALLOC_CONF``, which PyTorch
2.9 reads first and which then wins) each pool is one reserved range that maps
``cuMemCreate`` pages (20 MiB; 2 MiB for small tensors) as it grows and unmaps the whole free
pages inside free blocks when the cache is emptied.

``torch.mm`` launches one kernel on the current stream (the fake driver runs each for
``FAKE_CUDA_KERNEL_US``), through the driver's exports, which the preloaded library hooks as
it hooks PyTorch's launches. A tensor made with ``device="cpu"`` is host memory (plain memory:
the fake does not tell pinned from pageable), and a device tensor's ``copy_`` from it queues
``cuMemcpyHtoDAsync_v2`` on the current stream (the fake holds the stream
``FAKE_CUDA_COPY_US``), the driver call the library hooks as it hooks the runtime's async
copies; without ``non_blocking=True`` it waits for it, as PyTorch does. ``Tensor.add_`` (the
tiny op) launches only inside a capture, so that the capture has a node; elsewhere it costs the
host nothing, since the fake's kernels all take one duration. The figures this gives are the
fake GPU's, not a GPU's.
"""

from __future__ import annotations

import ctypes
import os
import threading
from math import prod
from typing import Any

import standin
from standin import MIB, Arena, Block, ExpandableSegment, check, cu, round_up

uint8, bfloat16, float32 = "uint8", "bfloat16", "float32"
_BYTES = {uint8: 1, bfloat16: 2, float32: 4}
_CAPTURE_GLOBAL = 0  # CU_STREAM_CAPTURE_MODE_GLOBAL, PyTorch's default
_state = threading.local()


class _Allocator:
    """PyTorch's caching allocator, as far as the driver sees it (module docstring)."""

    SMALL = MIB  # the largest request of the small pool
    SMALL_SEGMENT, LARGE_SEGMENT, MIN_LARGE_ALLOC, ROUND_LARGE = 2 * MIB, 20 * MIB, 10 * MIB, 2 * MIB

    def __init__(self) -> None:
        # PyTorch 2.9's order: PYTORCH_ALLOC_CONF, else the deprecated PYTORCH_CUDA_ALLOC_CONF
        # (c10/core/AllocatorConfig.cpp); earlier 2.x read only the second
        conf = os.environ.get("PYTORCH_ALLOC_CONF")
        if conf is None:
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        conf = conf.replace(" ", "")
        self.expandable = "expandable_segments:True" in conf.split(",")
        # a large block is split only when more than 1 MiB would be left
        self.small, self.large = Arena(min_split=512), Arena(min_split=MIB + 1)
        self._ranges: dict[int, list[ExpandableSegment]] = {}  # per pool, in address order
        self._lock = threading.RLock()  # a tensor collected inside malloc frees under it

    def malloc(self, nbytes: int) -> Block:
        size = max(512, round_up(nbytes, 512))
        arena = self.small if size <= self.SMALL else self.large
        with self._lock:
            block = arena.take(size) or self._grow(arena, size)
            if block is None:
                self._empty_cache()
                block = self._grow(arena, size)
            if block is None:
                free, total = standin.mem_get_info()
                raise cuda.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes / MIB:.2f} MiB. GPU 0 has a "
                    f"total capacity of {total / MIB / 1024:.2f} GiB of which {free / MIB:.2f} MiB "
                    f"is free. Of the allocated memory {self.allocated() / MIB / 1024:.2f} GiB is "
                    "allocated by PyTorch (rehearsal stand-in)")
            return block

    def free(self, block: Block) -> None:
        with self._lock:
            (self.small if block.segment in self.small.segments else self.large).give(block)

    def _grow(self, arena: Arena, size: int) -> Block | None:
        if self.expandable:
            return arena.take(size) if self._map_for(arena, size) else None
        if arena is self.small:
            segment = self.SMALL_SEGMENT
        elif size < self.MIN_LARGE_ALLOC:
            segment = self.LARGE_SEGMENT
        else:
            segment = round_up(size, self.ROUND_LARGE)
        ptr = standin.mem_alloc(segment)
        if ptr is None:
            return None
        arena.add(ptr, segment)
        return arena.take(size)

    def _map_for(self, arena: Arena, size: int) -> bool:
        """Map pages of the pool's ranges for ``size`` bytes: in the first range with room for
        them, or in a new range (each is 1.125x the device's total) when none has."""
        ranges = self._ranges.setdefault(id(arena), [])
        for expandable in ranges:
            candidate = expandable.candidate(size)
            if candidate is not None:
                return expandable.grow(candidate, size)
        page = self.SMALL_SEGMENT if arena is self.small else self.LARGE_SEGMENT
        span = max(round_up(standin.device_total() * 9 // 8, page), round_up(size, page))
        ranges.append(ExpandableSegment(arena, page, span))
        candidate = ranges[-1].candidate(size)
        return candidate is not None and ranges[-1].grow(candidate, size)

    def _empty_cache(self) -> None:
        if self.expandable:
            for ranges in self._ranges.values():
                for expandable in ranges:
                    expandable.release()
            return
        for arena in (self.small, self.large):
            arena.release_idle(lambda s: standin.mem_free(s.base))

    def empty_cache(self) -> None:
        with self._lock:
            self._empty_cache()

    def reserved(self) -> int:
        return self.small.reserved() + self.large.reserved()

    def allocated(self) -> int:
        return self.small.in_use() + self.large.in_use()


_allocator = _Allocator()


def _stream() -> ctypes.c_void_p:
    stack = getattr(_state, "streams", None)
    return stack[-1].handle if stack else ctypes.c_void_p(None)


def _launch() -> None:
    fn = standin.init()
    check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, _stream(), None, None), "cuLaunchKernel")


class Tensor(standin.Buffer):
    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        super().__init__(_allocator, shape, _BYTES[dtype])
        self.dtype = dtype
        self.nbytes = prod(shape) * _BYTES[dtype]

    def add_(self, _value: Any) -> Tensor:
        if getattr(_state, "capturing", False):
            _launch()
        return self

    def data_ptr(self) -> int:
        return self._block.ptr if self._block is not None else 0

    def copy_(self, src: HostTensor, non_blocking: bool = False) -> Tensor:
        """Host to device only: an async copy on the current stream (module docstring)."""
        if not isinstance(src, HostTensor) or src.nbytes != self.nbytes:
            raise NotImplementedError("the stand-in copies a host tensor of the same size only")
        standin.init()
        check(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(self.data_ptr()), src.data_ptr(),
                                      ctypes.c_size_t(self.nbytes), _stream()),
              "cuMemcpyHtoDAsync_v2")
        if not non_blocking:
            check(cu.cuStreamSynchronize(_stream()), "cuStreamSynchronize")
        return self


class HostTensor:
    """A tensor in host memory (``device="cpu"``; ``pin_memory`` taken, not modelled)."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape, self.dtype = shape, dtype
        self.nbytes = prod(shape) * _BYTES[dtype]
        self._buffer = (ctypes.c_ubyte * max(1, self.nbytes))()

    def data_ptr(self) -> ctypes.c_void_p:
        return ctypes.cast(self._buffer, ctypes.c_void_p)


def _dims(shape: tuple[Any, ...]) -> tuple[int, ...]:
    dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
    return tuple(int(n) for n in dims)


def zeros(*shape: Any, device: str = "cuda", dtype: str = float32) -> Tensor:
    return Tensor(_dims(shape), dtype)


def empty(*shape: Any, device: str = "cuda", dtype: str = float32, pin_memory: bool = False
          ) -> Tensor | HostTensor:
    return HostTensor(_dims(shape), dtype) if device == "cpu" else Tensor(_dims(shape), dtype)


def randn(shape: tuple[int, ...], device: str = "cuda", dtype: str = float32) -> Tensor:
    return Tensor(tuple(shape), dtype)


def empty_like(t: Tensor) -> Tensor:
    return Tensor(t.shape, t.dtype)


def mm(a: Tensor, b: Tensor, *, out: Tensor) -> Tensor:
    """``out`` keyword-only, as PyTorch's ``mm(input, mat2, *, out=None)`` takes it."""
    _launch()
    return out


class _Cuda:
    """``torch.cuda``: synchronize, memory, streams, graphs."""

    class OutOfMemoryError(RuntimeError):
        pass

    class Stream:
        def __init__(self) -> None:
            standin.init()
            self.handle = ctypes.c_void_p()
            check(cu.cuStreamCreate(ctypes.byref(self.handle), 0), "cuStreamCreate")

    class stream:  # torch's name
        def __init__(self, s: _Cuda.Stream) -> None:
            self.s = s

        def __enter__(self) -> None:
            if not hasattr(_state, "streams"):
                _state.streams = []
            _state.streams.append(self.s)

        def __exit__(self, *exc: object) -> None:
            _state.streams.pop()

    class CUDAGraph:
        """PyTorch's checks before the driver's: a capture begins on a stream that is not the
        default one and ends on the stream it began on."""

        def capture_begin(self) -> None:
            standin.init()
            self.stream = _stream()
            if self.stream.value is None:
                raise RuntimeError("CUDA graphs must be captured on a non-default stream. "
                                   "(rehearsal stand-in)")
            check(cu.cuStreamBeginCapture_v2(self.stream, _CAPTURE_GLOBAL),
                  "cuStreamBeginCapture_v2")
            _state.capturing = True

        def capture_end(self) -> None:
            if _stream().value != self.stream.value:
                raise RuntimeError("Capture must end on the same stream it began on. "
                                   "(rehearsal stand-in)")
            _state.capturing = False
            graph = ctypes.c_void_p()
            check(cu.cuStreamEndCapture(self.stream, ctypes.byref(graph)), "cuStreamEndCapture")

    @staticmethod
    def synchronize() -> None:
        standin.synchronize()

    @staticmethod
    def mem_get_info() -> tuple[int, int]:
        return standin.mem_get_info()

    @staticmethod
    def memory_reserved() -> int:
        return _allocator.reserved()

    @staticmethod
    def empty_cache() -> None:
        _allocator.empty_cache()


cuda = _Cuda()
