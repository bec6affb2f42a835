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

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from webhook.placement.inventory import Gpu, Usage
from webhook.placement.request import ContainerRequest, PodRequest


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
    if not (req.include_types or req.exclude_types or req.include_uuids or req.exclude_uuids):
        out = [g for g in gpus if g.healthy]
        return out, "" if len(out) == len(gpus) else "unhealthy GPUs skipped"
    out = []
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


def _choose(c: ContainerRequest, gpus: list[Gpu], used: Mapping[str, Usage], policy: str,
            split_count: int) -> tuple[list[Gpu], str | None]:
    """Pick ``c.count`` distinct GPUs for ``c`` in policy order, or say why there are too few.

    The hot path of filter and prioritize (once per node per pod): one pass that both tests
    each GPU (DESIGN.md §3, in the order of the reasons given) and orders the fitting ones.
    """
    if len(gpus) < c.count:
        return [], (f"gpuslice: container {c.name!r} needs {c.describe()}; the node has "
                    f"{len(gpus)} usable GPU{'s' if len(gpus) != 1 else ''}")
    spread = policy == "spread"
    cores, exclusive, fixed, pct = c.cores, c.exclusive, c.mem_mib, c.mem_percent or 0
    fitting: list[tuple[tuple[float, ...], int, Gpu]] = []
    refused: set[str] = set()
    for i, g in enumerate(gpus):
        u = used.get(g.uuid)
        total = g.memory_mib
        need = fixed if fixed is not None else total * pct // 100
        if u is None:
            taken = slices = busy = held = 0
        else:
            taken, slices, busy, held = u.mem, u.slices, u.cores, u.exclusive
        if held:
            refused.add("held exclusively")
        elif exclusive and slices:
            refused.add("not empty (exclusive request)")
        elif slices >= split_count:
            refused.add(f"at the split limit of {split_count}")
        elif taken + need > total:
            refused.add("too little free memory")
        elif busy + cores > 100:
            refused.add("too little free compute")
        elif spread:
            fitting.append(((taken / total, slices, busy, g.index), i, g))
        else:  # binpack: best fit, the GPU with the least memory left after this slice first
            fitting.append(((total - taken - need, -slices, -busy, g.index), i, g))
    if len(fitting) < c.count:
        # No per-node counts: kube-scheduler groups identical reasons across nodes.
        detail = ", ".join(sorted(refused))
        return [], (f"gpuslice: container {c.name!r} needs {c.describe()}; not enough GPUs "
                    f"with room" + (f" ({detail})" if detail else ""))
    if c.count == 1:
        return [min(fitting)[2]], None
    fitting.sort()
    return [g for _, _, g in fitting[:c.count]], None


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
        if g.healthy:
            n += 1
            total_mem += g.memory_mib
            u = usage.get(g.uuid)
            if u is not None:
                used_mem += u.mem
                used_cores += u.cores
    for d in demand.values():
        used_mem += d.mem
        used_cores += d.cores
    if not n:
        return 0
    fullness = min(1.0, max(used_mem / total_mem, used_cores / (100 * n)))
    score = round(10 * fullness)
    return score if policy == "binpack" else 10 - score


def _try(req: PodRequest, gpus: list[Gpu], usage: Mapping[str, Usage], split_count: int,
         memory_of: Mapping[str, int]) -> tuple[dict[str, tuple[str, ...]], str | None]:
    running = [c for c in req.containers if c.kind != "init"]
    if len(running) > 1:
        # the largest first; a percentage as the MiB it takes on this node's largest GPU (sorted
        # as 0 MiB it went after every fixed size: a pod that fits was refused, mutation testing)
        largest = max((g.memory_mib for g in gpus), default=0)
        running.sort(key=lambda c: (-c.count, -c.cores, -c.memory_on(largest)))
    inits = [c for c in req.containers if c.kind == "init"]
    assignment: dict[str, tuple[str, ...]] = {}
    work = usage
    for i, c in enumerate(running):
        chosen, why = _choose(c, gpus, work, req.policy, split_count)
        if why:
            return assignment, why
        assignment[c.name] = tuple(g.uuid for g in chosen)
        if i + 1 < len(running):  # later containers of this pod see this one's slices
            work = _plus(work, assignment[c.name], c, memory_of)
    for init in inits:
        base = usage
        for c in running:
            if c.kind == "sidecar" and c.order < init.order:
                base = _plus(base, assignment[c.name], c, memory_of)
        chosen, why = _choose(init, gpus, base, req.policy, split_count)
        if why:
            return assignment, why
        assignment[init.name] = tuple(g.uuid for g in chosen)
    return assignment, None


def _plus(usage: Mapping[str, Usage], uuids: Sequence[str], c: ContainerRequest,
          memory_of: Mapping[str, int]) -> dict[str, Usage]:
    """A copy of ``usage`` with one slice of ``c`` added on each of ``uuids`` (copy on write)."""
    out = dict(usage)
    for uuid in uuids:
        u = out[uuid].copy() if uuid in out else Usage()
        u.add(_slice(c, memory_of[uuid]))
        out[uuid] = u
    return out


@functools.lru_cache(maxsize=4096)
def _fails_when_empty(req: PodRequest, memories: tuple[int, ...], split_count: int) -> bool:
    """Whether the pod would not fit even on empty GPUs of these sizes (the usable GPUs of a
    node: preemption cannot help). Keyed by sizes alone, so nodes of one model share it."""
    gpus = [Gpu(str(i), i, "", m, True) for i, m in enumerate(memories)]
    return _try(req, gpus, {}, split_count, {g.uuid: g.memory_mib for g in gpus})[1] is not None


def place(req: PodRequest, gpus: Sequence[Gpu], usage: Mapping[str, Usage],
          split_count: int) -> Placement | NoFit:
    """Choose GPUs for every GPU container of ``req`` on a node, or say why it cannot."""
    usable, note = eligible_gpus(req, gpus)
    suffix = f" [{note}]" if note else ""
    if not usable:
        return NoFit("gpuslice: no usable GPU on this node" + (f" ({note})" if note else ""),
                     unresolvable=True)
    if len(req.containers) == 1 and req.containers[0].kind == "app":
        # The common pod, one GPU container: no phases, no intra-pod sharing to track.
        c = req.containers[0]
        chosen, why = _choose(c, usable, usage, req.policy, split_count)
        if why:
            unresolvable = _fails_when_empty(req, tuple(g.memory_mib for g in usable),
                                             split_count) if usage else True
            return NoFit(why + suffix, unresolvable=unresolvable)
        demand = {g.uuid: _slice(c, g.memory_mib) for g in chosen}
        return Placement({c.name: tuple(g.uuid for g in chosen)}, demand,
                         node_score(req.policy, gpus, usage, demand))
    memory_of = {g.uuid: g.memory_mib for g in usable}
    assignment, why = _try(req, usable, usage, split_count, memory_of)
    if why:
        unresolvable = _fails_when_empty(req, tuple(g.memory_mib for g in usable),
                                             split_count) if usage else True
        return NoFit(why + suffix, unresolvable=unresolvable)
    demand = pod_demand(req, assignment, memory_of)
    return Placement(assignment, demand, node_score(req.policy, gpus, usage, demand))
