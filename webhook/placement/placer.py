"""The extender's verbs as plain methods: filter, prioritize, preempt, bind, over the watched
state.

:class:`Placer` owns the :class:`ClusterState`, the watches that feed it and the API client
used to bind. Filter and prioritize are synchronous and pure over the state; bind reserves
the chosen GPUs in the state (atomically, on the event loop, no lock), then creates the
Binding with the device annotations, and releases the reservation if the API server refuses.

A Binding that gets no answer (a timeout, a dropped connection, a 5xx) may still be applied
by the API server, so its reservation is kept, like kube-scheduler's assumed pods: the watch
settles it (the pod bound: its real allocation replaces the reservation; deleted or bound
elsewhere: dropped), and after ``assume_ttl_s`` it is released. A read of the pod right
after the failure settles it at once when the pod is bound (what it holds replaces the
reservation), gone (404) or recreated (another UID). Until then a retried bind of the pod
asks for the same GPUs on the same node (whichever of the two Bindings is applied then holds
what is reserved) and is refused for another node: the GPUs of the first must not be given to
another pod while it may still land.

Only pods the webhook admitted (``gpuslice.io/mutated``) are given GPUs: another GPU pod
would run without the interposer, so without its caps.

Reservations live in this replica's memory, and the chart runs a scheduler and an extender in
every replica: a Binding the previous leader's extender sent may still be applied after the
scheduler lease changed hands, and this extender would not know its GPUs taken until the watch
shows the pod bound. So with ``settings.scheduler_lease`` set, GPU binds wait for
``failover_hold_s`` after the lease last changed hands (:meth:`Placer._failover_hold`). The
same holds for a restarted process of this container (``settings.restart_marker``): its
predecessor's reservations died with it.

A bind's API calls share one deadline (``bind_deadline_s``, below kube-scheduler's
``httpTimeout``): however slow the API server, the scheduler hears the bind's answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from webhook import names
from webhook.placement.fit import NoFit, Placement, place
from webhook.placement.holds import Held
from webhook.placement.model import (
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionResult,
    HostPriority,
    MetaPod,
    MetaVictims,
    Proposed,
    candidate_names,
    extender_pod,
)
from webhook.placement.preempt import choose_victims, importance_order
from webhook.placement.request import (
    NOT_ADMITTED,
    PodRequest,
    RequestError,
    admitted,
    pod_request,
)
from webhook.placement.state import (
    ClusterState,
    NodeState,
    pod_priority,
    pod_started,
)
from webhook.placement.sync import ApiStatusError, BadResponse, ClusterSync, read_json
from webhook.settings import Settings

logger = logging.getLogger(__name__)

Fit = Placement | NoFit
_Result = tuple[int, Held | None, Fit]
"""A cached ``place()`` result: (node version, the hold it was placed beside, result)."""

_POD_CACHE = 4096
_LEASE_CACHE_S = 1.0
"""Seconds a read of the scheduler's lease is reused. A scheduler that loses the lease exits,
so this replica cannot lose it and win it back within a second: a read made by a bind of this
replica's scheduler stays right that long."""
_RESULT_CACHE = 4
_PREEMPT_SLICE_S = 0.01
"""Seconds preempt judges nodes before it lets the event loop run the other requests."""
NOT_READY = "gpuslice: placement is still reading the cluster state; retry"


def _hold_until(lease: Any, hold_s: float) -> float:
    """Wall-clock time until which GPU binds wait after the lease last changed hands; 0 when
    it never did (its first holder) or says nothing of it."""
    spec = lease.get("spec") if isinstance(lease, dict) else None
    if not isinstance(spec, dict):
        return 0.0
    transitions = spec.get("leaseTransitions")
    if not isinstance(transitions, int) or transitions <= 0:
        return 0.0
    try:
        acquired = datetime.fromisoformat(str(spec.get("acquireTime")))
    except ValueError:
        return 0.0
    if acquired.tzinfo is None:
        return 0.0
    return acquired.timestamp() + hold_s


def _earlier_bind(node: str) -> str:
    """Why a pod whose earlier Binding (to ``node``) may still land is not bound elsewhere."""
    return (f"gpuslice: an earlier bind of this pod to node {node} may still be applied; its "
            f"GPUs stay reserved until it is settled")


class Placer:
    """Per-GPU placement for kube-scheduler; stored on the app at ``PLACEMENT_KEY``."""

    def __init__(self, settings: Settings, state: ClusterState | None = None,
                 api: client.ApiClient | None = None, *, bind_timeout_s: float = 3.0,
                 bind_deadline_s: float = 8.0, resync_s: float = 300.0,
                 assume_ttl_s: float = 60.0, preempt_deadline_s: float = 5.0) -> None:
        self.settings = settings
        self.state = state or ClusterState(settings)
        self.bind_timeout_s = bind_timeout_s
        """Seconds a call to the API server made by bind may take."""
        self.bind_deadline_s = bind_deadline_s
        """Seconds a whole bind may take, all its API calls together: below kube-scheduler's
        ``httpTimeout`` for the extender (the chart's 10 s), so that the scheduler hears its
        answer rather than giving up on it. Each call gets what is left, at most
        ``bind_timeout_s``."""
        self.resync_s = resync_s
        """Seconds between full lists of nodes and pods."""
        self.assume_ttl_s = assume_ttl_s
        """Seconds the reservation of a bind with an unknown outcome is kept, unless the watch
        or a retried bind settles it first: the API server's default request timeout (60 s),
        after which it no longer applies the Binding."""
        self.preempt_deadline_s = preempt_deadline_s
        """Seconds preempt may spend judging candidate nodes (those left are left out): below
        kube-scheduler's ``httpTimeout`` for the extender (the chart's 10 s)."""
        self.core: client.CoreV1Api | None = None
        self.leases: client.CoordinationV1Api | None = None
        self._lease_read: tuple[float, float] | None = None
        """(monotonic time of the last read of the scheduler's lease, its _hold_until)."""
        self._lease_reading: asyncio.Task[float | str] | None = None
        """The read of the lease under way: the binds that find the cache expired meanwhile
        (the scheduler binds many pods at once) wait on it rather than each sending one."""
        self._restarted_at: float | None = None
        """Wall-clock start of this process when an earlier one of its container ran."""
        self.sync: ClusterSync | None = None
        self._pods: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._results: OrderedDict[PodRequest, dict[str, _Result]] = OrderedDict()
        self._inflight: set[str] = set()
        if api is not None:
            self.attach(api)

    # ----- lifecycle and the interface the webhook uses -----
    def attach(self, api: client.ApiClient) -> None:
        """Use ``api`` for the watches and the binds."""
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.sync = ClusterSync(self.state, api, resync_s=self.resync_s)

    def start(self) -> None:
        self._note_start()
        if self.sync is not None:
            self.sync.start()

    def _note_start(self) -> None:
        """Leave the restart marker; found already there, an earlier process of this
        container may have sent Bindings that can still land: GPU binds wait."""
        marker = self.settings.restart_marker
        if marker is None:
            return
        path = Path(marker)
        try:
            if path.exists():
                self._restarted_at = time.monotonic()
            else:
                path.touch()
        except OSError as exc:  # cannot tell: assume the worst
            self._restarted_at = time.monotonic()
            logger.warning("cannot use the restart marker; GPU binds wait as after a restart",
                           extra={"path": marker, "error": str(exc)})
        if self._restarted_at is not None:
            logger.info("restarted within the pod; GPU binds wait for Bindings of the earlier "
                        "process", extra={"wait_s": self.failover_hold_s})

    async def stop(self) -> None:
        if self._lease_reading is not None:
            self._lease_reading.cancel()
        if self.sync is not None:
            await self.sync.stop()

    def ready(self) -> bool:
        """True once the initial list of nodes and pods is in; always when the API is off."""
        if not self.settings.kube_enabled and self.sync is None:
            return True
        return self.sync is not None and self.sync.ready.is_set()

    def largest_gpu_memory_mib(self) -> int | None:
        """The largest GPU memory (MiB) of any known node; None when no inventory is known."""
        return self.state.largest_gpu_memory_mib()

    # ----- filter / prioritize -----
    def _remember(self, pod: dict[str, Any]) -> None:
        """Keep the pod for bind, which gets only its name and UID."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if uid:
            self._pods[uid] = pod
            self._pods.move_to_end(uid)
            while len(self._pods) > _POD_CACHE:
                self._pods.popitem(last=False)

    def _results_for(self, req: PodRequest) -> dict[str, _Result]:
        """The cached ``place()`` results of ``req`` by node: (node version, hold, result).

        ``place`` is pure and a node's version changes with its GPUs or their usage, so a
        result stays right for every pod with the same request: prioritize and bind reuse
        filter's work, and the replicas of a workload reuse each other's on unchanged nodes.
        Beside the GPUs held for nominated pods, the result is kept with the hold it was placed
        beside: the state hands out the same hold object while it stays right, and a new one
        after any change (:meth:`ClusterState.held_usage`).
        """
        per_node = self._results.get(req)
        if per_node is None:
            per_node = self._results[req] = {}
            while len(self._results) > _RESULT_CACHE:
                self._results.popitem(last=False)
        else:
            self._results.move_to_end(req)
            if len(per_node) > 2 * len(self.state.nodes) + 16:  # results of deleted nodes
                for name in [n for n in per_node if n not in self.state.nodes]:
                    del per_node[name]
        return per_node

    def _place(self, req: PodRequest, node: NodeState, per_node: dict[str, _Result],
               held: Held | None = None) -> Fit:
        """``place()`` on the node's usage, or beside the GPUs ``held`` there for nominated
        pods, cached in ``per_node``."""
        hit = per_node.get(node.name)
        if hit is not None and hit[0] == node.version and hit[1] is held:
            return hit[2]
        result = place(req, node.gpus, node.usage if held is None else held,
                       self.settings.split_count)
        per_node[node.name] = (node.version, held, result)
        return result

    def _fit(self, req: PodRequest, node: NodeState, per_node: dict[str, _Result],
             priority: int, uid: str) -> Fit:
        """:meth:`_place` for the pod (``priority``, ``uid``), beside the GPUs held for the
        pods nominated to the node (:meth:`ClusterState.held_usage`)."""
        return self._place(req, node, per_node, self.state.held_usage(node, priority, uid))

    def filter(self, args: Any) -> ExtenderFilterResult:
        pod = extender_pod(args)
        candidates = candidate_names(args)
        self._remember(pod)
        out = ExtenderFilterResult(NodeNames=[], FailedNodes={}, FailedAndUnresolvableNodes={},
                                   Error="")
        if not self.ready():
            out["Error"] = NOT_READY
            return out
        try:
            req = pod_request(pod, self.settings)
        except RequestError as exc:
            out["FailedAndUnresolvableNodes"] = {n: f"gpuslice: {exc}" for n in candidates}
            return self._with_nodes(args, out)
        if not req.wants_gpus:
            out["NodeNames"] = list(candidates)
            return self._with_nodes(args, out)
        if not admitted(pod):
            out["FailedAndUnresolvableNodes"] = {n: NOT_ADMITTED for n in candidates}
            return self._with_nodes(args, out)
        self.state.expire(time.monotonic())
        earlier = self.state.allocs.get(str(pod["metadata"].get("uid") or ""))
        if earlier is not None and earlier.assumed:
            # A retry: bind asks for the same GPUs on the node where the earlier Binding may
            # still land, which the pod's own reservation holds, and refuses any other node.
            # Without that node among the candidates, an error: retried after a back-off,
            # not parked as unschedulable until some cluster event.
            if earlier.node not in candidates:
                out["Error"] = _earlier_bind(earlier.node)
                return out
            for name in candidates:
                if name == earlier.node:
                    out["NodeNames"].append(name)
                else:
                    out["FailedNodes"][name] = _earlier_bind(earlier.node)
            return self._with_nodes(args, out)
        per_node = self._results_for(req)
        priority, uid = pod_priority(pod), str(pod["metadata"].get("uid") or "")
        holds = bool(self.state.nominees)  # else no per-node look at nominated pods
        for name in candidates:
            node = self.state.node(name)
            if node is None or node.inventory_error:
                why = node.inventory_error if node is not None else "node not known"
                out["FailedAndUnresolvableNodes"][name] = f"gpuslice: {why}"
                continue
            result = self._fit(req, node, per_node, priority, uid) if holds \
                else self._place(req, node, per_node)
            if isinstance(result, NoFit):
                target = "FailedAndUnresolvableNodes" if result.unresolvable else "FailedNodes"
                out[target][name] = result.reason  # type: ignore[literal-required]
            else:
                out["NodeNames"].append(name)
        return self._with_nodes(args, out)

    @staticmethod
    def _with_nodes(args: Any, out: ExtenderFilterResult) -> ExtenderFilterResult:
        """Without nodeCacheCapable the scheduler sends and reads full ``Nodes``."""
        nodes = args.get("Nodes")
        if args.get("NodeNames") is None and isinstance(nodes, dict):
            keep = set(out["NodeNames"])
            out["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                            "items": [n for n in nodes.get("items") or []
                                      if ((n or {}).get("metadata") or {}).get("name") in keep]}
        return out

    def prioritize(self, args: Any) -> list[HostPriority]:
        pod = extender_pod(args)
        candidates = candidate_names(args)
        self._remember(pod)
        try:
            req = pod_request(pod, self.settings)
        except RequestError:
            req = None
        scores: list[HostPriority] = []
        per_node = self._results_for(req) if req is not None else {}
        if req is not None and req.wants_gpus:
            self.state.expire(time.monotonic())
        priority, uid = pod_priority(pod), str(pod["metadata"].get("uid") or "")
        holds = bool(self.state.nominees)
        for name in candidates:
            node = self.state.node(name)
            score = 0
            if req is not None and req.wants_gpus and node is not None and node.gpus:
                result = self._fit(req, node, per_node, priority, uid) if holds \
                    else self._place(req, node, per_node)
                score = 0 if isinstance(result, NoFit) else result.score
            scores.append(HostPriority(Host=name, Score=score))
        return scores

    # ----- preempt -----
    async def preempt(self, pod: dict[str, Any],
                      proposed: dict[str, Proposed]) -> ExtenderPreemptionResult:
        """The candidate nodes where preempting pods of lower priority lets ``pod`` fit its
        GPUs, each with the victims to preempt (:mod:`webhook.placement.preempt`); nodes where
        none can are left out. The caller has checked :meth:`ready`.

        Nodes are judged one at a time between yields to the event loop (no node is judged
        across an ``await``, so each sees one state); past ``preempt_deadline_s`` the rest are
        left out, so that the scheduler, which gives up after its ``httpTimeout``, hears the
        answer.
        """
        out: dict[str, MetaVictims] = {}
        result = ExtenderPreemptionResult(NodeNameToMetaVictims=out)
        try:
            req = pod_request(pod, self.settings)
        except RequestError:
            return result  # filter found every node unresolvable
        if not req.wants_gpus:  # no GPU to judge (the scheduler sends only GPU pods)
            for name, p in proposed.items():
                if p.uids:
                    out[name] = MetaVictims(Pods=[MetaPod(UID=u) for u in p.uids],
                                            NumPDBViolations=p.num_pdb_violations)
            return result
        if not admitted(pod):
            return result
        self.state.expire(time.monotonic())
        earlier = self.state.allocs.get(str(pod["metadata"].get("uid") or ""))
        if earlier is not None and earlier.assumed:
            return result  # filter offers only the node of its earlier bind, where it fits
        priority, uid = pod_priority(pod), str(pod["metadata"].get("uid") or "")
        start = slice_start = time.monotonic()
        for i, (name, p) in enumerate(proposed.items()):
            now = time.monotonic()
            if now - slice_start > _PREEMPT_SLICE_S:
                await asyncio.sleep(0)
                now = slice_start = time.monotonic()
            if now - start > self.preempt_deadline_s:
                logger.warning("preempt ran out of time; the other candidate nodes are left "
                               "out", extra={"judged": i, "candidates": len(proposed)})
                break
            victims = self._victims_on(name, req, priority, uid, p)
            if victims is not None:
                out[name] = victims
        return result

    def _victims_on(self, name: str, req: PodRequest, priority: int, uid: str,
                    p: Proposed) -> MetaVictims | None:
        """What to preempt on node ``name`` for the preemptor (``req``, ``priority``, ``uid``)
        given the scheduler's victims ``p``; None to leave the node out. GPUs held for pods
        nominated to the node are not the preemptor's to free (the scheduler's dry run, too,
        counts its nominated pods of no lower priority as on the node)."""
        node = self.state.node(name)
        if node is None or node.inventory_error or not p.uids:
            return None
        allocs = self.state.allocs
        gpu = choose_victims(req, priority, node, allocs, set(p.uids),
                             self.settings.split_count,
                             self.state.held_usage(node, priority, uid))
        if gpu is None:
            return None
        if not gpu:
            # The GPUs have room: what the pod lacks here is the scheduler's to judge (CPU,
            # memory, ports...), and so are its victims.
            return MetaVictims(Pods=[MetaPod(UID=u) for u in p.uids],
                               NumPDBViolations=p.num_pdb_violations)
        # The scheduler's victims that hold no GPU here were chosen for what only it sees, and
        # stay; those holding GPUs stay only where they help (they are in ``gpu`` then).
        chosen = set(gpu)
        kept = [u for u in p.uids if u in chosen or not (
            u in allocs and allocs[u].node == name and allocs[u].demand)]
        stay = set(kept)
        added = [u for u in gpu if u not in stay]
        known = {u: (pod_priority(p.pods[u]), pod_started(p.pods[u])) for u in kept
                 if u in p.pods}
        for u in (*kept, *added):
            alloc = allocs.get(u)
            if u not in known:  # a pod without GPUs sent as a UID: its priority from the watch
                known[u] = (alloc.priority, alloc.started) if alloc is not None \
                    else (self.state.priority_of(u), "")
        # Of the scheduler's count, only victims it chose can be the PDB violations (the
        # extender does not read PodDisruptionBudgets): at most those it chose that stay.
        return MetaVictims(Pods=[MetaPod(UID=u) for u in importance_order(kept, added, known)],
                           NumPDBViolations=min(p.num_pdb_violations, len(kept)))

    # ----- bind -----
    @property
    def failover_hold_s(self) -> float:
        """Seconds GPU binds wait after the scheduler's lease changes hands: the previous
        leader's extender may send a Binding up to one pod read (``bind_timeout_s``) after its
        scheduler stopped, and the API server may apply it for ``assume_ttl_s``."""
        return self.assume_ttl_s + self.bind_timeout_s

    def _time_left(self, deadline: float) -> float:
        """The timeout of a bind's next API call: ``bind_timeout_s``, or less as the bind's
        ``deadline`` (monotonic) nears; TimeoutError once it has passed (a timeout of 0 would
        mean none to the client)."""
        left = min(self.bind_timeout_s, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError("the bind's deadline passed")
        return left

    async def _failover_hold(self, deadline: float) -> str | None:
        """Why a GPU bind must wait now (this process restarted, or the scheduler's lease
        changed hands, too recently; or the lease cannot be read before ``deadline``), or
        None."""
        if self._restarted_at is not None:
            # (this process's own clock: the wall clock stepped back an hour, by NTP after a
            # node's boot, held GPU binds an hour)
            left = self._restarted_at + self.failover_hold_s - time.monotonic()
            if left > 0:
                return (f"gpuslice: the extender restarted less than "
                        f"{self.failover_hold_s:.0f}s ago; GPU binds wait {left:.0f}s more, "
                        f"until no Binding of its earlier process can still be applied")
            self._restarted_at = None
        lease = self.settings.scheduler_lease
        if lease is None or self.leases is None:
            return None
        now = time.monotonic()
        if self._lease_read is not None and now - self._lease_read[0] < _LEASE_CACHE_S:
            hold_until = self._lease_read[1]
        else:
            if self._lease_reading is None:
                self._lease_reading = asyncio.ensure_future(self._read_lease(lease))
            # (shielded: a bind whose request is dropped, or whose deadline comes first, does not
            # cancel the others' read)
            try:
                read = await asyncio.wait_for(asyncio.shield(self._lease_reading),
                                              self._time_left(deadline))
            except TimeoutError:
                return (f"gpuslice: cannot read the scheduler's leader lease {lease} before "
                        f"the bind's deadline")
            if isinstance(read, str):
                return read
            hold_until = read
        left = hold_until - time.time()
        if left <= 0:
            return None
        return (f"gpuslice: the scheduler leader changed less than {self.failover_hold_s:.0f}s "
                f"ago; GPU binds wait {left:.0f}s more, until no Binding of the previous "
                f"leader can still be applied")

    async def _read_lease(self, lease: str) -> float | str:
        """Read the scheduler's lease (one read for the binds waiting on it): its
        :func:`_hold_until`, kept for ``_LEASE_CACHE_S``; or why it cannot be read."""
        assert self.leases is not None
        try:
            now = time.monotonic()
            namespace, name = lease.split("/")
            obj: Any = None
            try:
                obj = await read_json(await self.leases.read_namespaced_lease(
                    name, namespace, _preload_content=False,
                    _request_timeout=self.bind_timeout_s))
            except ApiStatusError as exc:
                if exc.status != 404:  # 404: no leader election, no previous leader
                    return (f"gpuslice: cannot read the scheduler's leader lease {lease} "
                            f"({exc.status}): {exc.message}")
            except (TimeoutError, aiohttp.ClientError, BadResponse) as exc:
                return f"gpuslice: cannot read the scheduler's leader lease {lease}: {exc!r}"
            hold_until = _hold_until(obj, self.failover_hold_s)
            self._lease_read = (now, hold_until)
            return hold_until
        finally:
            self._lease_reading = None

    async def _pod(self, args: ExtenderBindingArgs, deadline: float) -> dict[str, Any]:
        pod = self._pods.get(args["PodUID"])
        if pod is None:
            if self.core is None:
                raise LookupError("pod was never seen by filter and the Kubernetes API is off")
            pod = await read_json(await self.core.read_namespaced_pod(
                args["PodName"], args["PodNamespace"], _preload_content=False,
                _request_timeout=self._time_left(deadline)))
            if not isinstance(pod, dict) or not isinstance(pod.get("metadata") or {}, dict):
                raise BadResponse(f"the pod read is not a Pod object: {str(pod)[:80]!r}")
        if (pod.get("metadata") or {}).get("uid") != args["PodUID"]:
            raise LookupError("the pod with this name has a different UID (recreated?)")
        return pod

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        deadline = time.monotonic() + self.bind_deadline_s
        uid, node_name = args["PodUID"], args["Node"]
        where = {"pod": f"{args['PodNamespace']}/{args['PodName']}", "node": node_name}
        if self.core is None:
            return ExtenderBindingResult(Error="gpuslice: bind needs the Kubernetes API "
                                               "(kube_enabled is false)")
        if uid in self._inflight:
            return ExtenderBindingResult(Error="gpuslice: a bind of this pod is in progress")
        self._inflight.add(uid)
        try:
            try:
                pod = await self._pod(args, deadline)
                req = pod_request(pod, self.settings)
            except (LookupError, RequestError, ApiStatusError) as exc:
                return ExtenderBindingResult(Error=f"gpuslice: cannot bind: {exc}")
            except (TimeoutError, aiohttp.ClientError, BadResponse) as exc:
                return ExtenderBindingResult(Error=f"gpuslice: cannot read the pod: {exc!r}")
            if req.wants_gpus:
                # Before the first list the state lacks the GPUs other pods hold.
                if not self.ready():
                    return ExtenderBindingResult(Error=NOT_READY)
                if not admitted(pod):
                    return ExtenderBindingResult(Error=NOT_ADMITTED)
                hold = await self._failover_hold(deadline)
                if hold:
                    return ExtenderBindingResult(Error=hold)
            return await self._bind(args, req, where,
                                    str((pod.get("metadata") or {}).get("resourceVersion") or ""),
                                    deadline, pod_priority(pod))
        finally:
            self._inflight.discard(uid)

    async def _bind(self, args: ExtenderBindingArgs, req: PodRequest, where: dict[str, str],
                    pod_rv: str, deadline: float, priority: int = 0) -> ExtenderBindingResult:
        uid, node_name = args["PodUID"], args["Node"]
        if deadline - time.monotonic() < self.bind_timeout_s / 3:
            # Too late to hear the Binding's answer: sent, it would likely stay undecided and
            # hold its GPUs for assume_ttl_s.
            return ExtenderBindingResult(Error="gpuslice: the reads before the bind took too "
                                               "long to send the Binding in time; retry")
        annotations: dict[str, str] = {}
        earlier: float | None = None  # deadline of an earlier attempt that may still land
        if req.wants_gpus:
            # From here to reserve() there is no await: choose-and-reserve is atomic.
            self.state.expire(time.monotonic())
            existing = self.state.allocs.get(uid)
            if existing is not None and not existing.assumed:
                return ExtenderBindingResult(
                    Error=f"gpuslice: pod already holds GPUs on node {existing.node}")
            # An earlier attempt (undecided, or answered but not yet seen by the watch) may
            # still be what the API server applies: its GPUs stay reserved until the pod says.
            # A retry on its node asks for the same GPUs, so that whichever Binding lands
            # holds what is reserved; a retry elsewhere waits until it is settled.
            if existing is not None and existing.node != node_name:
                return ExtenderBindingResult(Error=_earlier_bind(existing.node))
            node = self.state.node(node_name)
            if node is None or node.inventory_error:
                why = node.inventory_error if node is not None else "node not known"
                return ExtenderBindingResult(Error=f"gpuslice: {why}")
            if existing is not None:
                assignment = existing.assignment
                earlier = existing.expires_at or time.monotonic() + self.assume_ttl_s
            else:
                result = self._fit(req, node, self._results_for(req), priority, uid)
                if isinstance(result, NoFit):
                    return ExtenderBindingResult(Error=result.reason)
                assignment = result.assignment
            self.state.reserve(uid, args["PodNamespace"], args["PodName"], node_name, req,
                               assignment, pod_rv, priority)
            annotations = {names.devices_annotation(c): ",".join(uuids)
                           for c, uuids in assignment.items()}
        # metadata.uid makes the API server refuse the bind if the pod was recreated.
        body = client.V1Binding(
            api_version="v1", kind="Binding",
            metadata=client.V1ObjectMeta(name=args["PodName"], namespace=args["PodNamespace"],
                                         uid=uid, annotations=annotations),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node_name))
        assert self.core is not None
        try:
            # _preload_content=False: the API server answers a Status, which the generated
            # client fails to deserialise as V1Binding (a known client issue).
            await read_json(await self.core.create_namespaced_pod_binding(
                args["PodName"], args["PodNamespace"], body, _preload_content=False,
                _request_timeout=self._time_left(deadline)))
        except ApiStatusError as exc:
            logger.warning("bind refused", extra=where | {"status": exc.status,
                                                         "error": exc.message})
            error = f"gpuslice: bind refused by the API server ({exc.status}): {exc.message}"
            # A 5xx may come after the write (an etcd timeout); a 409 may mean that an earlier
            # attempt of ours was applied. Either way the pod tells what holds.
            if annotations and (exc.status >= 500 or exc.status == 409):
                return await self._undecided(args, annotations, where, error, deadline)
            if earlier is not None and exc.status != 404:  # the earlier one may still land
                self.state.keep_until(uid, earlier)
            else:
                self.state.release(uid)
            return ExtenderBindingResult(Error=error)
        except (TimeoutError, aiohttp.ClientError, BadResponse) as exc:
            # BadResponse: a 2xx, so likely applied, but not the API server's Status; the pod
            # tells.
            return await self._undecided(args, annotations, where,
                                         f"gpuslice: bind request failed: {exc!r}", deadline)
        logger.info("pod bound", extra=where | {"devices": annotations})
        return ExtenderBindingResult(Error="")

    async def _undecided(self, args: ExtenderBindingArgs, annotations: dict[str, str],
                         where: dict[str, str], error: str,
                         deadline: float) -> ExtenderBindingResult:
        """The Binding may or may not be applied: read the pod to learn what holds.

        Bound here with our devices: the bind succeeded. Bound otherwise (elsewhere, or by
        another attempt): what it holds replaces the reservation. Gone (404) or recreated
        (another UID): the reservation is released. Still unbound, or the read failed (or found
        no time left before ``deadline``): the API server may yet apply the Binding, so the
        reservation is kept for ``assume_ttl_s``.
        """
        uid = args["PodUID"]
        assert self.core is not None
        pod: dict[str, Any] | None = None
        try:
            pod = await read_json(await self.core.read_namespaced_pod(
                args["PodName"], args["PodNamespace"], _preload_content=False,
                _request_timeout=self._time_left(deadline)))
        except ApiStatusError as exc:
            if exc.status == 404:
                self.state.release(uid)
                return ExtenderBindingResult(Error=error)
        except (TimeoutError, aiohttp.ClientError, BadResponse):
            pass
        if isinstance(pod, dict) and isinstance(pod.get("metadata") or {}, dict):
            meta = pod.get("metadata") or {}
            if meta.get("uid") != uid:
                self.state.release(uid)
                return ExtenderBindingResult(Error=error)
            bound_to = (pod.get("spec") or {}).get("nodeName")
            if bound_to:
                # Replaces (or drops) the reservation. Once the watch has settled it (pod
                # deleted, finished, or seen bound) the watch knows better than this read:
                # applied, a read from before the pod's deletion would hold its GPUs again.
                if uid in self.state.allocs:
                    self.state.apply_pod(pod)
                annotated = all((meta.get("annotations") or {}).get(k) == v
                                for k, v in annotations.items())
                if bound_to == args["Node"] and annotated:
                    logger.info("pod bound", extra=where | {"devices": annotations,
                                                            "late": True})
                    return ExtenderBindingResult(Error="")
                return ExtenderBindingResult(Error=error)
        self.state.keep_until(uid, time.monotonic() + self.assume_ttl_s)
        logger.warning("bind outcome unknown", extra=where | {
            "error": error, "reservation_kept_s": self.assume_ttl_s if annotations else 0})
        return ExtenderBindingResult(Error=error)
