"""The pod mutation of DESIGN.md §2 as a pure function: pod + settings -> new pod or denial.

:func:`mutate_pod` never changes its input and does no I/O. The new pod shares every part it
does not change with the input (copy on write), so the HTTP edge can diff the two cheaply
(:mod:`webhook.admission.diff`), and holds our env entries, mounts and volumes as shared,
read-only :class:`~webhook.admission.encode.Fragment` dicts: treat results as read-only
(``copy.deepcopy`` gives plain dicts). Applying the mutation to its own output changes nothing.

Behaviour beyond the contract (decided here, tested in ``tests/admission/cases``):

* Our env names, and per-device overrides ``CUDA_DEVICE_{MEMORY,SM}_LIMIT_<i>`` and any other
  ``GPUSLICE_*`` name, are reserved: user values are dropped with a warning (they could lift the
  caps). Ours go first in ``env`` so user variables may refer to them with ``$(NAME)``.
* The limits file: each GPU container also gets its limit env entries (memory or memory
  percentage, compute when set, the shared cache path) as ``NAME=VALUE`` lines in the pod
  annotation ``gpuslice.io/limits.<name>`` (key shortened like the devices key), which a
  downward API volume ``gpuslice-limits`` (mode 0444, one file per GPU container, named after
  it) puts read-only at ``/etc/gpuslice/limits`` through a ``subPath`` mount: kubelet writes it
  at container start, so unlike the env a tenant cannot override it, and the interposer reads
  it first. The chart's annotation guard denies later changes to these annotations.
* User mounts at our mount paths or with our volume names are replaced (warning); user
  ``gpuslice.io/devices.*`` annotations are removed (warning): only the scheduler assigns GPUs.
  User ``gpuslice.io/limits.*`` annotations are replaced by ours, or removed where no GPU
  container owns the key (warning where the value differed).
* Conflicting user ``nodeSelector[gpu]``, ``schedulerName`` or ``runtimeClassName`` are
  overwritten with a warning: without them the pod would not get its GPUs. A replaced
  runtime class's ``spec.overhead`` (the API server's RuntimeClass admission copies it in
  before webhooks run, and refuses a pod whose overhead is not its class's after) is removed.
* Denied: privileged GPU containers and GPU containers adding ``SYS_ADMIN`` (or ``ALL``)
  capabilities (they can see every GPU or undo the library mount), ``spec.nodeName`` preset
  on a GPU pod (it would bypass the GPU scheduler), a GPU pod whose ``spec.os.name`` is not
  ``linux`` (the library and its mounts are Linux's), invalid placement annotations, two GPU
  containers whose devices or limits keys coincide (a name spelling out another's shortened
  key: one container would get the other's GPUs and limits).
* HAMi's task priority (``resource_priority``, ``nvidia.com/priority``) is read past: a GPU
  container asking for it is warned (once) that gpuslice has none and its limits apply; it is
  no device, so a container asking only for it gets no GPU (below). The chart's scheduler
  ignores the resource (managedResources, ignoredByScheduler), as HAMi's does.
* The other containers of a GPU pod (init, sidecar or app containers that request no GPU
  resource) get ``NVIDIA_VISIBLE_DEVICES=none``, a user value replaced with a warning. CUDA
  images set ``NVIDIA_VISIBLE_DEVICES=all`` themselves, and under the NVIDIA runtime (the
  runtime class the pod may be given, or the node's default) such a container would see every
  GPU of the node, without the library or a cap. ``none`` keeps the driver's libraries in the
  container (programs linked against them still start) but no GPU. A container asking for some
  of another ``nvidia.com/`` resource (a MIG slice of another device plugin, say) is left
  alone; asking for 0 of one gets no device, so it does not count. Resource claims (DRA) do not
  count either (the pod does not say which device a claim's class gives; NVIDIA's DRA driver
  sets the variable itself, through CDI, which wins over the container's env).
  With ``hide_gpus_from_pods_without_gpus`` the containers of pods that request no GPU get the
  same (and nothing else: such a pod is not marked as a gpuslice pod).
* Ephemeral containers cannot exist at CREATE; ``kubectl debug`` adds them later through the
  ``pods/ephemeralcontainers`` subresource (an UPDATE), which :func:`mutate_ephemeral` answers:
  in a gpuslice GPU pod (marked, or asking for its resources: the tenant may remove the mark;
  or in any pod, with ``hide_gpus_from_pods_without_gpus``) each newly
  added one gets ``NVIDIA_VISIBLE_DEVICES=none`` and loses gpuslice's volumes, like the other
  containers that request no GPU (a CUDA image's ``all`` under the pod's NVIDIA runtime would
  see every GPU of the node, without the library or a cap). Those added before are left as
  they are: the API server refuses changes to them.
"""

from __future__ import annotations

import difflib
import functools
import posixpath
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from webhook import __version__, names
from webhook.admission.encode import Fragment
from webhook.admission.quantity import QuantityError, parse_quantity
from webhook.admission.requests import GpuRequest, PolicyAnnotation, read_policy, read_request
from webhook.settings import Settings

NEVER_MUTATED_NAMESPACES = frozenset({"kube-system"})
VOLUME_LIBRARY = "gpuslice-lib"
VOLUME_PRELOAD = "gpuslice-preload"
VOLUME_STATE = "gpuslice-state"
VOLUME_LIMITS = "gpuslice-limits"
_OUR_VOLUMES = (VOLUME_LIBRARY, VOLUME_PRELOAD, VOLUME_STATE, VOLUME_LIMITS)
_OUR_MOUNT_PATHS = (names.HOST_LIBRARY_DIR, names.CONTAINER_PRELOAD_FILE,
                    names.CONTAINER_STATE_DIR, names.LIMITS_FILE)
_OUR_ENV = frozenset({
    names.ENV_POD_UID, names.ENV_POD_NAME, names.ENV_POD_NAMESPACE, names.ENV_CONTAINER,
    names.ENV_MEMORY_LIMIT, names.ENV_MEMORY_PERCENT, names.ENV_SM_LIMIT,
    names.ENV_SHARED_CACHE, names.ENV_VISIBLE_DEVICES,
})
_RESERVED_ENV = re.compile(rf"^(GPUSLICE_.*|({names.ENV_MEMORY_LIMIT}|{names.ENV_SM_LIMIT})_[0-9]+)$")
_RESERVED_PREFIXES = ("GPUSLICE_", "CUDA_DEVICE_")
_NO_GPUS_ENV = Fragment(name=names.ENV_VISIBLE_DEVICES, value=names.NO_GPUS)
_NVIDIA_RESOURCES = "nvidia.com/"
_DEFAULT_SCHEDULER = "default-scheduler"


class BadObject(ValueError):
    """The object is not shaped like a Pod (or pod template); the message names the field."""


class Denial(NamedTuple):
    """One reason the pod is refused; ``container`` is None for pod-level reasons."""

    container: str | None
    reason: str

    def __str__(self) -> str:
        return f'container "{self.container}": {self.reason}' if self.container else self.reason


class MutationResult(NamedTuple):
    """The new pod (the input object itself when unchanged) or the reasons it is denied."""

    pod: dict[str, Any] | None
    denials: tuple[Denial, ...] = ()
    warnings: tuple[str, ...] = ()
    changed: bool = False

    @property
    def allowed(self) -> bool:
        return not self.denials

    @property
    def message(self) -> str:
        return "; ".join(str(d) for d in self.denials)


class _Work:
    """Warnings collected while mutating, each once."""

    __slots__ = ("warnings",)

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)


def mutate_pod(pod: dict[str, Any], settings: Settings, *, namespace: str | None = None,
               max_gpu_memory_mib: int | None = None) -> MutationResult:
    """Apply DESIGN.md §2 to a Pod (or a pod template: ``metadata`` + ``spec``).

    ``namespace`` is the request's namespace (a pod being created may not carry one);
    ``max_gpu_memory_mib`` is the largest GPU in the cluster, when known. Raises
    :class:`BadObject` when the object is not shaped like a pod.
    """
    spec, metadata = pod_shape(pod)
    ns = namespace or metadata.get("namespace")
    if ns is not None and not isinstance(ns, str):  # a workload's namespace, for a template
        raise BadObject("metadata.namespace must be a string")
    if ns in NEVER_MUTATED_NAMESPACES or ns == settings.release_namespace:
        return MutationResult(pod)

    denials: list[Denial] = []
    gpu_containers: dict[tuple[str, int], GpuRequest] = {}
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(kind) or ()):
            reasons: list[str] = []
            request = read_request(container, settings, max_gpu_memory_mib, reasons)
            if request is not None or reasons:
                reasons.extend(_security_reasons(container))
            if reasons:
                denials.extend(Denial(container["name"], r) for r in reasons)
            elif request is not None:
                gpu_containers[(kind, index)] = request
    if not gpu_containers and not denials:
        if settings.hide_gpus_from_pods_without_gpus:
            return _hide_gpus(pod, spec, settings)
        return MutationResult(pod)

    annotations = metadata.get("annotations") or {}
    policy = read_policy(annotations, names.ANN_PLACEMENT, names.HAMI_POLICY)
    pod_reasons = _pod_reasons(spec, policy) + _key_collisions(spec, gpu_containers)
    if pod_reasons or denials:
        return MutationResult(None, tuple(Denial(None, r) for r in pod_reasons) + tuple(denials))

    _check_gpu_pod_shape(spec, list(gpu_containers))
    # In spec order, init containers first (as gpu_containers was filled).
    parts = {(kind, i): _container_parts(spec[kind][i]["name"], request)
             for (kind, i), request in gpu_containers.items()}
    work = _Work()
    if policy.skipped and names.ANN_MUTATED not in annotations:  # warned once
        work.warn(f"annotation {policy.key}: gpuslice has no {', '.join(policy.skipped)} "
                  f"placement; the pod is placed by {policy.policy or settings.default_policy}")
    if names.ANN_MUTATED not in annotations:  # warned once
        for kind, i in gpu_containers:
            limits = (spec[kind][i].get("resources") or {}).get("limits") or {}
            if settings.resource_priority in limits:
                work.warn(f'container "{spec[kind][i]["name"]}": {settings.resource_priority} is '
                          f"HAMi's task priority, which gpuslice does not have; it is ignored "
                          f"(the container's limits apply whatever its priority)")
        # Read by neither gpuslice nor HAMi; without a word the pod got what its limits say
        # (a whole GPU for nvidia.com/gpu alone), which nothing pointed back to.
        for key in (settings.resource_gpu, settings.resource_mem, settings.resource_mem_percent,
                    settings.resource_cores):
            if key in annotations:
                work.warn(f"annotation {key}: gpuslice reads GPU requests from the containers' "
                          f"resources.limits only; as a pod annotation it is ignored")
        _warn_unknown_keys(annotations, work)
        if names.HAMI_NODE_POLICY in annotations:
            work.warn(f"annotation {names.HAMI_NODE_POLICY}: gpuslice has no node policy of its "
                      f"own; nodes are chosen by the pod's placement, "
                      f"{policy.policy or settings.default_policy}")
    # A pod mutated before (a reinvocation, after a later webhook changed it): the limit env its
    # limits file lists is ours, replaced without a warning when the limits changed.
    earlier = annotations if names.ANN_MUTATED in annotations else {}
    new_spec = dict(spec)
    for kind in dict.fromkeys(k for k, _ in gpu_containers):
        new_spec[kind] = [
            _mutate_container(c, gpu_containers[(kind, i)], parts[(kind, i)], settings, work,
                              earlier.get(parts[(kind, i)].limits_key))
            if (kind, i) in gpu_containers else c
            for i, c in enumerate(spec[kind])]
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            new_spec[kind] = [
                c if (kind, i) in gpu_containers
                else _without_our_volumes(c if _asks_for_nvidia(c, settings)
                                          else _without_gpus(c, work), work)
                for i, c in enumerate(new_spec.get(kind, spec[kind]))]
    _mutate_pod_spec(new_spec, list(parts.values()), settings, work)
    new_pod = dict(pod)
    new_pod["spec"] = new_spec
    new_pod["metadata"] = _mutate_metadata(metadata, list(parts.values()), work)
    return MutationResult(new_pod, warnings=tuple(work.warnings), changed=True)


def mutate_ephemeral(pod: dict[str, Any], old_pod: Any, settings: Settings, *,
                     namespace: str | None = None) -> MutationResult:
    """An UPDATE of ``pods/ephemeralcontainers``: the ephemeral containers of ``pod`` that
    ``old_pod`` lacks (by name) get no GPU, in a gpuslice GPU pod (one :func:`mutate_pod`
    marked, or whose containers ask for gpuslice's GPU resources: the mark is an annotation the
    tenant may remove, the spec's resources cannot change), or in any pod with
    ``hide_gpus_from_pods_without_gpus``."""
    spec, metadata = pod_shape(pod)
    ns = namespace or metadata.get("namespace")
    if ns in NEVER_MUTATED_NAMESPACES or ns == settings.release_namespace:
        return MutationResult(pod)
    if not ((metadata.get("annotations") or {}).get(names.ANN_MUTATED)
            or settings.hide_gpus_from_pods_without_gpus or _asks_for_slices(spec, settings)):
        return MutationResult(pod)
    debuggers = spec.get("ephemeralContainers") or []
    if not isinstance(debuggers, list):
        raise BadObject("spec.ephemeralContainers must be a list")
    old_spec = old_pod.get("spec") if isinstance(old_pod, dict) else None
    old = (old_spec.get("ephemeralContainers") if isinstance(old_spec, dict) else None) or []
    existing = {c.get("name") for c in old if isinstance(c, dict)} if isinstance(old, list) \
        else set()
    work = _Work()
    new = []
    for i, c in enumerate(debuggers):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise BadObject(f"spec.ephemeralContainers[{i}] must be an object with a string name")
        if c["name"] in existing:
            new.append(c)
            continue
        if not isinstance(c.get("env") or [], list):
            raise BadObject(f"spec.ephemeralContainers[{i}].env must be a list")
        if not isinstance(c.get("volumeMounts") or [], list):
            raise BadObject(f"spec.ephemeralContainers[{i}].volumeMounts must be a list")
        new.append(_without_our_volumes(_without_gpus(c, work), work))
    if all(a is b for a, b in zip(new, debuggers)):
        return MutationResult(pod)  # mutated before, or nothing new
    new_pod = dict(pod)
    new_pod["spec"] = {**spec, "ephemeralContainers": new}
    return MutationResult(new_pod, warnings=tuple(work.warnings), changed=True)


def _asks_for_slices(spec: dict[str, Any], settings: Settings) -> bool:
    """Whether a container or init container asks for gpuslice's GPU resources (as
    :func:`mutate_pod` read them at creation, a request it denied counting too)."""
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or ():
            reasons: list[str] = []
            if read_request(container, settings, None, reasons) is not None or reasons:
                return True
    return False


def pod_shape(pod: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's spec and metadata, checked to be shaped as this module and the extender read
    them (the containers listed by name, the annotations); :class:`BadObject` says what is not."""
    if not isinstance(pod, dict):
        raise BadObject("the object must be a JSON/YAML mapping")
    spec, metadata = pod.get("spec"), pod.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise BadObject("metadata must be an object")
    if not isinstance(metadata.get("annotations") or {}, dict):
        raise BadObject("metadata.annotations must be an object")
    if not isinstance(metadata.get("namespace", ""), str | None):
        raise BadObject("metadata.namespace must be a string")
    if not isinstance(spec, dict):
        raise BadObject("spec must be an object")
    for kind in ("initContainers", "containers"):
        containers = spec.get(kind)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise BadObject(f"spec.{kind} must be a list")
        for i, c in enumerate(containers):
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                raise BadObject(f"spec.{kind}[{i}] must be an object with a string name")
    return spec, metadata


def _check_gpu_pod_shape(spec: dict[str, Any], containers: list[tuple[str, int]]) -> None:
    """The parts a GPU pod's mutation rewrites must have their Kubernetes types: every
    container's env (the others get NVIDIA_VISIBLE_DEVICES too) and mounts (the others lose any
    of gpuslice's volumes)."""
    del containers  # every container's parts are checked
    _check_env_lists(spec)
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or ()):
            if not isinstance(container.get("volumeMounts") or [], list):
                raise BadObject(f"spec.{kind}[{i}].volumeMounts must be a list")
    for key in ("volumes", "tolerations"):
        if not isinstance(spec.get(key) or [], list):
            raise BadObject(f"spec.{key} must be a list")
    if not isinstance(spec.get("nodeSelector") or {}, dict):
        raise BadObject("spec.nodeSelector must be an object")


def _check_env_lists(spec: dict[str, Any]) -> None:
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(kind) or ()):
            if not isinstance(container.get("env") or [], list):
                raise BadObject(f"spec.{kind}[{i}].env must be a list")


def _security_reasons(container: dict[str, Any]) -> list[str]:
    context = container.get("securityContext") or {}
    if not isinstance(context, dict):
        return []
    reasons = []
    if context.get("privileged") is True:
        reasons.append("privileged containers see every GPU of the node, so they cannot get a "
                       "GPU slice; remove securityContext.privileged")
    caps = context.get("capabilities") or {}
    added = caps.get("add") if isinstance(caps, dict) else None
    if isinstance(added, list) and {"SYS_ADMIN", "CAP_SYS_ADMIN", "ALL"} & {
            str(a).upper() for a in added}:
        reasons.append("a GPU container may not add the SYS_ADMIN capability (it could undo "
                       "the GPU limits); remove it from securityContext.capabilities.add")
    return reasons


def _pod_reasons(spec: dict[str, Any], policy: PolicyAnnotation) -> list[str]:
    reasons = []
    os_spec = spec.get("os")
    os_name = os_spec.get("name") if isinstance(os_spec, dict) else None
    if os_name not in (None, "linux"):
        reasons.append(f"spec.os.name is {os_name}, but gpuslice shares the GPUs of Linux nodes "
                       f"only; remove the GPU resources or run the pod on Linux")
    if spec.get("nodeName"):
        reasons.append("spec.nodeName is set, which bypasses the GPU scheduler that assigns "
                       "the GPUs; remove spec.nodeName (use a nodeSelector to pick nodes)")
    # Ours wins over HAMi's, as in the extender (``policy``); empty means the default policy.
    if not policy.valid:
        reasons.append(f"annotation {policy.key} is {policy.value!r}; use binpack or spread")
    return reasons


def _key_collisions(spec: dict[str, Any], containers: Mapping[tuple[str, int], Any]) -> list[str]:
    """Two GPU containers whose annotation keys are one key (a name that spells out another,
    longer one's shortened form) would share GPUs and limits: one could use the other's."""
    reasons = []
    owners: dict[str, str] = {}
    for kind, i in containers:
        name = spec[kind][i]["name"]
        for key in (names.devices_annotation(name), names.limits_annotation(name)):
            other = owners.setdefault(key, name)
            if other != name:  # the same name twice is the API server's to refuse
                reasons.append(f'containers "{other}" and "{name}" would share the annotation '
                               f"{key} (long names are shortened to 46 characters and a "
                               f"hash); rename one")
                break
    return reasons


def _field_ref(path: str) -> Fragment:
    return Fragment(fieldRef=Fragment(apiVersion="v1", fieldPath=path))


class _ContainerParts(NamedTuple):
    env: tuple[Fragment, ...]
    env_by_name: Mapping[str, Fragment]
    mounts: tuple[Fragment, ...]
    limits_key: str
    """The pod annotation holding the limits file (``names.limits_annotation``)."""
    limits: str
    """Its value: the limit env entries as ``NAME=VALUE`` lines."""
    limits_item: Fragment
    """The container's file in the limits volume: the annotation, at ``path: <name>``."""


@functools.lru_cache(maxsize=4096)
def _container_parts(name: str, request: GpuRequest) -> _ContainerParts:
    """Our env entries, mounts and limits annotation for one container: built once, shared,
    read-only."""
    identity = [
        Fragment(name=names.ENV_POD_UID, valueFrom=_field_ref("metadata.uid")),
        Fragment(name=names.ENV_POD_NAME, valueFrom=_field_ref("metadata.name")),
        Fragment(name=names.ENV_POD_NAMESPACE, valueFrom=_field_ref("metadata.namespace")),
        Fragment(name=names.ENV_CONTAINER, value=name),
    ]
    # The limits: env entries and, the same entries, lines of the limits file.
    limits = []
    if request.memory_mib is not None:
        limits.append(Fragment(name=names.ENV_MEMORY_LIMIT, value=f"{request.memory_mib}m"))
    else:
        limits.append(Fragment(name=names.ENV_MEMORY_PERCENT,
                               value=str(request.memory_percent)))
    if request.cores is not None:
        limits.append(Fragment(name=names.ENV_SM_LIMIT, value=str(request.cores)))
    limits.append(Fragment(name=names.ENV_SHARED_CACHE, value=names.REGION_FILE))
    devices = names.devices_annotation(name)
    env = (*identity, *limits, Fragment(
        name=names.ENV_VISIBLE_DEVICES, valueFrom=_field_ref(f"metadata.annotations['{devices}']")))
    mounts = (
        Fragment(name=VOLUME_LIBRARY, mountPath=names.HOST_LIBRARY_DIR, readOnly=True),
        Fragment(name=VOLUME_PRELOAD, mountPath=names.CONTAINER_PRELOAD_FILE, readOnly=True),
        Fragment(name=VOLUME_STATE, mountPath=names.CONTAINER_STATE_DIR,
                 subPathExpr=f"$({names.ENV_POD_UID})/{name}"),
        # subPath: a snapshot taken at container start, which later annotation edits (denied
        # by the chart's annotation guard anyway) do not reach.
        Fragment(name=VOLUME_LIMITS, mountPath=names.LIMITS_FILE, subPath=name, readOnly=True),
    )
    limits_key = names.limits_annotation(name)
    return _ContainerParts(
        env, MappingProxyType({e["name"]: e for e in env}), mounts, limits_key,
        "".join(f"{e['name']}={e['value']}\n" for e in limits),
        Fragment(path=name, fieldRef=Fragment(
            apiVersion="v1", fieldPath=f"metadata.annotations['{limits_key}']")))


_VOLUMES = (
    Fragment(name=VOLUME_LIBRARY,
             hostPath=Fragment(path=names.HOST_LIBRARY_DIR, type="Directory")),
    Fragment(name=VOLUME_PRELOAD,
             hostPath=Fragment(path=names.HOST_PRELOAD_FILE, type="File")),
    Fragment(name=VOLUME_STATE,
             hostPath=Fragment(path=names.HOST_STATE_DIR, type="DirectoryOrCreate")),
)

_LIMITS_FILE_MODE = 0o444


def _limits_volume(parts: list[_ContainerParts]) -> dict[str, Any]:
    """The downward API volume with each GPU container's limits file (named after it)."""
    return {"name": VOLUME_LIMITS, "downwardAPI": {
        "defaultMode": _LIMITS_FILE_MODE, "items": [p.limits_item for p in parts]}}


def _normal_path(path: str) -> str:
    """``path`` as kubelet and the runtime resolve it: ``/etc//gpuslice/./limits/`` is our
    mount path too (one a runtime mounted after ours would cover the limits file), and so is
    the relative ``etc/gpuslice/limits``, which the API server admits and kubelet prefixes
    with ``/``."""
    path = "/" + path.lstrip("/")
    if "//" in path or "/." in path or path.endswith("/"):
        return posixpath.normpath(path)
    return path  # no empty, "." or ".." part, no trailing slash: already normal


def _covers_ours(path: str) -> bool:
    """A mount at one of our mount paths or below one: runtimes mount deeper paths after
    shallower ones, so a mount at ``/usr/local/gpuslice/libgpuslice.so.<version>`` (a file of
    the tenant's own, from an emptyDir or a ConfigMap) would replace the library the preload
    names, and one below ``/var/run/gpuslice`` the region file. A mount above ours (``/etc``)
    is mounted first and covered by ours."""
    return path in _OUR_MOUNT_PATHS or path.startswith(_BELOW_OUR_MOUNT_PATHS)


_BELOW_OUR_MOUNT_PATHS = tuple(ours.rstrip("/") + "/" for ours in _OUR_MOUNT_PATHS)


def _mutate_container(container: dict[str, Any], request: GpuRequest, parts: _ContainerParts,
                      settings: Settings, work: _Work, earlier: Any = None) -> dict[str, Any]:
    """``earlier``: the container's limits annotation as an earlier pass of ours wrote it (its
    ``NAME=VALUE`` lines are env entries of ours, not the user's), or None."""
    name = container["name"]
    ours = frozenset(earlier.splitlines()) if isinstance(earlier, str) else frozenset()
    new = dict(container)
    if not request.count_given:
        resources = dict(container.get("resources") or {})
        resources["limits"] = {**(resources.get("limits") or {}), settings.resource_gpu: "1"}
        new["resources"] = resources

    wanted = parts.env_by_name
    kept: list[Any] = []
    ahead: int | None = None  # how many of kept stand before the first of our names
    for entry in container.get("env") or ():
        env_name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(env_name, str) and (env_name in _OUR_ENV or (
                env_name.startswith(_RESERVED_PREFIXES) and _RESERVED_ENV.match(env_name))):
            if entry != wanted.get(env_name) and not (
                    entry.keys() == {"name", "value"} and f"{env_name}={entry['value']}" in ours):
                verb = "replaced" if env_name in wanted else "removed"
                work.warn(f'container "{name}": env {env_name} is managed by gpuslice; '
                          f"the value in the pod was {verb}")
            ahead = len(kept) if ahead is None else ahead
            continue
        kept.append(entry)
    new["env"] = [*parts.env, *kept]
    if request.cores is not None and request.cores < _GANG_MIN_CORES:
        # Warned once: a container mutated before (our limit in its env) was warned of the env
        # it had then, which follows ours. What stands ahead of ours came after that pass, from
        # a later webhook (LeaderWorkerSet's puts LWS_GROUP_SIZE first): the API server calls
        # this one again (reinvocation) and shows its warnings too.
        if wanted[names.ENV_SM_LIMIT] not in (container.get("env") or ()):
            _warn_ranks_apart(name, request, kept, work)
        elif ahead and _spread_rank(request, kept[ahead:]) is None:
            _warn_ranks_apart(name, request, kept[:ahead], work)

    mounts = parts.mounts
    kept = []
    for mount in container.get("volumeMounts") or ():
        if isinstance(mount, dict) and (
                mount.get("name") in _OUR_VOLUMES
                or _covers_ours(_normal_path(str(mount.get("mountPath", ""))))):
            if mount not in mounts:
                work.warn(f'container "{name}": volumeMount {mount.get("name")} at '
                          f'{mount.get("mountPath")} conflicts with gpuslice and was replaced')
            continue
        kept.append(mount)
    new["volumeMounts"] = [*kept, *mounts]
    return new


_POD_KEYS = (names.ANN_PLACEMENT, names.ANN_GPU_TYPE, names.ANN_AVOID_GPU_TYPE, names.ANN_GPU_UUID,
             names.ANN_AVOID_GPU_UUID)
"""The ``gpuslice.io/`` pod annotations a user writes (the others are gpuslice's own)."""
_OWN_KEYS = (names.ANN_MUTATED, names.ANN_DEVICES_PREFIX, names.ANN_LIMITS_PREFIX)


def _warn_unknown_keys(annotations: dict[str, Any], work: _Work) -> None:
    """A ``gpuslice.io/`` pod annotation gpuslice does not read (a typo, ``gpuslice.io/placment``,
    or the namespace label written on the pod) is warned of, with the key it may mean: read
    past without a word, the pod was placed as if it were not there."""
    for key in annotations:
        if not (isinstance(key, str) and key.startswith(names.PREFIX)) or key in _POD_KEYS \
                or key.startswith(_OWN_KEYS):
            continue
        if key == names.LABEL_NAMESPACE_WEBHOOK:
            hint = f"{key} is a namespace label"
        else:
            near = difflib.get_close_matches(key, _POD_KEYS, n=1, cutoff=0.8)
            hint = f"did you mean {near[0]}?" if near else \
                f"the pod annotations it reads are {', '.join(_POD_KEYS)}"
        work.warn(f"annotation {key}: not a key gpuslice reads, so it is ignored ({hint})")


# Below this compute limit, ranks that synchronise across devices stall unless they wait for
# each other's budget, which the interposer does only within one container (its "gang").
_GANG_MIN_CORES = 50
# Env a distributed launcher sets on each pod of a job: the number of ranks (torch.distributed,
# Kubeflow's PyTorchJob) or of pods (PyTorchJob's PET_NNODES: a number, or torchrun's MIN:MAX
# range for an elastic job, "1:4", whose pods may be up to MAX; LeaderWorkerSet's
# LWS_GROUP_SIZE, its group's leader and workers, which its own webhook writes). True: counts
# pods, above 1 the ranks are spread over pods.
_RANK_ENV = {"WORLD_SIZE": False, "PET_NNODES": True, "LWS_GROUP_SIZE": True}
_RANGED_ENV = frozenset({"PET_NNODES"})


def _largest_count(text: str, *, ranged: bool) -> int | None:
    """The count ``text`` gives (the larger end of a ``MIN:MAX`` range where ``ranged``), or
    None where it is no count we can read. ASCII digits only, and few: int() refuses "²" (a
    digit to isdigit) and 4,301 digits."""
    parts = [p.strip() for p in (text.split(":") if ranged and text.count(":") == 1 else [text])]
    if not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        return None
    return max(int(p) for p in parts)


def _spread_rank(request: GpuRequest, env: list[Any]) -> tuple[str, str] | None:
    """The first entry of ``env`` that says the container is one rank of a job spread over
    pods (more ranks than its GPUs, or more than one pod), as (name, value)."""
    for entry in env:
        if not isinstance(entry, dict) or entry.get("name") not in _RANK_ENV:
            continue
        value = entry.get("value")
        if not isinstance(value, str):
            continue
        nodes = _RANK_ENV[entry["name"]]
        count = _largest_count(value, ranged=entry["name"] in _RANGED_ENV)
        if count is not None and count > (1 if nodes else request.count):
            return entry["name"], value.strip()
    return None


def _warn_ranks_apart(name: str, request: GpuRequest, env: list[Any], work: _Work) -> None:
    """A container under a compute limit below 50 % whose env says it is one rank of a job
    spread over pods gets a warning: ranks in different pods are paced apart, and their
    collectives can stall."""
    found = _spread_rank(request, env)
    if found is not None:
        work.warn(f'container "{name}": gpucores {request.cores} with {found[0]}={found[1]} '
                  f"looks like one rank of a job spread over pods; ranks in different pods are "
                  f"paced apart, and under a compute limit below {_GANG_MIN_CORES} their "
                  f"collectives can stall: give the job one pod with all its GPUs, gpucores of "
                  f"{_GANG_MIN_CORES} or more, or none")


def _hide_gpus(pod: dict[str, Any], spec: dict[str, Any], settings: Settings) -> MutationResult:
    """A pod that requests no GPU, with ``hide_gpus_from_pods_without_gpus``: every container
    that names no NVIDIA resource gets ``NVIDIA_VISIBLE_DEVICES=none`` (nothing else changes,
    and the pod is not marked as a gpuslice pod)."""
    _check_env_lists(spec)
    work = _Work()
    new_spec = dict(spec)
    changed = False
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            new_spec[kind] = [c if _asks_for_nvidia(c, settings) else _without_gpus(c, work)
                              for c in spec[kind]]
            changed = changed or any(a is not b for a, b in zip(new_spec[kind], spec[kind]))
    if not changed:
        return MutationResult(pod)  # mutated before, or nothing to hide
    new_pod = dict(pod)
    new_pod["spec"] = new_spec
    return MutationResult(new_pod, warnings=tuple(work.warnings), changed=True)


def _asks_for_nvidia(container: dict[str, Any], settings: Settings) -> bool:
    """Whether a container that requests no slice may get devices another way: it asks for
    some of another device plugin's NVIDIA resource (``nvidia.com/mig-1g.10gb``, say; HAMi's
    task priority is none: it gives no device). Asking for 0 of one gets no device from it (and
    fits every node: the scheduler and kubelet skip zero requests), so it does not count.
    Resource claims (DRA) do not count either: which
    device a claim gets (a CPU, a NIC, a GPU) is in its device class, not in the pod, and left
    alone, a CUDA image's ``all`` under the NVIDIA runtime would see every GPU of the node.
    NVIDIA's DRA driver gives its GPUs through CDI, whose env edit
    ``NVIDIA_VISIBLE_DEVICES=void`` replaces the container's value, so they stay."""
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return False
    for amounts in (resources.get("limits"), resources.get("requests")):
        if isinstance(amounts, dict):
            for k, v in amounts.items():
                if isinstance(k, str) and k.startswith(_NVIDIA_RESOURCES) and \
                        k not in settings.resource_names and k != settings.resource_priority \
                        and _positive(v):
                    return True
    return False


def _positive(quantity: Any) -> bool:
    try:
        return parse_quantity(quantity) > 0
    except QuantityError:
        return False  # the API server refuses it; until then it asks for nothing


def _without_gpus(container: dict[str, Any], work: _Work) -> dict[str, Any]:
    """A container that requests no GPU: ``NVIDIA_VISIBLE_DEVICES=none`` first in its env,
    replacing any value of its own (the same container back where that is already so)."""
    env = container.get("env") or ()
    kept: list[Any] = []
    theirs: list[Any] = []
    for e in env:
        (theirs if isinstance(e, dict) and e.get("name") == names.ENV_VISIBLE_DEVICES
         else kept).append(e)
    if any(e != _NO_GPUS_ENV for e in theirs):
        work.warn(f'container "{container["name"]}" requests no GPU: its env '
                  f"{names.ENV_VISIBLE_DEVICES} was set to {names.NO_GPUS} (a container sees only "
                  f"the GPUs it requests)")
    if env and env[0] == _NO_GPUS_ENV and len(kept) == len(env) - 1:
        return container  # mutated before: nothing to change
    new = dict(container)
    new["env"] = [_NO_GPUS_ENV, *kept]
    return new


def _without_our_volumes(container: dict[str, Any], work: _Work) -> dict[str, Any]:
    """A container that gets no GPU from gpuslice mounts none of its volumes: mounted whole,
    they are the node's library dir (a writable mount could replace the library every GPU
    container on the node loads) and every container's state dir (their region files)."""
    mounts = container.get("volumeMounts") or ()
    kept = [m for m in mounts if not (isinstance(m, dict) and m.get("name") in _OUR_VOLUMES)]
    if len(kept) == len(mounts):
        return container
    for mount in mounts:
        if mount not in kept:
            work.warn(f'container "{container["name"]}" gets no GPU from gpuslice: its '
                      f'volumeMount {mount["name"]} at {mount.get("mountPath")} was removed '
                      f"(gpuslice's volumes are mounted only into the containers that request "
                      f"its GPUs)")
    new = dict(container)
    new["volumeMounts"] = kept
    return new


def _mutate_pod_spec(spec: dict[str, Any], parts: list[_ContainerParts], settings: Settings,
                     work: _Work) -> None:
    ours = (*_VOLUMES, _limits_volume(parts))
    volumes = []
    for volume in spec.get("volumes") or ():
        if isinstance(volume, dict) and volume.get("name") in _OUR_VOLUMES:
            if volume not in ours:
                work.warn(f"volume {volume['name']} is reserved by gpuslice and was replaced")
            continue
        volumes.append(volume)
    spec["volumes"] = [*volumes, *ours]

    selector = dict(spec.get("nodeSelector") or {})
    for key, value in settings.node_selector.items():
        if selector.get(key, value) != value:
            work.warn(f"nodeSelector {key}={selector[key]} was changed to {key}={value}, "
                      f"the label of gpuslice GPU nodes")
        selector[key] = value
    spec["nodeSelector"] = selector

    current = spec.get("schedulerName")
    if current not in (None, _DEFAULT_SCHEDULER, settings.scheduler_name):
        work.warn(f"schedulerName {current} was changed to {settings.scheduler_name}, "
                  f"which assigns the GPUs")
    spec["schedulerName"] = settings.scheduler_name

    if settings.runtime_class_name is not None:
        current = spec.get("runtimeClassName")
        if current not in (None, settings.runtime_class_name):
            work.warn(f"runtimeClassName {current} was changed to "
                      f"{settings.runtime_class_name}, needed for GPU access")
            # The API server's RuntimeClass admission set spec.overhead from the class replaced
            # here (before webhooks run) and checks it against the new class after them: kept,
            # it refused the pod ("Pod Overhead set without corresponding RuntimeClass defined
            # Overhead"). The configured class defines none (values.yaml).
            if spec.pop("overhead", None) is not None:
                work.warn(f"spec.overhead was that of runtimeClassName {current} and was "
                          f"removed")
        spec["runtimeClassName"] = settings.runtime_class_name

    if settings.tolerations:
        tolerations = list(spec.get("tolerations") or ())
        for toleration in settings.tolerations:
            wanted = dict(toleration)
            if wanted not in tolerations:
                tolerations.append(wanted)
        spec["tolerations"] = tolerations


def _mutate_metadata(metadata: dict[str, Any], parts: list[_ContainerParts],
                     work: _Work) -> dict[str, Any]:
    new = dict(metadata)
    limits = {p.limits_key: p.limits for p in parts}
    annotations = {}
    for key, value in (metadata.get("annotations") or {}).items():
        if isinstance(key, str) and key.startswith(names.ANN_DEVICES_PREFIX):
            work.warn(f"annotation {key} is set by the gpuslice scheduler and was removed")
            continue
        if key == names.ANN_MUTATED:
            continue  # set last, so a second mutation keeps the annotations' order
        if isinstance(key, str) and key.startswith(names.ANN_LIMITS_PREFIX):
            # ours when the pod carries our mark (an earlier pass wrote it)
            if value != limits.get(key) and names.ANN_MUTATED not in metadata["annotations"]:
                verb = "replaced" if key in limits else "removed"
                work.warn(f"annotation {key} is managed by gpuslice; the value in the pod "
                          f"was {verb}")
            continue
        annotations[key] = value
    annotations.update(limits)
    annotations[names.ANN_MUTATED] = __version__
    new["annotations"] = annotations
    return new
