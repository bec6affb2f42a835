"""Which pods to preempt on a node so that a GPU pod fits its GPUs (the ``preempt`` verb).

kube-scheduler's default preemption dry-runs each candidate node with its in-tree filter
plugins only: it sees the node totals of the extended resources the agent publishes, never
which GPU has room, so its victims may free memory spread over several GPUs (or on the wrong
one) while the pod needs it on one. With a ``preemptVerb`` it sends the extender each candidate
node with its victims and takes back the nodes and victims the extender accepts.

:func:`choose_victims` runs the scheduler's own per-node algorithm (``SelectVictimsOnNode``)
with the per-GPU fit of :func:`webhook.placement.fit.place` as the filter: take every GPU pod
of lower priority off the node; if the pod does not fit even then, no victims can help. Else
give pods back, the most important first (higher priority, then, of one priority, the
scheduler's own choices last and the earlier started first), keeping each that still lets the
pod fit; those that do not are the victims. So only pods of lower priority than the preemptor
are ever chosen, the lowest priorities first, and none that does not help. Where a smaller set
of pods of no higher priority would do (a bounded search), it is taken instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from webhook.placement.fit import NoFit, eligible_gpus, place
from webhook.placement.inventory import Gpu, Usage, add_usage
from webhook.placement.request import PodRequest
from webhook.placement.state import NodeState, PodAlloc

_SEARCH_LIMIT = 256
"""Sets of pods :func:`_fewer` tries on one node at most (each a per-GPU fit)."""


def _with(usage: Mapping[str, Usage], demand: Mapping[str, Usage],
          sign: int) -> dict[str, Usage]:
    """A copy of ``usage`` with ``demand`` added (``sign`` 1) or taken off (-1)."""
    out = dict(usage)
    add_usage(out, demand, sign)
    return out


def _fits(req: PodRequest, node: NodeState, usage: Mapping[str, Usage],
          split_count: int) -> bool:
    return not isinstance(place(req, node.gpus, usage, split_count), NoFit)


def choose_victims(req: PodRequest, priority: int, node: NodeState,
                   allocs: Mapping[str, PodAlloc], proposed: Collection[str],
                   split_count: int,
                   held: Mapping[str, Usage] | None = None) -> list[str] | None:
    """The UIDs of the GPU pods on ``node`` to preempt so that ``req`` fits its GPUs, or None
    when no set of them can make it fit.

    Victims are pods of lower ``priority`` than the preemptor's that hold GPUs on the node:
    bound ones (the watch saw them, so the scheduler knows them too) and, of those still being
    bound (assumed), only ones the scheduler itself proposed (``proposed``; it knows those as
    on the node: it rejects a victim it does not). [] when the pod fits without preempting
    any GPU pod. ``held``: the node's usage with the GPUs held for pods nominated there
    (:meth:`ClusterState.held_usage`), which victims cannot free; None: ``node.usage``.
    """
    base = node.usage if held is None else held
    pool: list[PodAlloc] = []
    for uid in node.pods:
        alloc = allocs.get(uid)
        if alloc is None or not alloc.demand or alloc.priority >= priority:
            continue
        if alloc.assumed and uid not in proposed:
            continue
        pool.append(alloc)
    usage = base
    for alloc in pool:
        usage = _with(usage, alloc.demand, -1)
    if not _fits(req, node, usage, split_count):
        return None
    # Pods being deleted free their GPUs whatever is preempted: the running victims are
    # chosen as if they were gone, and they are given back last (taken before any running
    # pod), kept only where the pod fits beside them.
    going = [a for a in pool if a.terminating]
    running = [a for a in pool if not a.terminating]
    rest = base
    for alloc in going:
        rest = _with(rest, alloc.demand, -1)
    for pods in (running, going):  # the most important first: the order they are given back
        pods.sort(key=lambda a: (-a.priority, a.uid in proposed, a.started or "~", a.uid))
    usage, victims = _give_back(req, node, usage, running, split_count)
    if len(victims) > 1:
        victims = _fewer(req, node, rest, running, victims, proposed, split_count)
        usage = rest
        for alloc in victims:
            usage = _with(usage, alloc.demand, -1)
    return [a.uid for a in victims + _give_back(req, node, usage, going, split_count)[1]]


def _give_back(req: PodRequest, node: NodeState, usage: Mapping[str, Usage],
               pods: list[PodAlloc],
               split_count: int) -> tuple[Mapping[str, Usage], list[PodAlloc]]:
    """Give ``pods`` (taken off ``usage``) back in their order, each that still lets the pod
    fit: the usage then, and the pods that could not be given back (the victims)."""
    victims: list[PodAlloc] = []
    for alloc in pods:
        trial = _with(usage, alloc.demand, 1)
        if _fits(req, node, trial, split_count):
            usage = trial
        else:
            victims.append(alloc)
    return usage, victims


def _cost(victims: Iterable[PodAlloc], proposed: Collection[str]) -> tuple[int, int, int]:
    """kube-scheduler's preference among nodes' victims, for victims of one node: the lowest
    highest priority, then the smallest sum of priorities (each offset by 2^31, as it adds
    them: in effect the fewest, then the lowest priorities); then the most of its own."""
    chosen = list(victims)
    return (max(a.priority for a in chosen), sum(a.priority + 2**31 for a in chosen),
            sum(a.uid not in proposed for a in chosen))


def _least(amounts: list[int], short: int) -> int:
    """How many of ``amounts`` at least add up to ``short`` (a bound on the victims any set
    needs); one more than there are when all of them do not."""
    if short <= 0:
        return 0
    total = 0
    for n, amount in enumerate(sorted(amounts, reverse=True), 1):
        total += amount
        if total >= short:
            return n
    return len(amounts) + 1


class _Group(NamedTuple):
    """Pods to search among for a smaller set of victims, and what any set that helps must free."""

    least: int
    """The fewest victims any set of ``pods`` that helps needs."""
    pods: list[PodAlloc]
    mem: int
    """MiB a set must free in all: on one GPU, or over every GPU (as ``freed`` counts)."""
    cores: int
    """Compute (%) a set must free, likewise."""
    freed: dict[str, tuple[int, int]]
    """UID → the memory and compute each of ``pods`` frees there."""


def _frees(alloc: PodAlloc, on: str | None) -> tuple[int, int]:
    """Memory and compute ``alloc`` frees on GPU ``on`` (None: on all its GPUs together)."""
    if on is not None:
        u = alloc.demand.get(on) or Usage()
        return u.mem, u.cores
    return sum(u.mem for u in alloc.demand.values()), sum(u.cores for u in alloc.demand.values())


def _group(pods: list[PodAlloc], mem: int, cores: int, on: str | None) -> _Group:
    """The group of ``pods`` that must free ``mem`` and ``cores`` on GPU ``on`` (None: on all)."""
    freed = {a.uid: _frees(a, on) for a in pods}
    least = max(_least([m for m, _ in freed.values()], mem),
                _least([c for _, c in freed.values()], cores), 1)
    return _Group(least, pods, mem, cores, freed)


def _groups(req: PodRequest, node: NodeState, base: Mapping[str, Usage],
            candidates: list[PodAlloc]) -> list[_Group]:
    """The sets to search, each with what any set of it that helps must free.

    A pod whose one container takes one GPU fits or not by that GPU's usage alone, so the
    fewest victims are pods on one GPU: one group per GPU, bounded below by the memory and
    compute its pods must free there. A pod whose one container takes ``count`` GPUs needs
    that many GPUs with room: any set must free at least what the ``count`` GPUs that lack the
    least lack together (a victim frees its demand on its own GPUs only). Any other pod: one
    group of every candidate, unbounded."""
    if len(req.containers) != 1 or req.containers[0].kind != "app":
        return [_group(candidates, 0, 0, None)]
    c = req.containers[0]
    usable, _ = eligible_gpus(req, node.gpus)
    short: list[tuple[int, int, Gpu]] = []
    for gpu in usable:
        used = base.get(gpu.uuid) or Usage()
        short.append((max(0, used.mem + c.memory_on(gpu.memory_mib) - gpu.memory_mib),
                      max(0, used.cores + c.cores - 100), gpu))
    if c.count != 1 or len(short) < c.count:
        mem = sum(sorted(m for m, _, _ in short)[:c.count])
        cores = sum(sorted(k for _, k, _ in short)[:c.count])
        return [_group(candidates, mem, cores, None)]
    out = []
    for mem, cores, gpu in short:
        on = [a for a in candidates if gpu.uuid in a.demand]
        if on:
            out.append(_group(on, mem, cores, gpu.uuid))
    return out


def _fewer(req: PodRequest, node: NodeState, base: Mapping[str, Usage], pool: list[PodAlloc],
           victims: list[PodAlloc], proposed: Collection[str],
           split_count: int) -> list[PodAlloc]:
    """Fewer victims than the give-back order found, when a set of them frees the room: the
    order gives back the most important pods first, not the ones that matter least to the
    fit (a pod on two GPUs given back may leave two others, one on each, to be taken).

    Sets of each size below ``victims``' are tried, smallest first, among the pods of no
    higher priority than its highest; the best of the first size that fits wins. A set that
    frees less than its group's bound is passed over without a fit. At most
    ``_SEARCH_LIMIT`` sets are tried on a node: past that, ``victims`` stands.
    """
    top = max(a.priority for a in victims)
    groups = _groups(req, node, base, [a for a in pool if a.priority <= top])
    tried = 0
    for size in range(1, len(victims)):
        best: tuple[tuple[int, int, int], tuple[PodAlloc, ...]] | None = None
        for group in groups:
            if size < group.least:
                continue
            freed = group.freed
            for subset in itertools.combinations(group.pods, size):
                tried += 1
                if tried > _SEARCH_LIMIT:
                    return victims
                if sum(freed[a.uid][0] for a in subset) < group.mem or \
                        sum(freed[a.uid][1] for a in subset) < group.cores:
                    continue
                usage = base
                for alloc in subset:
                    usage = _with(usage, alloc.demand, -1)
                if _fits(req, node, usage, split_count):
                    cost = _cost(subset, proposed)
                    if best is None or cost < best[0]:
                        best = (cost, subset)
        if best is not None:
            return list(best[1])
    return victims


def importance_order(kept: Iterable[str], added: Iterable[str],
                     known: Mapping[str, tuple[int, str]]) -> list[str]:
    """The victims the most important first, as kube-scheduler lists a node's victims (its
    choice among nodes reads the first as the highest priority of them).

    ``kept``: the scheduler's own victims that stay, in its order; ``added``: the others;
    ``known``: UID → (priority, startTime) of every one of them (a pod without GPUs sent as a
    UID: the priority the watch saw, its start unknown). By priority, then the earlier
    started; of a tie, the scheduler's own first, in its order.
    """
    def rank(uid: str) -> tuple[int, str]:
        priority, started = known[uid]
        return -priority, started or "~"

    return sorted([*kept, *sorted(added)], key=rank)
