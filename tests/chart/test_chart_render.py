"""`helm lint` and `helm template` for the defaults and every documented option; each rendered
object validates against the Kubernetes schema (kubernetes-validate --strict) of the version
it was rendered for and of the newest shipped, and the oldest supported one (1.25)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import kubeschema
import pytest

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuslice"
RELEASE, NAMESPACE = "gpuslice", "gpuslice-system"  # the render fixture's defaults

# Every documented option, as the values an operator would pass.
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "opt-in namespaces": {"namespaceMode": "opt-in", "webhook": {"excludedNamespaces": ["ci"]}},
    "cert-manager, own CA": {"tls": {"mode": "cert-manager"}},
    "cert-manager, cluster issuer": {"tls": {"mode": "cert-manager", "certManager": {
        "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}},
    "runtime class and tolerations": {
        "gpuPods": {"runtimeClassName": "nvidia", "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "agent": {"runtimeClassName": "nvidia", "privileged": True}},
    "custom resource names and node label": {
        "resourceNames": {"gpu": "example.com/vgpu", "memory": "example.com/vgpu-mem",
                          "memoryPercentage": "example.com/vgpu-mem-pct",
                          "cores": "example.com/vgpu-cores"},
        "nodeLabel": {"key": "example.com/gpu-sharing", "value": "enabled"}},
    "matchConditions disabled": {"webhook": {"matchConditions": "disabled"}},
    "matchConditions forced": {"webhook": {"matchConditions": "enabled"}},
    "custom scheduler": {"scheduler": {"name": "shared-gpu", "leaseName": "shared-gpu-leader",
                                       "image": {"repository": "mirror.example/kube-scheduler",
                                                 "tag": "v1.30.2"},
                                       "extender": {"weight": 5, "httpTimeout": "30s"}}},
    "metrics with ServiceMonitor": {"metrics": {"serviceMonitor": {
        "enabled": True, "labels": {"release": "prometheus"}}}},
    "single replica, no agent, no pod annotations": {
        "webhook": {"replicas": 1}, "agent": {"enabled": False},
        "metrics": {"podAnnotations": False}},
    "placement knobs": {"splitCount": 4, "defaultPolicy": "spread", "maxGpuMemoryMiB": 81920,
                        "logLevel": "DEBUG"},
    "RBAC managed elsewhere": {"rbac": {"create": False}},
    "annotation guard off": {"annotationGuard": {"enabled": False}},
    "pods without GPUs see none": {"podsWithoutGpus": {"hideGpus": True}},
    "images pinned by digest": {
        "webhook": {"image": {"digest": "sha256:" + "1" * 64}},
        "scheduler": {"image": {"tag": "v1.30.2", "digest": "sha256:" + "2" * 64}},
        "agent": {"image": {"repository": "mirror.example:5000/gpuslice/agent",
                            "digest": "sha256:" + "3" * 64}}},
}
# Rendered for the oldest supported release, one with matchConditions on by default, newest.
KUBE_VERSIONS = (kubeschema.OLDEST, "1.28.0", kubeschema.NEWEST)
# Kinds from CRDs that the Kubernetes schema does not know; checked in test_chart_wiring.
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")


def _schema_versions(kube_version: str) -> tuple[str, ...]:
    """The render's own version and the newest; a 1.25 render must also pass 1.25."""
    return tuple(dict.fromkeys((kube_version, kubeschema.NEWEST)))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_helm_lint_passes(option: str, helm_run: Any) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        json.dump(OPTIONS[option], f)
        f.flush()
        proc = helm_run(["lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                         "--kube-version", kubeschema.NEWEST, "-f", f.name])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


# Forcing matchConditions on 1.25 is refused on purpose (test_chart_values checks the message).
RENDERS = [(option, version) for option in OPTIONS for version in KUBE_VERSIONS
           if (option, version) != ("matchConditions forced", kubeschema.OLDEST)]


@pytest.mark.parametrize(("option", "kube_version"), RENDERS)
def test_every_rendered_object_validates_against_the_kubernetes_schema(
        option: str, kube_version: str, render: Any) -> None:
    rendered = render(OPTIONS[option], kube_version)
    checked = 0
    for obj in rendered.objects:
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue
        kubeschema.assert_valid(obj, _schema_versions(kube_version))
        checked += 1
    assert checked >= 8


def test_defaults_render_the_expected_objects(render: Any) -> None:
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in render().objects)
    assert kinds == sorted([
        "ConfigMap/gpuslice-config", "ConfigMap/gpuslice-scheduler",
        "Deployment/gpuslice", "Service/gpuslice", "PodDisruptionBudget/gpuslice",
        "MutatingWebhookConfiguration/gpuslice",
        "ServiceAccount/gpuslice", "ClusterRole/gpuslice-webhook",
        "ClusterRoleBinding/gpuslice-webhook", "Role/gpuslice-tls", "RoleBinding/gpuslice-tls",
        "ClusterRoleBinding/gpuslice-kube-scheduler",
        "ClusterRoleBinding/gpuslice-volume-scheduler",
        "RoleBinding/gpuslice-scheduler-auth-reader", "Role/gpuslice-scheduler-lease",
        "RoleBinding/gpuslice-scheduler-lease",
        "DaemonSet/gpuslice-agent", "ServiceAccount/gpuslice-agent",
        "ClusterRole/gpuslice-agent", "ClusterRoleBinding/gpuslice-agent",
        "Service/gpuslice-agent-metrics",
        "ValidatingAdmissionPolicy/gpuslice-annotation-guard",
        "ValidatingAdmissionPolicyBinding/gpuslice-annotation-guard",
        "ValidatingAdmissionPolicy/gpuslice-agent-own-node",
        "ValidatingAdmissionPolicyBinding/gpuslice-agent-own-node"])


def test_namespaced_objects_go_to_the_release_namespace(render: Any) -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                      "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for obj in render(namespace="gpu-ops").objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert ns is None, obj["metadata"]["name"]
        elif obj["metadata"]["name"].endswith("scheduler-auth-reader"):
            assert ns == "kube-system"  # the role it binds lives there
        else:
            assert ns == "gpu-ops", f"{obj['kind']}/{obj['metadata']['name']}"


def test_release_name_prefixes_cluster_scoped_names(render: Any) -> None:
    rendered = render(release="team-a")
    names = {o["metadata"]["name"] for o in rendered.objects
             if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}
    assert names and all(n.startswith("team-a-gpuslice") for n in names)


def _notes(helm_run: Any, values: dict[str, Any]) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        json.dump(values, f)
        f.flush()
        proc = helm_run(["install", RELEASE, str(CHART), "--dry-run=client", "--namespace",
                         NAMESPACE, "-f", f.name])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def test_notes_tell_the_operator_the_next_steps(helm_run: Any) -> None:
    notes = _notes(helm_run, {})
    for step in ("rollout status deployment/gpuslice", "kubectl label node <node> gpu=on",
                 "gpuslice.io/webhook=disabled", "nvidia.com/gpu: 2",
                 "nvidia.com/gpumem: 10240", "nvidia.com/gpucores: 30", "caBundle"):
        assert step in notes, step
    opt_in = _notes(helm_run, {"namespaceMode": "opt-in", "tls": {"mode": "cert-manager"},
                               "resourceNames": {"gpu": "example.com/vgpu"}})
    assert "kubectl label namespace <namespace> gpuslice.io/webhook=enabled" in opt_in
    assert "get certificate gpuslice" in opt_in and "example.com/vgpu: 2" in opt_in
    # without the agent there is no DaemonSet to wait for
    assert "daemonset/gpuslice-agent" in notes
    assert "daemonset/" not in _notes(helm_run, {"agent": {"enabled": False}})


def test_renders_are_parsed_refusing_duplicate_keys(load_yaml: Any) -> None:
    """Every render goes through this loader, so no rendered object repeats a key (the API
    server rejects such manifests; PyYAML alone would keep the last value silently)."""
    assert load_yaml("a: 1\n---\nb: {c: 2}\n") == [{"a": 1}, {"b": {"c": 2}}]
    with pytest.raises(Exception, match="duplicate keys"):
        load_yaml("metadata:\n  labels:\n    app: x\n    app: y\n")
