"""Publishes the node's GPUs to the API server: annotation, labels and extended resources.

What is published (DESIGN.md §4), computed by the pure :func:`desired_state`:

- annotation ``gpuslice.io/gpus``: compact JSON list of ``{"uuid","index","product",
  "memoryMiB","health"}``, every GPU healthy or not (the extender skips unhealthy ones), except
  one whose memory size was never readable (the extender needs ``memoryMiB`` > 0);
- labels describing the hardware: ``gpuslice.io/gpu.product`` (product of the lowest-index GPU,
  sanitised to a label value; removed when there is no GPU), ``gpuslice.io/gpu.count`` (GPUs
  found) and ``gpuslice.io/gpu.memory`` (the smallest per-GPU memory in MiB);
- extended resources in ``status.capacity`` and ``status.allocatable``, counting healthy GPUs
  only: gpu = healthy x split count, gpumem = their total MiB, gpucores = 100 x healthy, plus
  what pods still hold on GPUs that are unhealthy or gone (:func:`held_off_healthy`: the
  scheduler and the kubelet count those pods against the totals). A node without driver or
  GPUs publishes zeros (plus what its pods hold), so nothing is scheduled onto it;
- annotation ``gpuslice.io/resources``: the extended resource names published (sorted,
  comma-separated). An agent configured with other names (``resourceNames`` changed by an
  upgrade) takes the recorded ones off the node's capacity and allocatable: left there, a pod
  asking for an old name, which the webhook no longer mutates, went to the default scheduler
  and started on the node without the library or a cap (a CUDA image's
  ``NVIDIA_VISIBLE_DEVICES=all``: every GPU). While pods of the node still hold an old name
  (admitted under it before the upgrade), it stays at what they hold (:func:`held_by_pods`):
  no new pod fits, and the kubelet, which admits its running pods again when it restarts,
  does not reject them for a resource the node no longer has. The record is widened to the
  new names before they are published and narrowed only once the old ones are off, so an
  agent stopped in between leaves them recorded for the next one; each old name is taken off
  once (another owner, a device plugin, may publish it again).

:class:`Publisher` reads the node first and sends only what differs (quantities compared by
value: the API server keeps them in canonical form, "1000" as "1k"), as JSON merge patches
(``application/merge-patch+json``; keys with ``/`` need no escaping there): one on the node for
metadata, one on ``nodes/{name}/status`` for the resources. Errors propagate to the caller,
which retries with backoff.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from webhook import names
from webhook.admission.quantity import QuantityError, parse_quantity
from webhook.node.config import AgentSettings
from webhook.node.inventory import DEPARTED_KEPT, Discovery
from webhook.settings import is_qualified_name

logger = logging.getLogger(__name__)

API_ERRORS = (client.ApiException, aiohttp.ClientError, TimeoutError, OSError, ValueError)
"""What a call to the API server may raise: HTTP errors, connection errors, timeouts, and
bodies that do not decode."""


def api_error(exc: BaseException) -> str:
    """One line for the log: ``HTTP <status> <reason>``, else the exception's type and text."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    return f"HTTP {status} {reason}" if status else f"{type(exc).__name__}: {exc}"

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT = 30
"""Seconds any one API request may take."""
_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """``text`` as a valid label value: invalid runs become ``-``, at most 63 characters,
    starting and ending alphanumeric ("NVIDIA A100-SXM4-80GB" -> "NVIDIA-A100-SXM4-80GB")."""
    value = _LABEL_BAD.sub("-", text.strip())[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


@dataclass(frozen=True)
class NodeState:
    """What the node object should carry."""

    annotation: str
    labels: Mapping[str, str | None]
    """Label values; None means the label must be absent."""
    resources: Mapping[str, str]
    """Extended resource name -> quantity, for both capacity and allocatable."""


def desired_state(discovery: Discovery, settings: AgentSettings,
                  held_off: Mapping[str, int] | None = None) -> NodeState:
    """The annotation, labels and resources for ``discovery`` (pure); ``held_off``: what pods
    hold on GPUs that are unhealthy or gone (:func:`held_off_healthy`), added to the totals."""
    gpus = sorted((g for g in discovery.gpus if g.memory_mib > 0), key=lambda g: g.index) \
        if discovery.available else []
    healthy = [g for g in gpus if g.healthy]
    annotation = json.dumps([g.to_json() for g in gpus], separators=(",", ":"))
    product = label_value(gpus[0].product) if gpus else ""
    labels: dict[str, str | None] = {
        names.LABEL_GPU_PRODUCT: product or None,
        names.LABEL_GPU_COUNT: str(len(gpus)),
        names.LABEL_GPU_MEMORY: str(min((g.memory_mib for g in gpus), default=0)),
    }
    held_off = held_off or {}
    resources = {
        settings.resource_gpu: len(healthy) * settings.split_count,
        settings.resource_mem: sum(g.memory_mib for g in healthy),
        settings.resource_cores: 100 * len(healthy),
    }
    return NodeState(annotation, labels,
                     {k: str(v + held_off.get(k, 0)) for k, v in resources.items()})


def recorded_resources(annotations: Mapping[str, str] | None) -> set[str]:
    """The extended resource names the node's ``gpuslice.io/resources`` records (names of the
    form ``domain/name`` outside ``kubernetes.io``, so that no edit of it takes a native
    resource such as ``cpu`` off the node)."""
    text = (annotations or {}).get(names.ANN_NODE_RESOURCES) or ""
    out = set()
    for name in text.split(","):
        domain, slash, _ = name.strip().partition("/")
        if slash and is_qualified_name(name.strip()) and domain != "kubernetes.io" \
                and not domain.endswith(".kubernetes.io"):
            out.add(name.strip())
    return out


def resources_record(resources: Iterable[str]) -> str:
    """The ``gpuslice.io/resources`` value for these names."""
    return ",".join(sorted(set(resources)))


def metadata_patch(annotations: Mapping[str, str] | None, labels: Mapping[str, str] | None,
                   want: NodeState, record: str | None = None) -> dict[str, Any] | None:
    """The merge patch that brings the node's metadata to ``want`` (and its
    ``gpuslice.io/resources`` to ``record``, when given); None if it already is."""
    annotations = annotations or {}
    labels = labels or {}
    meta: dict[str, Any] = {}
    changed_ann: dict[str, str] = {}
    if annotations.get(names.ANN_NODE_GPUS) != want.annotation:
        changed_ann[names.ANN_NODE_GPUS] = want.annotation
    if record is not None and annotations.get(names.ANN_NODE_RESOURCES) != record:
        changed_ann[names.ANN_NODE_RESOURCES] = record
    if changed_ann:
        meta["annotations"] = changed_ann
    changed = {k: v for k, v in want.labels.items() if labels.get(k) != v}
    if changed:
        meta["labels"] = changed
    return {"metadata": meta} if meta else None


def _published_uuids(annotations: Mapping[str, str]) -> set[str]:
    """The UUIDs of the node's ``gpuslice.io/gpus`` annotation (none where it does not read)."""
    try:
        data = json.loads(annotations.get(names.ANN_NODE_GPUS) or "[]")
    except ValueError:
        return set()
    if not isinstance(data, list):
        return set()
    return {g["uuid"] for g in data if isinstance(g, dict) and isinstance(g.get("uuid"), str)}


def _above(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    """Whether any of the node's quantities ``have`` is above ``want``'s."""
    for k, v in want.items():
        try:
            if k in have and parse_quantity(have[k]) > parse_quantity(v):
                return True
        except QuantityError:
            continue
    return False


def _same_quantity(have: str | None, want: str) -> bool:
    """Whether the node's quantity ``have`` is ``want``: the API server stores quantities in
    canonical form ("1000" comes back as "1k")."""
    try:
        return have is not None and parse_quantity(have) == parse_quantity(want)
    except QuantityError:
        return False


def held_by_pods(pods: Iterable[client.V1Pod], resources: Iterable[str],
                 share: Callable[[client.V1Pod, client.V1Container], Fraction] | None = None
                 ) -> dict[str, int]:
    """How much of each of ``resources`` the pods hold, as the kubelet counts a pod at
    admission: its app containers and sidecars (restartable init containers) together, or an
    init container beside the sidecars started before it, whichever is more (requests, else
    limits). Pods that finished hold nothing. ``share``: the part of each container's asks
    to count (all of them by default), rounded up per pod."""
    held = dict.fromkeys(resources, 0)
    for pod in pods:
        if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
            continue
        spec = pod.spec
        if spec is None:
            continue
        part = {id(c): share(pod, c) if share is not None else Fraction(1)
                for c in [*(spec.init_containers or []), *(spec.containers or [])]}
        for name in held:
            sidecars = init_peak = Fraction(0)
            for c in spec.init_containers or []:
                if c.restart_policy == "Always":
                    sidecars += _asks(c, name) * part[id(c)]
                else:
                    init_peak = max(init_peak, sidecars + _asks(c, name) * part[id(c)])
            apps = sum((_asks(c, name) * part[id(c)] for c in spec.containers or []), Fraction(0))
            held[name] += math.ceil(max(apps + sidecars, init_peak))
    return held


def _asks(container: client.V1Container, name: str) -> int:
    res = container.resources
    if res is None:
        return 0
    value = (res.requests or {}).get(name, (res.limits or {}).get(name))
    try:
        return max(0, math.ceil(parse_quantity(value))) if value is not None else 0
    except QuantityError:
        return 0


def held_off_healthy(pods: Iterable[client.V1Pod], discovery: Discovery,
                     resources: Iterable[str]) -> dict[str, int]:
    """What the pods hold of ``resources`` on GPUs that are not healthy in ``discovery``
    (unhealthy, or gone from it: fallen off the bus, or no driver), by their
    ``gpuslice.io/devices.<container>`` annotations: a container on n GPUs, k of them such,
    holds k/n of what it asks. The scheduler's fit check and the kubelet's admission count
    every pod against the node's totals: totals of the healthy GPUs alone let the pods on a
    failed one take the healthy ones' room (a pod that fits an empty healthy GPU refused), and
    a restarted kubelet reject running pods. Added to the totals, what is left is the room on
    the healthy GPUs; the extender places nothing on the others."""
    healthy = {g.uuid for g in discovery.healthy} if discovery.available else set()

    def share(pod: client.V1Pod, c: client.V1Container) -> Fraction:
        annotations = (pod.metadata.annotations if pod.metadata else None) or {}
        value = annotations.get(names.devices_annotation(c.name or "")) or ""
        uuids = [u.strip() for u in value.split(",") if u.strip()]
        if not uuids:
            return Fraction(0)
        return Fraction(sum(1 for u in uuids if u not in healthy), len(uuids))
    return held_by_pods(pods, resources, share)


def status_patch(capacity: Mapping[str, str] | None, allocatable: Mapping[str, str] | None,
                 want: NodeState, old: Mapping[str, int] | None = None) -> dict[str, Any] | None:
    """The merge patch for ``nodes/{name}/status``; None if capacity and allocatable match.

    ``old``: names no longer published, each at what pods still hold of it (0: taken off)."""
    capacity = capacity or {}
    allocatable = allocatable or {}
    body: dict[str, str | None] = {}
    for k, held in (old or {}).items():
        if k in want.resources:
            continue
        if held > 0:
            if not (_same_quantity(capacity.get(k), str(held))
                    and _same_quantity(allocatable.get(k), str(held))):
                body[k] = str(held)
        elif k in capacity or k in allocatable:
            body[k] = None
    if not body and all(_same_quantity(capacity.get(k), v)
                        and _same_quantity(allocatable.get(k), v)
                        for k, v in want.resources.items()):
        return None
    body.update(want.resources)
    return {"status": {"capacity": dict(body), "allocatable": dict(body)}}


@dataclass(frozen=True)
class PublishOutcome:
    """Which of the two patches were sent; and the node's pods, where the publish listed them
    (from the watch cache: :meth:`Publisher.node_pods` with ``cached``), for the round's
    clean-up to use rather than list them again."""

    metadata_patched: bool
    status_patched: bool
    pods: list[client.V1Pod] | None = None


class Publisher:
    """Talks to the API server for one node."""

    def __init__(self, api_client: client.ApiClient, settings: AgentSettings) -> None:
        self._api = client.CoreV1Api(api_client)
        self._settings = settings
        self._node = settings.node_name
        self._seen: set[str] = set()
        """UUIDs of GPUs discovered or published before: pods may hold slices of one that is
        gone now."""
        self._set: dict[str, str] = {}
        """The resources (capacity) this agent last set or found as it wants them."""
        self._foreign: set[tuple[str, str]] = set()
        """(resource, value) another writer was seen to put there, warned of once each."""

    async def publish(self, discovery: Discovery) -> PublishOutcome:
        """Bring the node's annotation, labels and resources to the discovered state."""
        node = await self._api.read_node(self._node, _request_timeout=TIMEOUT)
        annotations = node.metadata.annotations or {}
        self._seen.update(_published_uuids(annotations))
        self._seen.update(g.uuid for g in discovery.gpus)
        pods: list[client.V1Pod] | None = None
        held_off: dict[str, int] = {}
        status = node.status or client.V1NodeStatus()
        capacity, allocatable = status.capacity or {}, status.allocatable or {}
        self._check_foreign(capacity)
        # some are not healthy now; or the totals carry what pods held on such GPUs (a restarted
        # agent that never saw them, their pods still running)
        if not self._seen <= {g.uuid for g in discovery.healthy} \
                or _above(capacity, desired_state(discovery, self._settings).resources):
            s = self._settings
            try:
                pods = await self.node_pods(cached=True)
            except API_ERRORS:
                # The GPUs' health goes out first, the totals wait for the list: the extender
                # places nothing on a GPU the annotation says is unhealthy.
                meta = metadata_patch(annotations, node.metadata.labels,
                                      desired_state(discovery, self._settings))
                if meta is not None:
                    await self._api.patch_node(  # type: ignore[call-arg]
                        self._node, meta, _content_type=MERGE_PATCH, _request_timeout=TIMEOUT)
                raise
            held_off = held_off_healthy(pods, discovery,
                                        (s.resource_gpu, s.resource_mem, s.resource_cores))
            self._forget_departed(discovery, pods)
        want = desired_state(discovery, self._settings, held_off)
        stale = recorded_resources(annotations) - set(want.resources)
        # recorded before they are published; the old ones stay recorded until they are off
        meta = metadata_patch(annotations, node.metadata.labels, want,
                              resources_record([*want.resources, *stale]))
        # The generated client accepts _content_type at run time (its **kwargs), though its
        # signature does not declare it; without it a dict body goes as strategic-merge.
        if meta is not None:
            await self._api.patch_node(  # type: ignore[call-arg]
                self._node, meta, _content_type=MERGE_PATCH, _request_timeout=TIMEOUT)
        on_node = {k for k in stale if k in capacity or k in allocatable}
        if on_node and pods is None:
            pods = await self.node_pods(cached=True)
        held = held_by_pods(pods or [], on_node) if on_node else {}
        spatch = status_patch(capacity, allocatable, want, held)
        if spatch is not None:
            await self._api.patch_node_status(  # type: ignore[call-arg]
                self._node, spatch, _content_type=MERGE_PATCH, _request_timeout=TIMEOUT)
        self._set = dict(want.resources)
        forget = bool(stale) and not any(held.values())
        if forget:  # off the node now: forgotten, so taken off only once
            await self._api.patch_node(  # type: ignore[call-arg]
                self._node, {"metadata": {"annotations": {
                    names.ANN_NODE_RESOURCES: resources_record(want.resources)}}},
                _content_type=MERGE_PATCH, _request_timeout=TIMEOUT)
        return PublishOutcome(meta is not None or forget, spatch is not None, pods)

    def _forget_departed(self, discovery: Discovery, pods: Iterable[client.V1Pod]) -> None:
        """Once more than :data:`~webhook.node.inventory.DEPARTED_KEPT` GPUs gone from the
        discovery are remembered, forget those no pod of the node (``pods``, just listed)
        holds a slice of: each replaced GPU's UUID stayed for the agent's lifetime."""
        present = {g.uuid for g in discovery.gpus}
        if not discovery.available or len(self._seen - present) <= DEPARTED_KEPT:
            return  # (without NVML every GPU is missing, none known gone)
        held = {u.strip() for p in pods if p.metadata and p.metadata.annotations
                for k, v in p.metadata.annotations.items()
                if k.startswith(names.ANN_DEVICES_PREFIX) and isinstance(v, str)
                for u in v.split(",")}
        self._seen &= present | held

    def _check_foreign(self, capacity: Mapping[str, str]) -> None:
        """Warn (once per value) where a resource this agent set holds another value now: a
        device plugin advertising the same name (the kubelet writes its count back at each
        status update), the two writers taking turns. A resource gone altogether is a node
        registered again, and one at 0 the kubelet's reset of a node it finds rebuilt (it zeroes
        every extended resource until its owner publishes it): not another writer."""
        for name, value in self._set.items():
            found = capacity.get(name)
            if found is None or _same_quantity(found, value) or _same_quantity(found, "0") \
                    or (name, found) in self._foreign:
                continue
            self._foreign.add((name, found))
            logger.warning("a resource the agent publishes was changed by another writer (a "
                           "device plugin? gpuslice needs none on its nodes); setting it back",
                           extra={"node": self._node, "resource": name, "published": value,
                                  "found": found})

    async def live_pod_uids(self) -> set[str]:
        """UIDs of every pod the API server has on this node (all pages; raises on error)."""
        return {p.metadata.uid for p in await self.node_pods() if p.metadata and p.metadata.uid}

    async def node_pods(self, *, cached: bool = False) -> list[client.V1Pod]:
        """Every pod the API server has on this node (all pages; raises on error).

        By default a consistent read: the API server reads every pod of the cluster from etcd
        to pick this node's. ``cached``: from its watch cache (``resourceVersion=0``, indexed
        by node), which may lag a little: for what runs every round on every node."""
        out: list[client.V1Pod] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={self._node}",
                                      "limit": 500, "_request_timeout": TIMEOUT}
            if token:
                kwargs["_continue"] = token  # (a continue carries its own resourceVersion)
            elif cached:
                kwargs["resource_version"] = "0"
            pods = await self._api.list_pod_for_all_namespaces(**kwargs)
            out.extend(pods.items)
            token = pods.metadata._continue if pods.metadata else None
            if not token:
                return out
