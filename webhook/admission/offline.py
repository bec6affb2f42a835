"""Offline use of the mutation for CI pipelines: ``gpuslice mutate`` and ``gpuslice check``.

Both read YAML or JSON manifests (multi-document, ``-`` for stdin, ``kind: List`` items
included) and apply :func:`mutate_pod` to each Pod and to the pod template of Deployments,
StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs; other kinds pass through unchanged.

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


class InputError(Exception):
    """A manifest cannot be read or parsed."""


@dataclass(frozen=True, slots=True)
class Finding:
    """The outcome for one pod (or pod template) found in a manifest."""

    source: str
    label: str
    result: MutationResult | None
    error: str | None = None


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _label(obj: dict[str, Any], doc: int) -> str:
    meta = _metadata(obj)
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName")
                                else f"(document {doc})")
    return f"{obj.get('kind', 'object')}/{name}"


def _mutate_object(obj: Any, source: str, doc: int, settings: Settings,
                   findings: list[Finding]) -> Any:
    """Return ``obj`` with its pod (template) mutated; record a finding for every pod seen."""
    if not isinstance(obj, dict):
        return obj
    kind = obj.get("kind")
    if not isinstance(kind, str):
        return obj
    if kind.endswith("List") and isinstance(obj.get("items"), list):
        return {**obj, "items": [_mutate_object(item, source, doc, settings, findings)
                                 for item in obj["items"]]}
    if kind == "Pod":
        path: tuple[str, ...] = ()
    elif kind in TEMPLATE_PATHS:
        path = TEMPLATE_PATHS[kind]
    else:
        return obj
    label = _label(obj, doc)
    namespace = _metadata(obj).get("namespace")
    try:
        target = _get(obj, path)
        result = mutate_pod(target, settings, namespace=namespace,
                            max_gpu_memory_mib=settings.max_gpu_memory_mib)
    except BadObject as exc:
        where = ".".join(path)
        findings.append(Finding(source, label, None, f"{where + ': ' if where else ''}{exc}"))
        return obj
    findings.append(Finding(source, label, result))
    if not result.changed or result.pod is None:
        return obj
    return _replace(obj, path, result.pod)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), dict):
            raise BadObject(f"{'.'.join(path)} is missing")
        obj = obj[key]
    return obj


def _replace(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if not path:
        return value
    return {**obj, path[0]: _replace(obj[path[0]], path[1:], value)}


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
        yield from yaml.safe_load_all(text)
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
