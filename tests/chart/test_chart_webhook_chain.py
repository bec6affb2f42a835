"""The chart's MutatingWebhookConfiguration in the API server's mutating chain.

Its entries as rendered (matchConditions evaluated with cel-python, reinvocationPolicy as
written) go through the dispatcher of ``tests/admission/test_webhook_chain.py``, with another
webhook called after gpuslice's that gives a pod GPU resources: a policy engine's mutation
(Kyverno, Gatekeeper; their configurations' names sort after "gpuslice") adding
``nvidia.com/gpu`` to a pod's container, or a sidecar of its own. A pod that asks for
gpuslice's resources must never be stored unmutated: without the library and its caps, under
the default scheduler, a CUDA image would see every GPU of its node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.admission.test_webhook_chain import (
    NO_GPUS,
    Hook,
    admit,
    check_stored,
    gpu_pod,
    gpuslice,
    istio,
)
from tests.chart.test_chart_annotation_guard import policy_answer
from webhook.placement.request import admitted, pod_request
from webhook.settings import load_settings

celpy = pytest.importorskip("celpy", reason="cel-python not installed (pip install cel-python) "
                            "to evaluate the CEL")


def chart_hooks(rendered: Any, tmp_path: Path) -> list[Hook]:
    """gpuslice's entries as the API server reads them from the rendered configuration."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    settings = load_settings(config)
    configuration = rendered.one("MutatingWebhookConfiguration")
    env = celpy.Environment()
    hooks = []
    for i, entry in enumerate(configuration["webhooks"]):
        programs = [env.program(env.compile(c["expression"]))
                    for c in entry.get("matchConditions", [])]

        def match(pod: dict[str, Any], programs: list[Any] = programs) -> bool:
            return all(bool(p.evaluate({"object": celpy.json_to_cel(pod)})) for p in programs)
        hook = gpuslice(settings, config=f"{configuration['metadata']['name']}#{i}")
        hooks.append(hook._replace(reinvoke=entry["reinvocationPolicy"] == "IfNeeded",
                                   match=match))
    return hooks


def policy_engine(*, sidecar: bool) -> Hook:
    """A later webhook giving the pod a GPU: a limit added to its container, or a sidecar."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        containers = pod["spec"]["containers"]
        if sidecar:
            if all(c["name"] != "profiler" for c in containers):
                containers.append({"name": "profiler", "image": "nvcr.io/nvidia/cuda:12.4.1",
                                   "resources": {"limits": {"nvidia.com/gpumem": "2000"}}})
        else:
            limits = containers[0].setdefault("resources", {}).setdefault("limits", {})
            limits.setdefault("nvidia.com/gpu", "1")
        return pod, []
    return Hook("kyverno-resource-mutating-webhook-cfg", call)


def cpu_pod() -> dict[str, Any]:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2"}}
    return pod


@pytest.mark.parametrize("sidecar", [False, True], ids=["limit-added", "gpu-sidecar-added"])
@pytest.mark.parametrize("hide", [False, True], ids=["", "hide-gpus"])
@pytest.mark.parametrize("kube_version", ["1.27.0", "1.30.0"],
                         ids=["no-match-conditions", "match-conditions"])
def test_a_pod_given_gpus_by_a_later_webhook_is_never_stored_unmutated(
        kube_version: str, hide: bool, sidecar: bool, render: Any, tmp_path: Path) -> None:
    """Without matchConditions gpuslice's entry is sent every pod, so it is called again after
    the later webhook's change and mutates the pod. With them it never sees the pod, and the
    annotation guard (validating admission, after every mutating webhook) refuses it."""
    rendered = render({"podsWithoutGpus": {"hideGpus": hide}}, kube_version)
    hooks = chart_hooks(rendered, tmp_path)
    done = admit(cpu_pod(), [*hooks, policy_engine(sidecar=sidecar)])
    stored = done.pod
    assert pod_request(stored, load_settings_of(rendered, tmp_path)).containers
    guard = [p for p in rendered.all("ValidatingAdmissionPolicy")
             if p["metadata"]["name"].endswith("annotation-guard")]
    answer = None if not guard else policy_answer(
        guard[0], {"operation": "CREATE", "subResource": "",
                   "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"}},
        stored, None)
    if "matchConditions" in rendered.one("MutatingWebhookConfiguration")["webhooks"][0]:
        assert not admitted(stored) and answer is not None, done.calls
        assert "the gpuslice webhook did not mutate it" in answer
    else:
        assert admitted(stored) and (1, hooks[0].config) in done.calls
        check_stored(stored, {c["name"] for c in stored["spec"]["containers"]
                              if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})})


def load_settings_of(rendered: Any, tmp_path: Path) -> Any:
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump(rendered.config("gpuslice-config")))
    return load_settings(config)


@pytest.mark.parametrize("kube_version", ["1.27.0", "1.30.0"],
                         ids=["no-match-conditions", "match-conditions"])
def test_with_hidden_gpus_a_mesh_proxy_added_to_a_pod_without_gpus_sees_none(
        kube_version: str, render: Any, tmp_path: Path) -> None:
    """podsWithoutGpus.hideGpus: the entry that receives pods without GPU requests is called
    again after the mesh injected its containers (it still matches the pod), so they get
    NVIDIA_VISIBLE_DEVICES=none like the pod's own."""
    rendered = render({"podsWithoutGpus": {"hideGpus": True}}, kube_version)
    done = admit(cpu_pod(), [*chart_hooks(rendered, tmp_path), istio(native=True)])
    containers = [*done.pod["spec"]["initContainers"], *done.pod["spec"]["containers"]]
    assert {c["name"] for c in containers} == {"main", "istio-init", "istio-proxy"}
    for c in containers:
        assert c["env"][0] == NO_GPUS and \
            [e for e in c["env"] if e["name"] == NO_GPUS["name"]] == [NO_GPUS], c["name"]
    assert not admitted(done.pod)
