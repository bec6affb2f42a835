"""Pods as common ML batch and serving systems create them, through the webhook and the
extender's reading of them: Kueue (gated at creation, ungated later with its flavor's node
selector), Volcano (its own scheduler and PodGroup), Argo Workflows (emissary's init and wait
containers), Knative/KServe (queue-proxy), KubeRay (a wait-gcs-ready init container, the GPU
in limits only), Spark (executors the driver creates). README, "Batch and serving systems"."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubeschema import NEWEST, VERSIONS, assert_valid

from webhook import names
from webhook.admission.mutate import mutate_pod
from webhook.node.audit import Cap, tracked_containers
from webhook.placement.request import admitted, pod_request
from webhook.settings import Settings

SETTINGS = Settings()
CUDA = "nvcr.io/nvidia/pytorch:24.05-py3"


def _pod(name: str, spec: dict[str, Any], *, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def kueue_pod(limits: dict[str, str]) -> dict[str, Any]:
    """A plain pod Kueue manages: its webhook gated it (and added its finalizer)."""
    pod = _pod("train-0", {
        "schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
        "containers": [{"name": "trainer", "image": CUDA, "resources": {
            "limits": {**limits, "cpu": "4"}, "requests": {"cpu": "4"}}}]},
        labels={"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/managed": "true"})
    pod["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]
    return pod


def volcano_pod() -> dict[str, Any]:
    """A Volcano Job's task pod: scheduled by volcano as one of its PodGroup."""
    return _pod("vcjob-worker-0", {
        "schedulerName": "volcano",
        "containers": [{"name": "worker", "image": CUDA, "resources": {
            "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}}}]},
        annotations={"scheduling.k8s.io/group-name": "vcjob-6f1c", "volcano.sh/job-name": "vcjob",
                     "volcano.sh/queue-name": "default", "volcano.sh/task-spec": "worker"})


def argo_pod() -> dict[str, Any]:
    """An Argo Workflows step (emissary executor): argoexec's init and wait containers beside
    the step's main container, which emissary runs through the binary it copied."""
    argoexec = "quay.io/argoproj/argoexec:v3.5.8"
    run = {"name": "var-run-argo", "mountPath": "/var/run/argo"}
    return _pod("wf-train-123", {
        "initContainers": [{"name": "init", "image": argoexec, "command": ["argoexec", "init"],
                            "volumeMounts": [run]}],
        "containers": [
            {"name": "wait", "image": argoexec, "command": ["argoexec", "wait"],
             "env": [{"name": "ARGO_CONTAINER_NAME", "value": "wait"}], "volumeMounts": [run]},
            {"name": "main", "image": CUDA,
             "command": ["/var/run/argo/argoexec", "emissary", "--", "python", "train.py"],
             "env": [{"name": "ARGO_CONTAINER_NAME", "value": "main"}], "volumeMounts": [run],
             "resources": {"limits": {"nvidia.com/gpumem": "4000", "nvidia.com/gpucores": "50"}}}],
        "volumes": [{"name": "var-run-argo", "emptyDir": {}}]},
        labels={"workflows.argoproj.io/workflow": "wf", "workflows.argoproj.io/completed": "false"},
        annotations={"workflows.argoproj.io/node-name": "wf.train"})


def knative_pod() -> dict[str, Any]:
    """A KServe predictor under Knative: the user container and Knative's queue-proxy."""
    return _pod("llm-predictor-00001-deployment-7d9f", {
        "containers": [
            {"name": "kserve-container", "image": "kserve/huggingfaceserver:v0.13.0-gpu",
             "env": [{"name": "PORT", "value": "8080"}, {"name": "K_REVISION",
                                                          "value": "llm-predictor-00001"}],
             "resources": {"limits": {"nvidia.com/gpu": "1",
                                      "nvidia.com/gpumem-percentage": "50"}}},
            {"name": "queue-proxy", "image": "gcr.io/knative-releases/queue:v1.14",
             "env": [{"name": "SERVING_NAMESPACE", "value": "ml"}],
             "resources": {"requests": {"cpu": "25m"}}}]},
        labels={"serving.knative.dev/revision": "llm-predictor-00001"})


def kuberay_worker() -> dict[str, Any]:
    """A KubeRay worker: the GPU in limits only, an init container of the same CUDA image that
    waits for the head's GCS, /dev/shm from an emptyDir."""
    image = "rayproject/ray-ml:2.9.0-gpu"
    return _pod("raycluster-gpu-group-worker-x7k2p", {
        "initContainers": [{"name": "wait-gcs-ready", "image": image,
                            "command": ["/bin/bash", "-lc", "--"],
                            "args": ["until ray health-check --address head:6379; do sleep 5; done"]}],
        "containers": [{"name": "ray-worker", "image": image,
                        "args": ["ray start --address=head:6379 --num-gpus=1 --block"],
                        "env": [{"name": "RAY_CLUSTER_NAME", "value": "raycluster"}],
                        "resources": {"limits": {"cpu": "8", "memory": "32Gi",
                                                 "nvidia.com/gpu": "1"},
                                      "requests": {"cpu": "8", "memory": "32Gi"}},
                        "volumeMounts": [{"name": "shared-mem", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "shared-mem", "emptyDir": {"medium": "Memory"}}]},
        labels={"ray.io/cluster": "raycluster", "ray.io/node-type": "worker"})


def spark_executor() -> dict[str, Any]:
    """A Spark executor as the driver creates it (spark.executor.resource.gpu.*)."""
    return _pod("etl-5a1b-exec-1", {
        "restartPolicy": "Never",
        "containers": [{"name": "spark-kubernetes-executor", "image": "spark-rapids:24.06",
                        "args": ["executor"],
                        "env": [{"name": "SPARK_EXECUTOR_ID", "value": "1"}],
                        "resources": {"limits": {"memory": "16Gi", "nvidia.com/gpu": "1",
                                                 "nvidia.com/gpumem": "16000"},
                                      "requests": {"cpu": "4", "memory": "16Gi"}}}]},
        labels={"spark-role": "executor", "spark-app-selector": "spark-5a1b"})


def _admit(pod: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    received = copy.deepcopy(pod)
    result = mutate_pod(pod, SETTINGS)
    assert pod == received
    assert result.allowed, result.message
    assert result.pod is not None
    out = copy.deepcopy(result.pod)
    assert_valid(out, _versions(out))
    assert mutate_pod(out, SETTINGS).pod == out  # a reinvocation changes nothing
    return out, result.warnings


def _versions(pod: dict[str, Any]) -> tuple[str, ...]:
    """The schemas to check: spec.schedulingGates is in the API from Kubernetes 1.26."""
    return ("1.26.0", NEWEST) if "schedulingGates" in pod["spec"] else VERSIONS


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for kind in ("initContainers", "containers") for c in spec.get(kind, [])}


def _sees_no_gpu(container: dict[str, Any]) -> bool:
    return container["env"][0] == {"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}


@pytest.mark.parametrize("make", [kueue_pod, volcano_pod, argo_pod, knative_pod, kuberay_worker,
                                  spark_executor])
def test_each_systems_gpu_pod_is_admitted_placed_by_gpuslice_and_its_other_containers_see_none(
        make: Any) -> None:
    pod = make({"nvidia.com/gpu": "1"}) if make is kueue_pod else make()
    out, _ = _admit(pod)
    assert out["spec"]["schedulerName"] == SETTINGS.scheduler_name
    assert out["spec"]["nodeSelector"][SETTINGS.node_label_key] == SETTINGS.node_label_value
    assert admitted(out)
    request = pod_request(out, SETTINGS)
    assert [c.name for c in request.containers] == [
        n for n, c in _containers(pod).items()
        if any(k.startswith("nvidia.com/") for k in (c.get("resources") or {}).get("limits", {}))]
    for name, container in _containers(out).items():
        gpu = name in {c.name for c in request.containers}
        assert _sees_no_gpu(container) is not gpu, name
        # the controller's own env and mounts stay, after gpuslice's
        original = _containers(pod)[name]
        assert [e for e in container["env"] if e in (original.get("env") or [])] == \
            (original.get("env") or [])
        assert all(m in container.get("volumeMounts", []) for m in original.get("volumeMounts") or [])
    assert all(v in out["spec"]["volumes"] for v in pod["spec"].get("volumes") or [])
    # labels, annotations and finalizers the controllers watch are kept
    meta = pod["metadata"]
    assert out["metadata"].get("labels") == meta.get("labels")
    assert out["metadata"].get("finalizers") == meta.get("finalizers")
    assert meta.get("annotations", {}).items() <= out["metadata"]["annotations"].items()


def test_a_kueue_gated_pod_keeps_its_gate_and_is_read_alike_once_kueue_ungates_it() -> None:
    """Kueue removes its gate and adds its ResourceFlavor's node labels and tolerations with a
    pod UPDATE, which the webhook does not see: the pod it admitted at creation is what the
    extender then places, under the added selector."""
    out, _ = _admit(kueue_pod({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000",
                               "nvidia.com/gpucores": "30"}))
    assert out["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]
    ungated = copy.deepcopy(out)
    del ungated["spec"]["schedulingGates"]
    ungated["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] = "nvidia-l4"
    ungated["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                       "effect": "NoSchedule"}]
    assert_valid(ungated, _versions(out))
    assert pod_request(ungated, SETTINGS) == pod_request(out, SETTINGS)
    assert admitted(ungated)


def test_kueue_counts_what_the_pod_asks_when_the_gpu_count_is_written() -> None:
    """The webhook changes no resource a container names: with nvidia.com/gpu written, what
    Kueue reads from the (template of the) pod is what the pod asks after admission. Without
    it the webhook adds nvidia.com/gpu: 1 to the pod's limits, which Kueue, counting a Job's
    pod template, does not see (README)."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}
    out, _ = _admit(kueue_pod(limits))
    assert out["spec"]["containers"][0]["resources"] == {
        "limits": {**limits, "cpu": "4"}, "requests": {"cpu": "4"}}
    implicit, _ = _admit(kueue_pod({"nvidia.com/gpumem": "8000"}))
    assert implicit["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpumem": "8000", "cpu": "4", "nvidia.com/gpu": "1"}


def test_a_volcano_pod_is_taken_from_volcano_with_a_warning() -> None:
    """Only gpuslice-scheduler assigns the GPUs, so the pod leaves Volcano (and its gang): the
    warning says so; the PodGroup annotation is left as it was."""
    out, warnings = _admit(volcano_pod())
    assert out["spec"]["schedulerName"] == SETTINGS.scheduler_name
    assert out["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "vcjob-6f1c"
    assert "schedulerName volcano was changed to gpuslice-scheduler, which assigns the GPUs" \
        in warnings


class _Resp:
    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj)


NO_GPU = Cap(limit_bytes=0)


@pytest.mark.parametrize(("make", "caps"), [
    (argo_pod, {"init": (NO_GPU, None), "wait": (NO_GPU, None),
                "main": (Cap(limit_bytes=4000 << 20), 50)}),
    (knative_pod, {"kserve-container": (Cap(percent=50), None), "queue-proxy": (NO_GPU, None)}),
    (kuberay_worker, {"wait-gcs-ready": (NO_GPU, None), "ray-worker": (Cap(percent=100), None)}),
], ids=["argo", "knative", "kuberay"])
async def test_the_agents_audit_holds_the_controllers_containers_to_no_gpu(
        make: Any, caps: dict[str, tuple[Cap, int | None]]) -> None:
    """On the node, the audit reads each container's cap as the webhook wrote it: the GPU
    container's limits, and no GPU at all (cap 0) for argoexec's init and wait containers,
    Knative's queue-proxy and KubeRay's wait-gcs-ready."""
    out, _ = _admit(make())
    out["metadata"]["uid"] = "0c6e1a52-79a4-4bd4-9d0b-4b4a8d2b1e11"
    out["spec"]["nodeName"] = "gpu-1"

    def status(name: str) -> dict[str, Any]:
        ident = hashlib.sha256(name.encode()).hexdigest()
        return {"name": name, "containerID": f"containerd://{ident}", "ready": True,
                "restartCount": 0, "image": "x", "imageID": ""}
    spec = out["spec"]
    out["status"] = {"phase": "Running",
                     "initContainerStatuses": [status(c["name"])
                                               for c in spec.get("initContainers", [])],
                     "containerStatuses": [status(c["name"]) for c in spec["containers"]]}
    async with client.ApiClient() as api:
        model = api.deserialize(_Resp(out), "V1Pod")
    tracked = {t.container: t for t in tracked_containers([model]).values()}
    assert set(tracked) == set(caps)
    for name, (cap, cores) in caps.items():
        t = tracked[name]
        assert (t.cap, t.cores) == (cap, cores), name
        if cap == NO_GPU:
            assert t.gpus == frozenset(), name
