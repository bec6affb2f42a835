"""The outside check: what each gpuslice container really holds on each GPU, against its cap.

The interposer keeps a container under its cap from inside, with its accounting in the
container's region file, which every process of the container can write (and delete). A
tenant that rewrites that file, or runs CUDA code the preloaded library never sees (its own
dynamic loader, say), is not stopped by it. This check rests on nothing the container can
change:

- NVML's per-process figures (compute and graphics processes) give each host pid's memory on
  each GPU (:meth:`~webhook.node.inventory.Inventory.processes`);
- ``<proc>/<pid>/cgroup`` names the pid's pod and container: the runtime's cgroup for a
  container is ``.../<pod dir>/<container dir>``, the pod dir holding ``pod<uid>`` and the
  container dir the runtime's 64-hex ID (``cri-containerd-<id>.scope``, ``crio-<id>.scope``,
  ``docker-<id>.scope`` or ``<id>``), whatever the cgroup driver and however deep a process
  made its own sub-cgroups below it (only the first match is taken, so a sub-cgroup named after
  another container's ID does not move the process there);
- the pod's status maps the container ID to its name (and the pod UID must agree with the
  cgroup's), and the pod's limits annotation ``gpuslice.io/limits.<container>`` (or, for pods
  admitted before it existed, the container's env in the pod spec) gives the cap: the webhook
  wrote both and the chart's annotation guard denies changing them.

Each check yields one :class:`Holding` per container and GPU: the bytes NVML sees it hold
against its cap (a percentage resolved against the GPU's NVML total, as the interposer does;
on a GPU the bind did not assign to it, ``gpuslice.io/devices.<container>``, the cap is 0 and
the tolerance does not apply: any memory there is a breach of its isolation; so it is for the
pod's containers that requested no GPU, which the webhook gave ``NVIDIA_VISIBLE_DEVICES=none``).
One over ``cap + tolerance`` is reported in metrics, logged with its figures once per episode,
and recorded as a Warning Event on the pod; with ``--over-limit-action evict`` a pod found over
in ``--over-limit-rounds`` checks of one episode is evicted through the Eviction API (so
PodDisruptionBudgets hold: a refused eviction is retried at the next check, a conflicting one
too unless the pod is gone; the pod's UID is its precondition, so a pod made since under the
same name is not evicted; nor is one the API server lists as being deleted: the eviction of an
agent before a restart). An episode ends after as many checks in a row under the cap, so
dipping under now and then does not evade it; a check that finds no process of the container
on the GPU counts as neither (nor, for compute, one before the container has run on the GPU
for a whole window: the window holds time it did not run), and episodes are the pod's
container's, not one instance's (its ID), so crashing and being restarted does not evade it
either (an episode absent for ``ABSENT_TTL`` ends).

The pod list is read only when a process belongs to a container the check has not mapped yet
(a container ID maps to one pod container for ever); IDs found in no gpuslice pod are
remembered for ``UNKNOWN_TTL`` seconds, so processes of other pods or of the host cost no
list per check; an ID its listed pod has not reported yet (kubelet writes it a moment after
the container starts) is looked up again at the next check. Static pods are not checked (the
webhook does not admit them as GPU pods). A pid reused between NVML's list and the cgroup read
is not placed: after the cgroup, ``<proc>/<pid>/stat`` gives the start time of the process that
holds the pid now, and one started after the list was taken is not the process NVML listed
(that check is then incomplete); nor is one started after the first of the checks in a row
whose lists name the pid (NVML goes on listing a process that ended while its allocations are
held, by a child that inherited its descriptors: the process holding its pid since is not it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from kubernetes_asyncio import client

from webhook import names
from webhook.admission.quantity import QuantityError, parse_quantity
from webhook.node.compute import COVERED, ComputeSampler, ComputeShare, Handover
from webhook.node.config import OVER_LIMIT_ACTIONS, PRIORITY_RESOURCE
from webhook.node.inventory import GpuProcesses, Inventory
from webhook.node.publish import API_ERRORS, TIMEOUT, api_error

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
UNKNOWN_TTL = 60.0
"""Seconds a container ID found in no gpuslice pod is not looked up again (a new container's
ID reaches its pod's status within a few seconds of its start)."""
EVENT_REASON = "GPUMemoryOverLimit"
COMPUTE_EVENT_REASON = "GPUComputeOverLimit"
GONE_TTL = 10.0
"""Seconds a process gone from /proc keeps its place for the compute sampler."""
GONE_LATE_US = 2_000_000
"""How long after a gone process was last seen alive its samples may be stamped (µs, NVML's
wall clock): its last periods'; later ones are another process's under its pid."""
EVICTED_TTL = 600.0
"""Seconds an evicted pod is not asked for again (its processes may hold the GPU while it
terminates: up to its grace period)."""
ABSENT_TTL = 600.0
"""Seconds an episode over the limit outlives its container's absence (no process on the GPU,
no sample in the window): a container that crashes and is restarted (kubelet's back-off
reaches 5 minutes) goes on with its episode instead of starting a new one each time."""
COMPONENT = "gpuslice-agent"

_POD_DIR = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
                      r"(?:\.slice)?$")
_CONTAINER_DIR = re.compile(r"^(?:[a-z][a-z0-9-]*-)?([0-9a-f]{64})(?:\.scope)?$")
_TICKS = os.sysconf("SC_CLK_TCK")


def shares_pid_namespace(proc_root: str | Path) -> bool | None:
    """Whether this process is in the PID namespace of the procfs at ``proc_root``: its ``self``
    link names the reader by its pid in that procfs's namespace, which is the pid we know only
    where the namespaces are one. None where ``proc_root`` has no such link (not a procfs)."""
    try:
        return int(os.readlink(Path(proc_root) / "self")) == os.getpid()
    except (OSError, ValueError):
        return None


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc/<pid>/stat`` gives start times in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS)


def stat_fields(stat_text: str) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` line from the state (field 3) on: the command name
    before them, in parentheses, may hold spaces and parentheses, so they start after its last
    ``)`` (field N is item N - 3)."""
    return stat_text[stat_text.rfind(")") + 1:].split()


def start_ticks(stat_text: str) -> int | None:
    """The start time (ticks since boot; field 22) in a ``/proc/<pid>/stat`` line, or None."""
    fields = stat_fields(stat_text)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


_REUSED = ("", "")
"""What the cgroup read answers for a pid reused since NVML's list."""
_SIZE = re.compile(r"^\s*([0-9]+)([kmgt]?)\s*$", re.IGNORECASE)
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def pod_and_container(cgroup_text: str) -> tuple[str, str] | None:
    """The pod UID and container ID a ``/proc/<pid>/cgroup`` file names, or None (a host
    process, a pod sandbox's own processes)."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        dirs = [d for d in parts[2].split("/") if d and d != ".."]
        for i, d in enumerate(dirs[:-1]):
            pod = _POD_DIR.search(d)
            if pod:
                ctr = _CONTAINER_DIR.match(dirs[i + 1])
                if ctr:
                    return pod.group(1).replace("_", "-"), ctr.group(1)
                break
    return None


def parse_size(text: str) -> int | None:
    """A size as the interposer reads it (``10240m``, ``2g``, bytes without a suffix)."""
    m = _SIZE.match(text)
    return int(m.group(1)) << _SHIFT[m.group(2).lower()] if m else None


@dataclass(frozen=True)
class Cap:
    """A container's memory cap per GPU: ``limit_bytes``, or ``percent`` of the GPU's total."""

    limit_bytes: int | None = None
    percent: int | None = None

    def on(self, total: int | None) -> int | None:
        """The cap in bytes on a GPU of NVML total ``total`` (None where it cannot be said)."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        if self.percent is None or not total:
            return None
        # the interposer's rounding (config.c env_percent_cap): whole MiB of whole MiB, what the
        # extender reserves (the agent publishes the total in MiB, rounded down)
        cap = total // MIB * self.percent // 100 * MIB
        # (a GPU under 100 MiB, in tests only: its share in bytes)
        return cap or total // 100 * self.percent + total % 100 * self.percent // 100


def cap_from(values: Mapping[str, str]) -> Cap | None:
    """The cap the limits (``NAME=VALUE`` pairs) give, or None when they give none."""
    size = values.get(names.ENV_MEMORY_LIMIT)
    if size is not None and (n := parse_size(size)):
        return Cap(limit_bytes=n)
    pct = values.get(names.ENV_MEMORY_PERCENT)
    if pct is not None and (p := parse_size(pct)) and 1 <= p <= 100:
        return Cap(percent=p)
    return None


def cores_from(values: Mapping[str, str]) -> int | None:
    """The compute limit (% of each GPU's time) the limits give, or None when they give none
    (absent, 100, or not a number the interposer takes)."""
    text = values.get(names.ENV_SM_LIMIT, "").strip()
    return int(text) if text.isascii() and text.isdigit() and 0 < int(text) < 100 else None


def _limits_text(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@dataclass(frozen=True)
class Tracked:
    """One gpuslice container: who it is and its cap."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    cap: Cap
    field_path: str = ""
    """The container in the pod: ``spec.containers{name}`` or ``spec.initContainers{name}``."""
    gpus: frozenset[str] | None = None
    """The GPUs assigned to it (``gpuslice.io/devices.<name>``); None where not annotated."""
    cores: int | None = None
    """Its compute limit (``CUDA_DEVICE_SM_LIMIT``, % of each GPU's time); None: none."""
    deleting: bool = False
    """Its pod was being deleted when listed (an eviction of an agent before a restart, say)."""

    @property
    def who(self) -> tuple[str, str]:
        """The pod UID and container name: one container across its restarts (each instance
        has an ID of its own; its region file, and so its cap and its compute clock, is one)."""
        return self.pod_uid, self.container

    def cap_on(self, uuid: str, total: int | None) -> int | None:
        """The cap on GPU ``uuid``: none at all (0) on a GPU not assigned to the container."""
        if self.gpus is not None and uuid not in self.gpus:
            return 0
        return self.cap.on(total)


def _container_id(raw: str | None) -> str | None:
    """``containerd://<id>`` (any runtime prefix) -> ``<id>``."""
    if not raw:
        return None
    ident = raw.rsplit("://", 1)[-1]
    return ident if _CONTAINER_DIR.match(ident) else None


def _names_nvidia_resource(container: client.V1Container,
                           priority: str = PRIORITY_RESOURCE) -> bool:
    """Whether a container's limits or requests ask for some of an ``nvidia.com/`` resource
    (ours or another device plugin's), or it uses resource claims (DRA): it may get a GPU that
    way. 0 of one gets no device (the webhook gives such a container ``none`` too), nor does
    HAMi's task priority ``priority`` (the webhook reads it past)."""
    res = container.resources
    return res is not None and (bool(res.claims) or any(
        k.startswith("nvidia.com/") and k != priority and _positive(v)
        for amounts in (res.limits, res.requests) for k, v in (amounts or {}).items()))


def _positive(quantity: object) -> bool:
    try:
        return parse_quantity(quantity) > 0
    except QuantityError:
        return False


def tracked_containers(pods: Iterable[client.V1Pod], *,
                       priority: str = PRIORITY_RESOURCE) -> dict[str, Tracked]:
    """Container ID -> :class:`Tracked` for every started container of a gpuslice pod that has
    a memory cap (the webhook's limits annotation, else its env in the pod spec), and for the
    pod's containers the webhook gave no GPU (``NVIDIA_VISIBLE_DEVICES=none``: no GPU, cap 0)
    but those that ask for another device plugin's ``nvidia.com/`` resource (HAMi's task
    priority, the resource named ``priority``, gives no device: it is not one).
    A restarted container's previous instance (``lastState.terminated``) maps to it too: its
    processes may still hold memory, and its samples are in the compute window."""
    out: dict[str, Tracked] = {}
    for pod in pods:
        meta, spec, status = pod.metadata, pod.spec, pod.status
        annotations = (meta.annotations if meta else None) or {}
        if not meta or not spec or not status or names.ANN_MUTATED not in annotations:
            continue
        containers = [*(spec.containers or []), *(spec.init_containers or [])]
        env_of = {c.name: {e.name: e.value for e in (c.env or []) if e.value is not None}
                  for c in containers}
        other_plugin = {c.name for c in containers if _names_nvidia_resource(c, priority)}
        inits = {c.name for c in spec.init_containers or []}
        for st in [*(status.container_statuses or []), *(status.init_container_statuses or [])]:
            ident = _container_id(st.container_id)
            if ident is None:
                continue
            ended = st.last_state.terminated if st.last_state else None
            before = _container_id(ended.container_id) if ended else None
            text = annotations.get(names.limits_annotation(st.name))
            env = env_of.get(st.name, {})
            gpus: frozenset[str] | None = None
            cores: int | None = None
            if text is None and env.get(names.ENV_VISIBLE_DEVICES) == names.NO_GPUS:
                # a container the webhook gave no GPU: any GPU memory it holds is a breach
                # (whatever cap its own env claims), unless another device plugin gave it one
                if st.name in other_plugin:
                    continue
                cap = Cap(limit_bytes=0)
                gpus = frozenset()
            else:
                limits = _limits_text(text) if text is not None else env
                found = cap_from(limits)
                if found is None:
                    continue
                cap = found
                cores = cores_from(limits)
                devices = annotations.get(names.devices_annotation(st.name))
                if devices:
                    gpus = frozenset(u.strip() for u in devices.split(",") if u.strip())
            kind = "initContainers" if st.name in inits else "containers"
            out[ident] = Tracked(meta.namespace or "", meta.name or "", meta.uid or "",
                                 st.name, cap, f"spec.{kind}{{{st.name}}}", gpus, cores,
                                 meta.deletion_timestamp is not None)
            if before is not None and before != ident:
                out.setdefault(before, out[ident])
    return out


@dataclass(frozen=True)
class Holding:
    """What one container holds on one GPU, as NVML sees it (its instances together: one
    restarted while a process of the old one still holds memory has two IDs)."""

    tracked: Tracked
    container_ids: tuple[str, ...]
    uuid: str
    used_bytes: int
    cap_bytes: int | None
    pids: tuple[int, ...]
    unknown_pids: tuple[int, ...] = ()
    """Processes NVML could not give a figure for (counted as 0)."""

    @property
    def assigned(self) -> bool:
        """False for a GPU the container was not given (a breach of its isolation)."""
        return self.tracked.gpus is None or self.uuid in self.tracked.gpus

    def over(self, tolerance: int) -> bool:
        if not self.assigned:
            return self.used_bytes > 0
        return self.cap_bytes is not None and self.used_bytes > self.cap_bytes + tolerance


@dataclass(frozen=True)
class Load:
    """One container's share of one GPU's time over the compute window, as NVML sees it (its
    instances' together: a container that restarts within the window is one share, not one per
    ID, each under the limit)."""

    tracked: Tracked
    container_ids: tuple[str, ...]
    uuid: str
    percent: float
    """Its processes' summed share of the GPU's time over the covered part of the window."""
    limit: int
    covered: float
    """Seconds of the window NVML's samples cover."""
    judged: bool
    """The window is covered enough (``compute.COVERED``) for the share to be judged."""
    pids: tuple[int, ...] = ()

    def over(self, tolerance: float) -> bool:
        return self.judged and self.percent > self.limit + tolerance


@dataclass(frozen=True)
class AuditReport:
    """One check: per container and GPU, and what no gpuslice container holds per GPU."""

    holdings: tuple[Holding, ...] = ()
    loads: tuple[Load, ...] = ()
    """Per container under a compute limit and GPU assigned to it: its share of the GPU."""
    unattributed: Mapping[str, int] = field(default_factory=dict)
    complete: bool = False
    """Every GPU's process list was read, every process placed or found not ours, and NVML gave
    a figure for every process of a gpuslice container; and the lists can hold every process
    (not :attr:`Auditor.blind`)."""
    compute_unattributed: Mapping[str, float] = field(default_factory=dict)
    """Per GPU: the share of its time over the compute window of processes of no gpuslice
    container (other pods, the host, processes gone before they were placed)."""


@dataclass
class _Episode:
    rounds: int = 0
    """Checks that found the container over its cap on the GPU, since the episode began."""
    under: int = 0
    """Checks since then in a row that found it under (the episode ends at ``Auditor.rounds``);
    a check that does not find the container at all is neither."""
    evicted: bool = False
    seen: float = 0.0
    """When a check last found the container on the GPU, or began the episode (monotonic)."""


class Auditor:
    """Checks the node's gpuslice containers against their caps, one :meth:`check` at a time.

    ``list_pods`` returns the pods on this node (None: no API server, nothing is tracked);
    ``api_client`` (None: no Events, no evictions) is used for the Event and the eviction;
    ``priority`` is HAMi's task priority resource (the webhook's ``resource_priority``).
    """

    def __init__(self, inventory: Inventory, proc_root: str | Path, *,
                 list_pods: Callable[[], Awaitable[list[client.V1Pod]]] | None,
                 api_client: client.ApiClient | None = None, node_name: str = "",
                 tolerance_bytes: int = 0, action: str = "none", rounds: int = 3,
                 compute_window: float = 0.0, compute_tolerance: float = 10.0,
                 compute_action: str = "none", priority: str = PRIORITY_RESOURCE,
                 clock: Callable[[], float] = time.monotonic,
                 boot_clock: Callable[[], int] = boot_ticks) -> None:
        for what in (action, compute_action):
            if what not in OVER_LIMIT_ACTIONS:
                raise ValueError(f"over-limit action must be one of {OVER_LIMIT_ACTIONS}: "
                                 f"{what!r}")
        self._inventory = inventory
        self._proc = Path(proc_root)
        self._list_pods = list_pods
        self._api = client.CoreV1Api(api_client) if api_client is not None else None
        self._node = node_name
        self._priority = priority
        self.tolerance = tolerance_bytes
        self.action = action
        self.rounds = max(1, rounds)
        self.compute_tolerance = compute_tolerance
        self.compute_action = compute_action
        self.compute = ComputeSampler(inventory, self._place_now, compute_window, clock=clock,
                                      boot_clock=boot_clock) if compute_window > 0 else None
        """The outside compute check's sampler (None: off); the agent polls it every
        ``compute.SAMPLE_INTERVAL`` seconds."""
        self._clock = clock
        self._boot_clock = boot_clock
        self._known: dict[str, Tracked] = {}
        self._evicted: dict[str, float] = {}
        """Pods evicted (UID -> when), not asked for again while they terminate."""
        self._placed: dict[int, tuple[int, tuple[str, str] | None, float, int,
                                      tuple[int, tuple[str, str] | None] | None]] = {}
        """The compute sampler's pids: start time, place, when last seen alive (monotonic, and
        NVML's wall-clock µs), and where the pid changed hands since it was first placed, until
        when (NVML's µs) its samples are the earlier holder's, and that one's place."""
        self._unknown: dict[str, float] = {}
        self._listed_since: dict[int, tuple[int, frozenset[str]]] = {}
        """Each pid NVML's process lists name: the boot ticks taken before the first of the
        checks in a row that listed it, and the GPUs whose lists named it last (the list of one
        of those that failed breaks no row; the list of another is no news of it)."""
        self._episodes: dict[tuple[str, str, str, str], _Episode] = {}
        """("memory" or "compute", pod UID, container name, GPU UUID) -> its episode over the
        limit (by name: a container that restarts goes on with its episode)."""
        self._running: dict[tuple[str, str, str], float] = {}
        """(pod UID, container name, GPU UUID) -> since when the checks have found a process of
        the container on the GPU, every check (monotonic)."""
        self.last = AuditReport()
        self._warned_pid0 = False
        self.blind = shares_pid_namespace(proc_root) is False
        """In a PID namespace of its own and NVML has listed no process yet: drivers that give
        NVML callers their own namespace's pids (the open kernel modules' ``os_find_ns_pid``)
        leave every process of another namespace out of the lists, so the checks may see none
        of the containers' processes. The first pid NVML lists shows it gives host pids (no
        GPU process runs in the agent's namespace) and ends this."""
        if self.blind:
            logger.warning(
                "the agent runs in a PID namespace of its own, not the one of %s: drivers "
                "that give NVML callers the process IDs of their own PID namespace list none "
                "of the containers' GPU processes to it, so the outside checks may see nothing "
                "(they count as incomplete until NVML lists a process); run the agent with "
                "hostPID (chart value agent.hostPID: true, the default)", proc_root)
        self.errors = 0
        self.evictions = 0
        self.episodes = 0
        self.events = 0

    def _cgroup(self, pid: int, listed: int) -> tuple[str, str] | None:
        """The pod UID and container ID of ``pid`` (None: not a container's, or gone); _REUSED if
        the pid is held by a process started at or after ``listed`` (boot ticks before NVML's
        list was taken): the listed process ended and the pid was reused."""
        d = self._proc / str(pid)
        try:
            text = (d / "cgroup").read_text(errors="replace")
            # read second: a process that holds the pid now and started before the list is the
            # one NVML listed, and so was the one whose cgroup was read (pids are unique)
            started = start_ticks((d / "stat").read_text(errors="replace"))
        except OSError:
            return None  # gone since NVML listed it, or never ours to read
        if started is None or started >= listed:
            return _REUSED
        return pod_and_container(text)

    def _place_now(self, stamps: dict[int, int], listed: int,
                   wall_us: int) -> dict[int, tuple[str, str] | Handover]:
        """The pod UID and container ID of each process the compute sampler asks about (pid ->
        its newest sample's NVML timestamp, 0 for one only listed) that is a container's.
        ``listed``: boot ticks taken before the query; a process started since is not the one
        sampled. A pid placed before whose start time has not changed keeps its place (one
        read, not two: the sampler asks every second). One gone (or whose pid a newer process
        holds) keeps it for samples stamped at most :data:`GONE_LATE_US` after it was last seen
        alive, for :data:`GONE_TTL` seconds: a process sampled after it ended is still its
        container's, a later process under its pid is not. A pid another process took since it
        was placed (between two polls) is a :class:`~webhook.node.compute.Handover`: its
        samples stamped before the new process started are the old one's."""
        now = self._clock()
        out: dict[int, tuple[str, str] | Handover] = {}
        cache = {pid: known for pid, known in self._placed.items() if now - known[2] < GONE_TTL}
        for pid in stamps:
            known = cache.get(pid)
            try:
                started = start_ticks((self._proc / str(pid) / "stat").read_text(errors="replace"))
            except OSError:
                started = None  # gone (or never ours to read)
            if started is None or started >= listed:  # gone, or its pid reused since the query
                if known is not None and known[1] is not None:  # as placed while it lived
                    out[pid] = Handover(known[3] + GONE_LATE_US, known[1], None)
                continue
            before = None
            if known is not None and known[0] == started:
                place, before = known[1], known[4]
            else:
                got = self._cgroup(pid, listed)
                if got is _REUSED:
                    if known is not None and known[1] is not None:
                        out[pid] = Handover(known[3] + GONE_LATE_US, known[1], None)
                    continue
                place = got
                if known is not None:
                    # another process's since it was last seen: the samples stamped before the
                    # new one started (its start in boot ticks, on the wall clock) are the old
                    # one's, this poll's and those that show up late
                    begun = wall_us - (listed - started) * 1_000_000 // _TICKS
                    before = (max(known[3], min(begun, known[3] + GONE_LATE_US)), known[1])
            cache[pid] = (started, place, now, wall_us, before)
            if before is not None:
                out[pid] = Handover(before[0], before[1], place)
            elif place is not None:
                out[pid] = place
        self._placed = cache
        return out

    async def _refresh(self, wanted: Mapping[str, str]) -> bool:
        """Learn the containers in ``wanted`` (container ID -> its cgroup's pod UID) not mapped
        yet; False if some could not be (the pod list failed, or a listed pod has not reported
        a container ID yet)."""
        now = self._clock()
        for ident in [i for i, t in self._unknown.items() if now - t >= UNKNOWN_TTL]:
            del self._unknown[ident]
        missing = wanted.keys() - self._known.keys() - self._unknown.keys()
        if not missing or self._list_pods is None:
            return True
        try:
            pods = await self._list_pods()
        except API_ERRORS as exc:  # an outage: judge what is mapped, the rest next time
            self.errors += 1
            logger.warning("the outside memory check cannot list the node's pods; containers "
                           "it has not seen before are not checked this time",
                           extra={"error": api_error(exc)})
            return False
        self._known.update(tracked_containers(pods, priority=self._priority))
        # A container runs before kubelet writes its ID into its pod's status: an ID of a listed
        # pod that no status names yet is looked up again at the next check, not remembered
        # as not ours (that hid new and restarted containers for UNKNOWN_TTL).
        listed = {p.metadata.uid for p in pods if p.metadata and p.metadata.uid}
        statuses = [st for p in pods if p.status
                    for st in [*(p.status.container_statuses or []),
                               *(p.status.init_container_statuses or []),
                               *(p.status.ephemeral_container_statuses or [])]]
        reported = {_container_id(st.container_id) for st in statuses} | {
            _container_id(st.last_state.terminated.container_id) for st in statuses
            if st.last_state and st.last_state.terminated}
        lagging = False
        for ident in missing - self._known.keys():
            if wanted[ident] in listed and ident not in reported:
                lagging = True
            else:
                self._unknown[ident] = now
        return not lagging

    async def check(self) -> AuditReport:
        """Read NVML's processes, place them, compare with the caps, act; return the report."""
        listed = self._boot_clock()
        gpus: list[GpuProcesses] = await asyncio.to_thread(self._inventory.processes)
        places, reused = await asyncio.to_thread(self._places, gpus, listed)
        shares, coverage, unplaced = self._compute_snapshot()
        wanted = {c: pod for pod, c in places.values()}
        wanted.update({c: pod for pod, c, _ in shares})
        complete = await self._refresh(wanted)
        if self.blind and any(pid for g in gpus for pid in (g.processes or {})):
            self.blind = False
            logger.info("NVML lists GPU processes by host pids: the outside checks see the "
                        "containers' processes from the agent's PID namespace")
        complete = complete and not reused and all(g.processes is not None for g in gpus) \
            and not self.blind
        held: dict[tuple[str, str, str], tuple[set[str], list[int], list[int], list[int]]] = {}
        unattributed: dict[str, int] = {}
        for g in gpus:
            unattributed[g.gpu.uuid] = 0
            for pid, used in (g.processes or {}).items():
                if pid in reused:  # the listed process is gone: its figure is nobody's now
                    continue
                place = places.get(pid)
                tracked = self._known.get(place[1]) if place else None
                if place is None or tracked is None or tracked.pod_uid != place[0]:
                    unattributed[g.gpu.uuid] += used or 0
                    continue
                ids, pids, unknown, size = held.setdefault((*tracked.who, g.gpu.uuid),
                                                           (set(), [], [], [0]))
                ids.add(place[1])
                pids.append(pid)
                if used is None:
                    unknown.append(pid)
                size[0] += used or 0
        totals = {g.gpu.uuid: g.total_bytes for g in gpus}
        holdings = tuple(
            Holding(self._tracked(ids), tuple(sorted(ids)), uuid, size[0],
                    self._tracked(ids).cap_on(uuid, totals.get(uuid)), tuple(sorted(pids)),
                    tuple(sorted(unknown)))
            for (_, _, uuid), (ids, pids, unknown, size) in sorted(held.items()))
        loads = self._loads(holdings, shares, coverage)
        self._forget(places, shares)
        complete = complete and not any(h.unknown_pids for h in holdings)
        others = dict(unplaced)  # and the processes of containers not ours
        for (pod, ident, uuid), share in shares.items():
            t = self._known.get(ident)
            if t is None or t.pod_uid != pod:
                others[uuid] = others.get(uuid, 0.0) + share.percent
        report = AuditReport(holdings, loads, unattributed, complete, others)
        self.last = report
        await self._act(report, {g.gpu.uuid for g in gpus if g.processes is None}, blind=not gpus)
        return report

    def _compute_snapshot(self) -> tuple[dict[tuple[str, str, str], ComputeShare],
                                         dict[str, float], dict[str, float]]:
        """The compute sampler's window (nothing with the compute check off). A bug there is
        logged and judges no compute this time; it must not stop the memory check."""
        if self.compute is None:
            return {}, {}, {}
        try:
            return self.compute.snapshot()
        except Exception:
            self.errors += 1
            logger.exception("the outside compute check failed; memory is checked without it")
            return {}, {}, {}

    def _loads(self, holdings: Iterable[Holding],
               shares: Mapping[tuple[str, str, str], ComputeShare],
               coverage: Mapping[str, float]) -> tuple[Load, ...]:
        """Each container under a compute limit, on each GPU assigned to it where it ran or
        holds memory, with its share of the GPU's time (0 where it had no sample; its
        instances' shares summed)."""
        if self.compute is None:
            return ()
        ids: dict[tuple[str, str, str], set[str]] = {}
        seen: dict[tuple[str, str, str], tuple[float, float, set[int]]] = {}
        for (pod, ident, uuid), share in shares.items():
            t = self._known.get(ident)
            if t is not None and t.pod_uid == pod:
                key = (*t.who, uuid)
                ids.setdefault(key, set()).add(ident)
                pct, covered, pids = seen.get(key, (0.0, 0.0, set()))
                seen[key] = (pct + share.percent, max(covered, share.covered),
                             pids | set(share.pids))
        for h in holdings:
            ids.setdefault((*h.tracked.who, h.uuid), set()).update(h.container_ids)
        out = []
        for key in sorted(ids):
            t, uuid = self._tracked(ids[key]), key[2]
            pct, covered, pids = seen.get(key, (0.0, coverage.get(uuid, 0.0), set()))
            if t.cores is None or (t.gpus is not None and uuid not in t.gpus):
                continue  # no limit; or a GPU not its own: the memory check's breach
            out.append(Load(t, tuple(sorted(ids[key])), uuid, pct, t.cores, covered,
                            covered >= COVERED * self.compute.window, tuple(sorted(pids))))
        return tuple(out)

    def _tracked(self, ids: Iterable[str]) -> Tracked:
        """The container whose instances ``ids`` are (mapped, of one pod and name)."""
        return self._known[min(ids)]

    def _places(self, gpus: list[GpuProcesses],
                listed: int) -> tuple[dict[int, tuple[str, str]], set[int]]:
        """Each listed pid's pod UID and container ID (where it is a container's), and the pids
        reused since the list: since the first of the checks in a row that listed it. NVML goes
        on listing a process that ended while its memory is held (a child that inherited its
        device descriptors keeps its allocations), under its pid, which another process may
        have taken since: one started after NVML began listing the pid is not the one listed."""
        on: dict[int, set[str]] = {}
        for g in gpus:
            for pid in g.processes or {}:
                on.setdefault(pid, set()).add(g.gpu.uuid)
        pids = on.keys()
        unread = {g.gpu.uuid for g in gpus if g.processes is None}
        before = self._listed_since
        # a pid no list names now is in a row still only where a GPU that named it was not read
        # (one that went from the others' lists while a GPU stayed unreadable, for days, kept
        # its row: thousands of them, and a process given the pid since was never placed)
        self._listed_since = {pid: (since, gpus_of & unread)
                              for pid, (since, gpus_of) in before.items()
                              if pid not in pids and gpus_of & unread}
        if 0 in pids and not self._warned_pid0:
            self._warned_pid0 = True
            logger.warning("NVML lists GPU processes as pid 0: this driver gives process IDs of "
                           "the caller's PID namespace, so the outside memory check cannot place "
                           "them; run the agent with hostPID (chart value agent.hostPID: true)")
        places: dict[int, tuple[str, str]] = {}
        reused: set[int] = set()
        for pid in pids:
            since, gpus_of = before.get(pid, (None, frozenset()))
            place = self._cgroup(pid, listed if since is None else since)
            # (a process that started just before this list, after the ticks were taken, is not
            # placed this time: the row starts at the next check)
            if since is not None or place is not _REUSED:
                self._listed_since[pid] = (listed if since is None else since,
                                           frozenset(on[pid]) | (gpus_of & unread))
            if place is _REUSED:
                reused.add(pid)
            elif place is not None:
                places[pid] = place
        return places, reused

    def _forget(self, places: Mapping[int, tuple[str, str]],
                shares: Mapping[tuple[str, str, str], ComputeShare]) -> None:
        """Drop mapped containers no process of which holds GPU memory any more or ran in the
        compute window (a container ID is never reused, so one seen again is simply looked up
        again)."""
        live = {c for _, c in places.values()} | {c for _, c, _ in shares}
        for ident in [i for i in self._known if i not in live]:
            del self._known[ident]

    async def _act(self, report: AuditReport, unread: set[str], blind: bool = False) -> None:
        """Start, continue or end each container's over-the-limit episodes per GPU (memory and
        compute apart); an episode ends after ``rounds`` checks in a row under the limit (so one
        that dips under now and then is still evicted), or after ``ABSENT_TTL`` seconds in which
        no check found the container on the GPU (one that is restarted meanwhile goes on with
        it); a check that does not find it, a GPU whose list could not be read,
        a compute window not covered enough, or a check that read no GPU at all (NVML
        unavailable: ``blind``) changes nothing. A pod is asked for once: one evicted for one
        episode (memory, compute, another GPU) is not evicted again for
        ``EVICTED_TTL`` seconds (it may take that long to terminate)."""
        now = self._clock()
        for uid in [u for u, t in self._evicted.items() if now - t >= EVICTED_TTL]:
            del self._evicted[uid]
        if blind:  # the compute window holds only what was sampled before: not news
            return
        findings: list[tuple[tuple[str, str, str, str], bool, Holding | Load]] = [
            (("memory", *h.tracked.who, h.uuid), h.over(self.tolerance), h)
            for h in report.holdings]
        findings += [(("compute", *c.tracked.who, c.uuid), c.over(self.compute_tolerance), c)
                     for c in report.loads if c.judged]
        unjudged = {("compute", *c.tracked.who, c.uuid) for c in report.loads if not c.judged}
        over_now: set[tuple[str, str, str, str]] = set()
        # a container is on a GPU while a process of it is (a compute share still holds the
        # samples of one gone: under the limit for the rest of the window, it is not running)
        live = {(*h.tracked.who, h.uuid) for h in report.holdings}
        self._running = {k: since for k, since in self._running.items() if k[2] in unread} | {
            k: self._running.get(k, now) for k in live}
        present = {(kind, *k) for k in live for kind in ("memory", "compute")}
        for key, is_over, found in findings:
            if not is_over:
                continue
            over_now.add(key)
            ep = self._episodes.setdefault(key, _Episode(seen=now))
            ep.rounds += 1
            ep.under = 0
            if ep.rounds == 1:
                self.episodes += 1
                self._log_over(found)
                await self._event(found)
            action = self.action if isinstance(found, Holding) else self.compute_action
            pod_uid = found.tracked.pod_uid
            if action == "evict" and ep.rounds >= self.rounds and not ep.evicted:
                # (a pod listed as being deleted terminates already: an agent restarted after
                # its eviction, which it does not remember, must not ask for it again)
                ep.evicted = pod_uid in self._evicted or found.tracked.deleting or \
                    await self._evict(found)
                if ep.evicted:
                    self._evicted.setdefault(pod_uid, now)
        for key, ep in list(self._episodes.items()):
            if key in present or (key[0] == "memory" and key[3] in unread):
                ep.seen = now
            elif now - ep.seen >= ABSENT_TTL:
                del self._episodes[key]  # gone (or restarted less often than this) for good
                continue
            if key in over_now or key in unjudged or (key[0] == "memory" and key[3] in unread):
                continue
            if key not in present:  # not running now: neither over nor under its limit
                continue
            if key[0] == "compute" and self.compute is not None and \
                    now - self._running[key[1:]] < self.compute.window:
                continue  # the window holds time it did not run (a restart): not a verdict
            ep.under += 1
            if ep.under >= self.rounds:
                del self._episodes[key]

    def _log_over(self, found: Holding | Load) -> None:
        t = found.tracked
        where = {"namespace": t.namespace, "pod": t.pod, "container": t.container,
                 "gpu": found.uuid, "pids": list(found.pids)}
        if isinstance(found, Holding):
            logger.warning("container holds more GPU memory than its cap (seen from outside, "
                           "by NVML)", extra={
                               **where, "used_mib": found.used_bytes // MIB,
                               "cap_mib": (found.cap_bytes or 0) // MIB,
                               "pids_without_figure": list(found.unknown_pids),
                               "assigned": found.assigned, "action": self.action})
        else:
            logger.warning("container uses more of the GPU's time than its compute limit (seen "
                           "from outside, by NVML)", extra={
                               **where, "percent": round(found.percent, 1),
                               "limit_percent": found.limit,
                               "window_s": round(found.covered, 1),
                               "action": self.compute_action})

    def _message(self, found: Holding | Load) -> str:
        t = found.tracked
        if isinstance(found, Load):
            what = (f"evicting after {self.rounds} checks over it"
                    if self.compute_action == "evict"
                    else "not acted on (compute over-limit action none)")
            if t.deleting and self.compute_action == "evict":
                what = "not evicted: the pod is being deleted already"
            return (f"container {t.container} used {found.percent:.0f} % of GPU {found.uuid}'s "
                    f"time over the last {found.covered:.0f} s (NVML, pids "
                    f"{', '.join(map(str, found.pids))}), over its compute limit of "
                    f"{found.limit} % (nvidia.com/gpucores); {what}")
        h = found
        what = (f"evicting after {self.rounds} checks over it" if self.action == "evict"
                else "not acted on (--over-limit-action none)")
        if t.deleting and self.action == "evict":
            what = "not evicted: the pod is being deleted already"
        if h.assigned:
            over = f"over its cap of {(h.cap_bytes or 0) // MIB} MiB"
        elif t.gpus:
            over = f"a GPU not assigned to it (it has {', '.join(sorted(t.gpus))})"
        else:
            over = "although it requested no GPU"
        return (f"container {t.container} holds {h.used_bytes // MIB} MiB on GPU {h.uuid} "
                f"(NVML, pids {', '.join(map(str, h.pids))}), {over}; {what}")

    async def _event(self, found: Holding | Load) -> None:
        if self._api is None:
            return
        t = found.tracked
        now = datetime.now(UTC)
        reason = EVENT_REASON if isinstance(found, Holding) else COMPUTE_EVENT_REASON
        body = client.CoreV1Event(
            api_version="v1", kind="Event", metadata=client.V1ObjectMeta(name=f"{t.pod[:236]}.{secrets.token_hex(8)}",
                                         namespace=t.namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Pod", name=t.pod, namespace=t.namespace, uid=t.pod_uid,
                field_path=t.field_path or None),
            reason=reason, message=self._message(found)[:1024], type="Warning",
            source=client.V1EventSource(component=COMPONENT, host=self._node or None),
            reporting_component=COMPONENT, reporting_instance=self._node or COMPONENT,
            first_timestamp=now, last_timestamp=now, count=1)
        try:
            await self._api.create_namespaced_event(t.namespace, body, _request_timeout=TIMEOUT)
        except API_ERRORS as exc:  # the Event is a courtesy: the metric and the log stand
            self.errors += 1
            logger.warning("cannot record the over-limit Event", extra={
                "namespace": t.namespace, "pod": t.pod,
                "error": api_error(exc)})
        else:
            self.events += 1

    async def _gone(self, name: str, namespace: str, uid: str) -> bool:
        """Whether the pod with this UID no longer exists (False when the read fails).

        A list by name, not a get: the agent's role lists pods and gets none; without a
        ``resourceVersion`` the list is a consistent read (a just-deleted pod is not served
        from a lagging watch cache)."""
        assert self._api is not None
        try:
            pods = await self._api.list_namespaced_pod(
                namespace, field_selector=f"metadata.name={name}", _request_timeout=TIMEOUT)
        except API_ERRORS:
            return False
        return all(p.metadata is None or p.metadata.uid != uid for p in pods.items or [])

    async def _evict(self, found: Holding | Load) -> bool:
        """Ask for the pod's eviction; True once the API server took it (or the pod is gone)."""
        if self._api is None:
            return False
        t = found.tracked
        # the UID precondition: a pod made since under the same name (a StatefulSet's) is not
        # the one that went over
        body = client.V1Eviction(
            api_version="policy/v1", kind="Eviction",
            metadata=client.V1ObjectMeta(name=t.pod, namespace=t.namespace),
            delete_options=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=t.pod_uid)))
        try:
            await self._api.create_namespaced_pod_eviction(t.pod, t.namespace, body,
                                                           _request_timeout=TIMEOUT)
        except API_ERRORS as exc:
            status = getattr(exc, "status", None)
            if status == 404:
                return True  # gone already
            # 409 is both "only another pod has the name now" (the UID precondition) and a
            # PodDisruptionBudget whose update kept conflicting (the API server gives up after
            # its own retries): only a read of the pod tells which
            if status == 409 and await self._gone(t.pod, t.namespace, t.pod_uid):
                return True
            self.errors += 1
            logger.warning("eviction refused or failed (a PodDisruptionBudget answers 429, "
                           "a conflict on its update 409); retried at the next check", extra={
                               "namespace": t.namespace, "pod": t.pod,
                               "error": api_error(exc)})
            return False
        self.evictions += 1
        where = {"namespace": t.namespace, "pod": t.pod, "container": t.container,
                 "gpu": found.uuid}
        if isinstance(found, Holding):
            logger.warning("pod evicted: a container held more GPU memory than its cap", extra={
                **where, "used_mib": found.used_bytes // MIB,
                "cap_mib": (found.cap_bytes or 0) // MIB})
        else:
            logger.warning("pod evicted: a container used more of the GPU's time than its "
                           "compute limit", extra={
                               **where, "percent": round(found.percent, 1),
                               "limit_percent": found.limit})
        return True
