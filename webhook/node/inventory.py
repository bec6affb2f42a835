"""GPU discovery and sampling through NVML (pynvml): what the node has and how it is doing.

:class:`Inventory` wraps an NVML module (``pynvml`` by default; tests pass a fake with the same
functions and the real ``pynvml`` error classes). It never raises for a node without the driver
or without GPUs: :meth:`Inventory.discover` then reports :class:`Discovery` with
``available=False`` and a reason, and retries ``nvmlInit`` on the next call.

Health: a GPU is ``Unhealthy`` when any of its name/memory queries fails (its product and
memory are then the last ones read, or empty and 0 if never read), when NVML says it
has retired pages pending (a reset is needed), when row remapping failed, or once it has
reported a critical XID error (an event, read at each discovery without waiting; not those
an application causes, :data:`APPLICATION_XIDS`, nor those the operator skips), until the
agent restarts; probes a GPU does not support (consumer cards) or a driver lacks do not count
against it. A GPU gpuslice cannot share is ``Unhealthy`` too, so that nothing is placed on
it: one in MIG mode (CUDA then reaches only its MIG instances, which ``NVIDIA_VISIBLE_DEVICES=<GPU UUID>`` does not give a container: a pod
placed there finds no CUDA device) and one whose compute mode lets one process at a time
(``EXCLUSIVE_PROCESS``: every pod after the first fails to create its context, unless the
pods reach an MPS server, which the operator says with ``offer_exclusive_process``) or none
(``PROHIBITED``) use it. The reason is kept in :attr:`Gpu.problem` (logged, and exported as
``gpuslice_gpu_unhealthy_reason``). A GPU whose handle or UUID cannot be read
cannot be addressed by ``NVIDIA_VISIBLE_DEVICES`` and is left out (and logged). Becoming
Unhealthy is immediate; a GPU that was Unhealthy, or left out, is Healthy again only once it
has passed :data:`RECOVER_ROUNDS` discoveries in a row, the last at least
:attr:`Inventory.recover_s` after the first (one whose health flaps is not offered in the
rounds it passes).

Hung calls: NVML is called one series of calls at a time (a lock); one that has run for
:data:`HUNG_S` is hung (a GPU fallen off the bus can make calls block instead of failing). No
call is then made behind it: the readers answer at once without NVML (:meth:`Inventory.sample`
without figures, :meth:`Inventory.processes` as lists that cannot be read, no utilisation
samples, :meth:`Inventory.discover` as :attr:`Inventory.last`, where the GPU it queries is
Unhealthy), until it returns. It is logged once, and its end. The discovery it held up (or,
where it was a scrape's or an audit's, the next) finds that GPU Unhealthy too (then recovering
as from any other problem).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
AHEAD_US = 5_000_000
"""Samples stamped up to this far past the wall clock are a driver's clock ahead of it (taken
once the wall clock reaches them); further, garbage (some drivers' for exited processes)."""
PERIOD_MAX_US = 1_000_000
"""The longest sample period drivers use (1/6 to 1 s): the most time one device sample speaks
for."""
HUNG_S = 20.0
"""Seconds an NVML call may run before it is judged hung: a GPU fallen off the bus can make the
driver's calls to it block for minutes or for ever instead of failing (:attr:`Inventory.last`)."""
HUNG_PROBLEM = ("NVML call hung (the GPU fallen off the bus?): nothing is placed on it until "
                "the call returns")
RECOVER_ROUNDS = 3
"""Discoveries in a row (the agent's rounds: about 2 minutes at its default interval) a GPU that was
Unhealthy, or could not be addressed, must pass before it is offered again; becoming Unhealthy
is immediate. A GPU whose health flaps (a probe failing every other round) was offered in every
round it passed, and each flip patched the node twice. The time they span counts too
(:attr:`Inventory.recover_s`): the agent's rounds back off from 1 s after an API error."""
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XID errors an application causes (graphics engine exception, memory page fault, GPU
stopped processing, preemptive cleanup, video processor exception, context switch timeout):
the GPU is fine. NVIDIA's device plugin skips the same ones."""
XID_NAMES = {48: "double-bit ECC error", 63: "row remapping or page retirement recorded",
             64: "row remapping or page retirement failed", 74: "NVLink error",
             79: "GPU fallen off the bus", 92: "high single-bit ECC error rate",
             94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout",
             120: "GSP error"}
XID_DRAIN_MAX = 1000
"""The most XID events one discovery reads (each without waiting); more wait for the next."""
DEPARTED_KEPT = 16
"""GPUs gone from the discoveries (replaced, or no longer listed by the driver) whose
bookkeeping is kept: one back is judged as before it went (its last known size, its problem,
its recovery). Past that many, what is kept of every GPU gone goes; a replaced GPU's new UUID
added an entry to each for the agent's lifetime. A critical XID's verdict is kept regardless."""
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
_NO_SUCH_QUERY = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound,
                  pynvml.NVMLLibraryMismatchError)
"""A query this GPU or driver does not have (pynvml turns a missing versioned symbol behind an
unversioned call into NVMLLibraryMismatchError, which is not an NVMLError)."""


class ProcessInfoR535(ctypes.Structure):
    """An entry of the ``_v3`` process lists of R535 and R545 drivers (CUDA 12.2, 12.3):
    ``nvmlProcessInfo_v3_t`` of their nvml.h, 32 bytes (``usedGpuCcProtectedMemory`` after the
    24 bytes of ``nvmlProcessInfo_v2_t``). R550 moved it to
    ``nvmlDeviceGetRunningProcessDetailList`` and its ``_v3`` lists 24-byte entries again, which
    is all the pynvml we ship reads (its ``c_nvmlProcessInfo_v3_t`` is the v2 struct)."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
        ("usedGpuCcProtectedMemory", ctypes.c_ulonglong),
    ]


assert ctypes.sizeof(ProcessInfoR535) == 32
_NOT_AVAILABLE = 0xFFFF_FFFF_FFFF_FFFF
"""NVML_VALUE_NOT_AVAILABLE as an unsigned long long: a process's memory NVML cannot say."""
_UNAVAILABLE = (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded,
                pynvml.NVMLError_NoPermission, pynvml.NVMLError_LibRmVersionMismatch)


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as published in the node annotation ``gpuslice.io/gpus``."""

    uuid: str
    index: int
    product: str
    memory_mib: int
    health: str
    problem: str = ""
    """Why it is unhealthy, for people (not in the annotation, whose fields DESIGN.md fixes)."""

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY

    def to_json(self) -> dict[str, Any]:
        """The annotation entry: ``{"uuid","index","product","memoryMiB","health"}``."""
        return {"uuid": self.uuid, "index": self.index, "product": self.product,
                "memoryMiB": self.memory_mib, "health": self.health}


@dataclass(frozen=True)
class GpuSample:
    """A point-in-time reading of one GPU for the metrics (None where NVML had no answer)."""

    gpu: Gpu
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: int | None


@dataclass(frozen=True)
class GpuProcesses:
    """The processes holding memory on one GPU, by host pid (``None`` where NVML cannot say how
    much), and the GPU's total; ``processes`` is ``None`` when the list could not be read."""

    gpu: Gpu
    total_bytes: int | None
    processes: dict[int, int | None] | None


@dataclass(frozen=True)
class GpuUtilisation:
    """NVML's utilisation samples of one GPU newer than those asked for.

    ``samples``: the per-process SM samples, (pid, timestamp µs, %) (the driver gives one per
    process that ran in a sample period), None when a query failed or the GPU has none;
    ``newest``: their newest timestamp. ``device``: the GPU's utilisation over its new sample
    periods (over the time they speak for, :func:`busy_time`; the last period's figure where the
    driver keeps no samples), None where no period ended since ``dev_newest``, the device
    samples' newest timestamp. ``device_busy_us``: the µs those samples say the GPU was busy
    (None without them): over a poll's time, time no sample speaks for counts idle. ``idle``:
    no period ended and the driver's last one read 0 % (nothing ran). ``running``: the processes
    NVML lists on the GPU now (to place them while they live). ``ahead``: device samples
    stamped past the wall clock (by at most :data:`AHEAD_US`) wait to be taken: periods did
    end, by a driver's clock a little ahead. ``clock_us``: the driver's clock as the samples
    show it (their newest stamp, those waiting included; 0: none)."""

    gpu: Gpu
    samples: list[tuple[int, int, int]] | None
    newest: int
    device: float | None = None
    dev_newest: int = 0
    running: frozenset[int] = frozenset()
    idle: bool = False
    device_busy_us: float | None = None
    ahead: bool = False
    clock_us: int = 0


def busy_time(values: list[tuple[int, int]], since: int) -> tuple[float, float]:
    """What device samples ``values`` (timestamp µs, %; in order, newer than ``since``, 0 at the
    first query) say: (µs busy, µs they speak for). Each speaks for the time since the sample
    before it (the first query's first one, a period), at most :data:`PERIOD_MAX_US`: a driver
    that gives no sample for idle periods leaves gaps longer than any period, which are idle
    time, not more of the next busy sample (a container paced to 33 % by a second's run and two
    seconds' wait read 100 %)."""
    busy = spoken = 0.0
    before = since or values[0][0] - PERIOD_MAX_US
    for stamp, pct in values:
        step = min(stamp - before, PERIOD_MAX_US)
        busy, spoken, before = busy + pct / 100 * step, spoken + step, stamp
    return busy, spoken


@dataclass(frozen=True)
class Discovery:
    """The result of one discovery: the GPUs, or why NVML could not be used."""

    available: bool
    gpus: tuple[Gpu, ...] = ()
    reason: str = ""
    driver_version: str = ""

    @property
    def healthy(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.healthy)


def _handle_key(handle: Any) -> Any:
    """A device handle as a dictionary key: the address a pynvml handle (a ctypes pointer)
    holds, which NVML gives every call on the same GPU; as it is otherwise (a test's)."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class Inventory:
    """Discovers GPUs and samples them; safe to call from the event loop and a scrape thread."""

    def __init__(self, nvml: ModuleType | Any = pynvml, *,
                 offer_exclusive_process: bool = False, xid_check: bool = True,
                 skip_xids: Iterable[int] = (), recover_s: float = 0.0) -> None:
        self._nvml = nvml
        self.recover_s = recover_s
        """The least time (seconds, ``time.monotonic``) from a recovering GPU's first clean
        discovery to the one that offers it, besides :data:`RECOVER_ROUNDS` of them: the agent's
        rounds back off from 1 s after an API error, so rounds alone offered a GPU that flaps
        every few seconds within seconds. The agent sets ``RECOVER_ROUNDS - 1`` intervals (its
        rounds at the interval take that already)."""
        self._xid_skip = APPLICATION_XIDS | frozenset(skip_xids) if xid_check else None
        """The XIDs that do not count against a GPU (None: XID events are not read)."""
        self._events: Any = None
        """NVML's event set the GPUs are registered in for critical XID errors (None: not
        made, in this initialisation of NVML)."""
        self._no_events = False
        """The driver cannot make one (told once per initialisation)."""
        self._watched: dict[Any, str] = {}
        """The registered GPUs: handle (:func:`_handle_key`) -> UUID, in this initialisation."""
        self._unwatched: set[str] = set()
        """GPUs that cannot report XID errors (told once)."""
        self._xid_problems: dict[str, str] = {}
        """GPU UUID -> the critical XID it reported: Unhealthy for the agent's lifetime."""
        self._xids_told: set[tuple[str, int]] = set()
        self._wait_error = ""
        self._offer_exclusive_process = offer_exclusive_process
        """Offer GPUs in EXCLUSIVE_PROCESS compute mode (an MPS server the pods reach holds
        them; the operator mounts its pipe directory into the pods)."""
        self._lock = threading.Lock()
        self._busy_since: float | None = None
        """When the calls holding the lock began, or turned to the GPU they query now
        (``time.monotonic``); None: it is free."""
        self._busy_gpu: int | None = None
        """The NVML index of the GPU they query now (None: no one GPU, e.g. nvmlInit)."""
        self._answered_late: set[int] = set()
        """NVML indexes of GPUs whose calls hung, then answered, outside a discovery (a scrape,
        an audit): the next discovery finds them Unhealthy, as one they held up."""
        self._hung_told = False
        self._initialised = False
        self._last: Discovery = Discovery(available=False, reason="not discovered yet")
        self.discovered = False
        """A discovery has ended (before, :attr:`last` is a placeholder, not NVML's word)."""
        self._logged_state: tuple[Any, ...] = ()
        self._known: dict[str, tuple[str, int]] = {}
        self._problems: dict[str, str] = {}
        """GPU UUID -> the problem last logged for it ("" healthy)."""
        self._recovering: dict[str, tuple[str, int, float | None]] = {}
        """GPU UUID -> the problem it last had, the discoveries it has passed since and when the
        first of them was (``time.monotonic``; None: none yet), while fewer than
        :data:`RECOVER_ROUNDS` or within :attr:`recover_s` (it is still Unhealthy)."""
        self._unaddressed: set[int] = set()
        """NVML indexes whose GPU could not be addressed at the last discovery (logged)."""
        self._r535: bool | None = None
        """The driver lists ``_v3`` processes in 32-byte entries (None: not asked yet)."""

    @property
    def last(self) -> Discovery:
        """The latest discovery result (no NVML call). While an NVML call hangs (:meth:`hung`),
        the GPU it queries is Unhealthy in it, as is every GPU where it queries no one GPU of
        the result (nvmlInit, the count); NVML is unavailable where none was found yet."""
        last = self._last
        if self.hung() is None:
            return last
        busy = self._busy_gpu
        indexes = {g.index for g in last.gpus}
        marked = {busy} if busy in indexes else indexes
        if not last.available or not marked:
            return Discovery(available=False, reason=HUNG_PROBLEM,
                             driver_version=last.driver_version)
        return replace(last, gpus=tuple(
            replace(g, health=UNHEALTHY, problem=HUNG_PROBLEM)
            if g.index in marked and g.healthy else g for g in last.gpus))

    def hung(self) -> float | None:
        """For how long the NVML call now running has run, where that is :data:`HUNG_S` or
        more (it is hung); else None."""
        since = self._busy_since
        ran = None if since is None else time.monotonic() - since
        if ran is None or ran < HUNG_S:
            return None
        if not self._hung_told:
            self._hung_told = True
            logger.warning("NVML call hung (a GPU fallen off the bus?): the GPU it queries is "
                           "published Unhealthy, and no NVML call is made until it returns",
                           extra={"index": self._busy_gpu, "running_s": round(ran)})
        return ran

    @contextlib.contextmanager
    def _calling(self) -> Iterator[bool]:
        """Hold NVML's lock for a series of calls; yields False, without it, where the calls
        that hold it have run for :data:`HUNG_S` (they are hung: no call waits behind them).
        Calls that go on from GPU to GPU, each within it, are waited for (a discovery of many
        slow GPUs: a scrape behind it gave up at the deadline of the GPU queried when it asked,
        and answered as behind a hung call)."""
        while True:
            since = self._busy_since
            wait = HUNG_S if since is None else max(0.0, since + HUNG_S - time.monotonic())
            if self._lock.acquire(timeout=wait):
                break
            if self.hung() is not None:  # (told once)
                yield False
                return
        self._busy_since, self._busy_gpu = time.monotonic(), None
        try:
            yield True
        finally:
            self._note_hang()
            began, self._busy_since, self._busy_gpu = self._busy_since, None, None
            if self._hung_told:
                self._hung_told = False
                logger.info("NVML answers again",
                            extra={"hung_s": round(time.monotonic() - began)})
            self._lock.release()

    def _query(self, index: int) -> None:
        """The calls holding the lock turn to GPU ``index``: the deadline counts from now, per
        GPU (a discovery of many slow GPUs, each within it, is not hung)."""
        self._note_hang()
        self._busy_since, self._busy_gpu = time.monotonic(), index

    def _note_hang(self) -> None:
        """Where the calls to the GPU queried now ran :data:`HUNG_S` or more (hung, then
        answered), note it for its next discovery."""
        since, busy = self._busy_since, self._busy_gpu
        if busy is not None and since is not None and time.monotonic() - since >= HUNG_S:
            self._answered_late.add(busy)

    def _ensure_init(self) -> str:
        """Initialise NVML if needed; return "" on success or the reason it is unavailable."""
        if self._initialised:
            return ""
        try:
            self._nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            kind = ("NVIDIA driver not loaded" if isinstance(exc, pynvml.NVMLError_DriverNotLoaded)
                    else "NVML library not found" if isinstance(exc, pynvml.NVMLError_LibraryNotFound)
                    else "NVML initialisation failed")
            return f"{kind}: {exc}"
        except OSError as exc:
            return f"NVML library could not be loaded: {exc}"
        self._initialised = True
        return ""

    def discover(self) -> Discovery:
        """Query NVML for every GPU. Never raises; ``available=False`` says why."""
        with self._calling() as held:
            if not held:
                return self.last
            result = self._discover_locked()
            self._last, self.discovered = result, True
        state = (result.available, result.reason, len(result.gpus), len(result.healthy))
        if state != self._logged_state:
            self._logged_state = state
            if not result.available:
                logger.warning("no usable NVIDIA driver on this node; publishing zero GPUs and "
                               "retrying every interval", extra={"reason": result.reason})
            elif not result.gpus:
                logger.warning("NVIDIA driver loaded but no GPUs found; publishing zero GPUs",
                               extra={"driver": result.driver_version})
            else:
                logger.info("GPUs discovered", extra={
                    "gpus": len(result.gpus), "healthy": len(result.healthy),
                    "driver": result.driver_version})
        return result

    def _discover_locked(self) -> Discovery:
        reason = self._ensure_init()
        if reason:
            return Discovery(available=False, reason=reason)
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            if isinstance(exc, _UNAVAILABLE):
                self._shutdown_locked()
            return Discovery(available=False, reason=f"cannot count GPUs: {exc}")
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = ""
        self._read_xids()
        gpus: list[Gpu] = []
        self._unaddressed.intersection_update(range(count))
        for index in range(count):
            gpu = self._describe(index)
            if gpu is not None:
                gpus.append(gpu)
        if len(gpus) == count:  # every GPU addressed: one not among them is gone
            self._forget_departed({g.uuid for g in gpus})
        return Discovery(available=True, gpus=tuple(gpus), driver_version=driver)

    def _forget_departed(self, present: set[str]) -> None:
        """Once more than :data:`DEPARTED_KEPT` GPUs not ``present`` are remembered, forget
        them (their size, problem, recovery, lack of XID events)."""
        departed = (self._known.keys() | self._problems.keys() | self._recovering.keys()
                    | self._unwatched) - present
        if len(departed) <= DEPARTED_KEPT:
            return
        for uuid in departed:
            self._known.pop(uuid, None)
            self._problems.pop(uuid, None)
            self._recovering.pop(uuid, None)
        self._unwatched -= departed

    def _describe(self, index: int) -> Gpu | None:
        nvml = self._nvml
        self._query(index)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            if index not in self._unaddressed:  # told once: a GPU off the bus stays so for days
                self._unaddressed.add(index)
                logger.warning("GPU cannot be addressed; left out", extra={"index": index,
                                                                           "error": str(exc)})
            return None
        if index in self._unaddressed:
            self._unaddressed.discard(index)
            logger.info("GPU can be addressed again", extra={"index": index, "uuid": uuid})
            self._recovering[uuid] = ("it could not be addressed", 0, None)
        self._watch(handle, uuid)
        product, memory_mib = self._known.get(uuid, ("", 0))
        try:
            product = _text(nvml.nvmlDeviceGetName(handle))
            memory_mib = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
            self._known[uuid] = (product, memory_mib)
        except pynvml.NVMLError as exc:
            why = f"name or memory query failed: {exc}"
        else:
            why = self._health_problem(handle) or self._sharing_problem(handle, uuid)
        self._note_hang()  # (this discovery's calls, or a scrape's or an audit's before it)
        self._busy_since, self._busy_gpu = time.monotonic(), None  # (noted once)
        late = index in self._answered_late
        self._answered_late.discard(index)
        if not why and late:
            # hung, then answered: Unhealthy as it was while hung (it recovers as any other)
            why = (f"its NVML calls hung for {HUNG_S:g} s or more, then answered (the GPU "
                   "fallen off the bus?)")
        why = self._xid_problems.get(uuid, "") or why
        was = self._problems.get(uuid, "")
        why, recovering = self._damped(uuid, why)
        if not recovering and why != was:
            # logged when it changes, not every round (nor every flap)
            if why:
                logger.warning("GPU unhealthy; nothing is placed on it",
                               extra={"index": index, "uuid": uuid, "reason": why})
            else:
                logger.info("GPU healthy again", extra={"index": index, "uuid": uuid,
                                                        "healthy_rounds": RECOVER_ROUNDS})
            self._problems[uuid] = why
        return Gpu(uuid=uuid, index=index, product=product, memory_mib=memory_mib,
                   health=UNHEALTHY if why else HEALTHY, problem=why)

    def _watch(self, handle: Any, uuid: str) -> None:
        """Register the GPU for critical XID events (once per initialisation of NVML). A driver
        or GPU that cannot report them is told once and not held against; another failure is
        tried again at the next discovery."""
        if self._xid_skip is None or self._no_events or uuid in self._unwatched \
                or uuid in self._watched.values():
            return
        nvml = self._nvml
        if self._events is None:
            try:
                self._events = nvml.nvmlEventSetCreate()
            except _NO_SUCH_QUERY as exc:
                self._no_events = True
                logger.info("the driver reports no XID events; GPUs are not checked for XID "
                            "errors", extra={"error": str(exc)})
                return
            except pynvml.NVMLError as exc:
                logger.debug("making NVML's event set failed; tried again next round",
                             extra={"error": str(exc)})
                return
        try:
            kinds = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not kinds & pynvml.nvmlEventTypeXidCriticalError:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError,
                                          self._events)
        except _NO_SUCH_QUERY as exc:
            self._unwatched.add(uuid)
            logger.info("GPU reports no XID events; not checked for XID errors",
                        extra={"uuid": uuid, "error": str(exc)})
            return
        except pynvml.NVMLError as exc:
            logger.debug("registering for XID events failed; tried again next round",
                         extra={"uuid": uuid, "error": str(exc)})
            return
        self._watched[_handle_key(handle)] = uuid

    def _read_xids(self) -> None:
        """Take the XID events waiting (never waiting for one: a timeout of 0 ms; as one call
        on no one GPU, judged hung as any other): a critical one, not skipped, makes its GPU
        Unhealthy for the agent's lifetime, as NVIDIA's device plugin (a GPU reset, which NVML
        does not show, or a reboot is needed; the agent's restart forgets it)."""
        if self._events is None:
            return
        nvml = self._nvml
        self._busy_since, self._busy_gpu = time.monotonic(), None
        for _ in range(XID_DRAIN_MAX):
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:  # none waiting
                break
            except (pynvml.NVMLError, *_NO_SUCH_QUERY) as exc:
                if str(exc) != self._wait_error:
                    logger.warning("reading XID events failed; tried again next round",
                                   extra={"error": str(exc)})
                self._wait_error = str(exc)
                return
            if not int(event.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(event.eventData)
            uuid = self._watched.get(_handle_key(event.device), "")
            if not uuid:  # a handle NVML gave in another form: its GPU's UUID
                try:
                    uuid = _text(nvml.nvmlDeviceGetUUID(event.device))
                except pynvml.NVMLError:
                    pass
            if (uuid, xid) in self._xids_told:
                continue
            self._xids_told.add((uuid, xid))
            name = XID_NAMES.get(xid)
            if not uuid:
                logger.warning("an XID error on a GPU that cannot be told; no GPU is marked",
                               extra={"xid": xid, "meaning": name or ""})
            elif self._xid_skip is not None and xid in self._xid_skip:
                logger.info("GPU reported an XID error that does not count against it",
                            extra={"uuid": uuid, "xid": xid})
            elif uuid not in self._xid_problems:  # told as the GPU's problem
                self._xid_problems[uuid] = (
                    f"critical XID {xid}{f' ({name})' if name else ''} reported: reset the GPU "
                    f"(nvidia-smi -i {uuid} -r) or reboot the node, then restart the agent's "
                    "pod on it")
            else:
                logger.warning("GPU reported another critical XID error",
                               extra={"uuid": uuid, "xid": xid, "meaning": name or ""})
        self._wait_error = ""

    def _damped(self, uuid: str, why: str) -> tuple[str, bool]:
        """The GPU's problem in this discovery, where ``why`` is what its queries found: a GPU
        that was Unhealthy stays so until it has passed :data:`RECOVER_ROUNDS` discoveries in a
        row, the last at least :attr:`recover_s` after the first; and whether it is recovering
        (passed, but not yet that many or for that long)."""
        if why:
            self._recovering[uuid] = (why, 0, None)
            return why, False
        if uuid not in self._recovering:
            return "", False
        had, passed, since = self._recovering[uuid]
        now = time.monotonic()
        since = now if since is None else since
        if passed + 1 >= RECOVER_ROUNDS and now - since >= self.recover_s:
            del self._recovering[uuid]
            return "", False
        self._recovering[uuid] = (had, passed + 1, since)
        wait = f" and for {self.recover_s:g} s" if self.recover_s > 0 else ""
        return (f"recovering: {had}; it passes its checks again, and is offered once it has "
                f"for {RECOVER_ROUNDS} rounds in a row{wait}"), True

    def _health_problem(self, handle: Any) -> str:
        nvml = self._nvml
        try:
            if int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == \
                    pynvml.NVML_FEATURE_ENABLED:
                return "retired pages pending (reset needed)"
        except _NO_SUCH_QUERY:
            pass
        except pynvml.NVMLError as exc:
            return f"retired-pages query failed: {exc}"
        try:
            _corr, _unc, _pending, failure = nvml.nvmlDeviceGetRemappedRows(handle)
            if failure:
                return "row remapping failed"
        except _NO_SUCH_QUERY:
            pass
        except pynvml.NVMLError as exc:
            return f"remapped-rows query failed: {exc}"
        return ""

    def _sharing_problem(self, handle: Any, uuid: str) -> str:
        """Why pods cannot share this GPU through gpuslice ("" when they can). A query the GPU
        or driver does not have means the mode it reads does not exist there. The commands it
        suggests name the GPU by UUID (NVML's index need not be nvidia-smi's on the host)."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            if int(current) == pynvml.NVML_DEVICE_MIG_ENABLE:
                return ("MIG mode is enabled: gpuslice shares whole GPUs; disable it "
                        f"(nvidia-smi -i {uuid} -mig 0, then reset the GPU)")
        except _NO_SUCH_QUERY:
            pass
        except pynvml.NVMLError as exc:
            return f"MIG mode query failed: {exc}"
        try:
            mode = int(nvml.nvmlDeviceGetComputeMode(handle))
        except _NO_SUCH_QUERY:
            return ""
        except pynvml.NVMLError as exc:
            return f"compute mode query failed: {exc}"
        names = {pynvml.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED (no process may use it)",
                 pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                     "EXCLUSIVE_PROCESS (one process at a time: without an MPS server the pods "
                     "reach, every pod sharing it after the first fails to create its CUDA "
                     "context)",
                 pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "EXCLUSIVE_THREAD (one thread)"}
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS and self._offer_exclusive_process:
            return ""
        if mode in names:
            why = f"compute mode is {names[mode]}: set it back with nvidia-smi -i {uuid} -c DEFAULT"
            if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                why += (", or, where the pods reach an MPS server through a mount of its pipe "
                        "directory, offer it (agent.offerExclusiveProcessGpus)")
            return why
        return ""

    def sample(self) -> list[GpuSample]:
        """Memory and utilisation of the last discovered GPUs (empty without NVML)."""
        with self._calling() as held:
            if not held:
                return [GpuSample(gpu, None, None, None) for gpu in self.last.gpus]
            if not self._initialised or not self._last.available:
                return []
            out = []
            for gpu in self._last.gpus:
                used = total = util = None
                self._query(gpu.index)
                try:
                    handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                except pynvml.NVMLError:
                    out.append(GpuSample(gpu, None, None, None))
                    continue
                try:
                    mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                    used, total = int(mem.used), int(mem.total)
                except pynvml.NVMLError:
                    pass
                try:
                    util = int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                except pynvml.NVMLError:
                    pass
                out.append(GpuSample(gpu, used, total, util))
            return out

    def processes(self) -> list[GpuProcesses]:
        """Per GPU of the last discovery: NVML's compute, graphics and MPS client processes (host
        pids) and the memory each holds (empty without NVML)."""
        with self._calling() as held:
            if not held:  # as lists that cannot be read
                return [GpuProcesses(gpu, None, None) for gpu in self.last.gpus]
            if not self._initialised or not self._last.available:
                return []
            return [self._processes_locked(gpu) for gpu in self._last.gpus]

    def _processes_locked(self, gpu: Gpu) -> GpuProcesses:
        nvml = self._nvml
        self._query(gpu.index)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            total: int | None = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError:
            return GpuProcesses(gpu, None, None)
        held: dict[int, int | None] = {}
        for kind, optional in (("Compute", False), ("Graphics", True), ("MPSCompute", True)):
            try:
                found = self._process_list(kind, handle)
            except pynvml.NVMLError:
                return GpuProcesses(gpu, total, None)
            if found is None:
                if optional:  # a board or driver without graphics or MPS lists
                    continue
                return GpuProcesses(gpu, total, None)
            for p in found:
                # one process in both lists reports its memory twice: keep the larger figure
                used = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
                before = held.get(int(p.pid))
                held[int(p.pid)] = used if before is None else max(before, used or 0)
        return GpuProcesses(gpu, total, held)

    def process_utilisation(self, since: Mapping[str, tuple[int, int]],
                            wall_us: int | None = None,
                            read_at: float | None = None) -> list[GpuUtilisation]:
        """Per GPU of the last discovery (empty without NVML): NVML's samples newer than
        ``since[uuid]`` = (per-process timestamp, device timestamp), µs, NVML's (0: all the
        driver keeps), and the processes listed now. Samples above 100 % are dropped, and so
        are those stamped past now (``wall_us``, read at ``time.monotonic()`` ``read_at``, plus
        the time since: a period may end during the queries): garbage some drivers return for exited processes
        is stamped far ahead, and one a driver's clock put a little ahead is taken by the first
        query after the wall clock reaches it (taken at once, it moved the next queries' start
        past the periods stamped meanwhile, which were lost)."""
        began = time.monotonic() if read_at is None or wall_us is None else read_at
        wall = int(time.time() * 1e6) if wall_us is None else wall_us
        with self._calling() as held:
            if not held or not self._initialised or not self._last.available:
                return []
            return [self._utilisation_locked(gpu, *since.get(gpu.uuid, (0, 0)),
                                             lambda: wall + int((time.monotonic() - began) * 1e6))
                    for gpu in self._last.gpus]

    def _utilisation_locked(self, gpu: Gpu, since: int, dev_since: int,
                            now: Callable[[], int]) -> GpuUtilisation:
        nvml = self._nvml
        self._query(gpu.index)
        failed = GpuUtilisation(gpu, None, since, None, dev_since)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        except pynvml.NVMLError:
            return failed
        # the device: one sample per driver period (idle ones too, on most drivers)
        device: float | None = None
        device_busy: float | None = None
        dev_newest = dev_since
        idle = False
        values: list[tuple[int, int]] = []
        try:
            kind, got = self._twice(nvml.nvmlDeviceGetSamples, handle,
                                    pynvml.NVML_GPU_UTILIZATION_SAMPLES, dev_since)
            if kind != pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                return failed
            values = sorted({int(x.timeStamp): int(x.sampleValue.uiVal) for x in got}.items())
        except pynvml.NVMLError_NotFound:
            idle = self._idle_now(handle)  # no period ended since then
        except _NO_SUCH_QUERY:  # no sample buffer: the utilisation of the last period, now
            try:
                device = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                return failed
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_SUCCESS:  # pynvml's NVMLError(0): none, success
                return failed
            idle = self._idle_now(handle)
        # the processes: a sample per process that ran in a period
        try:
            found = list(self._twice(nvml.nvmlDeviceGetProcessUtilization, handle, since))
        except pynvml.NVMLError_NotFound:
            found = []
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_SUCCESS:
                return failed
            found = []
        except _NO_SUCH_QUERY:
            return failed
        limit = now()  # after the queries: a period may have ended during them
        values = [(t, v) for t, v in values if dev_since < t <= limit + AHEAD_US and v <= 100]
        clock_us = values[-1][0] if values else 0
        ahead = clock_us > limit
        values = [(t, v) for t, v in values if t <= limit]
        if values:
            device_busy, spoken = busy_time(values, dev_since)
            device = 100 * device_busy / max(1.0, spoken)
            dev_newest = values[-1][0]
        samples = [(int(x.pid), int(x.timeStamp), int(x.smUtil)) for x in found]
        # old news some drivers repeat; garbage (over 100 %, stamped far ahead)
        samples = [x for x in samples if since < x[1] <= limit + AHEAD_US and x[2] <= 100]
        clock_us = max([clock_us, *(x[1] for x in samples)])
        samples = [x for x in samples if x[1] <= limit]  # stamped past now: not yet
        newest = max([since, *(x[1] for x in samples)])
        listed = self._processes_locked(gpu).processes or {}
        return GpuUtilisation(gpu, samples, newest, device, dev_newest, frozenset(listed), idle,
                              device_busy, ahead, clock_us)

    def _idle_now(self, handle: Any) -> bool:
        """The driver's last period read 0 % (nvmlDeviceGetUtilizationRates): nothing ran."""
        try:
            return int(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu) == 0
        except (pynvml.NVMLError, *_NO_SUCH_QUERY):
            return False

    @staticmethod
    def _twice(query: Any, *args: Any) -> Any:
        """pynvml sizes its buffer with a first call: a sample that came between the two calls
        makes the second one INSUFFICIENT_SIZE. Asked again once."""
        try:
            return query(*args)
        except pynvml.NVMLError_InsufficientSize:
            return query(*args)

    def _process_list(self, kind: str, handle: Any) -> list[Any] | None:
        """NVML's ``kind`` process list of a GPU, None if the driver has no such query (a failing
        one raises its NVMLError). pynvml's unversioned query asks for ``_v3``; drivers older
        than that symbol (R450 to about R510) have ``_v2``, with the same entries. An R535 or
        R545 driver fills ``_v3``'s list with 32-byte entries, which pynvml reads as 24-byte
        ones: it is read here (:meth:`_r535_list`)."""
        if self._r535_driver():
            try:
                found = self._r535_list(kind, handle)
            except _NO_SUCH_QUERY:  # a board without graphics processes, say
                return None
            if found is not None:
                return found
        names = [f"nvmlDeviceGet{kind}RunningProcesses", f"nvmlDeviceGet{kind}RunningProcesses_v2"]
        for name in names:
            query = getattr(self._nvml, name, None)
            if query is None:
                continue
            try:
                found = list(query(handle))
            except _NO_SUCH_QUERY:
                continue
            return found
        return None

    def _exports(self, symbol: str) -> bool | None:
        """The driver's NVML library has ``symbol`` (None: it cannot say now)."""
        lookup = getattr(self._nvml, "_nvmlGetFunctionPointer", None)
        if lookup is None:  # an NVML module without pynvml's lookup: its own calls are right
            return False
        try:
            lookup(symbol)
        except pynvml.NVMLError_FunctionNotFound:
            return False
        except pynvml.NVMLError:
            return None
        return True

    def _r535_driver(self) -> bool:
        """A driver of the R535 or R545 branch, whose ``_v3`` process lists hold 32-byte entries.
        Told by its exports, as nvitop does (no version string to parse): R535 brought
        ``nvmlDeviceGetConfComputeMemSizeInfo``, R550 ``nvmlDeviceGetRunningProcessDetailList``
        (and 24-byte ``_v3`` entries again). Asked once per initialisation."""
        if self._r535 is None:
            conf = self._exports("nvmlDeviceGetConfComputeMemSizeInfo")
            detail = self._exports("nvmlDeviceGetRunningProcessDetailList")
            if conf is None or detail is None:
                return False
            self._r535 = conf and not detail
            if self._r535:
                logger.info("NVML driver of the R535/R545 branch: its process lists are read "
                            "with their 32-byte entries")
        return self._r535

    def _r535_list(self, kind: str, handle: Any) -> list[Any] | None:
        """``_v3``'s ``kind`` list of an R535/R545 driver, read with its 32-byte entries (None
        without the symbol: the caller asks as for any driver). Sized by a first call as pynvml
        does; asked again once when processes came between the two calls (:meth:`_twice`)."""
        try:
            query = self._nvml._nvmlGetFunctionPointer(f"nvmlDeviceGet{kind}RunningProcesses_v3")
        except pynvml.NVMLError_FunctionNotFound:
            return None
        found: list[Any] = self._twice(self._read_r535, query, handle)
        return found

    @staticmethod
    def _read_r535(query: Any, handle: Any) -> list[Any]:
        count = ctypes.c_uint(0)
        rc = query(handle, ctypes.byref(count), None)
        if rc == pynvml.NVML_SUCCESS:
            return []
        if rc != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(rc)
        room = count.value * 2 + 5  # as pynvml: room for processes that start meanwhile
        entries = (ProcessInfoR535 * room)()
        count.value = room
        rc = query(handle, ctypes.byref(count), entries)
        if rc != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(rc)
        return [SimpleNamespace(
            pid=int(e.pid),
            usedGpuMemory=None if e.usedGpuMemory == _NOT_AVAILABLE else int(e.usedGpuMemory),
            gpuInstanceId=int(e.gpuInstanceId), computeInstanceId=int(e.computeInstanceId),
            usedGpuCcProtectedMemory=int(e.usedGpuCcProtectedMemory))
            for e in entries[:min(count.value, room)]]

    def _shutdown_locked(self) -> None:
        self._r535 = None
        events, self._events, self._no_events = self._events, None, False
        self._watched.clear()
        if self._initialised:
            if events is not None:
                try:
                    self._nvml.nvmlEventSetFree(events)
                except (pynvml.NVMLError, *_NO_SUCH_QUERY):
                    pass
            try:
                self._nvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
            self._initialised = False

    def close(self, timeout: float | None = None) -> bool:
        """Release NVML; False, leaving it as it is, when a call still holds it after
        ``timeout`` seconds (None: wait as long as it takes), e.g. one hung on a GPU that fell
        off the bus."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self._shutdown_locked()
        finally:
            self._lock.release()
        return True
