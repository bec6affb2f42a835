"""A stand-in for the few PyTorch calls of ``tests/gpu/work.py matmul``, over the CUDA driver
API through ctypes, for rehearsing ``scripts/gpu-check.sh``'s compute rows on the fake driver
(``tests/interposer/test_gpu_check_rehearsal.py``). Only on that test's ``PYTHONPATH``; never
on a GPU machine, where the real PyTorch runs.

``torch.mm`` launches one kernel on the current stream (the fake driver runs each for
``FAKE_CUDA_KERNEL_US``), through the driver's exports, which the preloaded library hooks as
it hooks PyTorch's launches. ``Tensor.add_`` (the tiny op) launches only inside a capture, so
that the capture has a node; elsewhere it costs the host nothing, since the fake's kernels all
take one duration. The figures this gives are the fake GPU's, not a GPU's.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

if os.environ.get("GPUCHECK_REHEARSAL") != "1":  # never fake figures by accident
    raise ImportError("tests/gpu/rehearsal/torch is the rehearsal's stand-in, not PyTorch "
                      "(set GPUCHECK_REHEARSAL=1 to use it on the fake driver)")

bfloat16 = "bfloat16"
_BYTES = {"bfloat16": 2, "float32": 4}
_CAPTURE_GLOBAL = 0  # CU_STREAM_CAPTURE_MODE_GLOBAL, PyTorch's default

_cu = ctypes.CDLL("libcuda.so.1")
_state = threading.local()
_lock = threading.Lock()
_driver: dict[str, ctypes.c_void_p] = {}
"""The primary context ("ctx") and the one kernel every op launches ("fn"), made once."""


class Error(RuntimeError):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise Error(f"{what} failed: CUDA error {rc}")


def _init() -> ctypes.c_void_p:
    """The primary context of device 0 current in this thread, and the kernel (once)."""
    with _lock:
        if not _driver:
            _check(_cu.cuInit(0), "cuInit")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check(_cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
            _check(_cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _check(_cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_cu.cuModuleLoadData(ctypes.byref(module), b"rehearsal"), "cuModuleLoadData")
            _check(_cu.cuModuleGetFunction(ctypes.byref(fn), module, b"mm"), "cuModuleGetFunction")
            _driver.update(fn=fn, ctx=ctx)
    if getattr(_state, "current", None) is None:
        _check(_cu.cuCtxSetCurrent(_driver["ctx"]), "cuCtxSetCurrent")
        _state.current = True
    return _driver["fn"]


def _stream() -> ctypes.c_void_p:
    stack = getattr(_state, "streams", None)
    return stack[-1].handle if stack else ctypes.c_void_p(None)


def _launch() -> None:
    fn = _init()
    _check(_cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, _stream(), None, None), "cuLaunchKernel")


class Tensor:
    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        _init()
        self.shape, self.dtype = shape, dtype
        count = 1
        for n in shape:
            count *= n
        self.ptr = ctypes.c_uint64()
        _check(_cu.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(count * _BYTES[dtype])),
               "cuMemAlloc")

    def add_(self, _value: Any) -> Tensor:
        if getattr(_state, "capturing", False):
            _launch()
        return self


def zeros(*shape: Any, device: str = "cuda", dtype: str = "float32") -> Tensor:
    dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
    return Tensor(tuple(int(n) for n in dims), dtype)


def randn(shape: tuple[int, ...], device: str = "cuda", dtype: str = "float32") -> Tensor:
    return Tensor(tuple(shape), dtype)


def empty_like(t: Tensor) -> Tensor:
    return Tensor(t.shape, t.dtype)


def mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    _launch()
    return out


class _Cuda:
    """``torch.cuda``: synchronize, streams, graphs."""

    class Stream:
        def __init__(self) -> None:
            _init()
            self.handle = ctypes.c_void_p()
            _check(_cu.cuStreamCreate(ctypes.byref(self.handle), 0), "cuStreamCreate")

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
        def capture_begin(self) -> None:
            _init()
            self.stream = _stream()
            _check(_cu.cuStreamBeginCapture_v2(self.stream, _CAPTURE_GLOBAL),
                   "cuStreamBeginCapture_v2")
            _state.capturing = True

        def capture_end(self) -> None:
            _state.capturing = False
            graph = ctypes.c_void_p()
            _check(_cu.cuStreamEndCapture(self.stream, ctypes.byref(graph)), "cuStreamEndCapture")

    @staticmethod
    def synchronize() -> None:
        _init()
        _check(_cu.cuCtxSynchronize(), "cuCtxSynchronize")


cuda = _Cuda()
