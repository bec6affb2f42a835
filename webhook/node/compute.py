"""The outside compute check's sampler: each container's share of each GPU's time, as NVML sees
its processes use it, over a sliding window.

The interposer paces a container's kernels to its ``CUDA_DEVICE_SM_LIMIT`` from inside, with
its clock in the container's region file, which the container can write; a program that never
loads the library is not paced at all. NVML's utilisation samples are measured by the driver,
out of the container's reach; each query asks for the samples newer than the last ones seen:

- the device's (``nvmlDeviceGetSamples``, GPU utilisation): one per driver sample period (1/6
  to 1 s), idle periods included: the share of the period any kernel ran;
- the processes' (``nvmlDeviceGetProcessUtilization``): one per process per period *in which
  it ran*, the share of the period its kernels ran; none for the periods it did not.

So the processes' samples alone cannot say how long a process was idle (a process paced to
30 % by running 0.9 s and waiting 2.1 s has one sample of 90 % in three periods); the device's
can. Every :data:`SAMPLE_INTERVAL` :meth:`ComputeSampler.poll` asks once per GPU. Each pid that
ran is placed into its container then (the auditor's cgroup read, while the process lives) and
its samples are added up. When the device has new periods, the time since the last *span*
becomes one: each container's share of it is the device's utilisation over those periods times
the container's part of all processes' samples (other containers', the host's, unplaced ones
included). A driver without the device's sample buffer gives the last period's utilisation
instead (``nvmlDeviceGetUtilizationRates``: a snapshot per poll, which a workload whose cycle
matches the poll's can alias). A failing query covers nothing and starts the GPU again (what
the driver kept meanwhile is not placed), and so does a GPU with no new period for
:data:`SILENCE` seconds. :meth:`ComputeSampler.snapshot` answers, per container and GPU, the
time-weighted share over the last ``window`` seconds and how much of the window the spans
cover; the auditor judges a share only over a window mostly covered (:data:`COVERED`).

The interposer keeps a container's share of the GPU's time at or under its limit over any
stretch longer than its debts (a kernel's time at ``100 / C`` per unit), and its clock
compensation only lowers it; the window (60 s by default) is long enough that one long kernel,
paid for afterwards, does not look like a breach.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from webhook.node.inventory import FUTURE_US, GpuUtilisation, Inventory

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL = 1.0
"""Seconds between NVML queries (the driver's sample period is 1/6 to 1 s)."""
SILENCE = 3.0
"""Seconds without a new device sample period after which the time is not covered (drivers end
a period every 1/6 to 1 s, busy or idle)."""
COVERED = 0.75
"""The part of the window the spans must cover before a share is judged."""

Key = tuple[str, str]
"""A container: (pod UID, container ID)."""


@dataclass(frozen=True)
class ComputeShare:
    """One container's share of one GPU's time over the window."""

    percent: float
    """Time-weighted share of the GPU (%, its processes summed) over the covered time."""
    covered: float
    """Seconds of the window the samples cover (the GPU's, not the container's)."""
    pids: tuple[int, ...]
    """Its processes that had samples in the window."""


@dataclass
class _Span:
    end: float
    length: float
    shares: dict[Key, float]
    pids: dict[Key, set[int]]


@dataclass
class _Track:
    since: int = 0
    """NVML timestamp (µs) of the newest per-process sample seen: the next query asks for
    newer ones."""
    dev_since: int = 0
    """Likewise for the device's samples."""
    last: float | None = None
    """When the covered time ends (the last span, or the start); None: not started, or started
    again (after a failure: what the driver kept meanwhile is not placed)."""
    weights: dict[Key, float] = field(default_factory=dict)
    """Per-process samples summed per container since ``last`` (a span closes when the device
    has a new period)."""
    total: float = 0.0
    """All processes' samples summed since ``last``, those of no container included."""
    pids: dict[Key, set[int]] = field(default_factory=dict)
    spans: deque[_Span] = field(default_factory=deque)

    def restart(self) -> None:
        self.last = None
        self.weights, self.total, self.pids = {}, 0.0, {}


class ComputeSampler:
    """Polls NVML's utilisation samples and keeps each GPU's spans over the window.

    ``place(pids)`` names the containers of processes that ran (a pid it leaves out: not a
    container's, gone or reused since the sample). :meth:`poll` runs in a worker thread,
    :meth:`snapshot` on the event loop: a lock keeps them apart.
    """

    def __init__(self, inventory: Inventory, place: Callable[[set[int]], dict[int, Key]],
                 window: float, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        if window <= 0:
            raise ValueError(f"the compute window must be positive: {window!r}")
        self._inventory = inventory
        self._place = place
        self.window = window
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self.failures = 0
        """Queries that failed (NVML errors, a GPU without the queries)."""
        self.unsupported: set[str] = set()
        """GPUs whose last query failed (logged once each time one starts failing)."""

    def poll(self) -> None:
        """One query per GPU: the processes' samples are placed into their containers and
        added up; when the device has new sample periods, the time since the last span becomes
        a span, each container's share of it the device's utilisation over those periods times
        the container's part of all processes' samples."""
        wall_us = int(self._wall() * 1e6)
        with self._lock:
            since = {}
            for uuid, t in self._tracks.items():
                if max(t.since, t.dev_since) > wall_us + FUTURE_US:  # the wall clock stepped back
                    t.since = t.dev_since = 0
                    t.restart()
                since[uuid] = (t.since, t.dev_since)
        found = self._inventory.process_utilisation(since, wall_us)
        now = self._clock()
        # placed now: a process that ran may end soon
        places = self._place({pid for u in found for pid in u.samples or ()})
        with self._lock:
            if not found:  # NVML unavailable: nothing to tell, nothing forgotten
                for track in self._tracks.values():
                    track.restart()
                return
            for gone in self._tracks.keys() - {u.gpu.uuid for u in found}:
                del self._tracks[gone]
            for u in found:
                track = self._tracks.setdefault(u.gpu.uuid, _Track())
                self._advance(track, u, places, now)

    def _advance(self, track: _Track, u: GpuUtilisation, places: dict[int, Key],
                 now: float) -> None:
        if u.samples is None:  # a query failed: this time is not covered, nor what comes next
            self.failures += 1
            if u.gpu.uuid not in self.unsupported:
                self.unsupported.add(u.gpu.uuid)
                logger.warning("NVML's utilisation samples cannot be read; the outside compute "
                               "check does not judge this GPU meanwhile", extra={
                                   "gpu": u.gpu.uuid})
            track.restart()
            return
        self.unsupported.discard(u.gpu.uuid)
        track.since, track.dev_since = u.newest, u.dev_newest
        if track.last is None:  # the first answer: what the driver kept is from before us
            track.last = now
            return
        for pid, weight in u.samples.items():
            track.total += weight
            key = places.get(pid)
            if key is not None:
                track.weights[key] = track.weights.get(key, 0.0) + weight
                track.pids.setdefault(key, set()).add(pid)
        if u.device is not None:
            part = u.device / track.total if track.total else 0.0
            track.spans.append(_Span(now, now - track.last,
                                     {k: w * part for k, w in track.weights.items()}, track.pids))
            track.last = now
            track.weights, track.total, track.pids = {}, 0.0, {}
        elif now - track.last >= SILENCE:  # no period ended for that long: no figure
            self.failures += 1
            track.restart()
            track.last = now
        while track.spans and track.spans[0].end <= now - self.window:
            track.spans.popleft()

    def snapshot(self) -> tuple[dict[tuple[str, str, str], ComputeShare], dict[str, float]]:
        """(pod UID, container ID, GPU UUID) -> the container's share of the GPU over the
        window, for every container that had a sample in it; and per GPU sampled, the seconds
        of the window its spans cover (both read at one time)."""
        now = self._clock()
        out: dict[tuple[str, str, str], ComputeShare] = {}
        coverage: dict[str, float] = {}
        with self._lock:
            for uuid, track in self._tracks.items():
                covered = coverage[uuid] = sum(self._overlap(s, now) for s in track.spans)
                if covered <= 0:
                    continue
                busy: dict[Key, float] = {}
                pids: dict[Key, set[int]] = {}
                for s in track.spans:
                    part = self._overlap(s, now)
                    for key, pct in s.shares.items():
                        busy[key] = busy.get(key, 0.0) + pct * part
                        pids.setdefault(key, set()).update(s.pids.get(key, ()))
                for key, total in busy.items():
                    out[(*key, uuid)] = ComputeShare(total / covered, covered,
                                                     tuple(sorted(pids[key])))
        return out, coverage

    def _overlap(self, span: _Span, now: float) -> float:
        start = max(span.end - span.length, now - self.window)
        return max(0.0, min(span.end, now) - start)
