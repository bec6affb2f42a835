"""The cluster as the extender sees it: each node's GPUs and what every pod holds on them.

Fed by the watches (:mod:`webhook.placement.sync`) with raw Node and Pod JSON, and by binds
with *assumed* allocations: a bind reserves its GPUs here before it calls the API server, so a
concurrent bind for the same node sees them taken. An assumed allocation becomes confirmed
when the watch shows the pod bound with its device annotations, and is dropped if the bind
fails. A bind whose outcome is unknown (no answer: the API server may still apply it) keeps
its reservation until a deadline (:meth:`ClusterState.keep_until`); the watch settles it
before that, or :meth:`ClusterState.expire` drops it after. Everything here is synchronous
and runs on the event loop, so a check-and-reserve between two ``await`` points is atomic
without a lock.

Counted pods: bound (``spec.nodeName``), not ``Succeeded``/``Failed``, with at least one
``gpuslice.io/devices.<container>`` annotation. Deleted or finished pods release their GPUs.

Nominated pods: pending GPU pods whose ``status.nominatedNodeName`` kube-scheduler set after
preempting pods for them (:class:`Nominee`). They hold no GPUs in the usage; the verbs place
them on a copy of it for pods of no higher priority (:meth:`ClusterState.held_usage`), as the
scheduler's in-tree filters do with its nominated pods.

Views of a pod arrive out of order: a bind's own read of the pod can be newer than a list
snapshot taken before it, or than the events a lagging watch has yet to deliver. A pod object
older than the one an allocation was last built from is ignored, and a full list keeps what
was learnt after it was requested (:meth:`ClusterState.replace_pods`), so a stale view never
frees GPUs that a newer one showed taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from webhook import names
from webhook.placement.fit import pod_demand
from webhook.placement.holds import Held, Holds
from webhook.placement.inventory import Gpu, InventoryError, Usage, parse_inventory
from webhook.placement.request import (
    ContainerRequest,
    PodRequest,
    RequestError,
    admitted,
    pod_request,
)
from webhook.settings import Settings

logger = logging.getLogger(__name__)

_TERMINAL = ("Succeeded", "Failed")


@dataclass
class NodeState:
    """One node: its GPUs, what is taken on each, and a version that changes with either."""

    name: str
    gpus: tuple[Gpu, ...] = ()
    inventory_error: str | None = "node not seen yet"
    usage: dict[str, Usage] = field(default_factory=dict)
    pods: set[str] = field(default_factory=set)
    version: int = 0
    exists: bool = False
    """The API server has the node: seen by the watch or a list and not deleted since. One
    that does not is kept only while pods point at it, and forgotten with the last of them."""

    def memory_of(self) -> dict[str, int]:
        return {g.uuid: g.memory_mib for g in self.gpus}


@dataclass
class PodAlloc:
    """The GPUs a pod holds on a node."""

    uid: str
    namespace: str
    name: str
    node: str
    request: PodRequest
    assignment: dict[str, tuple[str, ...]]
    demand: dict[str, Usage]
    assumed: bool = False
    """True from the bind's reservation until the watch shows the pod bound."""
    reserved_at: float = 0.0
    expires_at: float | None = None
    """Monotonic time after which an assumed allocation whose bind is undecided is dropped;
    None while its bind is in flight or once the API server accepted it."""
    resource_version: str = ""
    """Of the pod object last applied; of an assumed allocation, the pod's as its bind saw it."""
    applied_at: float = 0.0
    """When (monotonic) the pod object last applied came in (confirmed allocations only)."""
    priority: int = 0
    """The pod's ``spec.priority`` (0 when unset, as kube-scheduler reads it): preemption
    takes only pods of lower priority than the preemptor's."""
    started: str = ""
    """The pod's ``status.startTime`` (RFC 3339), "" before it starts: of two pods of one
    priority, the one started later is preempted first (kube-scheduler's MoreImportantPod)."""
    terminating: bool = False
    """The pod has a ``metadata.deletionTimestamp``: it holds its GPUs until it is gone, and
    what it holds is already promised to the pods nominated to its node; it frees them whatever
    is preempted, so preemption takes it before any running pod."""


@dataclass
class Nominee:
    """A pending GPU pod nominated to a node (``status.nominatedNodeName``): kube-scheduler
    preempted pods there for it and treats it as on the node until it is bound elsewhere,
    deleted, or the nomination is cleared."""

    uid: str
    node: str
    request: PodRequest
    priority: int
    resource_version: str


def pod_priority(pod: dict[str, Any]) -> int:
    """``spec.priority`` as kube-scheduler reads it (corev1helpers.PodPriority): 0 if unset."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def pod_started(pod: dict[str, Any]) -> str:
    value = (pod.get("status") or {}).get("startTime")
    return value if isinstance(value, str) else ""


def rv_newer(a: str, b: str) -> bool | None:
    """Whether resourceVersion ``a`` is newer than ``b``; None when they cannot be compared.

    The API contract makes resourceVersions opaque strings; every etcd-backed API server
    issues them as increasing decimal integers (etcd revisions), so two of those are compared
    as numbers. Anything else (empty, or another server's format) is not compared at all.
    """
    if a.isascii() and a.isdigit() and b.isascii() and b.isdigit():
        return int(a) > int(b)
    return None


def assignment_from_pod(pod: dict[str, Any], req: PodRequest) -> dict[str, tuple[str, ...]]:
    """Container name → UUIDs, read from the pod's device annotations."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    out: dict[str, tuple[str, ...]] = {}
    for c in req.containers:
        value = annotations.get(names.devices_annotation(c.name))
        if value:
            out[c.name] = tuple(u.strip() for u in str(value).split(",") if u.strip())
    return out


def _whole_gpu_request(pod: dict[str, Any]) -> PodRequest:
    """For a pod whose requests cannot be read: every annotated container holds its GPUs whole."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    spec = pod.get("spec") or {}
    containers = []
    for kind, key in (("init", "initContainers"), ("app", "containers")):
        for i, c in enumerate(spec.get(key) or []):
            value = annotations.get(names.devices_annotation(str((c or {}).get("name", ""))))
            if value:
                containers.append(ContainerRequest(str(c.get("name")), kind, i,  # type: ignore[arg-type]
                                                   len(str(value).split(",")), None, 100, 100))
    return PodRequest(tuple(containers), "binpack")


class ClusterState:
    """Nodes and pod allocations; all mutation goes through these methods."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.nodes: dict[str, NodeState] = {}
        self.allocs: dict[str, PodAlloc] = {}
        self._expiring: dict[str, float] = {}
        """UID → deadline of the assumed allocations with an ``expires_at``."""
        self.nominees: dict[str, Nominee] = {}
        """UID → the pending GPU pods nominated to a node."""
        self._nominated_on: dict[str, dict[str, Nominee]] = {}
        """Node name → UID → its nominees (no entry for a node without any)."""
        self._holds = Holds(settings.split_count)
        """The GPUs held for them, kept per node (:meth:`held_usage`)."""
        self.priorities: dict[str, int] = {}
        """UID → ``spec.priority`` of the bound, unfinished pods whose priority is not 0, with
        GPUs or not: preempt names the most important of a node's victims first, and the
        scheduler's victims without GPUs come as UIDs only (0, the default, is not kept)."""
        self._version = 0

    # ----- reads -----
    def node(self, name: str) -> NodeState | None:
        return self.nodes.get(name)

    def priority_of(self, uid: str) -> int:
        """The ``spec.priority`` of a bound pod (0 for one not seen)."""
        alloc = self.allocs.get(uid)
        return alloc.priority if alloc is not None else self.priorities.get(uid, 0)

    def largest_gpu_memory_mib(self) -> int | None:
        sizes = [g.memory_mib for n in self.nodes.values() for g in n.gpus]
        return max(sizes) if sizes else None

    def held_usage(self, node: NodeState, priority: int, uid: str) -> Held | None:
        """``node.usage`` with the GPUs held for the pods nominated to the node, as seen by a
        pod of ``priority`` (UID ``uid``); None when none holds any (the usage as it is).

        Those nominated with a priority at least the pod's, other than the pod itself, hold
        what their victims free (:mod:`webhook.placement.holds`). Kept between calls: the
        result is shared and must not be changed, and is the same object while it stays right.
        """
        nominated = self._nominated_on.get(node.name)
        if not nominated:
            return None
        return self._holds.usage(node.name, node.version, node.gpus, node.usage, self.allocs,
                                 node.pods, nominated, priority, uid)

    # ----- nodes -----
    def _node(self, name: str) -> NodeState:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = NodeState(name)
            self._bump(node)  # versions are never reused, even by a node recreated by name
        return node

    def _bump(self, node: NodeState) -> None:
        self._version += 1
        node.version = self._version

    def apply_node(self, obj: dict[str, Any]) -> None:
        """A node was added or changed: re-read its GPU inventory."""
        meta = obj.get("metadata") or {}
        node = self._node(str(meta.get("name")))
        node.exists = True
        raw = (meta.get("annotations") or {}).get(names.ANN_NODE_GPUS)
        try:
            gpus, error = parse_inventory(raw), None
        except InventoryError as exc:
            gpus, error = (), str(exc)
        if gpus == node.gpus and error == node.inventory_error:
            return
        if error and raw is not None:
            logger.warning("bad node GPU inventory", extra={"node": node.name, "error": error})
        node.gpus, node.inventory_error = gpus, error
        self._recount(node)

    def delete_node(self, name: str) -> None:
        node = self.nodes.get(name)
        if node is None:
            return
        node.exists = False
        self._holds.forget(name)
        if node.pods:  # pods still point at it; keep their usage, forget the GPUs
            node.gpus, node.inventory_error = (), "node was deleted"
            self._recount(node)
        else:
            del self.nodes[name]

    def replace_nodes(self, objs: Iterable[dict[str, Any]]) -> None:
        """A full list of nodes (initial sync or resync)."""
        seen = set()
        for obj in objs:
            seen.add(str((obj.get("metadata") or {}).get("name")))
            self.apply_node(obj)
        for name in [n for n, s in self.nodes.items() if n not in seen and s.exists]:
            self.delete_node(name)

    def _recount(self, node: NodeState) -> None:
        """Recompute the node's usage from its pods (percentages depend on the GPUs)."""
        node.usage = {}
        memory = node.memory_of()
        for uid in node.pods:
            alloc = self.allocs[uid]
            alloc.demand = pod_demand(alloc.request, alloc.assignment, memory)
            for uuid, d in alloc.demand.items():
                node.usage.setdefault(uuid, Usage()).add(d)
        self._bump(node)

    # ----- allocations -----
    def _add(self, alloc: PodAlloc) -> None:
        node = self._node(alloc.node)
        alloc.demand = pod_demand(alloc.request, alloc.assignment, node.memory_of())
        self.allocs[alloc.uid] = alloc
        self._nominee_changed(alloc.uid)  # a nominee with an allocation holds nothing more
        node.pods.add(alloc.uid)
        for uuid, d in alloc.demand.items():
            node.usage.setdefault(uuid, Usage()).add(d)
        self._bump(node)

    def _remove(self, uid: str) -> PodAlloc | None:
        self._expiring.pop(uid, None)
        alloc = self.allocs.pop(uid, None)
        if alloc is None:
            return None
        self._nominee_changed(uid)
        node = self.nodes.get(alloc.node)
        if node is not None:
            node.pods.discard(uid)
            for uuid, d in alloc.demand.items():
                u = node.usage.get(uuid)
                if u is not None:
                    u.add(d, -1)
                    if u.is_zero():
                        del node.usage[uuid]
            self._bump(node)
            if not node.pods and not node.exists:  # deleted (or never seen): nothing left
                del self.nodes[node.name]
        return alloc

    def reserve(self, uid: str, namespace: str, name: str, node: str, req: PodRequest,
                assignment: dict[str, tuple[str, ...]], pod_rv: str = "",
                priority: int = 0) -> PodAlloc:
        """Hold ``assignment`` for a pod being bound (an assumed allocation); ``pod_rv``: the
        resourceVersion of the pod object the bind read, ``priority`` its spec.priority."""
        alloc = PodAlloc(uid, namespace, name, node, req, assignment, {}, assumed=True,
                         reserved_at=time.monotonic(), resource_version=pod_rv,
                         priority=priority)
        self._remove(uid)
        self._add(alloc)
        return alloc

    def release(self, uid: str) -> None:
        """Drop a reservation whose bind failed."""
        alloc = self.allocs.get(uid)
        if alloc is not None and alloc.assumed:
            self._remove(uid)

    def keep_until(self, uid: str, deadline: float) -> None:
        """Keep the reservation of a bind with an unknown outcome until ``deadline``
        (monotonic): the watch confirms it (the pod bound with these devices) or drops it (the
        pod deleted, bound elsewhere, finished) before, or :meth:`expire` drops it after."""
        alloc = self.allocs.get(uid)
        if alloc is not None and alloc.assumed:
            alloc.expires_at = self._expiring[uid] = deadline

    def expire(self, now: float) -> int:
        """Drop the undecided reservations whose deadline has passed; returns how many."""
        if not self._expiring:
            return 0
        gone = [uid for uid, deadline in self._expiring.items() if deadline <= now]
        for uid in gone:
            alloc = self._remove(uid)
            if alloc is not None:
                logger.warning("undecided bind expired; its reservation is released",
                               extra={"pod": f"{alloc.namespace}/{alloc.name}",
                                      "node": alloc.node})
        return len(gone)

    def _stale(self, current: PodAlloc | None, rv: str, listed_at: float | None) -> bool:
        """Whether a view of the pod (``rv``; from a list requested at ``listed_at``, or an
        event when None) is older than what ``current`` was built from."""
        if current is None or current.assumed:
            return False
        newer = rv_newer(current.resource_version, rv)
        if newer is not None:
            return newer
        # Versions not comparable: a list requested before the allocation was last applied
        # may predate it. Keeping it is the safe side; the watch or the next list settles it.
        return listed_at is not None and current.applied_at >= listed_at

    # ----- nominated pods -----
    def _nominee_changed(self, uid: str) -> None:
        """Drop the holds kept for the node of ``uid`` if it is a nominee."""
        nominee = self.nominees.get(uid)
        if nominee is not None:
            self._holds.forget(nominee.node)

    def _unnominate(self, uid: str) -> None:
        nominee = self.nominees.pop(uid, None)
        if nominee is not None:
            self._holds.forget(nominee.node)
            on = self._nominated_on.get(nominee.node)
            if on is not None:
                on.pop(uid, None)
                if not on:
                    del self._nominated_on[nominee.node]

    def _nominate(self, obj: dict[str, Any], uid: str, bound: bool, phase: Any, rv: str) -> None:
        """Track the pod's nomination: a pending GPU pod the webhook admitted, with a
        ``status.nominatedNodeName``; bound, finished or without one, none."""
        current = self.nominees.get(uid)
        target = (obj.get("status") or {}).get("nominatedNodeName")
        if current is None and not target:
            return  # the common pod: never nominated
        if current is not None and rv_newer(current.resource_version, rv):
            return  # an older view
        request: PodRequest | None = None
        if isinstance(target, str) and target and not bound and phase not in _TERMINAL \
                and uid and admitted(obj):
            try:
                request = pod_request(obj, self.settings)
            except RequestError:
                request = None  # filter finds every node unresolvable for it
        self._unnominate(uid)
        if request is None or not request.wants_gpus:
            return
        nominee = Nominee(uid, str(target), request, pod_priority(obj), rv)
        self.nominees[uid] = nominee
        self._nominated_on.setdefault(nominee.node, {})[uid] = nominee
        self._holds.forget(nominee.node)

    def apply_pod(self, obj: dict[str, Any], listed_at: float | None = None) -> None:
        """A pod was added or changed (``listed_at``: part of a list requested then)."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        node = (obj.get("spec") or {}).get("nodeName")
        phase = (obj.get("status") or {}).get("phase")
        annotations = meta.get("annotations") or {}
        has_devices = any(k.startswith(names.ANN_DEVICES_PREFIX) for k in annotations)
        current = self.allocs.get(uid)
        rv = str(meta.get("resourceVersion") or "")
        self._nominate(obj, uid, bool(node), phase, rv)
        if self._stale(current, rv, listed_at):
            return  # an older view (a lagging watch, a list snapshot taken before a bind)
        priority = pod_priority(obj)
        if node and phase not in _TERMINAL and priority:
            self.priorities[uid] = priority
        else:
            self.priorities.pop(uid, None)
        if not node or phase in _TERMINAL or not has_devices:
            if current is not None and not (current.assumed and not node and phase not in _TERMINAL):
                self._remove(uid)
            return
        if current is not None and not current.assumed and rv and current.resource_version == rv:
            return  # unchanged (a resync lists every pod again)
        try:
            req = pod_request(obj, self.settings, bound=True)
        except RequestError as exc:
            logger.warning("bound pod has unreadable GPU requests; counting its GPUs as whole",
                           extra={"pod": f"{meta.get('namespace')}/{meta.get('name')}",
                                  "error": str(exc)})
            req = _whole_gpu_request(obj)
        assignment = assignment_from_pod(obj, req)
        if not assignment:  # annotated containers that request no GPU: count them whole
            req = _whole_gpu_request(obj)
            assignment = assignment_from_pod(obj, req)
        if current is not None and not current.assumed and current.node == node \
                and current.assignment == assignment:
            current.resource_version, current.applied_at = rv, time.monotonic()
            current.started = pod_started(obj)
            terminating = bool(meta.get("deletionTimestamp"))
            if terminating != current.terminating:  # what it holds goes to the nominees
                current.terminating = terminating
                self._holds.forget(current.node)
            return
        self._remove(uid)
        self._add(PodAlloc(uid, str(meta.get("namespace") or ""), str(meta.get("name") or ""),
                           str(node), req, assignment, {}, resource_version=rv,
                           applied_at=time.monotonic(), priority=pod_priority(obj),
                           started=pod_started(obj),
                           terminating=bool(meta.get("deletionTimestamp"))))

    def delete_pod(self, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        self._unnominate(uid)
        self.priorities.pop(uid, None)
        self._remove(uid)

    def replace_pods(self, objs: Iterable[dict[str, Any]], listed_at: float,
                     resource_version: str = "") -> None:
        """A full list of pods, requested at ``listed_at`` (monotonic) and answered at
        ``resource_version``. Allocations of pods absent from it are dropped, except those
        learnt after the list: reservations made after it was requested (of pods the bind saw
        at a version no older than the list's), and pods seen bound
        at a newer version (by a bind's read of the pod) than the list's; items older than
        what an allocation was built from are ignored (:meth:`apply_pod`)."""
        seen: set[str] = set()
        for obj in objs:
            seen.add(str((obj.get("metadata") or {}).get("uid") or ""))
            self.apply_pod(obj, listed_at)
        for uid in [u for u in self.priorities if u not in seen]:
            del self.priorities[uid]
        for uid, alloc in list(self.allocs.items()):
            if uid in seen:
                continue
            if alloc.assumed:  # reserved after the list was asked for, and not since gone:
                # a list newer than a version of the pod the bind saw, without the pod, shows
                # it deleted (the list may have waited for its snapshot while it was bound)
                learnt_after = alloc.reserved_at >= listed_at \
                    and rv_newer(resource_version, alloc.resource_version) is not True
            else:  # absent from the list: is the list the stale view?
                learnt_after = self._stale(alloc, resource_version, listed_at)
            if not learnt_after:
                self._remove(uid)
        for uid, nominee in list(self.nominees.items()):
            if uid not in seen and rv_newer(nominee.resource_version, resource_version) is not True:
                self._unnominate(uid)
