"""What the rehearsal's stand-ins for PyTorch, CuPy and JAX share: the CUDA driver through
ctypes, and the caching allocators those frameworks keep between their programs and the driver.

The stand-ins (``torch``, ``cupy``, ``jax`` beside this file) let
``tests/interposer/test_gpu_check_rehearsal.py`` run ``scripts/gpu-check.sh``'s framework rows
on the fake driver. They take device memory the way the real frameworks do, as far as the
library can tell: PyTorch's allocator rounds requests and carves them from segments it keeps
after a free (2 MiB for small tensors, 20 MiB for up to 10 MiB, the request rounded to 2 MiB
above), releases what is cached and tries again before it raises its out-of-memory error, and
with ``expandable_segments:True`` maps 20 MiB pages of ``cuMemCreate`` into one reserved range
instead; CuPy's pool keeps freed blocks and retries after freeing them; JAX's BFC pool is one
allocation of 75 % of the reported total, and its platform allocator one per buffer. The figures
they give are the fake GPU's. None of this is imported unless ``GPUCHECK_REHEARSAL=1``: it can
never stand in for a framework on a GPU machine.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Protocol

if os.environ.get("GPUCHECK_REHEARSAL") != "1":  # never fake figures by accident
    raise ImportError("tests/gpu/rehearsal is the rehearsal's stand-in, not a GPU framework "
                      "(set GPUCHECK_REHEARSAL=1 to use it on the fake driver)")

MIB = 1 << 20
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY

cu = ctypes.CDLL("libcuda.so.1")
_lock = threading.Lock()
_thread = threading.local()
driver: dict[str, ctypes.c_void_p] = {}
"""The primary context of device 0 ("ctx") and the one kernel every op launches ("fn")."""


class CudaError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed: CUDA error {code}")
        self.code = code


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaError(what, rc)


def init() -> ctypes.c_void_p:
    """The primary context of device 0 current in this thread (made once, as the frameworks'
    runtime does); the kernel the stand-ins launch."""
    with _lock:
        if not driver:
            check(cu.cuInit(0), "cuInit")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
            check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            check(cu.cuModuleLoadData(ctypes.byref(module), b"rehearsal"), "cuModuleLoadData")
            check(cu.cuModuleGetFunction(ctypes.byref(fn), module, b"op"), "cuModuleGetFunction")
            driver.update(fn=fn, ctx=ctx)
    if not getattr(_thread, "current", False):
        check(cu.cuCtxSetCurrent(driver["ctx"]), "cuCtxSetCurrent")
        _thread.current = True
    return driver["fn"]


def synchronize() -> None:
    init()
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


def mem_get_info() -> tuple[int, int]:
    """(free, total) as cuMemGetInfo reports them: the slice's, with the library."""
    init()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return free.value, total.value


def device_total() -> int:
    init()
    total = ctypes.c_size_t()
    check(cu.cuDeviceTotalMem_v2(ctypes.byref(total), 0), "cuDeviceTotalMem_v2")
    return total.value


def mem_alloc(nbytes: int) -> int | None:
    """cuMemAlloc: the address, or None when the driver (or the cap) is out of memory."""
    init()
    ptr = ctypes.c_uint64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if rc == OUT_OF_MEMORY:
        return None
    check(rc, f"cuMemAlloc({nbytes})")
    return ptr.value


def mem_free(ptr: int) -> None:
    check(cu.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree_v2")


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass(eq=False)
class Block:
    segment: Segment
    offset: int
    size: int
    free: bool = True

    @property
    def ptr(self) -> int:
        return self.segment.base + self.offset


@dataclass(eq=False)
class Segment:
    """Device memory an allocator holds from the driver, cut into blocks in address order."""

    base: int
    size: int
    blocks: list[Block] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.blocks:
            self.blocks.append(Block(self, 0, self.size))

    def idle(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0].free


class Arena:
    """Best-fit blocks carved from segments, split when the rest is at least ``min_split``,
    merged with free neighbours when freed: the part every framework's allocator shares."""

    def __init__(self, min_split: int) -> None:
        self.min_split = min_split
        self.segments: list[Segment] = []

    def add(self, base: int, size: int) -> Segment:
        segment = Segment(base, size)
        self.segments.append(segment)
        return segment

    def take(self, size: int) -> Block | None:
        fits = [b for s in self.segments for b in s.blocks if b.free and b.size >= size]
        if not fits:
            return None
        block = min(fits, key=lambda b: (b.size, b.segment.base + b.offset))
        rest = block.size - size
        if rest >= self.min_split:
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1,
                          Block(block.segment, block.offset + size, rest))
            block.size = size
        block.free = False
        return block

    def give(self, block: Block) -> None:
        block.free = True
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += blocks.pop(i).size

    def reserved(self) -> int:
        return sum(s.size for s in self.segments)

    def in_use(self) -> int:
        return sum(b.size for s in self.segments for b in s.blocks if not b.free)

    def largest_free(self) -> int:
        return max((b.size for s in self.segments for b in s.blocks if b.free), default=0)

    def release_idle(self, free: Callable[[Segment], None]) -> int:
        """Give every segment with nothing allocated back to the driver; the bytes released."""
        idle = [s for s in self.segments if s.idle()]
        for segment in idle:
            free(segment)
            self.segments.remove(segment)
        return sum(s.size for s in idle)


class Allocator(Protocol):
    def malloc(self, nbytes: int) -> Block: ...

    def free(self, block: Block) -> None: ...


class Buffer:
    """An array's device memory: taken from its framework's allocator when the array is made,
    given back when it is released or collected (as PyTorch's and CuPy's arrays are)."""

    def __init__(self, allocator: Allocator, shape: tuple[int, ...], itemsize: int) -> None:
        init()
        self.shape = shape
        self._allocator = allocator
        count = prod(shape)
        self._block: Block | None = allocator.malloc(count * itemsize) if count else None

    def release(self) -> None:
        if self._block is not None:
            self._allocator.free(self._block)
            self._block = None

    def __del__(self) -> None:
        self.release()


class _Prop(ctypes.Structure):
    """CUmemAllocationProp: pinned device memory on device 0."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location_type", ctypes.c_int), ("location_id", ctypes.c_int),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc: read-write from device 0."""

    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int),
                ("flags", ctypes.c_int)]


_PINNED, _LOCATION_DEVICE, _READ_WRITE = 1, 1, 3


class ExpandableSegment:
    """One reserved address range that grows by mapping ``page``-sized ``cuMemCreate``
    allocations at its end and shrinks by unmapping free pages there (PyTorch's expandable
    segments: a handle per page, mapped and given access one by one)."""

    def __init__(self, arena: Arena, page: int, span: int) -> None:
        init()
        self.arena, self.page = arena, page
        self.span = round_up(span, page)
        base = ctypes.c_uint64()
        check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(self.span),
                                     ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)),
              "cuMemAddressReserve")
        self.base = base.value
        self.handles: list[int] = []
        self.segment: Segment | None = None

    def mapped(self) -> int:
        return len(self.handles) * self.page

    def grow(self, need: int) -> bool:
        """Map pages so that the free block at the end holds ``need`` bytes; False (nothing
        kept of this attempt) when the driver or the cap refuses a page."""
        tail = self._tail()
        pages = -(-(need - (tail.size if tail else 0)) // self.page)
        if self.mapped() + pages * self.page > self.span:
            return False
        made: list[int] = []
        for _ in range(pages):
            handle = self._map_page(self.base + self.mapped() + len(made) * self.page)
            if handle is None:
                for i in reversed(range(len(made))):
                    self._unmap_page(self.base + self.mapped() + i * self.page, made[i])
                return False
            made.append(handle)
        added = pages * self.page
        if self.segment is None:
            self.segment = self.arena.add(self.base, added)
        elif tail is not None:
            tail.size += added
            self.segment.size += added
        else:
            self.segment.blocks.append(Block(self.segment, self.segment.size, added))
            self.segment.size += added
        self.handles.extend(made)
        return True

    def shrink(self) -> int:
        """Unmap the whole free pages at the end; the bytes given back."""
        tail = self._tail()
        if tail is None or self.segment is None:
            return 0
        pages = tail.size // self.page
        for _ in range(pages):
            handle = self.handles.pop()
            self._unmap_page(self.base + self.mapped(), handle)
        cut = pages * self.page
        tail.size -= cut
        self.segment.size -= cut
        if tail.size == 0:
            self.segment.blocks.remove(tail)
        if not self.segment.blocks:
            self.arena.segments.remove(self.segment)
            self.segment = None
        return cut

    def _tail(self) -> Block | None:
        if self.segment is None:
            return None
        last = self.segment.blocks[-1]
        return last if last.free else None

    def _map_page(self, va: int) -> int | None:
        prop = _Prop(type=_PINNED, location_type=_LOCATION_DEVICE, location_id=0)
        handle = ctypes.c_uint64()
        rc = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.page), ctypes.byref(prop),
                            ctypes.c_ulonglong(0))
        if rc == OUT_OF_MEMORY:
            return None
        check(rc, "cuMemCreate")
        check(cu.cuMemMap(ctypes.c_uint64(va), ctypes.c_size_t(self.page), ctypes.c_size_t(0),
                          handle, ctypes.c_ulonglong(0)), "cuMemMap")
        access = _AccessDesc(location_type=_LOCATION_DEVICE, location_id=0, flags=_READ_WRITE)
        check(cu.cuMemSetAccess(ctypes.c_uint64(va), ctypes.c_size_t(self.page),
                                ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        return handle.value

    def _unmap_page(self, va: int, handle: int) -> None:
        check(cu.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(self.page)), "cuMemUnmap")
        check(cu.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")
