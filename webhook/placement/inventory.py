"""A node's GPUs as the agent publishes them, and the per-GPU usage the extender counts.

The agent writes node annotation ``gpuslice.io/gpus``: a JSON list of
``{"uuid", "index", "product", "memoryMiB", "health"}``. :func:`parse_inventory` turns it into
:class:`Gpu` records and rejects anything malformed with a message naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class InventoryError(ValueError):
    """The node's GPU annotation is missing or malformed."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU of a node."""

    uuid: str
    index: int
    product: str
    memory_mib: int
    healthy: bool


@dataclass(slots=True)
class Usage:
    """What is taken on one GPU: MiB, % compute, slices (containers), exclusive holders."""

    mem: int = 0
    cores: int = 0
    slices: int = 0
    exclusive: int = 0

    def add(self, other: Usage, sign: int = 1) -> None:
        self.mem += sign * other.mem
        self.cores += sign * other.cores
        self.slices += sign * other.slices
        self.exclusive += sign * other.exclusive

    def maximum(self, other: Usage) -> None:
        """Raise each field to at least ``other``'s (phases that never overlap)."""
        self.mem = max(self.mem, other.mem)
        self.cores = max(self.cores, other.cores)
        self.slices = max(self.slices, other.slices)
        self.exclusive = max(self.exclusive, other.exclusive)

    def copy(self) -> Usage:
        return Usage(self.mem, self.cores, self.slices, self.exclusive)

    def is_zero(self) -> bool:
        return not (self.mem or self.cores or self.slices or self.exclusive)


def add_usage(usage: dict[str, Usage], demand: Mapping[str, Usage], sign: int) -> None:
    """Add (``sign`` 1) or take off (-1) ``demand`` in ``usage``, copying what it changes."""
    for uuid, d in demand.items():
        u = usage[uuid].copy() if uuid in usage else Usage()
        u.add(d, sign)
        usage[uuid] = u


def parse_inventory(raw: Any) -> tuple[Gpu, ...]:
    """Parse the ``gpuslice.io/gpus`` annotation value (a JSON string) into GPUs."""
    if raw is None:
        raise InventoryError("node has no gpuslice.io/gpus annotation (is the agent running?)")
    try:
        data = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError as exc:
        raise InventoryError(f"gpuslice.io/gpus is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise InventoryError("gpuslice.io/gpus must be a JSON list")
    gpus: list[Gpu] = []
    seen: set[str] = set()
    indexes: set[int] = set()
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise InventoryError(f"gpuslice.io/gpus[{i}] must be an object")
        uuid, index, product = item.get("uuid"), item.get("index"), item.get("product", "")
        memory, health = item.get("memoryMiB"), item.get("health", "Healthy")
        if not isinstance(uuid, str) or not uuid:
            raise InventoryError(f"gpuslice.io/gpus[{i}].uuid must be a non-empty string")
        if any(c == "," or c.isspace() or not c.isprintable() for c in uuid):
            # The devices annotation is a comma list, read back stripped: such a UUID would
            # be counted as another one once the bind is confirmed.
            raise InventoryError(f"gpuslice.io/gpus[{i}].uuid {uuid!r} must not contain "
                                 f"commas, white space or control characters")
        if uuid in seen:
            raise InventoryError(f"gpuslice.io/gpus lists {uuid} twice")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise InventoryError(f"gpuslice.io/gpus[{i}].index must be a non-negative integer")
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise InventoryError(f"gpuslice.io/gpus[{i}].memoryMiB must be a positive integer")
        if not isinstance(product, str):
            raise InventoryError(f"gpuslice.io/gpus[{i}].product must be a string")
        if health not in ("Healthy", "Unhealthy"):
            raise InventoryError(f"gpuslice.io/gpus[{i}].health must be Healthy or Unhealthy")
        if index in indexes:
            raise InventoryError(f"gpuslice.io/gpus lists index {index} twice")
        seen.add(uuid)
        indexes.add(index)
        gpus.append(Gpu(uuid, index, product, memory, health == "Healthy"))
    gpus.sort(key=lambda g: g.index)
    return tuple(gpus)


def inventory_json(gpus: list[Gpu] | tuple[Gpu, ...]) -> str:
    """The annotation value for ``gpus`` (the agent's format; used by tests and tools)."""
    return json.dumps([{"uuid": g.uuid, "index": g.index, "product": g.product,
                        "memoryMiB": g.memory_mib,
                        "health": "Healthy" if g.healthy else "Unhealthy"} for g in gpus])
