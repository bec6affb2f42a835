"""The GPUs held on a node for the pods nominated there, kept between requests.

kube-scheduler's filters treat each pod nominated to a node with a priority at least the
filtered pod's, other than the pod itself, as on the node (addGENominatedPods). Each such pod
(the highest priority first, then by UID) is placed by the per-GPU fit against the usage
without the pods being deleted (its victims, still ending), then added to the usage: the GPUs
its victims free are its. One that does not fit even so holds nothing (its victims cannot make
room for it). A nominee with an allocation (its bind under way, or seen bound) counts through
that instead.

Filter and prioritize ask for the holds of every candidate node, and bind and preempt for
theirs; a wave of preemption nominates hundreds of pods at once. Worked out on every request,
the holds cost a sort and one ``place`` per nominee on each node, and the pod's own fit beside
them could not be reused by prioritize or bind. Yet they depend on the pod only through which
nominees count for it: of the node's nominees sorted by priority, those of its priority or
higher are a prefix, less the pod itself if it is one of them. So :class:`Holds` keeps them
per node, by that prefix and that pod, for as long as the node's version (its GPUs, usage and
pods) stays the same and :meth:`Holds.forget` is not called: the state calls it when a
nominee of the node comes or goes (renominated, its request or priority changed), when one
gains or loses an allocation, and when a pod on the node starts terminating. A hold handed out
is the same object for as long as it stays right, so callers may key their own caches on it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from webhook.placement.fit import NoFit, place
from webhook.placement.inventory import Gpu, Usage, add_usage

if TYPE_CHECKING:
    from webhook.placement.state import Nominee, PodAlloc

Held = Mapping[str, Usage]
"""A node's usage with the GPUs held for its nominees; shared, never to be changed."""

_KEPT_PER_NODE = 64
"""Holds kept per node (one per prefix of its nominees and pod excluded) before they are
dropped and worked out again: a node with many nominees asked for by as many of them."""


def held_usage(holders: Iterable[Nominee], gpus: tuple[Gpu, ...], usage: Mapping[str, Usage],
               terminating: Iterable[PodAlloc], split_count: int) -> dict[str, Usage] | None:
    """``usage`` with the GPUs that ``holders`` (in order) hold on a node with ``gpus``, each
    placed beside those before it and without the ``terminating`` pods; None when none holds
    any. Pure."""
    out = dict(usage)
    base = dict(usage)  # without the pods being deleted
    for alloc in terminating:
        add_usage(base, alloc.demand, -1)
    held = False
    for nominee in holders:
        result = place(nominee.request, gpus, base, split_count)
        if isinstance(result, NoFit):
            continue
        add_usage(base, result.demand, 1)
        add_usage(out, result.demand, 1)
        held = True
    return out if held else None


@dataclass(slots=True)
class _NodeHolds:
    """One node's nominees in the order they hold GPUs, and the holds worked out so far."""

    version: int
    """The node's version they were worked out at."""
    order: list[Nominee]
    """The nominees without an allocation, the highest priority first, then by UID."""
    ranks: list[int]
    """``-priority`` of each of ``order`` (ascending: bisected for a pod's prefix)."""
    held: dict[tuple[int, str], Held | None] = field(default_factory=dict)
    """(how many of ``order`` count, the one of them left out or "") → the hold."""


class Holds:
    """The holds of the nodes with nominees, kept until a change they depend on."""

    def __init__(self, split_count: int) -> None:
        self.split_count = split_count
        self._nodes: dict[str, _NodeHolds] = {}

    def forget(self, node: str) -> None:
        """Something the holds of ``node`` depend on, besides its version, changed."""
        self._nodes.pop(node, None)

    def usage(self, name: str, version: int, gpus: tuple[Gpu, ...],
              usage: Mapping[str, Usage], allocs: Mapping[str, PodAlloc], pods: Iterable[str],
              nominated: Mapping[str, Nominee], priority: int, uid: str) -> Held | None:
        """The usage of node ``name`` (at ``version``, with ``gpus``, ``usage`` and ``pods``)
        with the GPUs held for its ``nominated`` pods, as seen by a pod of ``priority`` (UID
        ``uid``); None when none holds any (the usage as it is)."""
        kept = self._nodes.get(name)
        if kept is None or kept.version != version:
            order = sorted((n for n in nominated.values() if n.uid not in allocs),
                           key=lambda n: (-n.priority, n.uid))
            kept = self._nodes[name] = _NodeHolds(version, order, [-n.priority for n in order])
        count = bisect.bisect_right(kept.ranks, -priority)
        me = nominated.get(uid)  # the pod itself, among those that count: left out
        left_out = uid if me is not None and me.priority >= priority and uid not in allocs \
            else ""
        key = (count, left_out)
        try:
            return kept.held[key]
        except KeyError:
            pass
        held: Held | None = None
        if count > (1 if left_out else 0):
            held = held_usage((n for n in kept.order[:count] if n.uid != left_out), gpus, usage,
                              (a for a in (allocs[u] for u in pods) if a.terminating),
                              self.split_count)
        if len(kept.held) >= _KEPT_PER_NODE:
            kept.held.clear()
        kept.held[key] = held
        return held
