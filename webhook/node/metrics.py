"""The agent's Prometheus metrics: per GPU from NVML, per container from the region files.

A custom collector on its own registry computes everything at scrape time (no background
polling): it samples NVML through the :class:`~webhook.node.inventory.Inventory` and reads
every ``<host-state-dir>/<pod-uid>/<container>/region`` with
:func:`webhook.node.region.read_region`. A corrupt or truncated region file is skipped,
counted in ``gpuslice_region_errors_total`` and logged once until it reads cleanly again; one
being initialised (empty, or its magic not written yet) is skipped as one not there yet.

Per container and device (labels ``namespace``, ``pod``, ``pod_uid``, ``container``, ``uuid``;
the pod UID and container are the state dir's names, which the container cannot choose; the
namespace and pod name are the API server's for that UID, from the agent's last list of the
node's pods, and the region's, which the container's processes write, only for a pod not listed
yet and only where the region's pod UID and container are the dir's): memory used (the
region's sum less what slots of processes found dead hold: one killed, or ended without its
exit handlers, stays in the region until a process of its container next starts;
:mod:`webhook.node.liveness`) and limit, compute limit (%), the busy-time counter the
interposer keeps, and the measured compute share (% of the GPU's time over the interval since
the previous scrape; absent on the first scrape of a region). From the outside checks
(:mod:`webhook.node.audit`, their last result): per container and device, the memory NVML sees
its processes hold and whether that is over its cap; per container under a compute limit and
device, its share of the device's time over the compute window as NVML sees it and whether
that is over its limit; per GPU, what processes of no gpuslice container hold and the share of
its time they used. The scrape runs in a worker thread so a slow NVML call cannot stall the
agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from webhook import __version__
from webhook.node.audit import Auditor, AuditReport
from webhook.node.cleanup import last_change
from webhook.node.inventory import Inventory
from webhook.node.liveness import Liveness
from webhook.node.region import ProcessUsage, Region, RegionError, RegionNotReady, read_region

logger = logging.getLogger(__name__)

REGION_NAME = "region"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_GPU_LABELS = ["uuid", "index", "product"]
_CTR_LABELS = ["namespace", "pod", "pod_uid", "container", "uuid"]


@dataclass
class AgentStatus:
    """Facts the agent's loop records for the metrics (written by one task, read by scrapes)."""

    library: str = ""
    """The library ld.so.preload names after the last install; "" once an install failed."""
    install_errors: int = 0
    publish_errors: int = 0
    last_publish_success: float = 0.0
    cleanup_removed: int = 0
    libraries_removed: int = 0
    old_libraries: int = 0
    """Old library versions the last clean-up left on the host (in use, or not judged)."""
    library_cleanup_blocked: bool = False
    """The last clean-up could judge no old library (a process it could not inspect...)."""
    last_audit: float = 0.0


LISTED_MARGIN_S = 60.0
"""A pod dir unchanged for this long before a list of the node's pods began, and not in it, is
a departed pod's (the list, from the watch cache, may lag the kubelet's start of a pod)."""


def _labels(region: Region, region_path: Path, pod_names: Mapping[str, tuple[str, str]],
            departed: bool) -> tuple[str, str, str, str]:
    """namespace, pod, pod UID, container. The UID and container are the dirs' (kubelet makes
    them for the container's mount), the names the API server's (``pod_names``: UID →
    namespace, name). Every process of the container can write the region, and could claim
    another pod's names there: they stand in only for a pod not listed yet whose region's
    identity is the dirs'; not for a ``departed`` one, whose dir stays until the clean-up (a
    StatefulSet's pod made again under a new UID was exported twice under its name for those
    minutes, `test_metrics.py -k departed`)."""
    uid, ctr = region_path.parent.parent.name, region_path.parent.name
    listed = pod_names.get(uid)
    if listed is not None:
        return listed[0], listed[1], uid, ctr
    if not departed and region.pod_uid == uid and region.container == ctr:
        return region.namespace, region.pod_name or uid, uid, ctr
    return "", uid, uid, ctr


class AgentCollector(Collector):
    """Collects the node's GPU and container metrics at scrape time."""

    def __init__(self, inventory: Inventory, state_dir: str | Path, status: AgentStatus,
                 clock: Callable[[], float] = time.monotonic, *,
                 auditor: Auditor | None = None, proc_root: str | Path = "/proc") -> None:
        self._inventory = inventory
        self._liveness = Liveness(proc_root)
        self._auditor = auditor
        self._state_dir = Path(state_dir)
        self._status = status
        self._clock = clock
        self._lock = threading.Lock()
        self._region_errors = 0
        self._bad_files: set[Path] = set()
        self._busy: dict[tuple[Path, str, int], tuple[int, float]] = {}
        self.pod_names: Mapping[str, tuple[str, str]] = {}
        """Pod UID → (namespace, name) of the pods on the node, as the API server last listed
        them (the agent's round replaces it whole)."""
        self.pod_names_at = 0.0
        """Wall-clock time that list began (0: none yet)."""

    @property
    def region_errors(self) -> int:
        return self._region_errors

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._collect_gpus()
            yield from self._collect_containers()
            yield from self._collect_audit()
            yield from self._collect_agent()

    def _collect_gpus(self) -> Iterator[Metric]:
        discovery = self._inventory.last
        up = GaugeMetricFamily("gpuslice_nvml_available",
                               "1 when NVML works on this node, 0 without driver or library")
        up.add_metric([], 1 if discovery.available else 0)
        yield up
        yield GaugeMetricFamily("gpuslice_nvml_hung",
                                "1 while an NVML call has run for inventory.HUNG_S or more (a "
                                "GPU fallen off the bus?): the GPU it queries is published "
                                "Unhealthy", value=1 if self._inventory.hung() is not None else 0)
        healthy = GaugeMetricFamily("gpuslice_gpu_healthy", "1 healthy, 0 unhealthy",
                                    labels=_GPU_LABELS)
        used = GaugeMetricFamily("gpuslice_gpu_memory_used_bytes",
                                 "GPU memory in use (all processes)", labels=_GPU_LABELS)
        total = GaugeMetricFamily("gpuslice_gpu_memory_total_bytes", "GPU memory size",
                                  labels=_GPU_LABELS)
        util = GaugeMetricFamily("gpuslice_gpu_utilization_percent",
                                 "GPU utilisation over NVML's last sample period",
                                 labels=_GPU_LABELS)
        reason = GaugeMetricFamily("gpuslice_gpu_unhealthy_reason",
                                   "1 for an unhealthy GPU, with why nothing is placed on it",
                                   labels=[*_GPU_LABELS, "reason"])
        for s in self._inventory.sample():
            lab = [s.gpu.uuid, str(s.gpu.index), s.gpu.product]
            healthy.add_metric(lab, 1 if s.gpu.healthy else 0)
            if not s.gpu.healthy:
                reason.add_metric([*lab, s.gpu.problem or "unknown"], 1)
            if s.memory_used_bytes is not None:
                used.add_metric(lab, s.memory_used_bytes)
            if s.memory_total_bytes is not None:
                total.add_metric(lab, s.memory_total_bytes)
            if s.utilization_percent is not None:
                util.add_metric(lab, s.utilization_percent)
        yield from (healthy, reason, used, total, util)

    def _departed(self, region_path: Path) -> bool:
        """Whether the region's pod is not in the last list and its dir was unchanged well
        before that list began (its pod gone; the dir waits for the clean-up's grace)."""
        pod_dir = region_path.parent.parent
        if not self.pod_names_at or pod_dir.name in self.pod_names:
            return False
        try:
            return last_change(pod_dir) < self.pod_names_at - LISTED_MARGIN_S
        except OSError:
            return False

    def _region_paths(self) -> list[Path]:
        try:
            return sorted(p for p in self._state_dir.glob(f"*/*/{REGION_NAME}") if p.is_file())
        except OSError:
            return []

    def _read(self, path: Path) -> Region | None:
        try:
            region = read_region(path)
        except (RegionError, OSError) as exc:
            if isinstance(exc, FileNotFoundError) or isinstance(exc.__cause__, FileNotFoundError):
                return None  # the container or pod went away between listing and reading
            if isinstance(exc, RegionNotReady):
                return None  # its first process is creating it: as a region not there yet
            self._region_errors += 1
            if path not in self._bad_files:
                self._bad_files.add(path)
                logger.warning("unreadable region file skipped",
                               extra={"path": str(path), "error": str(exc)})
            return None
        self._bad_files.discard(path)
        return region

    @staticmethod
    def _confirmed(path: Path, region: Region,
                   found: list[ProcessUsage]) -> list[tuple[int, ...]]:
        """The usage of the slots ``found`` dead that a second read, after the verdict, shows
        unchanged: as the library's sweep reclaims a slot only if it still holds the identity
        it found dead. The first read takes no lock and the library writes a slot's fields with
        relaxed stores: a slot being registered may read live with the new process's pid and
        charge beside the identity of the dead one before it (aarch64), which is gone; a dead
        process's slot stays as it is until swept. A slot that changed, or a second read that
        fails, counts as alive (a figure may show memory nobody holds, never hide memory held)."""
        if not found:
            return []
        try:
            again = read_region(path)
        except (RegionError, OSError):
            return []
        if again.inode != region.inode:
            return []
        still = set(again.processes)
        return [p.used_bytes for p in found if p in still]

    def _collect_containers(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("gpuslice_container_memory_used_bytes",
                                 "GPU memory the container's processes hold on the device",
                                 labels=_CTR_LABELS)
        limit = GaugeMetricFamily("gpuslice_container_memory_limit_bytes",
                                  "the container's GPU memory cap on the device (0 = no cap)",
                                  labels=_CTR_LABELS)
        sm = GaugeMetricFamily("gpuslice_container_compute_limit_percent",
                               "the container's compute cap on the device (100 = none)",
                               labels=_CTR_LABELS)
        busy = CounterMetricFamily("gpuslice_container_busy_seconds",
                                   "time the container kept the device busy",
                                   labels=_CTR_LABELS)
        share = GaugeMetricFamily("gpuslice_container_compute_share_percent",
                                  "measured share of the device's time since the last scrape",
                                  labels=_CTR_LABELS)
        scale = GaugeMetricFamily("gpuslice_container_compute_clock_scale",
                                  "clock compensation of the compute limit: GPU time is charged "
                                  "this many times over (1 = plain time share)",
                                  labels=_CTR_LABELS)
        now = self._clock()
        seen: set[tuple[Path, str, int]] = set()
        # Every process of a container can write its region, UUIDs included: rows naming a GPU
        # this node does not have are not exported (a container writing new ones at each scrape
        # made 8,000 series in 100 scrapes).  Without a discovery there is nothing to hold them to.
        discovery = self._inventory.last
        node_gpus = {g.uuid for g in discovery.gpus} if discovery.available else None
        paths = self._region_paths()
        self._liveness.begin()
        for path in paths:
            region = self._read(path)
            if region is None:
                continue
            ns, pod, uid, ctr = _labels(region, path, self.pod_names, self._departed(path))
            # the usage of processes that died without their exit handlers, which the
            # container's own processes reclaim only when one of them next starts (or never)
            dead = self._confirmed(path, region, [
                p for p in region.processes
                if any(p.used_bytes) and not self._liveness.alive(p, region.inode)])
            exported: set[str] = set()
            for d, dev in enumerate(region.devices):
                if not dev.uuid or node_gpus is not None and dev.uuid not in node_gpus:
                    continue
                # the library keeps one slot per GPU; a second slot naming it (written by the
                # container's processes) would repeat the series, which Prometheus drops
                if dev.uuid in exported:
                    continue
                exported.add(dev.uuid)
                lab = [ns, pod, uid, ctr, dev.uuid]
                gone = sum(u[d] for u in dead if d < len(u))
                used.add_metric(lab, max(0, dev.used_bytes - gone))
                limit.add_metric(lab, dev.limit_bytes)
                sm.add_metric(lab, dev.sm_limit if 0 < dev.sm_limit <= 100 else 100)
                busy.add_metric(lab, dev.busy_ns / 1e9)
                if 0 < dev.sm_limit < 100:
                    scale.add_metric(lab, dev.sm_scale_milli / 1000 if dev.sm_scale_milli else 1.0)
                # the file's inode too: a region replaced at its path (an older library's file
                # unlinked, or the tenant's rm) starts a new counter, and the two made no rate
                # (80 % for 90 % busy, `test_metrics.py -k replaced_region`)
                key = (path, dev.uuid, region.inode)
                seen.add(key)
                prev = self._busy.get(key)
                self._busy[key] = (dev.busy_ns, now)
                if prev is not None and now > prev[1] and dev.busy_ns >= prev[0]:
                    pct = (dev.busy_ns - prev[0]) / 1e9 / (now - prev[1]) * 100.0
                    share.add_metric(lab, min(pct, 100.0))
        self._liveness.end()
        for key in list(self._busy):
            if key not in seen:
                del self._busy[key]
        live = set(paths)
        self._bad_files &= live
        errors = CounterMetricFamily("gpuslice_region_errors",
                                     "region files that could not be read (corrupt, truncated)")
        errors.add_metric([], self._region_errors)
        yield from (used, limit, sm, busy, share, scale, errors)

    def _collect_audit(self) -> Iterator[Metric]:
        auditor = self._auditor
        if auditor is None:
            return
        # one report for the whole scrape: a check run on the event loop meanwhile replaces
        # auditor.last, and figures of two checks side by side (a container's compute share from
        # one, its memory or the GPU's unattributed share from the next) describe neither
        report = auditor.last
        seen = GaugeMetricFamily("gpuslice_container_memory_observed_bytes",
                                 "GPU memory the container's processes hold on the device as "
                                 "NVML sees them (the outside check)", labels=_CTR_LABELS)
        over = GaugeMetricFamily("gpuslice_container_memory_over_limit",
                                 "1 when the outside check saw the container hold more than its "
                                 "cap (plus the tolerance) on the device", labels=_CTR_LABELS)
        # one series per label set: a container restarted while a process of its old instance
        # still holds memory has two IDs under one name
        by_label: dict[tuple[str, str, str, str, str], tuple[int, bool]] = {}
        for h in report.holdings:
            t = h.tracked
            key = (t.namespace, t.pod, t.pod_uid, t.container, h.uuid)
            size, was_over = by_label.get(key, (0, False))
            by_label[key] = (size + h.used_bytes, was_over or h.over(auditor.tolerance))
        for key, (size, is_over) in by_label.items():
            seen.add_metric(list(key), size)
            over.add_metric(list(key), 1 if is_over else 0)
        other = GaugeMetricFamily("gpuslice_gpu_memory_unattributed_bytes",
                                  "GPU memory held by processes of no gpuslice container (other "
                                  "pods, the host)", labels=["uuid"])
        for uuid, size in sorted(report.unattributed.items()):
            other.add_metric([uuid], size)
        yield from (seen, over, other)
        yield from self._collect_loads(auditor, report)
        yield GaugeMetricFamily("gpuslice_agent_audit_complete",
                                "1 when the last outside check placed and measured every GPU "
                                "process (0 also while an agent outside the host's PID namespace "
                                "has seen NVML list no process)",
                                value=1 if report.complete else 0)
        yield GaugeMetricFamily("gpuslice_agent_last_audit_timestamp_seconds",
                                "Unix time of the last outside check (0 = never)",
                                value=self._status.last_audit)
        yield CounterMetricFamily("gpuslice_agent_audit_errors",
                                  "outside checks, Events or evictions that failed",
                                  value=auditor.errors)
        yield CounterMetricFamily("gpuslice_agent_over_limit_events",
                                  "containers found over their memory cap or compute limit (one "
                                  "per episode)",
                                  value=auditor.episodes)
        yield CounterMetricFamily("gpuslice_agent_evictions",
                                  "pods evicted for a container over its cap or compute limit",
                                  value=auditor.evictions)

    @staticmethod
    def _collect_loads(auditor: Auditor, report: AuditReport) -> Iterator[Metric]:
        if auditor.compute is None:
            return
        seen = GaugeMetricFamily("gpuslice_container_compute_observed_percent",
                                 "the container's share of the device's time over the compute "
                                 "window as NVML sees its processes use it (the outside check)",
                                 labels=_CTR_LABELS)
        over = GaugeMetricFamily("gpuslice_container_compute_over_limit",
                                 "1 when the outside check saw the container use more of the "
                                 "device's time than its compute limit (plus the tolerance)",
                                 labels=_CTR_LABELS)
        judged = GaugeMetricFamily("gpuslice_container_compute_judged",
                                   "1 when NVML's samples cover enough of the compute window for "
                                   "the observed share to be judged (0: a figure, no verdict)",
                                   labels=_CTR_LABELS)
        by_label: dict[tuple[str, str, str, str, str], tuple[float, bool, bool]] = {}
        for c in report.loads:
            t = c.tracked
            key = (t.namespace, t.pod, t.pod_uid, t.container, c.uuid)
            pct, was_over, was_judged = by_label.get(key, (0.0, False, False))
            by_label[key] = (pct + c.percent, was_over or c.over(auditor.compute_tolerance),
                             was_judged or c.judged)
        for key, (pct, is_over, is_judged) in by_label.items():
            seen.add_metric(list(key), round(pct, 2))
            over.add_metric(list(key), 1 if is_over else 0)
            judged.add_metric(list(key), 1 if is_judged else 0)
        other = GaugeMetricFamily("gpuslice_gpu_compute_unattributed_percent",
                                  "share of the device's time over the compute window used by "
                                  "processes of no gpuslice container (other pods, the host, "
                                  "processes gone before they were placed)", labels=["uuid"])
        for uuid, pct in sorted(report.compute_unattributed.items()):
            other.add_metric([uuid], round(pct, 2))
        yield from (seen, over, judged, other)
        yield CounterMetricFamily("gpuslice_agent_compute_sample_errors",
                                  "NVML per-process utilisation queries that failed",
                                  value=auditor.compute.failures)

    def _collect_agent(self) -> Iterator[Metric]:
        st = self._status
        info = GaugeMetricFamily("gpuslice_agent_info", "agent version and installed library",
                                 labels=["version", "library"])
        info.add_metric([__version__, st.library], 1)
        yield info
        yield CounterMetricFamily("gpuslice_agent_install_errors",
                                  "failed attempts to install the library and ld.so.preload",
                                  value=st.install_errors)
        yield CounterMetricFamily("gpuslice_agent_publish_errors",
                                  "failed attempts to publish the node's GPUs",
                                  value=st.publish_errors)
        yield GaugeMetricFamily("gpuslice_agent_last_publish_success_timestamp_seconds",
                                "Unix time of the last successful publication (0 = never)",
                                value=st.last_publish_success)
        yield CounterMetricFamily("gpuslice_agent_state_dirs_removed",
                                  "state dirs of departed pods removed", value=st.cleanup_removed)
        yield CounterMetricFamily("gpuslice_agent_libraries_removed",
                                  "unused old library versions removed",
                                  value=st.libraries_removed)
        yield GaugeMetricFamily("gpuslice_agent_old_libraries",
                                "old library versions left on the host by the last clean-up (in "
                                "use, or kept while the clean-up is blocked)",
                                value=st.old_libraries)
        yield GaugeMetricFamily("gpuslice_agent_library_cleanup_blocked",
                                "1 when the last clean-up could not tell which old libraries are "
                                "in use and removed none (a process the agent cannot inspect: "
                                "see its log)", value=1 if st.library_cleanup_blocked else 0)


def make_registry(collector: AgentCollector) -> CollectorRegistry:
    """A registry holding only the agent's collector (no process/platform defaults)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def metrics_app(registry: CollectorRegistry,
                stalled: Callable[[], str | None] = lambda: None) -> web.Application:
    """The aiohttp app serving ``/metrics`` and ``/healthz``; ``/healthz`` answers 503 with
    what ``stalled`` says while it says something (the liveness probe then restarts the agent)."""

    async def metrics(_request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_request: web.Request) -> web.Response:
        why = stalled()
        if why:
            return web.Response(status=503, text=f"{why}\n")
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
