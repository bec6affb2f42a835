"""What a pod asks of the GPUs: per-container slices and the pod's placement preferences.

Pure parsing of a Pod object (as JSON) into :class:`PodRequest`. Each container is read by the
webhook's own reader (:mod:`webhook.admission.requests`), so both apply DESIGN.md §1 alike:

* ``gpu`` = number of distinct GPUs; ``gpumem`` (MiB) or ``gpumem-percentage`` per GPU;
  ``gpucores`` (% of compute) per GPU; 100 cores = the GPU is exclusive to the container.
* ``gpumem``/``gpucores`` without ``gpu`` mean one GPU; ``gpu`` alone means whole, exclusive
  GPUs (100% memory, 100 cores). No memory given (only ``gpu`` and ``gpucores``) means 100% of
  the memory, no cores given means 0 (no compute share reserved, no throttling), as in HAMi.
* Values come from ``resources.limits``; ``requests``, if given, must equal them.
* Init containers run one at a time before the app containers; restartable init containers
  (``restartPolicy: Always``, native sidecars) keep running beside everything declared after
  them. :func:`webhook.placement.fit.pod_demand` turns that into per-GPU demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from webhook import names
from webhook.admission.requests import read_policy, read_request
from webhook.settings import Settings

Kind = Literal["app", "init", "sidecar"]
NOT_ADMITTED = (f"gpuslice: pod was not admitted by the gpuslice webhook (no {names.ANN_MUTATED} "
                f"annotation): its GPU limits would not be enforced; recreate it in a namespace "
                f"the webhook serves")
"""Why a GPU pod the webhook never mutated is not placed (filter and bind)."""


class RequestError(ValueError):
    """The pod's GPU requests or placement annotations are invalid; the message says why."""


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU slice: ``count`` distinct GPUs, each with this memory and compute."""

    name: str
    kind: Kind
    order: int
    """Position in ``containers`` (app) or ``initContainers`` (init, sidecar)."""
    count: int
    mem_mib: int | None
    """MiB per GPU, or None when the request is a percentage."""
    mem_percent: int | None
    """% of each GPU's memory, or None when the request is in MiB."""
    cores: int
    """% of each GPU's compute, 0-100; 100 means exclusive."""

    @property
    def exclusive(self) -> bool:
        return self.cores >= 100

    def memory_on(self, gpu_memory_mib: int) -> int:
        """MiB this container takes on a GPU with ``gpu_memory_mib`` of memory."""
        if self.mem_mib is not None:
            return self.mem_mib
        return gpu_memory_mib * (self.mem_percent or 0) // 100

    def describe(self) -> str:
        mem = f"{self.mem_mib} MiB" if self.mem_mib is not None else f"{self.mem_percent}% memory"
        gpus = "1 GPU" if self.count == 1 else f"{self.count} distinct GPUs"
        return f"{gpus} with {mem} and {self.cores}% compute"


@dataclass(frozen=True, slots=True)
class PodRequest:
    """Every GPU-requesting container of a pod, and how the pod wants to be placed."""

    containers: tuple[ContainerRequest, ...]
    policy: str
    include_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    include_uuids: tuple[str, ...] = ()
    exclude_uuids: tuple[str, ...] = ()

    @property
    def wants_gpus(self) -> bool:
        return bool(self.containers)

    def shape_key(self) -> tuple[Any, ...]:
        """A hashable key: two pods with equal keys fit and score identically."""
        return (self.containers and tuple((c.kind, c.order, c.count, c.mem_mib, c.mem_percent,
                                           c.cores) for c in self.containers),
                self.policy, self.include_types, self.exclude_types, self.include_uuids,
                self.exclude_uuids)


def container_request(container: dict[str, Any], kind: Kind, order: int,
                      settings: Settings) -> ContainerRequest | None:
    """Parse one container's GPU resources; None when it asks for no GPU.

    The rules are the webhook's (:func:`webhook.admission.requests.read_request`), so the
    extender and the webhook can never disagree on what a container asks for.
    """
    name = str(container.get("name") or "")
    reasons: list[str] = []
    req = read_request(container, settings, None, reasons)
    if reasons:
        raise RequestError(f"container {name!r}: " + "; ".join(reasons))
    if req is None:
        return None
    return ContainerRequest(name, kind, order, req.count, req.memory_mib, req.memory_percent,
                            req.cores or 0)


def _csv(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(sorted({p.strip().lower() for p in str(value).split(",") if p.strip()}))


def _either(annotations: dict[str, Any], ours: str, hami: str) -> tuple[str, ...]:
    return tuple(sorted(set(_csv(annotations.get(ours))) | set(_csv(annotations.get(hami)))))


def admitted(pod: dict[str, Any]) -> bool:
    """The webhook mutated the pod: it carries the interposer and its caps.

    A GPU pod without the mark (its namespace opted out, ``schedulerName`` set by hand, or
    created while the webhook was down with ``failurePolicy: Ignore``) would use its slice
    unchecked, so the extender does not place it.
    """
    return bool(((pod.get("metadata") or {}).get("annotations") or {}).get(names.ANN_MUTATED))


def pod_request(pod: dict[str, Any], settings: Settings, *, bound: bool = False) -> PodRequest:
    """Parse a pod's GPU requests and placement annotations (raises :class:`RequestError`).

    ``bound``: the pod is placed already, so its policy no longer matters; one that is not
    known (the annotation stays editable after creation) is read as the default, not an error.
    """
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    containers: list[ContainerRequest] = []
    for i, c in enumerate(spec.get("initContainers") or []):
        kind: Kind = "sidecar" if (c or {}).get("restartPolicy") == "Always" else "init"
        req = container_request(c or {}, kind, i, settings)
        if req is not None:
            containers.append(req)
    for i, c in enumerate(spec.get("containers") or []):
        req = container_request(c or {}, "app", i, settings)
        if req is not None:
            containers.append(req)
    read = read_policy(annotations, names.ANN_PLACEMENT, names.HAMI_POLICY)
    if not read.valid and not bound:
        raise RequestError(f"annotation {read.key}: {read.value!r} is not one of binpack, spread")
    policy = read.policy or settings.default_policy
    return PodRequest(
        containers=tuple(containers), policy=policy,
        include_types=_either(annotations, names.ANN_GPU_TYPE, names.HAMI_USE_GPUTYPE),
        exclude_types=_either(annotations, names.ANN_AVOID_GPU_TYPE, names.HAMI_NOUSE_GPUTYPE),
        include_uuids=_either(annotations, names.ANN_GPU_UUID, names.HAMI_USE_GPUUUID),
        exclude_uuids=_either(annotations, names.ANN_AVOID_GPU_UUID, names.HAMI_NOUSE_GPUUUID),
    )
