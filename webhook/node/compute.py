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
can. Every :data:`SAMPLE_INTERVAL` :meth:`ComputeSampler.poll` asks once per GPU (the
processes' samples from :data:`LATE_US` before the newest seen, each counted once: drivers stamp
each pid on its own schedule). Each pid that ran, and each that NVML lists, is placed into its
container then (the auditor's cgroup read, while the process lives; a process gone keeps its
place for its samples of its last periods; one that lives less than a poll may never be placed
and counts as no container's) and its samples are added up. When the device has new periods, the time since
the last *span* becomes one, with the device's utilisation over them and the samples added up
meanwhile. Over the window, a container's share is the device's utilisation over the covered
time times the container's part of all processes' samples (other containers', the host's,
unplaced ones included): one ratio for the window, not per span, since a process's sample of a
period may show up a poll before or after the device's. The device's utilisation over a span
is the time its new samples say it was busy (each speaks for the time since the one before, at
most a driver's longest period) over the span's: time no sample speaks for is idle (drivers
that give no sample for idle periods); a poll with no new period, no process sample and a last
period of 0 % (``nvmlDeviceGetUtilizationRates``) is idle time too. A GPU busy with no process
sample to split its time by, or with too few to account for its busy time (:data:`EXPLAINED`),
is not judged. A driver without the device's sample
buffer gives the last period's utilisation instead (``nvmlDeviceGetUtilizationRates``: a
snapshot per poll, which a workload whose cycle matches the poll's can alias). A failing query
covers nothing and starts the GPU again (what the driver kept meanwhile is not placed), and so
does a GPU with no new period for :data:`SILENCE` seconds (logged), unless its periods are
stamped ahead of the wall clock (a driver's clock up to ``inventory.AHEAD_US`` ahead: they are
taken when the wall clock reaches them, and a process seen alive is so by the driver's clock).
:meth:`ComputeSampler.snapshot` answers, per container and GPU, the share over the last ``window`` seconds and how much of the
window the spans cover; the auditor judges a share only over a window mostly covered
(:data:`COVERED`).

What this rests on, not yet measured on a real driver: that a process's samples weigh its time
(one per period it ran in, as NVML's documentation says; a driver that gives one sample per
process per query, its mean over the periods it ran in, weighs a process that ran one period
in six as much as one that ran all six, when both ran); that ``smUtil`` is a share of time, not
of SMs. Alone on a GPU a container reads the device's utilisation whatever the per-process
semantics. ``scripts/gpu-check.sh`` records both streams raw.

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

from webhook.node.inventory import GpuUtilisation, Inventory

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL = 1.0
"""Seconds between NVML queries (the driver's sample period is 1/6 to 1 s)."""
SILENCE = 3.0
"""Seconds without a new device sample period after which the time is not covered (drivers end
a period every 1/6 to 1 s, busy or idle)."""
COVERED = 0.75
"""The part of the window the spans must cover before a share is judged."""
EXPLAINED = 0.5
"""The part of the device's utilisation the processes' samples must account for (their sum per
poll, over the window) before the time is split by them: else the busy time of processes
without samples would go to whichever had a few (a container with samples of 5 % read 100 %
on a GPU kept busy by something NVML gives no samples of)."""

STEP_US = 1_000_000
"""A wall clock behind the last poll's by more than this (µs) stepped back; so did one behind
the newest sample taken (none is taken stamped past the wall clock) by more than this."""
LATE_US = 2_000_000
"""How far before the newest per-process sample seen each query asks (µs): drivers stamp each
pid's samples on its own schedule, so one can show up after a newer one of another pid's."""

Key = tuple[str, str]
"""A container: (pod UID, container ID)."""


@dataclass(frozen=True)
class Handover:
    """A pid that changed hands since it was last placed: its samples stamped at or before
    ``until`` (NVML's µs) are the earlier holder's (``before``), later ones the holder's now
    (``after``); None: no container's."""

    until: int
    before: Key | None
    after: Key | None

    def at(self, stamp: int) -> Key | None:
        return self.before if stamp <= self.until else self.after


@dataclass(frozen=True)
class ComputeShare:
    """One container's share of one GPU's time over the window."""

    percent: float
    """The GPU's utilisation over the covered time times the container's part of all the
    processes' samples in it (%, its processes together)."""
    covered: float
    """Seconds of the window the samples cover (the GPU's, not the container's)."""
    pids: tuple[int, ...]
    """Its processes that had samples in the window."""


@dataclass
class _Span:
    end: float
    length: float
    busy: float
    """The device's utilisation over the span's periods (%)."""
    weights: dict[Key, float]
    """Each container's processes' samples in the span, summed."""
    total: float
    """All processes' samples in the span, summed (those of no container included)."""
    pids: dict[Key, set[int]]
    polls: int
    """The polls whose samples the span holds."""


@dataclass
class _Track:
    since: int = 0
    """NVML timestamp (µs) of the newest per-process sample seen."""
    dev_since: int = 0
    """Likewise for the device's samples: the next query asks for newer ones."""
    seen: set[tuple[int, int]] = field(default_factory=set)
    """(pid, timestamp) of the per-process samples of the last :data:`LATE_US`: a query asks
    that far back (a pid's sample can show up after a newer one of another pid's)."""
    last: float | None = None
    """When the covered time ends (the last span, or the start); None: not started, or started
    again (after a failure: what the driver kept meanwhile is not placed)."""
    weights: dict[Key, float] = field(default_factory=dict)
    total: float = 0.0
    pids: dict[Key, set[int]] = field(default_factory=dict)
    polls: int = 0
    spans: deque[_Span] = field(default_factory=deque)
    silent: bool = False
    """The device gave no period for :data:`SILENCE` seconds (logged once until it does)."""

    def restart(self) -> None:
        self.last = None
        self.weights, self.total, self.pids, self.polls = {}, 0.0, {}, 0


class ComputeSampler:
    """Polls NVML's utilisation samples and keeps each GPU's spans over the window.

    ``place(stamps, listed, wall_us)`` names the containers of the processes given (pid -> its
    newest sample's timestamp, 0 for one only listed); a pid it leaves out is not a
    container's, or was reused since ``listed`` (boot ticks taken before the query); a pid
    that changed hands meanwhile is a :class:`Handover` (its samples placed by their stamps).
    :meth:`poll` runs in a worker thread, :meth:`snapshot` on the event loop: a lock keeps them
    apart.
    """

    def __init__(self, inventory: Inventory,
                 place: Callable[[dict[int, int], int, int], dict[int, Key | Handover]],
                 window: float, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 boot_clock: Callable[[], int] = lambda: 1 << 62) -> None:
        if window <= 0:
            raise ValueError(f"the compute window must be positive: {window!r}")
        self._inventory = inventory
        self._place = place
        self.window = window
        self._clock = clock
        self._wall = wall
        self._boot_clock = boot_clock
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._last_wall = 0
        self.failures = 0
        """Queries that failed (NVML errors, a GPU without the queries, no sample period)."""
        self.unsupported: set[str] = set()
        """GPUs whose last query failed (logged once each time one starts failing), of those
        sampled: a GPU gone from the discoveries is forgotten with its samples."""

    def poll(self) -> None:
        """One query per GPU: the processes' samples (and the processes NVML lists) are placed
        into their containers and added up; when the device has new sample periods, the time
        since the last span becomes one."""
        wall_us, read_at = int(self._wall() * 1e6), time.monotonic()
        stepped = wall_us < self._last_wall - STEP_US
        self._last_wall = wall_us
        with self._lock:
            since = {}
            for uuid, t in self._tracks.items():
                # the wall clock (NVML's stamps) stepped back: start again from what it keeps
                if stepped or max(t.since, t.dev_since) > wall_us + STEP_US:
                    t.since = t.dev_since = 0
                    t.seen = set()
                    t.restart()
                since[uuid] = (max(0, t.since - LATE_US), t.dev_since)
        listed = self._boot_clock()
        found = self._inventory.process_utilisation(since, wall_us, read_at)
        now = self._clock()
        # placed now, and the listed ones while they live: a process that ran may end soon
        stamps: dict[int, int] = {}
        for u in found:
            for pid, stamp, _pct in u.samples or ():
                stamps[pid] = max(stamps.get(pid, 0), stamp)
            for pid in u.running:
                stamps.setdefault(pid, 0)
        # now by the driver's clock, which may be ahead of ours: a process alive now was alive
        # at the stamps its samples waiting to be taken will have (placed by that, later)
        places = self._place(stamps, listed, max([wall_us, *(u.clock_us for u in found)]))
        with self._lock:
            if not found:  # NVML unavailable: nothing to tell, nothing forgotten
                for track in self._tracks.values():
                    track.restart()
                return
            for gone in self._tracks.keys() - {u.gpu.uuid for u in found}:
                del self._tracks[gone]
                self.unsupported.discard(gone)  # (one back that still fails is told again)
            for u in found:
                track = self._tracks.setdefault(u.gpu.uuid, _Track())
                self._advance(track, u, places, now)

    def _advance(self, track: _Track, u: GpuUtilisation, places: dict[int, Key | Handover],
                 now: float) -> None:
        if u.samples is None:  # a query failed: this time is not covered, nor what comes next
            self.failures += 1
            self._warn(u.gpu.uuid, "NVML's utilisation samples cannot be read")
            track.restart()
            return
        self.unsupported.discard(u.gpu.uuid)
        fresh = [x for x in {(x[0], x[1]): x for x in u.samples}.values()
                 if (x[0], x[1]) not in track.seen]
        track.since, track.dev_since = max(track.since, u.newest), u.dev_newest
        track.seen = {(p, t) for p, t in track.seen | {(x[0], x[1]) for x in fresh}
                      if t > track.since - LATE_US}
        if track.last is None:  # the first answer: what the driver kept is from before us
            track.last = now
            return
        track.polls += 1
        for pid, stamp, pct in fresh:
            track.total += pct
            place = places.get(pid)
            key = place.at(stamp) if isinstance(place, Handover) else place
            if key is not None:
                track.weights[key] = track.weights.get(key, 0.0) + pct
                track.pids.setdefault(key, set()).add(pid)
        device = u.device
        if u.device_busy_us is not None and now > track.last:
            # the time the samples say it was busy, over the poll's: time no sample speaks for
            # (a driver that gives none for idle periods) is idle, not at the busy ones' mean
            device = u.device_busy_us / 1e4 / (now - track.last)
        if device is None and u.idle and not fresh and not track.total:
            # no period ended, no process ran, the driver's last period read 0 %: idle time,
            # covered (drivers that give no device sample for idle periods made an idle GPU a
            # silence, never judged, and a failure every few seconds)
            device = 0.0
        if device is not None and now > track.last:
            track.spans.append(_Span(now, now - track.last, device, track.weights, track.total,
                                     track.pids, track.polls))
            track.last = now
            track.weights, track.total, track.pids, track.polls = {}, 0.0, {}, 0
            track.silent = False
        elif now - track.last >= SILENCE and not u.ahead:  # no period ended for that long
            self.failures += 1
            if not track.silent:
                track.silent = True
                logger.warning("NVML gives no utilisation sample period for this GPU; the "
                               "outside compute check does not judge it meanwhile",
                               extra={"gpu": u.gpu.uuid, "seconds": SILENCE})
            track.restart()
            track.last = now
        while track.spans and track.spans[0].end <= now - self.window:
            track.spans.popleft()

    def _warn(self, uuid: str, what: str) -> None:
        if uuid not in self.unsupported:
            self.unsupported.add(uuid)
            logger.warning(f"{what}; the outside compute check does not judge this GPU "
                           "meanwhile", extra={"gpu": uuid})

    def snapshot(self) -> tuple[dict[tuple[str, str, str], ComputeShare], dict[str, float],
                                dict[str, float]]:
        """Read at one time: (pod UID, container ID, GPU UUID) -> the container's share of the
        GPU over the window, for every container that had a sample in it; per GPU sampled, the
        seconds of the window its spans cover; and per GPU, the share of processes placed in no
        container (other pods' not yet known, the host's, processes gone before placed).

        A container's share is the GPU's utilisation over the covered time times the
        container's part of all processes' samples over the window (one ratio for the window,
        not per span: a process's sample may come a poll before or after the device's sample of
        the same period)."""
        now = self._clock()
        out: dict[tuple[str, str, str], ComputeShare] = {}
        coverage: dict[str, float] = {}
        unplaced: dict[str, float] = {}
        with self._lock:
            for uuid, track in self._tracks.items():
                covered = busy = total = polls = 0.0
                weights: dict[Key, float] = {}
                pids: dict[Key, set[int]] = {}
                for s in track.spans:
                    part = self._overlap(s, now)
                    if part <= 0:
                        continue
                    frac = part / s.length if s.length > 0 else 1.0
                    covered += part
                    busy += s.busy * part
                    total += s.total * frac
                    polls += s.polls * frac
                    for key, w in s.weights.items():
                        weights[key] = weights.get(key, 0.0) + w * frac
                        pids.setdefault(key, set()).update(s.pids.get(key, ()))
                coverage[uuid] = covered
                if covered <= 0:
                    continue
                # a poll's samples may hold a little more than its time (periods end on the
                # driver's schedule), the next one's less: the window evens them out
                util = min(100.0, busy / covered)
                # no process's sample to split the time by (or all read 0 %), or too few to
                # account for the busy time: busy, but whose is not known, not judged
                if util > 0 and (total <= 0 or total < EXPLAINED * util * max(polls, 1.0)):
                    unplaced[uuid] = util
                    coverage[uuid] = 0.0
                    continue
                if total <= 0:
                    unplaced[uuid] = util
                    total = 1.0  # idle: every container's share is 0
                unplaced[uuid] = max(0.0, util * (1 - sum(weights.values()) / total))
                for key, w in weights.items():
                    out[(*key, uuid)] = ComputeShare(util * w / total, covered,
                                                     tuple(sorted(pids[key])))
        return out, coverage, unplaced

    def _overlap(self, span: _Span, now: float) -> float:
        start = max(span.end - span.length, now - self.window)
        return max(0.0, min(span.end, now) - start)
