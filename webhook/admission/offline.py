"""Offline use of the mutation for CI pipelines: ``gpuslice mutate`` and ``gpuslice check``.

Both read YAML or JSON manifests (multi-document, ``-`` for stdin, ``kind: List`` items
included) and apply :func:`mutate_pod` to each Pod, to the pod template of Deployments,
StatefulSets, DaemonSets, ReplicaSets, ReplicationControllers, Jobs and CronJobs, and to every
pod template of the custom resources in :data:`CUSTOM_SHAPES` (Kubeflow training jobs and
Trainer runtimes, JobSet, LeaderWorkerSet, KubeRay, Volcano Job; Knative is checked only).
Kinds are matched with their API group, so a look-alike kind of another group, and every
other kind, passes through unchanged. Argo Workflows are not read: a workflow step names one
container, not a pod template, and the pods Argo builds from it pass through the webhook.

* ``mutate`` prints every document (mutated where it applies) as multi-document YAML on stdout,
  warnings and denials on stderr; exit 1 when something is denied, 2 when input is unreadable.
* ``check`` prints one line per denial, ``FILE: Kind/name: container "c": reason``, and exits 1
  when there is any, 0 when everything would be admitted, 2 when input is unreadable.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from webhook import names
from webhook.admission.encode import Fragment
from webhook.admission.mutate import BadObject, MutationResult, mutate_pod
from webhook.settings import Settings


class _Dumper(yaml.SafeDumper):
    """Safe YAML that also writes the mutation's shared read-only fragments as mappings."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # Multi-line values (the gpuslice.io/limits.* annotations) as literal blocks, one line a
    # line; PyYAML still quotes a value that a block cannot hold exactly.
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(Fragment, yaml.SafeDumper.represent_dict)
_Dumper.add_representer(str, _represent_str)


_TEXT = "tag:yaml.org,2002:str"
_AS_TEXT = ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value")
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class _Loader(yaml.SafeLoader):
    """Safe YAML that reads as text what kubectl's YAML (go-yaml) reads as text: an unquoted
    timestamp (PyYAML's datetime was written back as ``2024-01-01 10:00:00+00:00``), YAML
    1.1's base-60 numbers (``1:4``, torchrun's elastic ``--nnodes``, was 64) and ``=`` (which
    PyYAML could not read)."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = str(super().resolve(kind, value, implicit))
        if tag in _AS_TEXT or (tag in _NUMBERS and ":" in value):
            return _TEXT
        return tag


# Where each workload kind keeps its pod template.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


# The API groups of the core kinds above (an object without apiVersion is taken as one of them).
_CORE_GROUPS: dict[str, tuple[str, ...]] = {
    "Pod": ("",), "ReplicationController": ("",),
    "Deployment": ("apps", "extensions"), "StatefulSet": ("apps",),
    "DaemonSet": ("apps", "extensions"), "ReplicaSet": ("apps", "extensions"),
    "Job": ("batch",), "CronJob": ("batch",),
}

_RAY_CLUSTER = ("headGroupSpec.template", "workerGroupSpecs?.*.template")


@dataclass(frozen=True, slots=True)
class Shape:
    """Where a custom resource keeps its pod templates.

    Each path is dotted; ``*`` stands for every entry of a map or list, and a key ending in
    ``?`` may be absent (then that path has no template). A missing key elsewhere is reported.
    ``rewrite`` False: ``check`` reports on the templates, ``mutate`` leaves them as they are.
    ``env``: variables the system's own webhook puts first in every container of the pods, as
    (name, dotted path of the value in the object); the warnings read them too (the webhook's
    pass that sees them warns, but of a controller's pods only the controller is told).
    """

    paths: tuple[str, ...]
    rewrite: bool = True
    note: str = ""
    env: tuple[tuple[str, str], ...] = ()
    container_name: str = ""
    """The name the system's webhook gives a container without one (Knative's
    ``user-container``; ``-N`` after it where there are several); "" where a name is required."""


# Pod templates of the custom resources ML workloads are written as, by (API group, kind),
# at the paths of the projects' API types. Their pods still pass through the webhook; these
# are for the systems that count a template's resources before any pod exists (Kueue,
# Volcano's PodGroup minResources, KubeRay).
CUSTOM_SHAPES: dict[tuple[str, str], Shape] = {
    # Kubeflow training-operator (kubeflow.org/v1) and mpi-operator (v2beta1): a map from
    # replica type (Master, Worker, PS, Launcher, ...) to a ReplicaSpec with a pod template.
    **{("kubeflow.org", kind): Shape((f"spec.{field}.*.template",)) for kind, field in (
        ("PyTorchJob", "pytorchReplicaSpecs"), ("TFJob", "tfReplicaSpecs"),
        ("XGBoostJob", "xgbReplicaSpecs"), ("PaddleJob", "paddleReplicaSpecs"),
        ("JAXJob", "jaxReplicaSpecs"), ("MPIJob", "mpiReplicaSpecs"))},
    # Kubeflow Trainer v2: a TrainJob has no pod template (spec.trainer.resourcesPerNode is
    # merged into the runtime's trainer container when the JobSet is built); the runtimes
    # hold a JobSet template.
    **{("trainer.kubeflow.org", kind): Shape(
        ("spec.template.spec.replicatedJobs.*.template.spec.template",))
       for kind in ("TrainingRuntime", "ClusterTrainingRuntime")},
    ("jobset.x-k8s.io", "JobSet"): Shape(("spec.replicatedJobs.*.template.spec.template",)),
    # LWS's pod webhook gives every container LWS_GROUP_SIZE, the group's pods.
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): Shape(
        ("spec.leaderWorkerTemplate.leaderTemplate?", "spec.leaderWorkerTemplate.workerTemplate"),
        env=(("LWS_GROUP_SIZE", "spec.leaderWorkerTemplate.size"),)),
    ("ray.io", "RayCluster"): Shape(tuple(f"spec.{p}" for p in _RAY_CLUSTER)),
    ("ray.io", "RayJob"): Shape(tuple(f"spec.rayClusterSpec?.{p}" for p in _RAY_CLUSTER)
                                + ("spec.submitterPodTemplate?",)),
    ("ray.io", "RayService"): Shape(tuple(f"spec.rayClusterConfig.{p}" for p in _RAY_CLUSTER)),
    ("batch.volcano.sh", "Job"): Shape(("spec.tasks.*.template",)),
    # Knative's revision template is a PodSpec with more fields, and Knative's own webhook
    # refuses schedulerName, nodeSelector, runtimeClassName and hostPath volumes unless
    # feature flags allow them; nothing counts its template's GPUs, so it is only checked.
    **{("serving.knative.dev", kind): Shape(
        ("spec.template",), rewrite=False, container_name="user-container",
        note="not rewritten: Knative refuses the mutated fields (schedulerName, nodeSelector, "
             "hostPath volumes) unless its feature flags allow them; the webhook mutates the "
             "pods Knative creates")
       for kind in ("Service", "Configuration")},
}


class InputError(Exception):
    """A manifest cannot be read or parsed."""


@dataclass(frozen=True, slots=True)
class Finding:
    """The outcome for one pod (or pod template) found in a manifest."""

    source: str
    label: str
    result: MutationResult | None
    error: str | None = None
    note: str | None = None  # why ``mutate`` printed a template that needs mutating unchanged


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _label(obj: dict[str, Any], doc: int) -> str:
    meta = _metadata(obj)
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName")
                                else f"(document {doc})")
    return f"{obj.get('kind', 'object')}/{name}"


def _group(obj: dict[str, Any]) -> str | None:
    """The API group of ``obj`` ("" for core/v1), or None when it names no apiVersion."""
    api = obj.get("apiVersion")
    if not isinstance(api, str) or not api:
        return None
    return api.rpartition("/")[0]


Path = tuple[str | int, ...]


def _dotted(path: Path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _templates(obj: dict[str, Any], pattern: str) -> Iterator[tuple[Path, Any]]:
    """Every template matching ``pattern`` (see :class:`Shape`) with its path, in order.

    Where a key is missing or of the wrong type the item is ``(path, BadObject)`` instead.
    """
    def walk(node: Any, keys: list[str], path: Path) -> Iterator[tuple[Path, Any]]:
        if not keys:
            yield path, node
            return
        key, rest = keys[0], keys[1:]
        if key == "*":
            if isinstance(node, dict):
                entries: Iterable[tuple[str | int, Any]] = node.items()
            elif isinstance(node, list):
                entries = enumerate(node)
            else:
                yield path, BadObject(f"{_dotted(path)} must be a map or a list")
                return
            for k, child in entries:
                yield from walk(child, rest, (*path, k))
            return
        optional = key.endswith("?")
        key = key.rstrip("?")
        child = node.get(key) if isinstance(node, dict) else None
        if child is None and optional:
            return
        if child is None or (not isinstance(child, dict) and rest[:1] != ["*"]):
            yield path, BadObject(f"{_dotted((*path, key))} is missing")
            return
        yield from walk(child, rest, (*path, key))

    return walk(obj, pattern.split("."), ())


def _mutate_object(obj: Any, source: str, doc: int, settings: Settings,
                   findings: list[Finding]) -> Any:
    """Return ``obj`` with its pod (templates) mutated; record a finding for every pod seen."""
    if not isinstance(obj, dict):
        return obj
    kind = obj.get("kind")
    if not isinstance(kind, str):
        return obj
    if kind.endswith("List") and isinstance(obj.get("items"), list):
        return {**obj, "items": [_mutate_object(item, source, doc, settings, findings)
                                 for item in obj["items"]]}
    group = _group(obj)
    label = _label(obj, doc)
    shape = CUSTOM_SHAPES.get((group, kind)) if group is not None else None
    if shape is not None:
        return _mutate_templates(obj, shape, label, source, settings, findings)
    if group is not None and group not in _CORE_GROUPS.get(kind, ()):
        return obj
    if kind == "Pod":
        path: tuple[str, ...] = ()
    elif kind in TEMPLATE_PATHS:
        path = TEMPLATE_PATHS[kind]
    else:
        return obj
    namespace = _metadata(obj).get("namespace")
    try:
        target = _get(obj, path)
        result = mutate_pod(target, settings, namespace=namespace,
                            max_gpu_memory_mib=settings.max_gpu_memory_mib)
    except BadObject as exc:
        where = ".".join(path)
        findings.append(Finding(source, label, None, f"{where + ': ' if where else ''}{exc}"))
        return obj
    if path and (result.changed or result.denials):
        result = result._replace(warnings=result.warnings + _misplaced(obj, target, kind, path))
    findings.append(Finding(source, label, result))
    if not result.changed or result.pod is None:
        return obj
    return _replace(obj, path, result.pod)


def _misplaced(obj: dict[str, Any], template: Any, kind: str,
               path: tuple[str, ...]) -> tuple[str, ...]:
    """Warnings for placement annotations on a workload's own metadata that its pod template
    lacks: the controller gives pods the template's annotations only, so these do nothing."""
    own = _metadata(obj).get("annotations")
    theirs = _metadata(template).get("annotations") if isinstance(template, dict) else None
    if not isinstance(own, dict):
        return ()
    where = ".".join((*path, "metadata", "annotations"))
    return tuple(f"annotation {key} is on the {kind}, not on its pod template: its pods do not "
                 f"get it (set it in {where})"
                 for key in names.POD_PLACEMENT_ANNOTATIONS
                 if key in own and not (isinstance(theirs, dict) and key in theirs))


def _mutate_templates(obj: dict[str, Any], shape: Shape, label: str, source: str,
                      settings: Settings, findings: list[Finding]) -> dict[str, Any]:
    """Mutate each pod template of a custom resource; one finding per template."""
    namespace = _metadata(obj).get("namespace")
    out = obj
    for pattern in shape.paths:
        for path, template in _templates(obj, pattern):
            if isinstance(template, BadObject):
                findings.append(Finding(source, label, None, str(template)))
                continue
            where = f"{label}: {_dotted(path)}"
            if shape.container_name:
                template = _named(template, shape.container_name)
            try:
                result = mutate_pod(template, settings, namespace=namespace,
                                    max_gpu_memory_mib=settings.max_gpu_memory_mib)
            except BadObject as exc:
                findings.append(Finding(source, where, None, str(exc)))
                continue
            if shape.env and result.changed and result.allowed:
                result = _with_added_env_warnings(obj, shape, template, result, namespace,
                                                  settings)
            keep = result.changed and not shape.rewrite
            findings.append(Finding(source, where, result, note=shape.note if keep else None))
            if result.changed and result.pod is not None and shape.rewrite:
                out = _replace(out, path, result.pod)
    return out


def _named(template: Any, name: str) -> Any:
    """``template`` with its unnamed containers named as the system's webhook names them
    (Knative's own examples leave the name out: `check` refused them for want of one)."""
    spec = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(spec, dict):
        return template
    containers = spec.get("containers")
    if not isinstance(containers, list) or not any(
            isinstance(c, dict) and "name" not in c for c in containers):
        return template
    named = [({**c, "name": name if len(containers) == 1 else f"{name}-{i}"}
              if isinstance(c, dict) and "name" not in c else c)
             for i, c in enumerate(containers)]
    return {**template, "spec": {**spec, "containers": named}}


def _with_added_env_warnings(obj: dict[str, Any], shape: Shape, template: dict[str, Any],
                             result: MutationResult, namespace: Any,
                             settings: Settings) -> MutationResult:
    """``result`` with the warnings the webhook gives the template's pods once the system's
    webhook has put ``shape.env`` first in their containers' env (the template mutated before,
    shaped as a pod)."""
    added = []
    for name, where in shape.env:
        value: Any = obj
        for key in where.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str):
            added.append({"name": name, "value": value})
    if not added:
        return result
    taken = {e["name"] for e in added}
    spec = dict(template["spec"])
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            spec[kind] = [{**c, "env": [*added, *(e for e in c.get("env") or ()
                                                  if not (isinstance(e, dict)
                                                          and e.get("name") in taken))]}
                          for c in spec[kind]]
    seen = mutate_pod({**template, "spec": spec}, settings, namespace=namespace,
                      max_gpu_memory_mib=settings.max_gpu_memory_mib)
    more = tuple(w for w in seen.warnings if w not in result.warnings)
    return result._replace(warnings=result.warnings + more) if more else result


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), dict):
            raise BadObject(f"{'.'.join(path)} is missing")
        obj = obj[key]
    return obj


def _replace(obj: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    key = path[0]
    if isinstance(obj, list):  # (by what it is: a map's key may be a number too)
        return [_replace(item, path[1:], value) if i == key else item
                for i, item in enumerate(obj)]
    return {**obj, key: _replace(obj[key], path[1:], value)}


def _documents(source: str) -> Iterator[Any]:
    try:
        if source == "-":
            text = sys.stdin.read()
        else:
            with open(source, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise InputError(f"{source}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{source}: not UTF-8 text: {exc}") from None
    try:
        yield from yaml.load_all(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: not valid YAML/JSON: {exc}") from None


def mutate_documents(docs: Iterable[Any], source: str, settings: Settings,
                     findings: list[Finding]) -> list[Any]:
    """Mutate the pods in ``docs`` (from ``source``), appending a finding for each pod seen."""
    return [_mutate_object(obj, source, n, settings, findings)
            for n, obj in enumerate(docs, start=1) if obj is not None]


def process(sources: list[str], settings: Settings) -> tuple[list[Any], list[Finding]]:
    """Mutate every document of every source; return the documents and the findings."""
    out: list[Any] = []
    findings: list[Finding] = []
    for source in sources:
        out += mutate_documents(_documents(source), source, settings, findings)
    return out, findings


def problems(findings: list[Finding]) -> list[str]:
    """One line per denial or unusable object: ``FILE: Kind/name: [container "c": ]reason``."""
    lines = []
    for f in findings:
        if f.error is not None:
            lines.append(f"{f.source}: {f.label}: {f.error}")
        elif f.result is not None:
            lines.extend(f"{f.source}: {f.label}: {d}" for d in f.result.denials)
    return lines


def _process_args(args: argparse.Namespace, verb: str) -> tuple[list[Any], list[Finding]] | None:
    """Settings from the command line, then :func:`process` on ``-f``; None after an input error."""
    from webhook.cli import settings_from_args

    settings = settings_from_args(args)
    sources = args.filename if isinstance(args.filename, list) else [args.filename]
    try:
        return process(sources, settings)
    except InputError as exc:
        print(f"gpuslice {verb}: {exc}", file=sys.stderr)
        return None


def cmd_mutate(args: argparse.Namespace) -> int:
    """``gpuslice mutate -f FILE``: print the mutated manifest."""
    processed = _process_args(args, "mutate")
    if processed is None:
        return 2
    docs, findings = processed
    sys.stdout.write(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True))
    for f in findings:
        for warning in (f.result.warnings if f.result is not None else ()):
            print(f"{f.source}: {f.label}: warning: {warning}", file=sys.stderr)
        if f.note is not None:
            print(f"{f.source}: {f.label}: {f.note}", file=sys.stderr)
    lines = problems(findings)
    for line in lines:
        print(line, file=sys.stderr)
    return 1 if lines else 0


def cmd_check(args: argparse.Namespace) -> int:
    """``gpuslice check -f FILE...``: list every denial; exit 1 if any."""
    processed = _process_args(args, "check")
    if processed is None:
        return 2
    _, findings = processed
    lines = problems(findings)
    for line in lines:
        print(line)
    pods = len(findings)
    print(f"{pods} pod{'s' if pods != 1 else ''} checked, "
          f"{len(lines)} problem{'s' if len(lines) != 1 else ''}",
          file=sys.stderr)
    return 1 if lines else 0
