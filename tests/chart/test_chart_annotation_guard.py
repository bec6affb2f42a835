"""The annotation guard: a ValidatingAdmissionPolicy that keeps the ``gpuslice.io/devices.*``
pod annotations (the GPUs the extender assigned at bind time) as the extender wrote them, and
the ``gpuslice.io/limits.*`` annotations (each GPU container's limits file, written by the
webhook at pod creation) as the webhook wrote them.

Rendered in the API version the cluster serves (v1, v1beta1 or none) and valid against that
version's schema; its CEL is evaluated with cel-python (the API server uses cel-go) on pods
before and after CREATEs and UPDATEs, the way the API server applies a policy: matchConditions
first, then the variables, then the validations."""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path
from typing import Any

import kubeschema
import pytest

from webhook import names
from webhook.admission.mutate import mutate_pod
from webhook.settings import Settings

celpy = pytest.importorskip("celpy", reason="cel-python not installed (pip install cel-python) "
                            "to evaluate the policy's CEL")

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuslice"
NAMESPACE = "gpuslice-system"  # the render fixture's default
POLICY, BINDING = "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"
NAME = "gpuslice-annotation-guard"
MESSAGE = ("gpuslice.io/devices.* annotations are set by the gpuslice scheduler at bind time "
           "and cannot be changed")
LIMITS_MESSAGE = ("gpuslice.io/limits.* and gpuslice.io/mutated annotations are written by the "
                  "gpuslice webhook at pod creation and cannot be changed")
GPUSLICE_SA = f"system:serviceaccount:{NAMESPACE}:gpuslice"
TENANT = "system:serviceaccount:team-a:default"
DEV_C = names.devices_annotation("c")
DEV_D = names.devices_annotation("d")
LIM_C = names.limits_annotation("c")
LIM_D = names.limits_annotation("d")


def _guard(rendered: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    policies = [p for p in rendered.all(POLICY) if p["metadata"]["name"].endswith(NAME)]
    bindings = [b for b in rendered.all(BINDING) if b["metadata"]["name"].endswith(NAME)]
    if not policies and not bindings:
        return None
    assert len(policies) == len(bindings) == 1, "the policy and its binding come together"
    return policies[0], bindings[0]


# ----- which API version, and valid against that version's schema -----

# (Kubernetes version, what it serves beyond its defaults, the guard's apiVersion)
@pytest.mark.parametrize(("kube_version", "served", "expected"), [
    (kubeschema.OLDEST, None, None),
    ("1.28.0", None, None),  # the beta API is off by default
    ("1.29.0", "v1beta1", "admissionregistration.k8s.io/v1beta1"),
    ("1.30.0", None, "admissionregistration.k8s.io/v1"),
    ("1.31.0", "both", "admissionregistration.k8s.io/v1"),
    (kubeschema.NEWEST, None, "admissionregistration.k8s.io/v1"),
], ids=["1.25", "1.28", "1.29-beta-on", "1.30", "1.31-both-served", "newest"])
def test_guard_uses_the_api_version_the_cluster_serves_and_validates_against_it(
        kube_version: str, served: str | None, expected: str | None, render: Any,
        vap_api_versions: dict[str, tuple[str, ...]]) -> None:
    api_versions = vap_api_versions[served] if served else None
    guard = _guard(render({}, kube_version, api_versions=api_versions))
    if expected is None:
        assert guard is None
        return
    assert guard is not None
    policy, binding = guard
    assert policy["apiVersion"] == binding["apiVersion"] == expected
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == NAME
    # v1beta1 is gone from the newest schema: beta objects are checked against 1.28 and 1.29.
    versions = (("1.28.0", kube_version) if expected.endswith("v1beta1")
                else (kube_version, kubeschema.NEWEST))
    for obj in guard:
        kubeschema.assert_valid(obj, tuple(dict.fromkeys(versions)))


def test_guard_is_not_installed_when_disabled(render: Any) -> None:
    assert _guard(render({"annotationGuard": {"enabled": False}}, "1.30.0")) is None


# ----- what it matches -----

@pytest.mark.parametrize("namespace", [NAMESPACE, "gpu-ops"])
def test_guard_denies_on_pod_creates_and_updates_outside_kube_system_and_the_release_namespace(
        namespace: str, render: Any) -> None:
    # excludedNamespaces are not mutated but stay guarded: the extender counts every namespace.
    guard = _guard(render({"webhook": {"excludedNamespaces": ["ci"]}}, namespace=namespace))
    assert guard is not None
    policy, binding = guard
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"]["validationActions"] == ["Deny"]
    constraints = policy["spec"]["matchConstraints"]
    assert constraints["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
        "resources": ["pods", "pods/status", "pods/ephemeralcontainers"],
        "scope": "Namespaced"}]
    assert constraints["namespaceSelector"] == {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "NotIn",
        "values": ["kube-system", namespace]}]}


def test_extender_binding_is_not_matched_so_binds_are_never_denied(render: Any) -> None:
    """POST pods/<name>/binding is admitted as a CREATE of the pods/binding subresource; the
    registry then merges the Binding's annotations into the stored pod without a pods UPDATE
    admission. The policy must not match the subresource (nor a wildcard covering it)."""
    guard = _guard(render())
    assert guard is not None
    resources = {r for rule in guard[0]["spec"]["matchConstraints"]["resourceRules"]
                 for r in rule["resources"]}
    assert not resources & {"pods/binding", "pods/*", "*/*", "*"}


def test_guard_names_the_contract_prefixes_and_says_why(render: Any) -> None:
    guard = _guard(render())
    assert guard is not None
    spec = guard[0]["spec"]
    devices, limits, _ephemeral, _unmutated = spec["validations"]
    assert devices["message"] == MESSAGE and limits["message"] == LIMITS_MESSAGE
    assert devices["reason"] == limits["reason"] == "Forbidden"
    prefixes = [f"startsWith('{prefix}')" for prefix in (names.ANN_DEVICES_PREFIX,
                                                         names.ANN_LIMITS_PREFIX)]
    for variable in spec["variables"]:
        assert sum(p in variable["expression"] for p in prefixes) == 1, variable
    for prefix in prefixes:
        assert sum(prefix in v["expression"] for v in spec["variables"]) == 2


# ----- the CEL, evaluated -----

@functools.cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    """The value of ``expression``; an evaluation error fails the test (with failurePolicy
    Fail the API server would deny the request, kubelet's status updates included)."""
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELEvalError as exc:
        pytest.fail(f"CEL error in {expression!r}: {exc}")
    assert not isinstance(result, celpy.CELEvalError), f"CEL error in {expression!r}: {result}"
    return result


def admission(policy: dict[str, Any], operation: str, obj: dict[str, Any],
              old: dict[str, Any] | None = None, username: str = TENANT,
              sub_resource: str = "", namespace_labels: dict[str, str] | None = None
              ) -> str | None:
    """What the policy answers: None (admitted, or not matched) or the denial message.
    The pod's namespace carries ``namespace_labels`` besides its name label."""
    request = {"operation": operation, "userInfo": {"username": username},
               "subResource": sub_resource}
    return policy_answer(policy, request, obj, old, namespace_labels)


def policy_answer(policy: dict[str, Any], request: dict[str, Any], obj: dict[str, Any],
                  old: dict[str, Any] | None,
                  namespace_labels: dict[str, str] | None = None) -> str | None:
    """A ValidatingAdmissionPolicy applied as the API server does: matchConditions, then the
    variables in order, then the validations; None when admitted (or not matched), else the
    first failing validation's message (its messageExpression's value where it has one).
    ``namespaceObject`` is the object's namespace (null for a cluster-scoped object)."""
    ns = (obj.get("metadata") or {}).get("namespace")
    namespace = None if ns is None else {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": ns, "labels": {"kubernetes.io/metadata.name": ns, **(namespace_labels or {})}}}
    base = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel(request),
            "namespaceObject": celpy.json_to_cel(namespace)}
    spec = policy["spec"]
    if not all(bool(_eval(c["expression"], base)) for c in spec.get("matchConditions", [])):
        return None
    variables: dict[Any, Any] = {}
    for variable in spec.get("variables", []):
        activation = {**base, "variables": celpy.celtypes.MapType(variables)}
        variables[celpy.celtypes.StringType(variable["name"])] = \
            _eval(variable["expression"], activation)
    activation = {**base, "variables": celpy.celtypes.MapType(variables)}
    for validation in spec["validations"]:
        if not bool(_eval(validation["expression"], activation)):
            if "messageExpression" in validation:
                return str(_eval(validation["messageExpression"], activation))
            return str(validation["message"])
    return None


def _pod(annotations: dict[str, str] | None = None, node: str | None = "gpu-1",
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "train", "namespace": "team-a", "uid": "u-1"}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "cuda"},
                                           {"name": "d", "image": "cuda"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@pytest.fixture(scope="module")
def policy(render: Any) -> dict[str, Any]:
    guard = _guard(render())
    assert guard is not None
    return guard[0]


BOUND = {DEV_C: "GPU-a", DEV_D: "GPU-b,GPU-c", "team": "ml"}

# (operation, old annotations, new annotations, username, denied)
CASES: dict[str, tuple[str, Any, Any, str, bool]] = {
    "create without annotations": ("CREATE", None, None, TENANT, False),
    "create with unrelated annotations": ("CREATE", None, {"team": "ml"}, TENANT, False),
    "create with other gpuslice annotations": (
        "CREATE", None, {names.ANN_MUTATED: "0.1.0", "gpuslice.io/placement": "spread",
                         "gpuslice.io/devicesx": "GPU-a", "example.com/devices.c": "GPU-a"},
        TENANT, False),
    "create carrying a device assignment": ("CREATE", None, {DEV_C: "GPU-a"}, TENANT, True),
    "update of an unrelated annotation": (
        "UPDATE", BOUND, {**BOUND, "team": "vision"}, TENANT, False),
    "update adding an unrelated annotation": (
        "UPDATE", BOUND, {**BOUND, "note": "x"}, TENANT, False),
    "update leaving everything as is": ("UPDATE", BOUND, dict(BOUND), TENANT, False),
    "update of a pod without annotations": ("UPDATE", None, None, TENANT, False),
    "update adding a device assignment": (
        "UPDATE", {"team": "ml"}, {"team": "ml", DEV_C: "GPU-a"}, TENANT, True),
    "update adding one to a pod without annotations": (
        "UPDATE", None, {DEV_C: "GPU-a"}, TENANT, True),
    "update adding a second container's assignment": (
        "UPDATE", {DEV_C: "GPU-a"}, {DEV_C: "GPU-a", DEV_D: "GPU-b"}, TENANT, True),
    "update changing an assignment (kubectl annotate --overwrite)": (
        "UPDATE", BOUND, {**BOUND, DEV_C: "GPU-other"}, TENANT, True),
    "update swapping two containers' assignments": (
        "UPDATE", BOUND, {**BOUND, DEV_C: BOUND[DEV_D], DEV_D: BOUND[DEV_C]}, TENANT, True),
    "update removing an assignment": (
        "UPDATE", BOUND, {k: v for k, v in BOUND.items() if k != DEV_D}, TENANT, True),
    "update removing every annotation": ("UPDATE", BOUND, None, TENANT, True),
    "kubelet status update of a bound pod": (
        "UPDATE", BOUND, dict(BOUND), "system:node:gpu-1", False),
    "gpuslice's own service account changing an assignment": (
        "UPDATE", BOUND, {**BOUND, DEV_C: "GPU-z"}, GPUSLICE_SA, False),
    "the agent's service account changing an assignment": (
        "UPDATE", BOUND, {**BOUND, DEV_C: "GPU-z"},
        f"system:serviceaccount:{NAMESPACE}:gpuslice-agent", True),
    "a kube-system controller changing an assignment": (
        "UPDATE", BOUND, {**BOUND, DEV_C: "GPU-z"},
        "system:serviceaccount:kube-system:generic-garbage-collector", True),
}


def test_old_object_is_read_only_on_update(policy: dict[str, Any]) -> None:
    """oldObject is null on CREATE, and cel-go errors on a field of null (an error denies the
    request: failurePolicy Fail). cel-python's has() answers false instead, so the evaluations
    below cannot catch a missing guard: every expression reading oldObject must start with it."""
    spec = policy["spec"]
    expressions = [e["expression"] for e in
                   spec.get("matchConditions", []) + spec["variables"] + spec["validations"]]
    readers = [e for e in expressions if "oldObject" in e]
    assert readers
    for expression in readers:
        assert expression.startswith("request.operation == 'UPDATE' && "), expression


@pytest.mark.parametrize("case", list(CASES))
def test_policy_denies_exactly_the_changes_to_device_assignments(
        case: str, policy: dict[str, Any]) -> None:
    operation, old, new, username, denied = CASES[case]
    old_pod = _pod(old) if operation == "UPDATE" else None
    answer = admission(policy, operation, _pod(new, node=None if old_pod is None else "gpu-1"),
                       old_pod, username)
    assert answer == (MESSAGE if denied else None)


LIMITS_C = ("CUDA_DEVICE_MEMORY_LIMIT=1000m\nCUDA_DEVICE_SM_LIMIT=20\n"
            "CUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpuslice/region\n")
LIMITS_D = "GPUSLICE_MEMORY_PERCENT=25\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpuslice/region\n"
RAISED = "CUDA_DEVICE_MEMORY_LIMIT=80000m\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpuslice/region\n"
MUTATED = {names.ANN_MUTATED: "0.1.0", LIM_C: LIMITS_C, LIM_D: LIMITS_D, "team": "ml"}
RUNNING = {**MUTATED, DEV_C: "GPU-a", DEV_D: "GPU-b"}  # mutated, then bound

# (operation, old annotations, new annotations, username, the answer)
LIMITS_CASES: dict[str, tuple[str, Any, Any, str, str | None]] = {
    "create of a mutated pod (the webhook wrote them)": ("CREATE", None, MUTATED, TENANT, None),
    "create carrying any limits annotation (e.g. an offline-mutated template)": (
        "CREATE", None, {LIM_C: RAISED, names.limits_annotation("x"): "y"}, TENANT, None),
    "create carrying limits and a device assignment": (
        "CREATE", None, {**MUTATED, DEV_C: "GPU-a"}, TENANT, MESSAGE),
    "update of an unrelated annotation": (
        "UPDATE", RUNNING, {**RUNNING, "team": "vision"}, TENANT, None),
    "update of a look-alike key outside the prefix": (
        "UPDATE", {**RUNNING, "gpuslice.io/limitsx": "a"},
        {**RUNNING, "gpuslice.io/limitsx": "b"}, TENANT, None),
    "update leaving everything as is": ("UPDATE", RUNNING, dict(RUNNING), TENANT, None),
    "update raising a limit (kubectl annotate --overwrite)": (
        "UPDATE", RUNNING, {**RUNNING, LIM_C: RAISED}, TENANT, LIMITS_MESSAGE),
    "update dropping only the trailing newline": (
        "UPDATE", RUNNING, {**RUNNING, LIM_C: LIMITS_C.rstrip()}, TENANT, LIMITS_MESSAGE),
    "update swapping two containers' limits": (
        "UPDATE", RUNNING, {**RUNNING, LIM_C: LIMITS_D, LIM_D: LIMITS_C}, TENANT, LIMITS_MESSAGE),
    "update removing a limits annotation": (
        "UPDATE", RUNNING, {k: v for k, v in RUNNING.items() if k != LIM_C}, TENANT,
        LIMITS_MESSAGE),
    "update adding a limits annotation for another name": (
        "UPDATE", RUNNING, {**RUNNING, names.limits_annotation("e"): RAISED}, TENANT,
        LIMITS_MESSAGE),
    "update adding one to a pod that had none": (
        "UPDATE", {"team": "ml"}, {"team": "ml", LIM_C: RAISED}, TENANT, LIMITS_MESSAGE),
    "update adding one to a pod without annotations": (
        "UPDATE", None, {LIM_C: RAISED}, TENANT, LIMITS_MESSAGE),
    "kubelet status update of a running pod": (
        "UPDATE", RUNNING, dict(RUNNING), "system:node:gpu-1", None),
    "gpuslice's own service account changing a limit": (
        "UPDATE", RUNNING, {**RUNNING, LIM_C: RAISED}, GPUSLICE_SA, None),
    "the agent's service account changing a limit": (
        "UPDATE", RUNNING, {**RUNNING, LIM_C: RAISED},
        f"system:serviceaccount:{NAMESPACE}:gpuslice-agent", LIMITS_MESSAGE),
    # The mark: without it the agent's audit passes the pod by (no over-limit report or
    # eviction) and the extender would place a pod the webhook never capped.
    "update removing the mutated mark (kubectl annotate gpuslice.io/mutated-)": (
        "UPDATE", RUNNING, {k: v for k, v in RUNNING.items() if k != names.ANN_MUTATED},
        TENANT, LIMITS_MESSAGE),
    "update changing the mutated mark": (
        "UPDATE", RUNNING, {**RUNNING, names.ANN_MUTATED: "0.0.1"}, TENANT, LIMITS_MESSAGE),
    "update adding the mutated mark to a pod the webhook did not mutate": (
        "UPDATE", {"team": "ml"}, {"team": "ml", names.ANN_MUTATED: "0.1.0"}, TENANT,
        LIMITS_MESSAGE),
}


@pytest.mark.parametrize("case", list(LIMITS_CASES))
def test_policy_denies_changes_to_limits_after_creation(case: str, policy: dict[str, Any]) -> None:
    operation, old, new, username, answer = LIMITS_CASES[case]
    old_pod = _pod(old) if operation == "UPDATE" else None
    assert admission(policy, operation, _pod(new, node=None if old_pod is None else "gpu-1"),
                     old_pod, username) == answer


def test_mutated_gpu_pod_is_created_and_its_limits_then_kept(policy: dict[str, Any]) -> None:
    """The webhook's output passes the guard at CREATE (mutating admission runs first); once
    the pod exists, a tenant can neither raise nor drop the limits it was given."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team-a", "annotations": {"team": "ml"}},
           "spec": {"containers": [{"name": "c", "image": "cuda", "resources": {
               "limits": {"nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"}}}]}}
    result = mutate_pod(pod, Settings())
    assert result.allowed and result.pod is not None
    created = copy.deepcopy(result.pod)
    assert created["metadata"]["annotations"][LIM_C] == (
        "CUDA_DEVICE_MEMORY_LIMIT=1024m\nCUDA_DEVICE_SM_LIMIT=30\n"
        "CUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpuslice/region\n")
    assert admission(policy, "CREATE", created) is None

    bound = copy.deepcopy(created)
    bound["metadata"]["annotations"][DEV_C] = "GPU-a"  # merged from the extender's Binding
    bound["spec"]["nodeName"] = "gpu-1"
    raised = copy.deepcopy(bound)
    raised["metadata"]["annotations"][LIM_C] = RAISED
    assert admission(policy, "UPDATE", raised, bound) == LIMITS_MESSAGE
    assert admission(policy, "UPDATE", raised, bound, GPUSLICE_SA) is None
    dropped = copy.deepcopy(bound)
    del dropped["metadata"]["annotations"][LIM_C]
    assert admission(policy, "UPDATE", dropped, bound) == LIMITS_MESSAGE
    relabelled = copy.deepcopy(bound)
    relabelled["metadata"]["annotations"]["team"] = "vision"
    assert admission(policy, "UPDATE", relabelled, bound) is None


def test_batch_controllers_later_updates_are_admitted(policy: dict[str, Any]) -> None:
    """What controllers change on a pod after the webhook admitted it passes: Kueue ungating it
    with its ResourceFlavor's node selector and tolerations, Volcano or Argo updating their
    labels and annotations on the bound pod (README, "Batch and serving systems")."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team-a",
                        "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
           "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
                    "containers": [{"name": "c", "image": "cuda", "resources": {
                        "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}}}]}}
    result = mutate_pod(pod, Settings())
    assert result.allowed and result.pod is not None
    gated = copy.deepcopy(result.pod)
    assert admission(policy, "CREATE", gated) is None
    ungated = copy.deepcopy(gated)
    del ungated["spec"]["schedulingGates"]
    ungated["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] = "nvidia-l4"
    ungated["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    ungated["metadata"]["annotations"]["kueue.x-k8s.io/workload"] = "pod-p-1a2b"
    assert admission(policy, "UPDATE", ungated, gated,
                     "system:serviceaccount:kueue-system:kueue-controller-manager") is None
    bound = copy.deepcopy(ungated)
    bound["metadata"]["annotations"][DEV_C] = "GPU-a"  # merged from the extender's Binding
    bound["spec"]["nodeName"] = "gpu-1"
    done = copy.deepcopy(bound)
    done["metadata"]["labels"]["workflows.argoproj.io/completed"] = "true"
    done["metadata"]["annotations"]["volcano.sh/task-index"] = "0"
    assert admission(policy, "UPDATE", done, bound) is None


def test_label_change_on_a_bound_pod_is_admitted(policy: dict[str, Any]) -> None:
    old = _pod(BOUND, labels={"app": "train"})
    assert admission(policy, "UPDATE", _pod(BOUND, labels={"app": "train", "v": "2"}),
                     old) is None


def test_pod_with_forged_devices_is_admitted_after_the_webhook_strips_them(
        policy: dict[str, Any]) -> None:
    """Mutating admission (the webhook) runs before validating admission (the policy): a GPU
    pod created with a forged assignment reaches the policy without it and is admitted; a pod
    the webhook does not touch (no GPU request) keeps it and is denied."""
    forged = {"metadata": {"name": "p", "namespace": "team-a",
                           "annotations": {DEV_C: "GPU-victim", "team": "ml"}},
              "spec": {"containers": [{"name": "c", "image": "cuda", "resources": {
                  "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}}}]}}
    result = mutate_pod(forged, Settings())
    assert result.allowed and result.pod is not None
    assert DEV_C not in result.pod["metadata"]["annotations"]
    assert admission(policy, "CREATE", result.pod) is None
    assert admission(policy, "CREATE", forged) == MESSAGE

    cpu_only = {"metadata": forged["metadata"],
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    assert mutate_pod(cpu_only, Settings()).pod is cpu_only  # not a GPU pod: left alone
    assert admission(policy, "CREATE", cpu_only) == MESSAGE


# ----- NOTES.txt -----

def _notes(helm_run: Any, load_yaml: Any, tmp_path: Path, api_versions: tuple[str, ...],
           values: list[str]) -> str:
    """NOTES.txt rendered by ``helm template`` (which, unlike ``helm install --dry-run``,
    takes --api-versions): a copy of the chart renders it into a ConfigMap through ``tpl``."""
    chart = tmp_path / "gpuslice"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes-src.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        "  notes: {{ tpl (.Files.Get \"notes-src.txt\") . | toJson }}\n")
    proc = helm_run(["template", "gpuslice", str(chart), "--namespace", NAMESPACE,
                     "--kube-version", "1.30.0", "--show-only", "templates/zz-notes.yaml",
                     *(a for v in values for a in ("--set", v)),
                     *(a for v in api_versions for a in ("--api-versions", v))])
    assert proc.returncode == 0, proc.stderr
    [configmap] = load_yaml(proc.stdout)
    return str(configmap["data"]["notes"])


def test_notes_say_whether_the_guard_is_installed(
        tmp_path: Path, helm_run: Any, load_yaml: Any,
        vap_api_versions: dict[str, tuple[str, ...]]) -> None:
    v1 = vap_api_versions["v1"]
    installed = _notes(helm_run, load_yaml, tmp_path / "a", v1, [])
    assert f"kubectl get validatingadmissionpolicy {NAME}" in installed
    assert "WARNING" not in installed
    missing = _notes(helm_run, load_yaml, tmp_path / "b", (), [])
    assert "WARNING: no annotation guard was installed" in missing
    assert "--api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" in missing
    disabled = _notes(helm_run, load_yaml, tmp_path / "c", v1, ["annotationGuard.enabled=false"])
    assert "WARNING: annotationGuard.enabled=false" in disabled


# ----- ephemeral containers (kubectl debug) -----

EPHEMERAL_MESSAGE = ("ephemeral containers cannot mount gpuslice's volumes (gpuslice-lib, "
                     "gpuslice-preload, gpuslice-state, gpuslice-limits)")


def _debugged(mounts: list[dict[str, Any]] | None) -> dict[str, Any]:
    pod = _pod(RUNNING)
    debug: dict[str, Any] = {"name": "debugger", "image": "busybox"}
    if mounts is not None:
        debug["volumeMounts"] = mounts
    pod["spec"]["ephemeralContainers"] = [debug]
    return pod


@pytest.mark.parametrize(("mounts", "sub_resource", "denied"), [
    (None, "ephemeralcontainers", False),
    ([{"name": "data", "mountPath": "/data"}], "ephemeralcontainers", False),
    ([{"name": "gpuslice-lib", "mountPath": "/lib-rw"}], "ephemeralcontainers", True),
    ([{"name": "data", "mountPath": "/data"},
      {"name": "gpuslice-state", "mountPath": "/all-regions"}], "ephemeralcontainers", True),
    # a pod that has one already (added before the policy) keeps its other updates
    ([{"name": "gpuslice-state", "mountPath": "/all-regions"}], "", False),
    ([{"name": "gpuslice-state", "mountPath": "/all-regions"}], "status", False),
], ids=["no-mounts", "other-volume", "library-dir", "state-dir", "pod-update", "status-update"])
def test_ephemeral_containers_cannot_mount_gpuslices_volumes(
        policy: dict[str, Any], mounts: list[dict[str, Any]] | None, sub_resource: str,
        denied: bool) -> None:
    answer = admission(policy, "UPDATE", _debugged(mounts), _pod(RUNNING),
                       sub_resource=sub_resource)
    assert answer == (EPHEMERAL_MESSAGE if denied else None)


def test_the_guarded_volume_names_are_the_ones_the_webhook_adds(policy: dict[str, Any]) -> None:
    from webhook.admission import mutate
    expression = policy["spec"]["validations"][2]["expression"]
    listed = expression[expression.index("[") + 1:expression.index("]")]
    assert [n.strip(" '") for n in listed.split(",")] == list(mutate._OUR_VOLUMES)


# ----- GPU pods the webhook was never sent -----

UNMUTATED_MESSAGE = (
    "the pod asks for gpuslice's GPU resources but the gpuslice webhook did not mutate it: a "
    "mutating webhook called after gpuslice's gave them to a pod created without them, and the "
    "API server does not call gpuslice's webhook again for a pod it was not sent; create the "
    "pod with its GPU resources (or set the chart's webhook.matchConditions to disabled)")


def _gpu_pod(limits: dict[str, str], namespace: str = "team-a", *, init: bool = False
             ) -> dict[str, Any]:
    container = {"name": "c", "image": "cuda", "resources": {"limits": limits}}
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "cuda"}]}
    if init:
        spec["initContainers"] = [container]
    else:
        spec["containers"].append(container)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": namespace}, "spec": spec}


def _create(policy: dict[str, Any], pod: dict[str, Any],
            labels: dict[str, str] | None = None) -> str | None:
    answer = admission(policy, "CREATE", pod, namespace_labels=labels)
    return None if answer is None else " ".join(answer.split())


@pytest.mark.parametrize(("limits", "init", "denied"), [
    ({"nvidia.com/gpu": "1"}, False, True),
    ({"nvidia.com/gpumem": "2000"}, False, True),
    ({"nvidia.com/gpumem-percentage": "50"}, False, True),
    ({"nvidia.com/gpucores": "30"}, True, True),
    ({"nvidia.com/gpu": "2", "cpu": "1"}, True, True),
    ({"nvidia.com/gpu": "0"}, False, False),        # asks for no GPU: the webhook leaves it
    ({"nvidia.com/mig-1g.10gb": "1"}, False, False),  # another plugin's
    ({"cpu": "1"}, False, False),
], ids=["gpu", "gpumem", "percentage", "init-cores", "init-gpu", "gpu-0", "mig", "cpu"])
def test_a_gpu_pod_the_webhook_did_not_mutate_is_refused_at_creation(
        policy: dict[str, Any], limits: dict[str, str], init: bool, denied: bool) -> None:
    """What reaches validation without the webhook's mark in a namespace it mutates was never
    sent to it: with failurePolicy Fail every GPU pod it is sent comes back marked or refused.
    That is a pod a mutating webhook after gpuslice's gave GPU resources (matchConditions
    sent gpuslice's webhook none of it, and a reinvocation calls only webhooks called before)."""
    pod = _gpu_pod(limits, init=init)
    assert _create(policy, pod) == (UNMUTATED_MESSAGE if denied else None)
    mutated = mutate_pod(pod, Settings(), namespace="team-a")
    assert mutated.allowed and mutated.pod is not None
    assert _create(policy, mutated.pod) is None
    if denied:  # only the CREATE: its later updates, status ones included, are not concerned
        old = copy.deepcopy(pod)
        old["spec"]["nodeName"] = "node-1"
        assert admission(policy, "UPDATE", old, old, sub_resource="status") is None


def test_unmutated_gpu_pods_of_namespaces_the_webhook_leaves_alone_are_admitted(
        render: Any) -> None:
    """Opted-out and excluded namespaces (the webhook's namespaceSelector) keep their GPU pods
    unmutated, as before; in opt-in mode only labelled namespaces are mutated; with the
    webhook's failurePolicy Ignore an unmutated GPU pod may be one created while the webhook
    was down, which that setting admits."""
    pod = _gpu_pod({"nvidia.com/gpu": "1"})
    opt_out = _guard(render({"webhook": {"excludedNamespaces": ["ci", "ops"]}}))
    assert opt_out is not None
    assert _create(opt_out[0], pod) == UNMUTATED_MESSAGE
    assert _create(opt_out[0], pod, {"gpuslice.io/webhook": "enabled"}) == UNMUTATED_MESSAGE
    assert _create(opt_out[0], pod, {"gpuslice.io/webhook": "disabled"}) is None
    assert _create(opt_out[0], _gpu_pod({"nvidia.com/gpu": "1"}, "ops")) is None
    # the namespaces the webhook always leaves alone, whatever the values say
    for never in ("kube-system", NAMESPACE):
        assert _create(opt_out[0], _gpu_pod({"nvidia.com/gpu": "1"}, never)) is None, never
        assert _create(opt_out[0], _gpu_pod({"nvidia.com/gpu": "1"}, never),
                       {"gpuslice.io/webhook": "enabled"}) is None, never
    opt_in = _guard(render({"namespaceMode": "opt-in"}))
    assert opt_in is not None
    assert _create(opt_in[0], pod) is None
    assert _create(opt_in[0], pod, {"gpuslice.io/webhook": "disabled"}) is None
    assert _create(opt_in[0], pod, {"gpuslice.io/webhook": "enabled"}) == UNMUTATED_MESSAGE
    ignore = _guard(render({"webhook": {"failurePolicy": "Ignore"}}))
    assert ignore is not None
    assert len(ignore[0]["spec"]["validations"]) == 3
    assert _create(ignore[0], pod) is None
