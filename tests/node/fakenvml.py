"""A fake NVML module for the agent's tests: the pynvml functions the agent calls, over a list
of fake devices, raising the real ``pynvml`` error classes so the agent's ``except`` clauses
are exercised exactly as with the real library.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

MIB = 1024 * 1024
GIB = 1024 * MIB
NOT_AVAILABLE = 0xFFFF_FFFF_FFFF_FFFF
_V2 = struct.Struct("<IxxxxQII")
"""nvmlProcessInfo_v2_t: 24 bytes (pid, 4 bytes of padding, usedGpuMemory, instance IDs)."""
_V3_R535 = struct.Struct("<IxxxxQIIQ")
"""nvmlProcessInfo_v3_t of R535/R545 drivers: 32 bytes (and usedGpuCcProtectedMemory)."""


@dataclass
class FakeDevice:
    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GIB
    used: int = 0
    util: int = 0
    retired_pending: bool = False
    remap_failure: bool = False
    health_probes_supported: bool = True
    mig: tuple[int, int] | None = (0, 0)
    """MIG mode (current, pending); None: the GPU has no MIG (NOT_SUPPORTED)."""
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    processes: dict[int, int | None] = field(default_factory=dict)
    """Compute processes: host pid -> bytes held (None: NVML cannot say)."""
    graphics: dict[int, int | None] = field(default_factory=dict)
    """Graphics processes, likewise; ``graphics_supported=False`` makes that query NOT_SUPPORTED."""
    graphics_supported: bool = True
    mps: dict[int, int | None] = field(default_factory=dict)
    """MPS client processes, likewise."""
    fail: dict[str, int] = field(default_factory=dict)
    """NVML function name -> NVML error code it raises for this device."""
    fail_once: dict[str, int] = field(default_factory=dict)
    """Likewise, for the next call only."""
    hang: dict[str, threading.Event] = field(default_factory=dict)
    """NVML function name -> an event: the function, called for this device, blocks until the
    event is set (a GPU fallen off the bus: NVML's calls to it hang rather than fail), then
    answers as usual. ``FakeNvml.hung`` is set while one is blocked."""
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    """Per-process utilisation samples the driver keeps: (pid, timestamp µs, SM %), one per
    process per sample period in which it ran."""
    device_samples: list[tuple[int, int]] = field(default_factory=list)
    """The device's utilisation samples (``nvmlDeviceGetSamples``): (timestamp µs, %), one per
    sample period, idle ones included."""
    event_types: int = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
                        | pynvml.nvmlEventTypeDoubleBitEccError)
    """The event types it can report (``nvmlDeviceGetSupportedEventTypes``); registering
    others is NOT_SUPPORTED (a GeForce board, an old driver)."""


@dataclass
class FakeEventSet:
    """An ``nvmlEventSet_t``: the devices registered in it and the events waiting."""

    registered: dict[int, int] = field(default_factory=dict)
    """Device handle -> the event types registered for it."""
    waiting: list[Any] = field(default_factory=list)
    freed: bool = False


class FakeNvml:
    """Stands in for the ``pynvml`` module (pass it to ``Inventory(nvml=...)``)."""

    def __init__(self, devices: list[FakeDevice] | None = None,
                 init_error: int | None = None, driver: str = "550.54.15") -> None:
        self.devices = list(devices or [])
        self.init_error = init_error
        self.driver = driver
        self.initialised = False
        self.init_calls = 0
        self.calls = 0
        """Calls made to an initialised library's functions (each counted on entry)."""
        self.count_error: int | None = None
        self.empty_success = False
        self.value_type = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        """The value type nvmlDeviceGetSamples says its samples hold."""
        self.absent: set[str] = set()
        """Versioned symbols this driver lacks (``nvmlDeviceGetComputeRunningProcesses_v3``: a
        driver before about 510): pynvml's unversioned call for a missing ``_v3`` raises
        NVMLLibraryMismatchError, a missing versioned one NVML_ERROR_FUNCTION_NOT_FOUND."""
        self.r535 = False
        """A driver of the R535 or R545 branch: it exports nvmlDeviceGetConfComputeMemSizeInfo
        but not nvmlDeviceGetRunningProcessDetailList (R550), and its ``_v3`` process lists
        hold 32-byte entries, which pynvml's calls read as 24-byte ones (what they return is
        that garbage, as with the real pynvml); read through ``_nvmlGetFunctionPointer`` with
        32-byte entries, they are right. Later drivers (the default) export both, 24 bytes."""
        self.hung = threading.Event()
        """Set while a call is blocked by ``FakeDevice.hang``."""
        self.event_sets: list[FakeEventSet] = []
        """Those ``nvmlEventSetCreate`` made."""
        self.waits: list[int] = []
        """The timeouts (ms) ``nvmlEventSetWait_v2`` was called with."""
        self.event_handle: Callable[[int], Any] = lambda index: index
        """The device handle an event of GPU ``index`` carries (NVML's own handles, by
        default)."""
        self.wait_hang: threading.Event | None = None
        """Set: ``nvmlEventSetWait_v2`` blocks until it is set (``hung`` set meanwhile)."""
        self.between_calls: Callable[[], None] | None = None
        """Run once, after the next sizing call (no buffer) of a ``_v3`` process list got
        through ``_nvmlGetFunctionPointer``: processes that start between the two calls."""

    # --- library ---
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def _need_init(self) -> None:
        self.calls += 1
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._need_init()
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._need_init()
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return len(self.devices)

    # --- devices ---
    def _dev(self, handle: Any, fn: str) -> FakeDevice:
        self._need_init()
        dev = self.devices[handle]
        release = dev.hang.get(fn)
        if release is not None:
            self.hung.set()
            release.wait()
            self.hung.clear()
        if fn in dev.fail:
            raise pynvml.NVMLError(dev.fail[fn])
        if fn in dev.fail_once:
            raise pynvml.NVMLError(dev.fail_once.pop(fn))
        return dev

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._need_init()
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._dev(index, "nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self._dev(handle, "nvmlDeviceGetName").name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        d = self._dev(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=d.util, memory=0)

    def _process_list(self, held: dict[int, int | None], v3: bool) -> list[Any]:
        if self.r535 and v3:  # pynvml reads the driver's 32-byte entries as 24-byte ones
            raw = self._entries(held, _V3_R535)
            return [self._friendly(*_V2.unpack_from(raw, i * _V2.size)) for i in range(len(held))]
        return [self._friendly(pid, NOT_AVAILABLE if used is None else used, 0xFFFFFFFF,
                               0xFFFFFFFF) for pid, used in held.items()]

    @staticmethod
    def _friendly(pid: int, used: int, gi: int, ci: int) -> Any:
        """An entry as pynvml returns it (NVML_VALUE_NOT_AVAILABLE memory as None)."""
        return SimpleNamespace(pid=pid, usedGpuMemory=None if used == NOT_AVAILABLE else used,
                               gpuInstanceId=gi, computeInstanceId=ci)

    @staticmethod
    def _entries(held: dict[int, int | None], layout: struct.Struct) -> bytes:
        """The list as the driver writes it (no MIG: instance IDs 0xFFFFFFFF)."""
        fields = [(pid, NOT_AVAILABLE if used is None else used, 0xFFFFFFFF, 0xFFFFFFFF)
                  for pid, used in held.items()]
        if layout is _V3_R535:
            return b"".join(layout.pack(*f, 0) for f in fields)
        return b"".join(layout.pack(*f) for f in fields)

    # --- symbols, for pynvml's _nvmlGetFunctionPointer ---
    def _exports(self) -> dict[str, Callable[..., int]]:
        out: dict[str, Callable[..., int]] = {
            "nvmlDeviceGetConfComputeMemSizeInfo": lambda *_: pynvml.NVML_ERROR_NOT_SUPPORTED}
        if not self.r535:
            out["nvmlDeviceGetRunningProcessDetailList"] = \
                lambda *_: pynvml.NVML_ERROR_NOT_SUPPORTED
        lists = {"Compute": lambda d: d.processes, "Graphics": lambda d: d.graphics,
                 "MPSCompute": lambda d: d.mps}
        for kind, of in lists.items():
            out[f"nvmlDeviceGet{kind}RunningProcesses_v3"] = self._c_list(kind, of)
        return {name: fn for name, fn in out.items() if name not in self.absent}

    def _nvmlGetFunctionPointer(self, name: str) -> Callable[..., int]:
        """pynvml's lookup of a driver's symbol (its function, called with ctypes arguments)."""
        fn = self._exports().get(name)
        if fn is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return fn

    def _c_list(self, kind: str, of: Callable[[FakeDevice], dict[int, int | None]]
                ) -> Callable[..., int]:
        """``nvmlDeviceGet<kind>RunningProcesses_v3`` as C callers see it: (device, unsigned
        *count, entries or NULL) -> nvmlReturn_t, with the driver's entry size; a buffer
        smaller than ``*count`` entries of that size would be written past: the fake fails."""
        layout = _V3_R535 if self.r535 else _V2

        def call(handle: int, count: Any, entries: Any) -> int:
            count = count._obj if hasattr(count, "_obj") else count.contents  # byref or pointer
            try:
                d = self._dev(handle, f"nvmlDeviceGet{kind}RunningProcesses")
                if kind == "Graphics" and not d.graphics_supported:
                    return pynvml.NVML_ERROR_NOT_SUPPORTED
            except pynvml.NVMLError as exc:
                return int(exc.value)
            held = of(d)
            if entries is None:
                rc = self._size(count, held)
                if self.between_calls is not None:
                    hook, self.between_calls = self.between_calls, None
                    hook()
                return rc
            room = count.value
            assert ctypes.sizeof(entries) >= room * layout.size, \
                f"{room} entries of {layout.size} bytes do not fit in {ctypes.sizeof(entries)}"
            if len(held) > room:
                count.value = len(held)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            raw = self._entries(held, layout)
            ctypes.memmove(entries, raw, len(raw))
            count.value = len(held)
            return pynvml.NVML_SUCCESS
        return call

    @staticmethod
    def _size(count: Any, held: dict[int, int | None]) -> int:
        fits = len(held) <= count.value
        count.value = len(held)
        return pynvml.NVML_SUCCESS if fits else pynvml.NVML_ERROR_INSUFFICIENT_SIZE

    def _symbol(self, name: str) -> None:
        if name in self.absent:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _unversioned(self, name: str) -> None:
        if f"{name}_v3" in self.absent:
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML "
                                                  "version does not match the NVML lib version.")

    # a failure set in FakeDevice.fail under the unversioned name fails every version
    # (pynvml's unversioned calls ask for _v3: ``v3``, what an R535 driver lists wider)
    def _compute(self, handle: int, fn: str, v3: bool = True) -> list[Any]:
        return self._process_list(self._dev(handle, fn).processes, v3)

    def _graphics(self, handle: int, fn: str, v3: bool = True) -> list[Any]:
        d = self._dev(handle, fn)
        if not d.graphics_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._process_list(d.graphics, v3)

    def _mps(self, handle: int, fn: str, v3: bool = True) -> list[Any]:
        return self._process_list(self._dev(handle, fn).mps, v3)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetComputeRunningProcesses")
        return self._compute(handle, "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._compute(handle, "nvmlDeviceGetComputeRunningProcesses", v3=False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetGraphicsRunningProcesses")
        return self._graphics(handle, "nvmlDeviceGetGraphicsRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._graphics(handle, "nvmlDeviceGetGraphicsRunningProcesses", v3=False)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetMPSComputeRunningProcesses")
        return self._mps(handle, "nvmlDeviceGetMPSComputeRunningProcesses")

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetMPSComputeRunningProcesses_v2")
        return self._mps(handle, "nvmlDeviceGetMPSComputeRunningProcesses", v3=False)

    def nvmlDeviceGetProcessUtilization(self, handle: int, timeStamp: int) -> list[Any]:
        """The samples newer than ``timeStamp``; none raises what the driver answers
        (NVML_ERROR_NOT_FOUND), or with ``empty_success`` what pynvml makes of a driver that
        answers success with none (an NVMLError of value 0)."""
        d = self._dev(handle, "nvmlDeviceGetProcessUtilization")
        found = [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=pct, memUtil=0, encUtil=0,
                                 decUtil=0) for pid, ts, pct in d.samples if ts > timeStamp]
        if not found:
            raise pynvml.NVMLError(0 if self.empty_success else pynvml.NVML_ERROR_NOT_FOUND)
        return found

    def nvmlDeviceGetSamples(self, handle: int, kind: int, timeStamp: int) -> tuple[int, list[Any]]:
        """The device samples newer than ``timeStamp`` (GPU utilisation only), as pynvml returns
        them: (value type, samples); none raises NVML_ERROR_NOT_FOUND."""
        d = self._dev(handle, "nvmlDeviceGetSamples")
        if kind != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        found = [SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=pct))
                 for ts, pct in d.device_samples if ts > timeStamp]
        if not found:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.value_type, found

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        d = self._dev(handle, "nvmlDeviceGetRetiredPagesPendingStatus")
        if not d.health_probes_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if d.retired_pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        d = self._dev(handle, "nvmlDeviceGetMigMode")
        if d.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(d.mig)

    def nvmlDeviceGetComputeMode(self, handle: int) -> int:
        return self._dev(handle, "nvmlDeviceGetComputeMode").compute_mode

    # --- events ---
    def xid(self, index: int, xid: int, kind: int = pynvml.nvmlEventTypeXidCriticalError
            ) -> int:
        """The driver reports XID ``xid`` (an event of type ``kind``) on GPU ``index``: queued
        in every live event set where that type is registered for it; returns how many."""
        queued = 0
        for events in self.event_sets:
            if not events.freed and events.registered.get(index, 0) & kind:
                events.waiting.append(SimpleNamespace(
                    device=self.event_handle(index), eventType=kind, eventData=xid, gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF))
                queued += 1
        return queued

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._need_init()
        self._symbol("nvmlEventSetCreate")
        events = FakeEventSet()
        self.event_sets.append(events)
        return events

    def nvmlEventSetFree(self, events: FakeEventSet) -> None:
        self._need_init()
        events.freed = True

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
        self._symbol("nvmlDeviceGetSupportedEventTypes")
        return self._dev(handle, "nvmlDeviceGetSupportedEventTypes").event_types

    def nvmlDeviceRegisterEvents(self, handle: int, kinds: int, events: FakeEventSet) -> None:
        self._symbol("nvmlDeviceRegisterEvents")
        d = self._dev(handle, "nvmlDeviceRegisterEvents")
        if kinds & ~d.event_types:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        events.registered[handle] = events.registered.get(handle, 0) | kinds

    def nvmlEventSetWait_v2(self, events: FakeEventSet, timeoutms: int) -> Any:
        """The oldest event waiting; none: NVML_ERROR_TIMEOUT, at once (the fake never waits
        ``timeoutms``; ``waits`` records it)."""
        self._need_init()
        self._symbol("nvmlEventSetWait_v2")
        self.waits.append(timeoutms)
        if self.wait_hang is not None:
            self.hung.set()
            self.wait_hang.wait()
            self.hung.clear()
        if events.freed:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not events.waiting:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return events.waiting.pop(0)

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        d = self._dev(handle, "nvmlDeviceGetRemappedRows")
        if not d.health_probes_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (0, 0, 0, 1 if d.remap_failure else 0)


FUNCTIONS = [name for name in dir(FakeNvml) if name.startswith("nvml")]
"""The pynvml functions the fake provides (and the agent may call)."""


def two_a100s() -> FakeNvml:
    return FakeNvml([
        FakeDevice("GPU-00000000-0000-0000-0000-000000000000", used=5 * GIB, util=40),
        FakeDevice("GPU-11111111-1111-1111-1111-111111111111", used=1 * GIB, util=7),
    ])
