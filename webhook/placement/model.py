"""Wire formats of kube-scheduler's extender protocol (k8s.io/kube-scheduler/extender/v1).

The Go structs carry no JSON tags, so the JSON keys are the Go field names (PascalCase). The
scheduler decodes case-insensitively, but we always answer with the exact names. With
``nodeCacheCapable: true`` the scheduler sends ``NodeNames`` (not ``Nodes``) and reads
``NodeNames`` back.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NotRequired, TypedDict

from webhook.admission.mutate import BadObject, pod_shape

MIN_PRIORITY = 0
"""MinExtenderPriority."""
MAX_PRIORITY = 10
"""MaxExtenderPriority."""


class ExtenderArgs(TypedDict, total=False):
    """Filter and prioritize request: the pod and the candidate nodes."""

    Pod: dict[str, Any]
    Nodes: dict[str, Any] | None
    NodeNames: list[str] | None


class ExtenderFilterResult(TypedDict):
    """Filter answer: nodes that fit, and a reason per node that does not."""

    NodeNames: list[str]
    FailedNodes: dict[str, str]
    FailedAndUnresolvableNodes: dict[str, str]
    Error: str
    Nodes: NotRequired[dict[str, Any]]
    """Only when the request carried ``Nodes`` instead of ``NodeNames``."""


class HostPriority(TypedDict):
    """One node's score, 0 (worst) to 10 (best)."""

    Host: str
    Score: int


HostPriorityList = list[HostPriority]


class ExtenderBindingArgs(TypedDict):
    """Bind request: the pod chosen for a node."""

    PodName: str
    PodNamespace: str
    PodUID: str
    Node: str


class ExtenderBindingResult(TypedDict):
    """Bind answer: an empty Error means success."""

    Error: str


class WireError(ValueError):
    """A request body that is not the extender wire format (answered with HTTP 400)."""


def candidate_names(args: dict[str, Any]) -> list[str]:
    """The candidate node names of ExtenderArgs: ``NodeNames``, else the names in ``Nodes``."""
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireError("NodeNames must be a list of strings")
        return names
    nodes = args.get("Nodes")
    if isinstance(nodes, dict):
        items = nodes.get("items") or []
        if not isinstance(items, list):
            raise WireError("Nodes.items must be a list")
        out = []
        for i, node in enumerate(items):
            meta = node.get("metadata") if isinstance(node, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
                raise WireError(f"Nodes.items[{i}] must be a Node object with a "
                                f"metadata.name string")
            out.append(meta["name"])
        return out
    if nodes is None:
        return []
    raise WireError("Nodes must be a NodeList object")


def extender_pod(args: Any) -> dict[str, Any]:
    """The ``Pod`` of ExtenderArgs, checked to be shaped as the placement code reads it.

    The containers, annotations and identity fields get the webhook's shape checks
    (:func:`webhook.admission.mutate.pod_shape`): the placement code reads a pod only after this.
    """
    if not isinstance(args, dict):
        raise WireError("ExtenderArgs must be a JSON object")
    pod = args.get("Pod")
    if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
        raise WireError("ExtenderArgs.Pod must be a Pod object with metadata")
    if not isinstance(pod.get("spec"), dict):
        raise WireError("ExtenderArgs.Pod.spec must be an object")
    try:
        _, metadata = pod_shape(pod)
    except BadObject as exc:
        raise WireError(f"ExtenderArgs.Pod.{exc}") from exc
    for key in ("name", "namespace", "uid"):
        if not isinstance(metadata.get(key), str | None):
            raise WireError(f"ExtenderArgs.Pod.metadata.{key} must be a string")
    annotations = metadata.get("annotations") or {}
    if not all(isinstance(v, str) for v in annotations.values()):
        raise WireError("ExtenderArgs.Pod.metadata.annotations values must be strings")
    return pod


def binding_args(body: Any) -> ExtenderBindingArgs:
    """Validate an ExtenderBindingArgs body."""
    if not isinstance(body, dict):
        raise WireError("ExtenderBindingArgs must be a JSON object")
    out: dict[str, str] = {}
    for key in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise WireError(f"ExtenderBindingArgs.{key} must be a non-empty string")
        out[key] = value
    return ExtenderBindingArgs(PodName=out["PodName"], PodNamespace=out["PodNamespace"],
                               PodUID=out["PodUID"], Node=out["Node"])


class MetaPod(TypedDict):
    """A pod named by its UID (nodeCacheCapable: the scheduler finds it among the node's pods)."""

    UID: str


class MetaVictims(TypedDict):
    """The pods to preempt on one node, and how many PodDisruptionBudgets that violates."""

    Pods: list[MetaPod]
    NumPDBViolations: int


class ExtenderPreemptionResult(TypedDict):
    """Preempt answer: the candidate nodes the extender accepts, each with its victims. The
    scheduler always reads ``NodeNameToMetaVictims``, and looks each UID up among the pods it
    has on that node."""

    NodeNameToMetaVictims: dict[str, MetaVictims]


class Proposed(NamedTuple):
    """The scheduler's victims on one node, as ExtenderPreemptionArgs carries them."""

    uids: list[str]
    num_pdb_violations: int
    pods: dict[str, dict[str, Any]]
    """UID → Pod object, for the victims sent whole (``NodeNameToVictims``, without
    nodeCacheCapable); empty with ``NodeNameToMetaVictims``."""


def _count(value: Any, where: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"{where} must be a non-negative integer")
    return value


def preemption_args(body: Any) -> tuple[dict[str, Any], dict[str, Proposed]]:
    """Validate an ExtenderPreemptionArgs body: the preemptor and, per candidate node, the
    scheduler's victims.

    With nodeCacheCapable the scheduler sends ``NodeNameToMetaVictims`` (victims as UIDs) and
    ``NodeNameToVictims: null``; without it ``NodeNameToVictims`` (victims as Pod objects).
    """
    pod = extender_pod(body)
    meta, full = body.get("NodeNameToMetaVictims"), body.get("NodeNameToVictims")
    use_meta = meta is not None
    nodes = meta if use_meta else full
    key = "NodeNameToMetaVictims" if use_meta else "NodeNameToVictims"
    if nodes is None:
        return pod, {}
    if not isinstance(nodes, dict):
        raise WireError(f"ExtenderPreemptionArgs.{key} must be an object")
    out: dict[str, Proposed] = {}
    for node, victims in nodes.items():
        where = f"ExtenderPreemptionArgs.{key}[{node!r}]"
        if not isinstance(victims, dict):
            raise WireError(f"{where} must be an object")
        items = victims.get("Pods")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise WireError(f"{where}.Pods must be a list")
        uids: list[str] = []
        pods: dict[str, dict[str, Any]] = {}
        for i, item in enumerate(items):
            if use_meta:
                uid = item.get("UID") if isinstance(item, dict) else None
            else:
                m = item.get("metadata") if isinstance(item, dict) else None
                uid = m.get("uid") if isinstance(m, dict) else None
            if not isinstance(uid, str) or not uid:
                raise WireError(f"{where}.Pods[{i}] must name a pod by a non-empty " +
                                ("UID" if use_meta else "metadata.uid"))
            uids.append(uid)
            if not use_meta:
                pods[uid] = item
        out[node] = Proposed(uids, _count(victims.get("NumPDBViolations"),
                                          f"{where}.NumPDBViolations"), pods)
    return pod, out
