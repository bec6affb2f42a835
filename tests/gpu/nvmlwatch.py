"""Watch real GPU memory use from outside the container, through NVML, with no preload.

The parent test process never loads the interposer, so what NVML tells it is the truth the
cap is judged against: per process (``nvmlDeviceGetComputeRunningProcesses``) where the
driver reports processes, else the device's used memory above the level seen before the
children started.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Self

MIB = 1 << 20


class Nvml:
    """The real NVML of device 0 (raises when there is no NVIDIA driver or GPU)."""

    def __init__(self) -> None:
        import pynvml

        self._nv = pynvml
        self.error = pynvml.NVMLError
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            raise RuntimeError("NVML sees no GPU")
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.name = _text(pynvml.nvmlDeviceGetName(self.handle))
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self.handle))
        self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)

    def device_used(self) -> int:
        """Bytes in use on the whole device."""
        return int(self._nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def pids_used(self, pids: set[int]) -> int | None:
        """Bytes NVML charges to ``pids`` together; None when none of them is listed."""
        found, total = False, 0
        for proc in self._nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid in pids and proc.usedGpuMemory is not None:
                found = True
                total += int(proc.usedGpuMemory)
        return total if found else None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "uuid": self.uuid, "driver": self.driver,
                "total_mib": self.total // MIB}


class _Sampling:
    """Calls :meth:`sample` every ``interval`` seconds in a thread, as a context manager."""

    interval: float

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)


class Poller(_Sampling):
    """Polls the usage of a set of child pids in a thread; keeps the maxima.

    Use as a context manager; add each child's pid with :meth:`add` as it starts.
    """

    def __init__(self, nvml: Nvml, label: str, interval: float = 0.002) -> None:
        self.nvml, self.label, self.interval = nvml, label, interval
        self.pids: set[int] = set()
        self.baseline = nvml.device_used()
        self.max_pid_bytes: int | None = None
        self.max_device_delta = 0
        self.samples = 0
        self.errors = 0
        self.phase = "run"  # a test may name phases; the maximum of each is kept
        self.phase_max: dict[str, int] = {}
        super().__init__(f"poll-{label}")

    def add(self, pid: int) -> None:
        self.pids = self.pids | {pid}

    def sample(self) -> None:
        """Take one sample now (also called by the thread)."""
        try:
            used = self.nvml.pids_used(self.pids) if self.pids else None
            delta = self.nvml.device_used() - self.baseline
        except self.nvml.error:  # a transient NVML error must not kill the watch
            self.errors += 1
            return
        if used is not None:
            self.max_pid_bytes = max(self.max_pid_bytes or 0, used)
        self.max_device_delta = max(self.max_device_delta, delta)
        value = used if used is not None else delta
        self.phase_max[self.phase] = max(self.phase_max.get(self.phase, 0), value)
        self.samples += 1

    @property
    def method(self) -> str:
        return "per-process" if self.max_pid_bytes is not None else "device-delta"

    @property
    def max_bytes(self) -> int:
        """The largest usage seen: per process when NVML lists them, else the device delta."""
        if self.max_pid_bytes is not None:
            return self.max_pid_bytes
        return self.max_device_delta

    @property
    def max_mib(self) -> float:
        return self.max_bytes / MIB

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "max_mib": round(self.max_mib, 1), "method": self.method,
                "max_device_delta_mib": round(self.max_device_delta / MIB, 1),
                "samples": self.samples, "errors": self.errors,
                "phases_mib": {k: round(v / MIB, 1) for k, v in self.phase_max.items()}}


class ClockWatch(_Sampling):
    """Samples the SM clock, board power and utilisation in a thread (context manager).

    The compute rows report them: a throttled tenant on an otherwise idle GPU runs at a higher
    clock than the same work under full load, which is what the clock compensation is for.
    """

    def __init__(self, nvml: Nvml, interval: float = 0.1) -> None:
        self.nvml, self.interval = nvml, interval
        self.samples: list[tuple[int, float, int]] = []  # (MHz, W, util %)
        super().__init__("clockwatch")

    def sample(self) -> None:
        nv, h = self.nvml._nv, self.nvml.handle
        try:
            self.samples.append((int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                                 nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                                 int(nv.nvmlDeviceGetUtilizationRates(h).gpu)))
        except self.nvml.error:
            pass

    def summary(self) -> dict[str, Any]:
        busy = [s for s in self.samples if s[2] > 0]
        if not busy:
            return {"samples": len(self.samples)}

        def mid(values: list[float]) -> float:
            return sorted(values)[len(values) // 2]

        return {"samples": len(self.samples), "sm_mhz_busy": mid([s[0] for s in busy]),
                "power_w_busy": round(mid([s[1] for s in busy]), 1),
                "util_pct_mean": round(sum(s[2] for s in self.samples) / len(self.samples), 1)}


class ShareWatch(_Sampling):
    """The agent's outside compute check as it samples (``webhook.node.compute``), in a thread:
    NVML's device and per-process utilisation samples every second, each process its own
    "container", averaged over the last ``window`` seconds of the watch. Keeps the raw samples
    of each poll too (what the real driver's streams look like: their periods, whether a
    process has a sample for the periods it did not run in, how far apart the two streams show
    up), for the record."""

    def __init__(self, window: float) -> None:
        from webhook.node.compute import SAMPLE_INTERVAL, ComputeSampler
        from webhook.node.inventory import Inventory
        self.interval = SAMPLE_INTERVAL
        self.inventory = Inventory()
        self.inventory.discover()
        self.trace: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.polls = 0
        self.t0 = time.monotonic()
        real = self.inventory.process_utilisation

        def traced(since: Any, wall_us: int, read_at: float | None = None) -> Any:
            found = real(since, wall_us, read_at)
            self.trace.append({"t": round(time.monotonic() - self.t0, 2), "gpus": [
                {"device": u.device, "dev_newest": u.dev_newest, "samples": u.samples}
                for u in found[:1]]})
            return found

        self.inventory.process_utilisation = traced  # type: ignore[method-assign,assignment]
        self.sampler = ComputeSampler(self.inventory, lambda pids, _listed, _wall: {
            p: ("pid", str(p)) for p in pids}, window)
        super().__init__("sharewatch")

    def sample(self) -> None:
        self.sampler.poll()
        self.polls += 1
        if self.polls % 2 == 0:
            self.probes.append(self.probe())

    def probe(self) -> dict[str, Any]:
        """What the per-process query gives for two look-backs, to settle its semantics on the
        real driver: asked for everything the driver keeps (``lastSeenTimeStamp`` 0), does it
        give one sample per pid per period (many per pid: they weigh time, as NVML documents),
        or one per pid (the latest, or a mean since the time asked for, as nvtop's maintainer
        reports)? And the samples of the last 2 s, whole."""
        import pynvml

        from webhook.node.inventory import Inventory

        now_us = int(time.time() * 1e6)
        out: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2)}
        for label, since in (("all", 0), ("last_2s", now_us - 2_000_000)):
            try:
                # the agent's retry of pynvml's two calls (a sample added between them)
                got = Inventory._twice(pynvml.nvmlDeviceGetProcessUtilization,
                                       pynvml.nvmlDeviceGetHandleByIndex(0), since)
            except pynvml.NVMLError_NotFound:  # no process ran since then
                got = []
            except pynvml.NVMLError as exc:
                out[label] = f"{type(exc).__name__}: {exc}"
                continue
            per: dict[str, list[list[int]]] = {}
            for x in got:
                per.setdefault(str(x.pid), []).append([int(x.timeStamp), int(x.smUtil)])
            if label == "all":  # counts and spans: the whole buffer would be too long to keep
                out[label] = {pid: {"n": len(v), "first_us": min(t for t, _ in v),
                                    "last_us": max(t for t, _ in v),
                                    "mean_sm": round(sum(u for _, u in v) / len(v), 1)}
                              for pid, v in per.items()}
            else:
                out[label] = per
        return out

    def summary(self) -> dict[str, Any]:
        shares, coverage, _unplaced = self.sampler.snapshot()
        self.inventory.close()
        covered = max(coverage.values(), default=0.0)
        per_pid = {key[1]: round(s.percent, 1) for key, s in shares.items()}
        return {"share_pct": round(sum(per_pid.values()), 1) if covered else None,
                "per_pid": per_pid, "covered_s": round(covered, 1),
                "failures": self.sampler.failures, "trace": self.trace[-40:],
                "probes": self.probes[-12:]}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
