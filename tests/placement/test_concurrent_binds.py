"""Many binds at once on one node never double-book a GPU (checked against the API server)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from fakekube import FakeKube
from placement.kubeobjects import eventually, gpu_node, gpu_pod

GPUS = [(f"GPU-{i}", 81920) for i in range(8)]
SPLIT = 4


def random_limits(rng: random.Random) -> dict[str, str]:
    kind = rng.random()
    if kind < 0.05:
        return {"nvidia.com/gpu": "1"}  # a whole, exclusive GPU
    cores = rng.choice([0, 10, 25, 30, 50])
    limits = {"nvidia.com/gpucores": str(cores)} if cores else {}
    if kind < 0.25:
        limits["nvidia.com/gpumem-percentage"] = str(rng.choice([10, 25, 50]))
    else:
        limits["nvidia.com/gpumem"] = str(rng.choice([2048, 5000, 10240, 20000, 40000]))
    if rng.random() < 0.2:
        limits["nvidia.com/gpu"] = "2"
    return limits


def truth(kube: FakeKube) -> dict[str, dict[str, int]]:
    """Per-GPU totals recomputed from the API server's pods, independently of fit.py."""
    memory = dict(GPUS)
    out = {uuid: {"mem": 0, "cores": 0, "slices": 0, "exclusive": 0} for uuid in memory}
    for (plural, _, _), pod in kube.objects.items():
        if plural != "pods" or not pod["spec"].get("nodeName"):
            continue
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        devices = pod["metadata"]["annotations"]["gpuslice.io/devices.main"].split(",")
        assert len(devices) == len(set(devices)) == int(limits.get("nvidia.com/gpu", "1"))
        for uuid in devices:
            whole = set(limits) == {"nvidia.com/gpu"}
            cores = 100 if whole else int(limits.get("nvidia.com/gpucores", 0))
            if "nvidia.com/gpumem" in limits:
                mem = int(limits["nvidia.com/gpumem"])
            else:
                pct = 100 if whole else int(limits["nvidia.com/gpumem-percentage"])
                mem = memory[uuid] * pct // 100
            t = out[uuid]
            t["mem"] += mem
            t["cores"] += cores
            t["slices"] += 1
            t["exclusive"] += cores == 100
    return out


async def test_200_concurrent_binds_never_exceed_memory_compute_or_split_count(
        kube: FakeKube, extender: Any) -> None:
    rng = random.Random(7)
    kube.put(gpu_node("n1", GPUS))
    pods = [kube.put(gpu_pod(f"p{i:03d}", random_limits(rng))) for i in range(200)]
    ext = await extender(split_count=SPLIT)

    in_flight_at_reserve: list[int] = []
    reserve = ext.placer.state.reserve

    def spying_reserve(*args: Any, **kwargs: Any) -> Any:
        in_flight_at_reserve.append(len(ext.placer._inflight))
        return reserve(*args, **kwargs)

    ext.placer.state.reserve = spying_reserve  # type: ignore[method-assign]
    errors = await asyncio.gather(*(ext.bind(pod, "n1") for pod in pods))

    bound = [e for e in errors if e == ""]
    refused = [e for e in errors if e]
    assert 10 <= len(bound) < 200
    assert all("gpuslice: container 'main' needs" in e for e in refused), set(refused)
    assert max(in_flight_at_reserve) > 10  # reservations really overlapped other binds
    totals = truth(kube)
    memory = dict(GPUS)
    for uuid, t in totals.items():
        assert t["mem"] <= memory[uuid], (uuid, t)
        assert t["cores"] <= 100, (uuid, t)
        assert t["slices"] <= SPLIT, (uuid, t)
        assert t["exclusive"] == 0 or t["slices"] == 1, (uuid, t)
    # Once the watch has caught up, the extender's view equals the API server's.
    await eventually(lambda: not any(a.assumed for a in ext.placer.state.allocs.values()))
    usage = ext.placer.state.node("n1").usage
    assert {u: (x.mem, x.cores, x.slices) for u, x in usage.items()} == {
        u: (t["mem"], t["cores"], t["slices"]) for u, t in totals.items() if t["slices"]}
