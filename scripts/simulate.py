#!/usr/bin/env python3
"""Cluster simulator for gpuslice placement: per-GPU binpack and spread vs the node-level sum.

Drives the real placement code (``webhook.placement.request.pod_request`` to read each pod
shape, ``webhook.placement.fit.place`` to fit and score, ``Usage`` accounting as the extender
keeps it) over a synthetic cluster: N nodes × 8 GPUs of mixed models, a seeded Poisson stream
of pods with mixed slice sizes, each living an exponential time. The offered load is above
capacity, so the cluster fills, and the first refusal marks how much GPU memory a policy could
allocate before fragmentation stopped it.

Schedulers compared:

* ``binpack`` / ``spread``: the extender. Every node is filtered and scored with ``place()``
  (memoised per node version and pod shape, which changes nothing: ``place`` is pure); the pod
  goes to a best-scoring node, ties broken at random as kube-scheduler does.
* ``node-sum``: what the stock scheduler can do with node-level extended resources
  (``nvidia.com/gpu`` = GPUs × split count, ``gpumem`` = total MiB, ``gpucores`` = 100 × GPUs),
  idealised so that it even counts per-GPU requests × GPU count and resolves percentages. It
  picks a random node whose sums fit (default scoring ignores extended resources). The device
  plugin then has to find real GPUs: when ``place()`` finds none, the pod is an over-commit
  (it would OOM or fail to start); the scheduler still counts it as placed.

Fragmentation: the share of free GPU memory that the next pod cannot use, expected over the
workload mix: Σ_shape p(shape) × (free MiB on GPUs where one slice of that shape does not fit)
/ (total free MiB). 0 = every free MiB is usable by any pod, 1 = none is.

Usage: ``.venv/bin/python scripts/simulate.py [--nodes 500] [--arrivals 30000] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from webhook.placement.fit import NoFit, Placement, place
from webhook.placement.inventory import Gpu, Usage
from webhook.placement.request import PodRequest, pod_request
from webhook.settings import Settings

# (product, MiB per GPU, share of nodes)
MODELS = [("NVIDIA H100 80GB HBM3", 81920, 0.30), ("NVIDIA H200 141GB", 143360, 0.20),
          ("NVIDIA L4 24GB", 24576, 0.30), ("NVIDIA L40S 48GB", 49152, 0.20)]
# (name, limits of the one container, weight)
SHAPES: list[tuple[str, dict[str, str], float]] = [
    ("4Gi", {"nvidia.com/gpumem": "4096"}, 0.18),
    ("8Gi-20%", {"nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "20"}, 0.16),
    ("2x10Gi-30%", {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10240",
                    "nvidia.com/gpucores": "30"}, 0.10),
    ("16Gi", {"nvidia.com/gpumem": "16384"}, 0.14),
    ("20Gi-40%", {"nvidia.com/gpumem": "20480", "nvidia.com/gpucores": "40"}, 0.10),
    ("25%mem", {"nvidia.com/gpumem-percentage": "25"}, 0.08),
    ("50%mem-50%", {"nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "50"}, 0.06),
    ("40Gi", {"nvidia.com/gpumem": "40960"}, 0.08),
    ("1 whole GPU", {"nvidia.com/gpu": "1"}, 0.05),
    ("4x40Gi-60%", {"nvidia.com/gpu": "4", "nvidia.com/gpumem": "40960",
                    "nvidia.com/gpucores": "60"}, 0.03),
    ("8 whole GPUs", {"nvidia.com/gpu": "8"}, 0.02),
]
GPUS_PER_NODE = 8


@dataclass
class Node:
    gpus: tuple[Gpu, ...]
    usage: dict[str, Usage] = field(default_factory=dict)
    # node-level sums (what the stock scheduler sees)
    sum_mem: int = 0
    sum_cores: int = 0
    sum_slices: int = 0

    @property
    def memory(self) -> int:
        return self.gpus[0].memory_mib


def make_cluster(n: int, rng: random.Random) -> list[Node]:
    nodes = []
    for i in range(n):
        product, mib, _ = rng.choices(MODELS, weights=[m[2] for m in MODELS])[0]
        nodes.append(Node(tuple(Gpu(f"GPU-{i}-{j}", j, product, mib, True)
                                for j in range(GPUS_PER_NODE))))
    return nodes


def shape_request(limits: dict[str, str], settings: Settings) -> PodRequest:
    pod = {"metadata": {"name": "p", "annotations": {}},
           "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}
    return pod_request(pod, settings)


class Index:
    """Per pod shape: which nodes fit and with what score, recomputed only for changed nodes."""

    def __init__(self, n_nodes: int, n_shapes: int, evaluate: Callable[[int, int], int | None]
                 ) -> None:
        self.evaluate = evaluate
        self.scores: list[list[int | None]] = [[None] * n_nodes for _ in range(n_shapes)]
        self.buckets: list[dict[int, set[int]]] = [{} for _ in range(n_shapes)]
        self.dirty: list[set[int]] = [set(range(n_nodes)) for _ in range(n_shapes)]

    def touch(self, node: int) -> None:
        for d in self.dirty:
            d.add(node)

    def best(self, shape: int, rng: random.Random) -> int | None:
        scores, buckets = self.scores[shape], self.buckets[shape]
        for node in self.dirty[shape]:
            old, new = scores[node], self.evaluate(node, shape)
            if old == new:
                continue
            if old is not None:
                buckets[old].discard(node)
            if new is not None:
                buckets.setdefault(new, set()).add(node)
            scores[node] = new
        self.dirty[shape].clear()
        for score in sorted(buckets, reverse=True):
            if buckets[score]:
                return rng.choice(sorted(buckets[score]))
        return None


@dataclass
class Result:
    policy: str
    arrivals: int = 0
    placed: int = 0
    refused: int = 0
    overcommits: int = 0
    first_refusal_share: float | None = None
    first_refusal_frag: float | None = None
    first_refusal_free_gpus: int | None = None
    first_refusal_cores: float | None = None
    share_samples: list[float] = field(default_factory=list)
    real_samples: list[float] = field(default_factory=list)
    frag_samples: list[float] = field(default_factory=list)
    seconds: float = 0.0


def gpu_share(nodes: list[Node]) -> float:
    total = sum(g.memory_mib for n in nodes for g in n.gpus)
    used = sum(min(u.mem, n.memory) for n in nodes for u in n.usage.values())
    return used / total


def cores_share(nodes: list[Node]) -> float:
    used = sum(min(u.cores, 100) for n in nodes for u in n.usage.values())
    return used / (100 * GPUS_PER_NODE * len(nodes))


def node_sum_share(nodes: list[Node]) -> float:
    total = sum(n.memory * GPUS_PER_NODE for n in nodes)
    return sum(min(n.sum_mem, n.memory * GPUS_PER_NODE) for n in nodes) / total


def fragmentation(nodes: list[Node], reqs: list[PodRequest], weights: list[float],
                  split: int) -> float:
    free_total = 0
    stranded = 0.0
    for n in nodes:
        for g in n.gpus:
            u = n.usage.get(g.uuid) or Usage()
            free = max(0, g.memory_mib - u.mem)
            if not free:
                continue
            free_total += free
            for req, w in zip(reqs, weights):
                c = req.containers[0]
                fits = (not u.exclusive and not (c.exclusive and u.slices)
                        and u.slices < split and u.mem + c.memory_on(g.memory_mib) <= g.memory_mib
                        and u.cores + c.cores <= 100)
                if not fits:
                    stranded += w * free
    return stranded / free_total if free_total else 0.0


def free_whole_gpus(nodes: list[Node]) -> int:
    return sum(1 for n in nodes for g in n.gpus if g.uuid not in n.usage)


def simulate(policy: str, args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    settings = Settings(split_count=args.split)
    nodes = make_cluster(args.nodes, rng)
    shapes = [sh for sh in SHAPES if sh[0] not in args.exclude]
    base = [shape_request(limits, settings) for _, limits, _ in shapes]
    weights = [w / sum(sh[2] for sh in shapes) for _, _, w in shapes]
    per_gpu = policy != "node-sum"
    reqs = [PodRequest(r.containers, policy if per_gpu else "binpack") for r in base]
    result = Result(policy)
    cache: dict[tuple[int, int], Placement | NoFit] = {}

    def fit(node: int, shape: int) -> Placement | NoFit:
        key = (node, shape)
        if key not in cache:
            n = nodes[node]
            cache[key] = place(reqs[shape], n.gpus, n.usage, args.split)
        return cache[key]

    def node_level(node: int, shape: int) -> tuple[int, int, int]:
        c, n = reqs[shape].containers[0], nodes[node]
        return c.count * c.memory_on(n.memory), c.count * c.cores, c.count

    def evaluate(node: int, shape: int) -> int | None:
        if per_gpu:
            r = fit(node, shape)
            return None if isinstance(r, NoFit) else r.score
        n = nodes[node]
        mem, cores, slices = node_level(node, shape)
        ok = (n.sum_mem + mem <= n.memory * GPUS_PER_NODE
              and n.sum_cores + cores <= 100 * GPUS_PER_NODE
              and n.sum_slices + slices <= args.split * GPUS_PER_NODE)
        return 0 if ok else None

    index = Index(len(nodes), len(reqs), evaluate)
    capacity = sum(n.memory * GPUS_PER_NODE for n in nodes)
    mean_mem = sum(w * r.containers[0].count * (r.containers[0].mem_mib or
                   sum(m[1] * m[2] for m in MODELS) * (r.containers[0].mem_percent or 0) // 100)
                   for r, w in zip(reqs, weights))
    lifetime = 1.0
    rate = args.load * capacity / mean_mem / lifetime
    departures: list[tuple[float, int, int, dict[str, Usage], tuple[int, int, int]]] = []
    now = 0.0
    started = time.perf_counter()
    sample_every = max(1, args.arrivals // 60)
    for i in range(args.arrivals):
        now += rng.expovariate(rate)
        while departures and departures[0][0] <= now:
            _, _, gone, held, sums = heapq.heappop(departures)
            n = nodes[gone]
            for uuid, d in held.items():
                n.usage[uuid].add(d, -1)
                if n.usage[uuid].is_zero():
                    del n.usage[uuid]
            n.sum_mem -= sums[0]
            n.sum_cores -= sums[1]
            n.sum_slices -= sums[2]
            for s in range(len(reqs)):
                cache.pop((gone, s), None)
            index.touch(gone)
        shape = rng.choices(range(len(reqs)), weights=weights)[0]
        result.arrivals += 1
        node = index.best(shape, rng)
        if node is None:
            result.refused += 1
            share = node_sum_share(nodes) if not per_gpu else gpu_share(nodes)
            if result.first_refusal_share is None:
                result.first_refusal_share = share
                result.first_refusal_frag = fragmentation(nodes, reqs, weights, args.split)
                result.first_refusal_free_gpus = free_whole_gpus(nodes)
                result.first_refusal_cores = cores_share(nodes)
            continue
        n = nodes[node]
        placed = fit(node, shape)
        demand: dict[str, Usage] = {}
        if isinstance(placed, Placement):
            demand = placed.demand
            for uuid, d in demand.items():
                n.usage.setdefault(uuid, Usage()).add(d)
        else:
            result.overcommits += 1  # only node-sum gets here: no single GPU has room
        sums = node_level(node, shape)
        n.sum_mem += sums[0]
        n.sum_cores += sums[1]
        n.sum_slices += sums[2]
        for s in range(len(reqs)):
            cache.pop((node, s), None)
        index.touch(node)
        result.placed += 1
        heapq.heappush(departures, (now + rng.expovariate(1 / lifetime), i, node, demand, sums))
        if i > args.arrivals // 2 and i % sample_every == 0:
            result.share_samples.append(gpu_share(nodes) if per_gpu else node_sum_share(nodes))
            result.real_samples.append(gpu_share(nodes))
            result.frag_samples.append(fragmentation(nodes, reqs, weights, args.split))
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=500)
    p.add_argument("--arrivals", type=int, default=30000)
    p.add_argument("--load", type=float, default=1.3,
                   help="offered GPU memory load as a multiple of capacity (default 1.3)")
    p.add_argument("--split", type=int, default=10, help="split count (default 10)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policies", default="binpack,spread,node-sum")
    p.add_argument("--exclude", default="", type=lambda v: set(filter(None, v.split(","))),
                   help="pod shapes to leave out, by name (e.g. '8 whole GPUs')")
    args = p.parse_args(argv)
    unknown = args.exclude - {sh[0] for sh in SHAPES}
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; known: {[sh[0] for sh in SHAPES]}")
    print(f"cluster: {args.nodes} nodes x {GPUS_PER_NODE} GPUs "
          f"({', '.join(f'{int(m[2] * 100)}% {m[1] // 1024} GiB' for m in MODELS)}), "
          f"split {args.split}, {args.arrivals} arrivals, offered load {args.load}x, "
          f"seed {args.seed}" + (f", without {sorted(args.exclude)}" if args.exclude else ""))
    rows: list[list[Any]] = []
    for policy in args.policies.split(","):
        r = simulate(policy, args)
        mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))
        pc = (lambda x: "never" if x is None else f"{100 * x:.1f}%")
        rows.append([policy, pc(r.first_refusal_share), pc(r.first_refusal_cores),
                     f"{100 * (r.first_refusal_frag or 0):.1f}%", r.first_refusal_free_gpus,
                     f"{100 * mean(r.share_samples):.1f}%", f"{100 * mean(r.real_samples):.1f}%",
                     f"{100 * mean(r.frag_samples):.1f}%",
                     f"{100 * r.refused / r.arrivals:.1f}%", r.overcommits, f"{r.seconds:.1f}s"])
    head = ["policy", "mem@1st refusal", "compute@1st", "frag@1st refusal",
            "free GPUs@1st",
            "mem (steady)", "on real GPUs (steady)", "frag (steady)", "refused", "over-commits", "time"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |")
    print("mem = share of GPU memory allocated (node-sum: as the stock scheduler counts it, "
          "over-commits included); on real GPUs = memory of pods that got real GPUs; "
          "steady = mean over the second half of the run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
