"""Kubernetes objects for placement tests (import as ``placement.kubeobjects``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any


def gpu_node(name: str, gpus: list[tuple[str, int]], product: str = "NVIDIA A100-SXM4-80GB",
             unhealthy: tuple[str, ...] = ()) -> dict[str, Any]:
    """A Node whose agent annotation lists ``gpus`` as (uuid, memoryMiB)."""
    inventory = [{"uuid": u, "index": i, "product": product, "memoryMiB": m,
                  "health": "Unhealthy" if u in unhealthy else "Healthy"}
                 for i, (u, m) in enumerate(gpus)]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"gpu": "on"},
                         "annotations": {"gpuslice.io/gpus": json.dumps(inventory)}},
            "spec": {}, "status": {}}


def gpu_pod(name: str, limits: dict[str, str], *, container: str = "main",
            node: str | None = None, devices: str | None = None, namespace: str = "default",
            phase: str = "Pending", annotations: dict[str, str] | None = None,
            mutated: bool = True) -> dict[str, Any]:
    """A Pod with one GPU container; bound to ``node`` with ``devices`` when given.

    ``mutated``: it carries the webhook's ``gpuslice.io/mutated`` mark, as every pod the
    webhook admitted does (the extender places no GPU pod without it)."""
    ann = {"gpuslice.io/mutated": "0.1.0"} if mutated else {}
    ann.update(annotations or {})
    if devices is not None:
        ann[f"gpuslice.io/devices.{container}"] = devices
    spec: dict[str, Any] = {"schedulerName": "gpuslice-scheduler",
                            "containers": [{"name": container, "image": "cuda",
                                            "resources": {"limits": limits}}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": ann},
            "spec": spec, "status": {"phase": phase}}


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``check()`` is true (the watches are asynchronous)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
