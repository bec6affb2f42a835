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
    """Part of a segment: allocated or free; in an expandable segment, mapped or not (an
    unmapped block is free and spans whole pages)."""

    segment: Segment
    offset: int
    size: int
    free: bool = True
    mapped: bool = True

    @property
    def ptr(self) -> int:
        return self.segment.base + self.offset


@dataclass(eq=False)
class Segment:
    """Device memory an allocator holds from the driver (or, expandable, an address range it
    maps pages into), cut into blocks in address order."""

    base: int
    size: int
    expandable: bool = False
    blocks: list[Block] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.blocks:
            self.blocks.append(Block(self, 0, self.size, mapped=not self.expandable))

    def idle(self) -> bool:
        """Nothing allocated in it, so it can go back to the driver whole (not expandable)."""
        return not self.expandable and len(self.blocks) == 1 and self.blocks[0].free

    def merge(self, block: Block) -> Block:
        """``block`` joined with its free neighbours of the same mapping state; the result."""
        i = self.blocks.index(block)
        for j in (i + 1, i - 1):
            if 0 <= j < len(self.blocks):
                other = self.blocks[j]
                if other.free and block.free and other.mapped == block.mapped:
                    first, second = (block, other) if j > i else (other, block)
                    first.size += second.size
                    self.blocks.remove(second)
                    block = first
        return block

    def split(self, block: Block, size: int) -> Block:
        """Cut ``block`` after ``size`` bytes; the second part, with the same flags."""
        second = Block(self, block.offset + size, block.size - size, block.free, block.mapped)
        block.size = size
        self.blocks.insert(self.blocks.index(block) + 1, second)
        return second


class Arena:
    """Best-fit free mapped blocks carved from segments, split when ``split(block size,
    request)`` says so (default: when at least ``min_split`` would be left), merged with free
    neighbours when freed: the part every framework's allocator shares."""

    def __init__(self, min_split: int, split: Callable[[int, int], bool] | None = None) -> None:
        self.should_split = split or (lambda size, want: size - want >= min_split)
        self.segments: list[Segment] = []

    def add(self, base: int, size: int, expandable: bool = False) -> Segment:
        segment = Segment(base, size, expandable)
        self.segments.append(segment)
        return segment

    def take(self, size: int) -> Block | None:
        fits = [b for s in self.segments for b in s.blocks
                if b.free and b.mapped and b.size >= size]
        if not fits:
            return None
        block = min(fits, key=lambda b: (b.size, b.ptr))
        if self.should_split(block.size, size):
            block.segment.split(block, size)
        block.free = False
        return block

    def give(self, block: Block) -> None:
        block.free = True
        block.segment.merge(block)

    def _blocks(self) -> list[Block]:
        return [b for s in self.segments for b in s.blocks if b.mapped]

    def reserved(self) -> int:
        """Bytes held from the driver: every mapped block, allocated or free."""
        return sum(b.size for b in self._blocks())

    def in_use(self) -> int:
        return sum(b.size for b in self._blocks() if not b.free)

    def largest_free(self) -> int:
        return max((b.size for b in self._blocks() if b.free), default=0)

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
        self._block: Block | None = None  # set first: a refused malloc leaves nothing to free
        init()
        self.shape = shape
        self._allocator = allocator
        count = prod(shape)
        if count:
            self._block = allocator.malloc(count * itemsize)

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
    """PyTorch's expandable segment: one reserved address range (``span``) whose ``page``-sized
    pieces are backed by ``cuMemCreate`` allocations as blocks need them and given back, whole
    pages inside free blocks, when the cache is emptied, leaving holes that later requests can
    map again. Mapping creates every page's handle first (a refused one releases those made, never
    mapped), then maps them one by one and gives access to the whole range in one call."""

    def __init__(self, arena: Arena, page: int, span: int) -> None:
        init()
        self.page = page
        span = round_up(span, page)
        base = ctypes.c_uint64()
        check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(span),
                                     ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0)),
              "cuMemAddressReserve")
        self.handles: list[int | None] = [None] * (span // page)
        self.segment = arena.add(base.value, span, expandable=True)

    def candidate(self, size: int) -> Block | None:
        """Where PyTorch would put ``size`` bytes it has to map: the first unmapped block that,
        with the free block before it and the free ones after, spans ``size``; None when the
        range has no such run left (PyTorch then reserves another range)."""
        blocks = self.segment.blocks
        for i, block in enumerate(blocks):
            if block.mapped:
                continue
            first = i - 1 if i > 0 and blocks[i - 1].free else i
            run, j = 0, first
            while j < len(blocks) and blocks[j].free and run < size:
                run, j = run + blocks[j].size, j + 1
            if run >= size:
                return blocks[first]
        return None

    def grow(self, candidate: Block, size: int) -> bool:
        """Map pages from ``candidate`` on, only as far as its free blocks lack, so that one free
        mapped block holds ``size`` bytes; False when the driver or the cap refuses a page (that
        step's handles are released, never mapped; an earlier step's pages stay mapped and free,
        as PyTorch's do)."""
        blocks = self.segment.blocks
        mapped: Block | None = candidate
        if not candidate.mapped:
            mapped = self._map(candidate, min(candidate.size, size))
        while mapped is not None and mapped.size < size:
            following = blocks[blocks.index(mapped) + 1]
            mapped = self._map(following, min(following.size, size - mapped.size))
        return mapped is not None

    def release(self) -> int:
        """Unmap the whole pages inside free blocks (PyTorch's empty_cache); the bytes."""
        released = 0
        for block in [b for b in self.segment.blocks if b.free and b.mapped]:
            first = round_up(block.offset, self.page)
            last = (block.offset + block.size) // self.page * self.page
            if last <= first:
                continue
            for page in range(first // self.page, last // self.page):
                handle = self.handles[page]
                self.handles[page] = None
                va = self.segment.base + page * self.page
                check(cu.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(self.page)), "cuMemUnmap")
                check(cu.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")
            hole = block
            if first > block.offset:
                hole = self.segment.split(block, first - block.offset)
            if hole.offset + hole.size > last:
                self.segment.split(hole, last - hole.offset)
            hole.mapped = False
            self.segment.merge(hole)
            released += last - first
        return released

    def _map(self, block: Block, nbytes: int) -> Block | None:
        """Back the first ``nbytes`` of the unmapped ``block`` (whole pages); the free mapped
        block that contains them after merging, or None when a page is refused."""
        first = block.offset // self.page
        count = -(-nbytes // self.page)
        made: list[int] = []
        for _ in range(count):
            prop = _Prop(type=_PINNED, location_type=_LOCATION_DEVICE, location_id=0)
            handle = ctypes.c_uint64()
            rc = cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.page),
                                ctypes.byref(prop), ctypes.c_ulonglong(0))
            if rc != 0:
                for h in made:
                    check(cu.cuMemRelease(ctypes.c_uint64(h)), "cuMemRelease")
                if rc == OUT_OF_MEMORY:
                    return None
                check(rc, "cuMemCreate")
            made.append(handle.value)
        va = self.segment.base + first * self.page
        for i, handle in enumerate(made):
            check(cu.cuMemMap(ctypes.c_uint64(va + i * self.page), ctypes.c_size_t(self.page),
                              ctypes.c_size_t(0), ctypes.c_uint64(handle), ctypes.c_ulonglong(0)),
                  "cuMemMap")
            self.handles[first + i] = handle
        access = _AccessDesc(location_type=_LOCATION_DEVICE, location_id=0, flags=_READ_WRITE)
        check(cu.cuMemSetAccess(ctypes.c_uint64(va), ctypes.c_size_t(count * self.page),
                                ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        if count * self.page < block.size:
            self.segment.split(block, count * self.page)
        block.mapped = True
        return self.segment.merge(block)
