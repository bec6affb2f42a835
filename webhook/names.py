"""Names fixed by the contract between the parts (DESIGN.md): annotation keys, env vars, paths.

One place for every string that the webhook, the extender, the agent and the interposer must
agree on. The per-container annotation keys (devices, limits) come from one helper, the single
implementation the webhook and the extender use.
"""

from __future__ import annotations

import hashlib

PREFIX = "gpuslice.io/"

# Pod annotations written by gpuslice.
ANN_MUTATED = PREFIX + "mutated"
ANN_DEVICES_PREFIX = PREFIX + "devices."
ANN_LIMITS_PREFIX = PREFIX + "limits."

# Node annotation and labels published by the agent.
ANN_NODE_GPUS = PREFIX + "gpus"
ANN_NODE_RESOURCES = PREFIX + "resources"
"""The extended resource names the agent publishes on the node (sorted, comma-separated), so
that an agent publishing others (``resourceNames`` changed) takes the old ones off."""
LABEL_GPU_PRODUCT = PREFIX + "gpu.product"
LABEL_GPU_COUNT = PREFIX + "gpu.count"
LABEL_GPU_MEMORY = PREFIX + "gpu.memory"

# Namespace label for the per-namespace toggle.
LABEL_NAMESPACE_WEBHOOK = PREFIX + "webhook"

# User-facing pod annotations (ours, then HAMi's equivalents).
ANN_GPU_TYPE = PREFIX + "gpu-type"
ANN_AVOID_GPU_TYPE = PREFIX + "avoid-gpu-type"
ANN_GPU_UUID = PREFIX + "gpu-uuid"
ANN_AVOID_GPU_UUID = PREFIX + "avoid-gpu-uuid"
ANN_PLACEMENT = PREFIX + "placement"
HAMI_USE_GPUTYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
HAMI_USE_GPUUUID = "nvidia.com/use-gpuuuid"
HAMI_NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"
HAMI_POLICY = "hami.io/gpu-scheduler-policy"
HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
"""HAMi's node policy: gpuslice has none (nodes follow the pod's placement); warned of."""
POD_PLACEMENT_ANNOTATIONS = (ANN_GPU_TYPE, ANN_AVOID_GPU_TYPE, ANN_GPU_UUID, ANN_AVOID_GPU_UUID,
                             ANN_PLACEMENT, HAMI_USE_GPUTYPE, HAMI_NOUSE_GPUTYPE,
                             HAMI_USE_GPUUUID, HAMI_NOUSE_GPUUUID, HAMI_POLICY)
"""The pod annotations placement reads (a workload's own metadata does not reach its pods)."""

# Env vars written into containers (DESIGN.md §2) and read by the interposer (§5).
ENV_POD_UID = "GPUSLICE_POD_UID"
ENV_POD_NAME = "GPUSLICE_POD_NAME"
ENV_POD_NAMESPACE = "GPUSLICE_POD_NAMESPACE"
ENV_CONTAINER = "GPUSLICE_CONTAINER"
ENV_MEMORY_LIMIT = "CUDA_DEVICE_MEMORY_LIMIT"
ENV_MEMORY_PERCENT = "GPUSLICE_MEMORY_PERCENT"
ENV_SM_LIMIT = "CUDA_DEVICE_SM_LIMIT"
ENV_SHARED_CACHE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NO_GPUS = "none"
"""``NVIDIA_VISIBLE_DEVICES`` the webhook gives containers that request no GPU (those of GPU
pods; with ``hide_gpus_from_pods_without_gpus`` those of every pod): the driver's libraries, no
device."""

# Paths.
HOST_LIBRARY_DIR = "/usr/local/gpuslice"
HOST_PRELOAD_FILE = HOST_LIBRARY_DIR + "/ld.so.preload"
CONTAINER_PRELOAD_FILE = "/etc/ld.so.preload"
HOST_STATE_DIR = "/var/lib/gpuslice/containers"
CONTAINER_STATE_DIR = "/var/run/gpuslice"
REGION_FILE = CONTAINER_STATE_DIR + "/region"
LIMITS_FILE = "/etc/gpuslice/limits"
"""The container's limits (``NAME=VALUE`` lines), a read-only snapshot of its limits annotation
that kubelet writes at container start; the interposer prefers it to the env."""

# Ports and HTTP paths.
WEBHOOK_PORT = 8443
AGENT_METRICS_PORT = 9400

_MAX_NAME_PART = 63
_HASHED_NAME_CHARS = 46


def _container_key(key_prefix: str, container_name: str) -> str:
    """``<key_prefix><name>`` (``key_prefix`` is ``gpuslice.io/<word>.``), its name part (after
    the ``/``) shortened where longer than 63 characters to
    ``<word>.<first 46 chars of name>-<first 8 hex of sha256(name)>``."""
    word = key_prefix.removeprefix(PREFIX)
    name_part = word + container_name
    if len(name_part) > _MAX_NAME_PART:
        digest = hashlib.sha256(container_name.encode()).hexdigest()[:8]
        name_part = f"{word}{container_name[:_HASHED_NAME_CHARS]}-{digest}"
    return PREFIX + name_part


def devices_annotation(container_name: str) -> str:
    """Return the pod annotation key holding the GPU UUIDs assigned to ``container_name``.

    The name part of an annotation key may have at most 63 characters. Where
    ``devices.<name>`` is longer, the key is ``devices.<first 46 chars>-<8 hex of sha256(name)>``.
    """
    return _container_key(ANN_DEVICES_PREFIX, container_name)


def limits_annotation(container_name: str) -> str:
    """Return the pod annotation key holding ``container_name``'s limits (``LIMITS_FILE``).

    Shortened like :func:`devices_annotation`: ``limits.<first 46 chars>-<8 hex of sha256>``
    where ``limits.<name>`` would be longer than 63 characters.
    """
    return _container_key(ANN_LIMITS_PREFIX, container_name)
