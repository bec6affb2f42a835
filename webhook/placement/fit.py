"""Pure placement: does a pod fit a node's GPUs, which GPUs, and how good is the node.

No I/O and no shared state: given a :class:`PodRequest`, a node's GPUs and what is already
taken on each (:class:`Usage` by UUID), :func:`place` returns a :class:`Placement` (the GPUs
of every container, the pod's per-GPU demand and the node's score) or a :class:`NoFit` with a
reason a user can read in ``kubectl describe pod``.

A GPU fits a container (DESIGN.md §3) when free memory ≥ request, free compute ≥ request,
slices on it < split count, type/UUID filters match, it is healthy, and no exclusive container
holds it (an exclusive container needs an empty GPU). A multi-GPU container gets distinct GPUs.
Init containers run one at a time before the app containers, so each is placed against the
other pods' usage plus the sidecars started before it, and the pod's demand on a GPU is the
maximum over its phases, never the sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from webhook.placement.inventory import Gpu, Usage
from webhook.placement.request import ContainerRequest, PodRequest

_EMPTY = Usage()


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pod goes on a node."""

    assignment: dict[str, tuple[str, ...]]
    """Container name → UUIDs of its GPUs."""
    demand: dict[str, Usage]
    """UUID → what the pod takes on that GPU (maximum over init and app phases)."""
    score: int
    """Node score 0-10 for the pod's policy (higher is better)."""


@dataclass(frozen=True, slots=True)
class NoFit:
    """Why a pod does not fit a node; ``unresolvable`` when even an empty node would not do."""

    reason: str
    unresolvable: bool


def eligible_gpus(req: PodRequest, gpus: Sequence[Gpu]) -> tuple[list[Gpu], str]:
    """The GPUs the pod may use (healthy, filters matched) and a note on what was left out."""
    out: list[Gpu] = []
    unhealthy = by_type = by_uuid = 0
    for g in gpus:
        if not g.healthy:
            unhealthy += 1
            continue
        product = g.product.lower()
        if (req.include_types and not any(t in product for t in req.include_types)) \
                or any(t in product for t in req.exclude_types):
            by_type += 1
            continue
        uuid = g.uuid.lower()
        if (req.include_uuids and uuid not in req.include_uuids) or uuid in req.exclude_uuids:
            by_uuid += 1
            continue
        out.append(g)
    notes = [what for n, what in ((unhealthy, "unhealthy GPUs skipped"),
                                  (by_type, "GPUs excluded by GPU type annotations"),
                                  (by_uuid, "GPUs excluded by GPU UUID annotations")) if n]
    return out, ", ".join(notes)


def _refusal(c: ContainerRequest, g: Gpu, u: Usage, split_count: int) -> str | None:
    """None when ``c`` fits one slice on ``g`` with ``u`` taken, else the short reason."""
    if u.exclusive:
        return "held exclusively"
    if c.exclusive and u.slices:
        return "not empty (exclusive request)"
    if u.slices >= split_count:
        return f"at the split limit of {split_count}"
    if u.mem + c.memory_on(g.memory_mib) > g.memory_mib:
        return "too little free memory"
    if u.cores + c.cores > 100:
        return "too little free compute"
    return None


def _order_key(policy: str, c: ContainerRequest, g: Gpu, u: Usage) -> tuple[float, ...]:
    if policy == "spread":
        return (u.mem / g.memory_mib, u.slices, u.cores, g.index)
    # binpack: best fit, the GPU with the least memory left after this slice first
    return (g.memory_mib - u.mem - c.memory_on(g.memory_mib), -u.slices, -u.cores, g.index)


def _choose(c: ContainerRequest, gpus: list[Gpu], used: Mapping[str, Usage], policy: str,
            split_count: int) -> tuple[tuple[str, ...], str | None]:
    fitting: list[Gpu] = []
    reasons: dict[str, int] = {}
    for g in gpus:
        why = _refusal(c, g, used.get(g.uuid, _EMPTY), split_count)
        if why is None:
            fitting.append(g)
        else:
            reasons[why] = reasons.get(why, 0) + 1
    if len(gpus) < c.count:
        return (), (f"gpuslice: container {c.name!r} needs {c.describe()}; the node has "
                    f"{len(gpus)} usable GPU{'s' if len(gpus) != 1 else ''}")
    if len(fitting) < c.count:
        # No per-node counts: kube-scheduler groups identical reasons across nodes.
        detail = ", ".join(sorted(reasons))
        return (), (f"gpuslice: container {c.name!r} needs {c.describe()}; not enough GPUs "
                    f"with room" + (f" ({detail})" if detail else ""))
    if len(fitting) > c.count:
        fitting.sort(key=lambda g: _order_key(policy, c, g, used.get(g.uuid, _EMPTY)))
    return tuple(g.uuid for g in fitting[:c.count]), None


def _slice(c: ContainerRequest, memory_mib: int) -> Usage:
    return Usage(c.memory_on(memory_mib), c.cores, 1, 1 if c.exclusive else 0)


def pod_demand(req: PodRequest, assignment: Mapping[str, Sequence[str]],
               memory_of: Mapping[str, int]) -> dict[str, Usage]:
    """Per-GPU demand of a placed pod: app containers and sidecars add up; each init container
    adds to the sidecars declared before it; the pod takes the maximum over these phases."""
    demand: dict[str, Usage] = {}
    running = [c for c in req.containers if c.kind != "init"]
    for c in running:
        for uuid in assignment.get(c.name, ()):
            demand.setdefault(uuid, Usage()).add(_slice(c, memory_of.get(uuid, 0)))
    for init in (c for c in req.containers if c.kind == "init"):
        phase: dict[str, Usage] = {}
        for c in running:
            if c.kind == "sidecar" and c.order < init.order:
                for uuid in assignment.get(c.name, ()):
                    phase.setdefault(uuid, Usage()).add(_slice(c, memory_of.get(uuid, 0)))
        for uuid in assignment.get(init.name, ()):
            phase.setdefault(uuid, Usage()).add(_slice(init, memory_of.get(uuid, 0)))
        for uuid, u in phase.items():
            demand.setdefault(uuid, Usage()).maximum(u)
    return demand


def node_score(policy: str, gpus: Sequence[Gpu], usage: Mapping[str, Usage],
               demand: Mapping[str, Usage]) -> int:
    """0-10: binpack favours nodes that are fuller after the pod, spread emptier ones.

    Fullness is the dominant share (memory or compute, whichever is larger) over the node's
    healthy GPUs once the pod's demand is added."""
    total_mem = used_mem = used_cores = n = 0
    for g in gpus:
        if not g.healthy:
            continue
        n += 1
        total_mem += g.memory_mib
        u, d = usage.get(g.uuid, _EMPTY), demand.get(g.uuid, _EMPTY)
        used_mem += min(g.memory_mib, u.mem + d.mem)
        used_cores += min(100, u.cores + d.cores)
    if not n:
        return 0
    fullness = max(used_mem / total_mem, used_cores / (100 * n))
    score = round(10 * fullness)
    return score if policy == "binpack" else 10 - score


def _try(req: PodRequest, gpus: list[Gpu], usage: Mapping[str, Usage],
         split_count: int) -> tuple[dict[str, tuple[str, ...]], str | None]:
    assignment: dict[str, tuple[str, ...]] = {}
    memory_of = {g.uuid: g.memory_mib for g in gpus}
    running = sorted((c for c in req.containers if c.kind != "init"),
                     key=lambda c: (-c.count, -c.cores, -(c.mem_mib or 0), -(c.mem_percent or 0)))
    work = {uuid: u.copy() for uuid, u in usage.items() if uuid in memory_of}
    for c in running:
        chosen, why = _choose(c, gpus, work, req.policy, split_count)
        if why:
            return assignment, why
        assignment[c.name] = chosen
        for uuid in chosen:
            work.setdefault(uuid, Usage()).add(_slice(c, memory_of[uuid]))
    for init in (c for c in req.containers if c.kind == "init"):
        base = {uuid: u.copy() for uuid, u in usage.items() if uuid in memory_of}
        for c in running:
            if c.kind == "sidecar" and c.order < init.order:
                for uuid in assignment[c.name]:
                    base.setdefault(uuid, Usage()).add(_slice(c, memory_of[uuid]))
        chosen, why = _choose(init, gpus, base, req.policy, split_count)
        if why:
            return assignment, why
        assignment[init.name] = chosen
    return assignment, None


def place(req: PodRequest, gpus: Sequence[Gpu], usage: Mapping[str, Usage],
          split_count: int) -> Placement | NoFit:
    """Choose GPUs for every GPU container of ``req`` on a node, or say why it cannot."""
    usable, note = eligible_gpus(req, gpus)
    suffix = f" [{note}]" if note else ""
    if not usable:
        return NoFit("gpuslice: no usable GPU on this node" + (f" ({note})" if note else ""),
                     unresolvable=True)
    assignment, why = _try(req, usable, usage, split_count)
    if why:
        _, empty_why = _try(req, usable, {}, split_count) if usage else (None, why)
        return NoFit(why + suffix, unresolvable=bool(empty_why))
    demand = pod_demand(req, assignment, {g.uuid: g.memory_mib for g in usable})
    return Placement(assignment, demand, node_score(req.policy, gpus, usage, demand))
