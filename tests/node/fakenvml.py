"""A fake NVML module for the agent's tests: the pynvml functions the agent calls, over a list
of fake devices, raising the real ``pynvml`` error classes so the agent's ``except`` clauses
are exercised exactly as with the real library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

MIB = 1024 * 1024
GIB = 1024 * MIB


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
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    """Per-process utilisation samples the driver keeps: (pid, timestamp µs, SM %), one per
    process per sample period in which it ran."""
    device_samples: list[tuple[int, int]] = field(default_factory=list)
    """The device's utilisation samples (``nvmlDeviceGetSamples``): (timestamp µs, %), one per
    sample period, idle ones included."""


class FakeNvml:
    """Stands in for the ``pynvml`` module (pass it to ``Inventory(nvml=...)``)."""

    def __init__(self, devices: list[FakeDevice] | None = None,
                 init_error: int | None = None, driver: str = "550.54.15") -> None:
        self.devices = list(devices or [])
        self.init_error = init_error
        self.driver = driver
        self.initialised = False
        self.init_calls = 0
        self.count_error: int | None = None
        self.empty_success = False
        self.value_type = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        """The value type nvmlDeviceGetSamples says its samples hold."""
        self.absent: set[str] = set()
        """Versioned symbols this driver lacks (``nvmlDeviceGetComputeRunningProcesses_v3``: a
        driver before about 510): pynvml's unversioned call for a missing ``_v3`` raises
        NVMLLibraryMismatchError, a missing versioned one NVML_ERROR_FUNCTION_NOT_FOUND."""

    # --- library ---
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def _need_init(self) -> None:
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

    @staticmethod
    def _process_list(held: dict[int, int | None]) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in held.items()]

    def _symbol(self, name: str) -> None:
        if name in self.absent:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _unversioned(self, name: str) -> None:
        if f"{name}_v3" in self.absent:
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML "
                                                  "version does not match the NVML lib version.")

    # a failure set in FakeDevice.fail under the unversioned name fails every version
    def _compute(self, handle: int, fn: str) -> list[Any]:
        return self._process_list(self._dev(handle, fn).processes)

    def _graphics(self, handle: int, fn: str) -> list[Any]:
        d = self._dev(handle, fn)
        if not d.graphics_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._process_list(d.graphics)

    def _mps(self, handle: int, fn: str) -> list[Any]:
        return self._process_list(self._dev(handle, fn).mps)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetComputeRunningProcesses")
        return self._compute(handle, "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._compute(handle, "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetGraphicsRunningProcesses")
        return self._graphics(handle, "nvmlDeviceGetGraphicsRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetGraphicsRunningProcesses_v2")
        return self._graphics(handle, "nvmlDeviceGetGraphicsRunningProcesses")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: int) -> list[Any]:
        self._unversioned("nvmlDeviceGetMPSComputeRunningProcesses")
        return self._mps(handle, "nvmlDeviceGetMPSComputeRunningProcesses")

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        self._symbol("nvmlDeviceGetMPSComputeRunningProcesses_v2")
        return self._mps(handle, "nvmlDeviceGetMPSComputeRunningProcesses")

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
