"""Reading one container's GPU request from its resource limits, with every rule the user can break.

DESIGN.md §1 as the webhook applies it (the extender reads the same limits):

* ``nvidia.com/gpu`` N: N slices of distinct GPUs (1-16). ``gpu: 0`` alone means no GPU.
* ``gpumem`` (MiB per GPU) or ``gpumem-percentage`` (1-100), never both.
* ``gpucores`` (1-100) % of each GPU's compute; 100 = exclusive.
* ``gpumem``/``gpumem-percentage``/``gpucores`` without ``gpu`` mean 1 GPU (the webhook then
  writes ``gpu: 1`` into the limits, as HAMi does, so kubelet and the stock scheduler count the
  slice against the node's ``nvidia.com/gpu`` capacity).
* No memory given means the whole memory of each GPU (100%); ``gpu`` alone means whole,
  exclusive GPUs (memory 100%, cores 100).
* Requests, if given, must equal limits; values must be whole, non-negative numbers.

Problems come back as plain sentences (``reasons``) for the caller to attach to the container.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from webhook.admission.quantity import QuantityError, parse_quantity
from webhook.settings import Settings

MAX_GPUS_PER_CONTAINER = 16
"""The most GPUs one container may ask for (the largest single nodes have 16)."""
_SHARE_HINT = " (to share a GPU, ask for 1 GPU with gpumem or gpumem-percentage)"
MAX_SANE_MEMORY_MIB = 1 << 22
"""4 TiB: no GPU has this much memory; larger gpumem values are unit mistakes."""


class GpuRequest(NamedTuple):
    """What one container asks of each of its GPUs, with the defaults applied."""

    count: int  # type: ignore[assignment]  # shadows tuple.count, on purpose: the API name
    """Number of distinct GPUs (slices); the extender reads it too."""
    memory_mib: int | None
    """MiB per GPU, or None when the memory is a percentage."""
    memory_percent: int | None
    """% of each GPU's memory (100 when nothing was given), or None for a MiB request."""
    cores: int | None
    """% of each GPU's compute; None = not limited (no throttling, not exclusive)."""
    count_given: bool
    """``nvidia.com/gpu`` is in the limits; when False the webhook adds ``gpu: 1``."""


def read_request(container: dict[str, Any], settings: Settings,
                 max_gpu_memory_mib: int | None, reasons: list[str]) -> GpuRequest | None:
    """Return the container's GPU request, None if it asks for no GPU.

    Every problem found is appended to ``reasons``; the result is then meaningless.
    """
    resources = container.get("resources") or {}
    if not isinstance(resources, dict):
        reasons.append("resources must be an object")
        return None
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        reasons.append("resources.limits and resources.requests must be objects")
        return None
    names = settings.resource_names
    if not (limits.keys() & names or requests and requests.keys() & names):
        return None

    values: dict[str, int] = {}
    for name in names:
        hint = _SHARE_HINT if name == settings.resource_gpu else ""
        limit = _whole(limits, name, "limits", reasons, hint) if name in limits else None
        if name in requests:
            request = _whole(requests, name, "requests", reasons, hint)
            if name not in limits:
                reasons.append(f"{name} is set in resources.requests but not in "
                               f"resources.limits; put GPU resources in limits")
            elif request is not None and limit is not None and request != limit:
                reasons.append(f"resources.requests[{name}] ({requests[name]}) must equal "
                               f"resources.limits[{name}] ({limits[name]}); "
                               f"set it only in limits")
        if limit is not None:
            values[name] = limit
    gpu_name, mem_name, pct_name, cores_name = names
    count = values.get(gpu_name)
    mem, pct, cores = values.get(mem_name), values.get(pct_name), values.get(cores_name)
    # The checks below look at every value that parsed, so all problems are reported at once.
    slicing = mem is not None or pct is not None or cores is not None
    if count == 0:
        if slicing:
            reasons.append(f"{gpu_name} is 0 but GPU memory or cores are requested; "
                           f"remove them or ask for at least 1 GPU")
        return None
    if count is not None and count > MAX_GPUS_PER_CONTAINER:
        reasons.append(f"{gpu_name} is {count}; a container may use at most "
                       f"{MAX_GPUS_PER_CONTAINER} GPUs")
    if mem is not None and pct is not None:
        reasons.append(f"{mem_name} and {pct_name} are both set; use one of them")
    if mem is not None:
        if mem < 1:
            reasons.append(f"{mem_name} must be at least 1 (MiB per GPU)")
        elif mem > MAX_SANE_MEMORY_MIB:
            reasons.append(f"{mem_name} is {limits[mem_name]} (= {mem} MiB), more than any GPU "
                           f"has; it counts MiB, e.g. 8000 for about 8 GB")
        elif max_gpu_memory_mib is not None and mem > max_gpu_memory_mib:
            reasons.append(f"{mem_name} is {mem} MiB but the largest GPU in the cluster has "
                           f"{max_gpu_memory_mib} MiB; ask for less or use {pct_name}")
    for name, value in ((pct_name, pct), (cores_name, cores)):
        if value is not None and not 1 <= value <= 100:
            hint = "; omit it for no compute limit" if name == cores_name else ""
            reasons.append(f"{name} is {value}; it is a percentage from 1 to 100{hint}")
    if reasons:
        return None

    if not slicing:
        return GpuRequest(count=count or 1, memory_mib=None, memory_percent=100, cores=100,
                          count_given=True)
    return GpuRequest(count=count or 1, memory_mib=mem,
                      memory_percent=None if mem is not None else (pct or 100),
                      cores=cores, count_given=count is not None)


def _whole(table: dict[str, Any], name: str, where: str, reasons: list[str],
           hint: str) -> int | None:
    raw = table[name]
    # The common case, e.g. "8000"; longer digit strings (int() refuses more than 4,300
    # digits) go through parse_quantity, which refuses absurd lengths.
    if type(raw) is str and len(raw) <= 18 and raw.isascii() and raw.isdigit():
        return int(raw)
    try:
        value = parse_quantity(raw)
    except QuantityError as exc:
        reasons.append(f"resources.{where}[{name}]: {exc}")
        return None
    if value < 0:
        reasons.append(f"resources.{where}[{name}] is {raw}; it must not be negative")
        return None
    if value.denominator != 1:
        reasons.append(f"resources.{where}[{name}] is {raw}; it must be a whole number{hint}")
        return None
    return int(value)


POLICIES = ("binpack", "spread")
HAMI_ONLY_POLICIES = ("numa", "mutex", "topology-aware")
"""GPU policies HAMi knows and gpuslice does not place by: in HAMi's annotation (a comma list,
as HAMi reads it) they are read past, so pods written for HAMi work unchanged."""


class PolicyAnnotation(NamedTuple):
    """The pod's placement policy annotation: ours, else HAMi's (neither set: ``key`` None)."""

    key: str | None
    value: Any
    policy: str | None
    """binpack or spread, None for the default (nothing set, or only HAMi's own policies)."""
    valid: bool
    skipped: tuple[str, ...] = ()
    """HAMi's own policies in the value, which gpuslice does not have."""


def read_policy(annotations: dict[str, Any], ours: str, hami: str) -> PolicyAnnotation:
    """The policy from annotation ``ours`` (binpack or spread), else ``hami`` (a comma list of
    HAMi's GPU policies: its binpack or spread, if any, counts); empty means unset."""
    key = ours if annotations.get(ours) else hami if annotations.get(hami) else None
    if key is None:
        return PolicyAnnotation(None, None, None, True)
    value = annotations[key]
    words = [str(value).strip().lower()] if key == ours else \
        [w.strip().lower() for w in str(value).split(",")]
    if not all(w in POLICIES or key == hami and w in HAMI_ONLY_POLICIES for w in words):
        return PolicyAnnotation(key, value, None, False)
    policy = next((w for w in words if w in POLICIES), None)
    return PolicyAnnotation(key, value, policy, True,
                            tuple(dict.fromkeys(w for w in words if w not in POLICIES)))
