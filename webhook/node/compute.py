"""The outside compute check's sampler: each container's share of each GPU's time, as NVML sees
its processes use it, over a sliding window.

The interposer paces a container's kernels to its ``CUDA_DEVICE_SM_LIMIT`` from inside, with
its clock in the container's region file, which the container can write; a program that never
loads the library is not paced at all. NVML's per-process utilisation
(``nvmlDeviceGetProcessUtilization``) is measured by the driver, out of the container's reach:
for each process that ran in a sample period (1/6 to 1 s), the share of the period its kernels
ran. Asked with the newest timestamp it returned before, it gives each process's share since
then.

Every :data:`SAMPLE_INTERVAL` :meth:`ComputeSampler.poll` asks once per GPU. New samples cover
the time since the last new ones (a *span*): each pid is placed into its container then (by the
auditor's cgroup read, while the process still lives), and the span records each container's
summed share. A GPU with no new sample for :data:`SILENCE` seconds ran nothing of anyone's (the
driver samples every second at most): that time is a span of zero shares. A failing query
covers nothing. :meth:`ComputeSampler.shares` answers, per container and GPU, the time-weighted
share over the last ``window`` seconds and how much of the window the spans cover; the auditor
judges a share only over a window mostly covered (:data:`COVERED`).

The interposer keeps a container's share of the GPU's time at or under its limit over any
stretch longer than its debts (a kernel's time at ``100 / C`` per unit), and its clock
compensation only lowers it; the window (60 s by default) is long enough that one long kernel,
paid for afterwards, does not look like a breach.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from webhook.node.inventory import Inventory

SAMPLE_INTERVAL = 1.0
"""Seconds between NVML queries (the driver's sample period is 1/6 to 1 s)."""
SILENCE = 3.0
"""Seconds without a new sample after which the GPU's time counts as idle for every process."""
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
    """NVML timestamp (µs) of the newest sample seen: the next query asks for newer ones."""
    last: float | None = None
    """When the covered time ends (the last new samples, silence or failure); None: not started."""
    spans: deque[_Span] = field(default_factory=deque)


class ComputeSampler:
    """Polls NVML's per-process utilisation and keeps each GPU's spans over the window.

    ``place(pids)`` names the containers of processes that ran (a pid it leaves out: not a
    container's, gone or reused since the sample). :meth:`poll` runs in a worker thread, :meth:`shares` on the event
    loop: a lock keeps them apart.
    """

    def __init__(self, inventory: Inventory, place: Callable[[set[int]], dict[int, Key]],
                 window: float,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        if window <= 0:
            raise ValueError(f"the compute window must be positive: {window!r}")
        self._inventory = inventory
        self._place = place
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self.failures = 0
        """Queries that failed (NVML errors, a GPU without the query)."""

    def poll(self) -> None:
        """One query per GPU; new samples become a span of each container's summed share."""
        with self._lock:
            since = {uuid: t.since for uuid, t in self._tracks.items()}
        found = self._inventory.process_utilisation(since)
        now = self._clock()
        # placed now: a process that ran may end soon
        places = self._place({pid for u in found for pid in u.samples or ()})
        spans: dict[str, _Span | None] = {}
        for u in found:
            if not u.samples:
                continue
            shares: dict[Key, float] = {}
            pids: dict[Key, set[int]] = {}
            for pid, pct in u.samples.items():
                key = places.get(pid)
                if key is not None:
                    shares[key] = min(100.0, shares.get(key, 0.0) + pct)
                    pids.setdefault(key, set()).add(pid)
            spans[u.gpu.uuid] = _Span(now, 0.0, shares, pids)
        with self._lock:
            for gone in self._tracks.keys() - {u.gpu.uuid for u in found}:
                del self._tracks[gone]
            for u in found:
                track = self._tracks.setdefault(u.gpu.uuid, _Track())
                self._advance(track, u.samples, u.newest, spans.get(u.gpu.uuid), now)

    def _advance(self, track: _Track, samples: dict[int, float] | None, newest: int,
                 span: _Span | None, now: float) -> None:
        if samples is None:  # the query failed: this time is not covered
            self.failures += 1
            track.last = now
        elif track.last is None:  # the first answer: what the driver kept is from before us
            track.since, track.last = newest, now
        elif span is not None:  # new samples: each process's share since the last ones
            span.length = now - track.last
            track.spans.append(span)
            track.since, track.last = newest, now
        elif now - track.last >= SILENCE:  # nobody ran
            track.spans.append(_Span(now, now - track.last, {}, {}))
            track.last = now
        while track.spans and track.spans[0].end <= now - self.window:
            track.spans.popleft()

    def coverage(self) -> dict[str, float]:
        """Per GPU sampled: seconds of the window its spans cover."""
        now = self._clock()
        with self._lock:
            return {uuid: sum(self._overlap(s, now) for s in t.spans)
                    for uuid, t in self._tracks.items()}

    def shares(self) -> dict[tuple[str, str, str], ComputeShare]:
        """(pod UID, container ID, GPU UUID) -> the container's share of the GPU over the
        window, for every container that had a sample in it."""
        now = self._clock()
        out: dict[tuple[str, str, str], ComputeShare] = {}
        with self._lock:
            for uuid, track in self._tracks.items():
                covered = sum(self._overlap(s, now) for s in track.spans)
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
        return out

    def _overlap(self, span: _Span, now: float) -> float:
        start = max(span.end - span.length, now - self.window)
        return max(0.0, min(span.end, now) - start)
