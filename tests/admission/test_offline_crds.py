"""``gpuslice check`` / ``mutate -f`` on the pod templates of ML custom resources.

Each manifest follows the shape of its project's API types and documented examples; the
mutated templates must be what the webhook makes of a pod from them, the rest of the object
must be untouched, and a Pod built from each mutated template must pass the Kubernetes schema.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubeschema import assert_valid

from webhook.admission.mutate import mutate_pod
from webhook.admission.offline import CUSTOM_SHAPES, Finding, mutate_documents
from webhook.cli import main
from webhook.settings import Settings

GPU_LIMITS = "limits: {nvidia.com/gpumem: 8000, nvidia.com/gpucores: 50, cpu: 4}"

PYTORCHJOB = f"""
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {{name: mnist, namespace: ml}}
spec:
  runPolicy: {{cleanPodPolicy: None}}
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template:
        spec:
          containers:
          - name: pytorch
            image: docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727
            command: [python3, /opt/pytorch-mnist/mnist.py, --epochs=1]
            resources: {{{GPU_LIMITS}}}
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        metadata: {{annotations: {{sidecar.istio.io/inject: "false"}}}}
        spec:
          containers:
          - name: pytorch
            image: docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727
            resources: {{{GPU_LIMITS}}}
"""

TFJOB = f"""
apiVersion: kubeflow.org/v1
kind: TFJob
metadata: {{name: dist-mnist, namespace: ml}}
spec:
  tfReplicaSpecs:
    PS:
      replicas: 1
      restartPolicy: Never
      template:
        spec:
          containers:
          - {{name: tensorflow, image: kubeflow/tf-dist-mnist-test:latest}}
    Worker:
      replicas: 2
      restartPolicy: Never
      template:
        spec:
          containers:
          - name: tensorflow
            image: kubeflow/tf-dist-mnist-test:latest
            resources: {{{GPU_LIMITS}}}
"""

XGBOOSTJOB = f"""
apiVersion: kubeflow.org/v1
kind: XGBoostJob
metadata: {{name: xgboost-dist-iris, namespace: ml}}
spec:
  xgbReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: Never
      template:
        spec:
          containers:
          - name: xgboost
            image: docker.io/kubeflow/xgboost-dist-iris:latest
            ports: [{{containerPort: 9991, name: xgboostjob-port}}]
            resources: {{{GPU_LIMITS}}}
    Worker:
      replicas: 2
      restartPolicy: ExitCode
      template:
        spec:
          containers:
          - name: xgboost
            image: docker.io/kubeflow/xgboost-dist-iris:latest
            resources: {{{GPU_LIMITS}}}
"""

PADDLEJOB = f"""
apiVersion: kubeflow.org/v1
kind: PaddleJob
metadata: {{name: paddle-simple-gpu, namespace: ml}}
spec:
  paddleReplicaSpecs:
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          containers:
          - name: paddle
            image: registry.baidubce.com/paddlepaddle/paddle:2.4.0rc0-gpu-cuda11.2-cudnn8.1-trt8.0
            command: [python]
            args: [-m, paddle.distributed.launch, run_check]
            resources: {{{GPU_LIMITS}}}
"""

JAXJOB = f"""
apiVersion: kubeflow.org/v1
kind: JAXJob
metadata: {{name: jaxjob-simple, namespace: ml}}
spec:
  jaxReplicaSpecs:
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          containers:
          - name: jax
            image: docker.io/kubeflow/jaxjob-simple:latest
            command: [python3, train.py]
            resources: {{{GPU_LIMITS}}}
"""

MPIJOB = f"""
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata: {{name: tensorflow-benchmarks, namespace: ml}}
spec:
  slotsPerWorker: 1
  runPolicy: {{cleanPodPolicy: Running}}
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      template:
        spec:
          containers:
          - image: mpioperator/tensorflow-benchmarks:latest
            name: tensorflow-benchmarks
            command: [mpirun, --allow-run-as-root, -np, "2", python, tf_cnn_benchmarks.py]
    Worker:
      replicas: 2
      template:
        spec:
          containers:
          - image: mpioperator/tensorflow-benchmarks:latest
            name: tensorflow-benchmarks
            resources: {{{GPU_LIMITS}}}
"""

TRAININGRUNTIME = f"""
apiVersion: trainer.kubeflow.org/v1alpha1
kind: ClusterTrainingRuntime
metadata: {{name: torch-distributed}}
spec:
  mlPolicy:
    numNodes: 2
    torch: {{numProcPerNode: auto}}
  template:
    spec:
      replicatedJobs:
      - name: node
        template:
          metadata:
            labels: {{trainer.kubeflow.org/trainjob-ancestor-step: trainer}}
          spec:
            template:
              spec:
                containers:
                - name: node
                  image: pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
                  command: [/bin/bash, -c, torchrun train.py]
                  resources: {{{GPU_LIMITS}}}
"""

JOBSET = f"""
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {{name: pytorch, namespace: ml}}
spec:
  replicatedJobs:
  - name: driver
    replicas: 1
    template:
      spec:
        template:
          spec:
            restartPolicy: Never
            containers:
            - {{name: driver, image: python:3.12, command: [python, -c, "print(1)"]}}
  - name: workers
    replicas: 1
    template:
      spec:
        parallelism: 4
        completions: 4
        backoffLimit: 0
        template:
          spec:
            restartPolicy: Never
            containers:
            - name: pytorch
              image: pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
              ports: [{{containerPort: 3389}}]
              env: [{{name: MASTER_ADDR, value: pytorch-workers-0-0.pytorch}}]
              resources: {{{GPU_LIMITS}}}
"""

LWS = f"""
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {{name: vllm, namespace: serving}}
spec:
  replicas: 2
  leaderWorkerTemplate:
    size: 2
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      metadata: {{labels: {{role: leader}}}}
      spec:
        containers:
        - name: vllm-leader
          image: vllm/vllm-openai:latest
          command: [sh, -c, "ray start --head && vllm serve model --tensor-parallel-size 2"]
          ports: [{{containerPort: 8080}}]
          resources: {{{GPU_LIMITS}}}
    workerTemplate:
      spec:
        containers:
        - name: vllm-worker
          image: vllm/vllm-openai:latest
          command: [sh, -c, "ray start --address=$LWS_LEADER_ADDRESS:6379 --block"]
          resources: {{{GPU_LIMITS}}}
"""

RAY_GROUPS = f"""
    headGroupSpec:
      rayStartParams: {{dashboard-host: 0.0.0.0}}
      template:
        spec:
          containers:
          - name: ray-head
            image: rayproject/ray:2.46.0
            ports: [{{containerPort: 6379, name: gcs-server}}, {{containerPort: 8265, name: dashboard}}]
            resources: {{limits: {{cpu: 1, memory: 2G}}}}
    workerGroupSpecs:
    - groupName: gpu-group
      replicas: 2
      minReplicas: 1
      maxReplicas: 4
      rayStartParams: {{}}
      template:
        spec:
          containers:
          - name: ray-worker
            image: rayproject/ray:2.46.0-gpu
            resources: {{{GPU_LIMITS}}}
    - groupName: small-gpu-group
      replicas: 1
      rayStartParams: {{}}
      template:
        spec:
          containers:
          - name: ray-worker
            image: rayproject/ray:2.46.0-gpu
            resources: {{limits: {{nvidia.com/gpumem-percentage: 25}}}}
"""

RAYCLUSTER = f"""
apiVersion: ray.io/v1
kind: RayCluster
metadata: {{name: raycluster-gpu, namespace: ml}}
spec:
    rayVersion: 2.46.0
{RAY_GROUPS}"""

RAYJOB = f"""
apiVersion: ray.io/v1
kind: RayJob
metadata: {{name: rayjob-sample, namespace: ml}}
spec:
  entrypoint: python /home/ray/samples/sample_code.py
  shutdownAfterJobFinishes: true
  rayClusterSpec:
    rayVersion: 2.46.0
{RAY_GROUPS}
  submitterPodTemplate:
    spec:
      restartPolicy: Never
      containers:
      - {{name: ray-job-submitter, image: rayproject/ray:2.46.0}}
"""

RAYSERVICE = f"""
apiVersion: ray.io/v1
kind: RayService
metadata: {{name: rayservice-sample, namespace: serving}}
spec:
  serveConfigV2: |
    applications:
      - name: fruit_app
        import_path: fruit.deployment_graph
  rayClusterConfig:
    rayVersion: 2.46.0
{RAY_GROUPS}"""

VOLCANOJOB = f"""
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata: {{name: tensorflow-dist-mnist, namespace: ml}}
spec:
  minAvailable: 3
  schedulerName: volcano
  plugins: {{env: [], svc: []}}
  policies:
  - {{event: PodEvicted, action: RestartJob}}
  queue: default
  tasks:
  - replicas: 1
    name: ps
    template:
      spec:
        restartPolicy: Never
        containers:
        - {{name: tensorflow, image: volcanosh/dist-mnist-tf-example:0.0.1}}
  - replicas: 2
    name: worker
    policies:
    - {{event: TaskCompleted, action: CompleteJob}}
    template:
      spec:
        restartPolicy: Never
        containers:
        - name: tensorflow
          image: volcanosh/dist-mnist-tf-example:0.0.1
          resources: {{{GPU_LIMITS}}}
"""

# kind -> (manifest, the paths of its pod templates)
CASES: dict[str, tuple[str, list[tuple[str | int, ...]]]] = {
    "PyTorchJob": (PYTORCHJOB, [("spec", "pytorchReplicaSpecs", r, "template")
                                for r in ("Master", "Worker")]),
    "TFJob": (TFJOB, [("spec", "tfReplicaSpecs", r, "template") for r in ("PS", "Worker")]),
    "XGBoostJob": (XGBOOSTJOB, [("spec", "xgbReplicaSpecs", r, "template")
                                for r in ("Master", "Worker")]),
    "PaddleJob": (PADDLEJOB, [("spec", "paddleReplicaSpecs", "Worker", "template")]),
    "JAXJob": (JAXJOB, [("spec", "jaxReplicaSpecs", "Worker", "template")]),
    "MPIJob": (MPIJOB, [("spec", "mpiReplicaSpecs", r, "template")
                        for r in ("Launcher", "Worker")]),
    "ClusterTrainingRuntime": (TRAININGRUNTIME, [
        ("spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template")]),
    "JobSet": (JOBSET, [("spec", "replicatedJobs", i, "template", "spec", "template")
                        for i in (0, 1)]),
    "LeaderWorkerSet": (LWS, [("spec", "leaderWorkerTemplate", t)
                              for t in ("leaderTemplate", "workerTemplate")]),
    "RayCluster": (RAYCLUSTER, [("spec", "headGroupSpec", "template"),
                                ("spec", "workerGroupSpecs", 0, "template"),
                                ("spec", "workerGroupSpecs", 1, "template")]),
    "RayJob": (RAYJOB, [("spec", "rayClusterSpec", "headGroupSpec", "template"),
                        ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template"),
                        ("spec", "rayClusterSpec", "workerGroupSpecs", 1, "template"),
                        ("spec", "submitterPodTemplate")]),
    "RayService": (RAYSERVICE, [("spec", "rayClusterConfig", "headGroupSpec", "template"),
                                ("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template"),
                                ("spec", "rayClusterConfig", "workerGroupSpecs", 1, "template")]),
    "VolcanoJob": (VOLCANOJOB, [("spec", "tasks", i, "template") for i in (0, 1)]),
}


def _get(obj: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _set(obj: Any, path: tuple[str | int, ...], value: Any) -> None:
    _get(obj, path[:-1])[path[-1]] = value


def _dotted(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "in.yaml"
    path.write_text(text)
    return path


def test_check_counts_the_pod_templates_of_a_pytorchjob(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "0 pods checked" (PyTorchJob passed through), so `gpuslice check` in CI
    # said nothing about the templates Kueue counts.
    bad = PYTORCHJOB.replace("cpu: 4}", "cpu: 4, nvidia.com/gpumem-percentage: 10}", 1)
    path = _write(tmp_path, bad)
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert "2 pods checked, 1 problem" in err
    assert code == 1
    assert out.splitlines() == [
        (f'{path}: PyTorchJob/mnist: spec.pytorchReplicaSpecs.Master.template: container '
         f'"pytorch": nvidia.com/gpumem and nvidia.com/gpumem-percentage are both set; '
         f"use one of them")]


@pytest.mark.parametrize("case", list(CASES))
def test_mutate_rewrites_each_pod_template_as_the_webhook_would(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, paths = CASES[case]
    before = yaml.safe_load(text)
    path = _write(tmp_path, text)

    code, out, err = _run(capsys, "check", "-f", str(path))
    assert code == 0 and out == "", err
    assert f"{len(paths)} pod{'s' if len(paths) > 1 else ''} checked, 0 problems" in err

    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0, err
    (after,) = yaml.safe_load_all(out)
    namespace = before["metadata"].get("namespace")
    restored = copy.deepcopy(after)
    gpu_templates = 0
    for template_path in paths:
        template = _get(before, template_path)
        expected = mutate_pod(template, Settings(), namespace=namespace)
        assert _get(after, template_path) == expected.pod
        gpu_templates += expected.changed
        if expected.changed:
            limits = [c["resources"]["limits"] for c in _get(after, template_path)["spec"][
                "containers"] if "resources" in c]
            # what Kueue, Volcano and KubeRay count: the GPU the webhook adds to the pods
            assert all(lim["nvidia.com/gpu"] == "1" for lim in limits)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**(_get(after, template_path).get("metadata") or {}),
                            "name": "from-template"},
               "spec": _get(after, template_path)["spec"]}
        assert_valid(pod)
        _set(restored, template_path, template)
    assert gpu_templates >= 1
    # Everything outside the templates is as it was.
    assert restored == before

    # Mutating the output again changes nothing.
    again = tmp_path / "again.yaml"
    again.write_text(out)
    code, out2, _ = _run(capsys, "mutate", "-f", str(again))
    assert code == 0 and yaml.safe_load(out2) == after


@pytest.mark.parametrize("case", list(CASES))
def test_denials_name_the_kind_object_and_template_path(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, paths = CASES[case]
    obj = yaml.safe_load(text)
    for template_path in paths:
        _get(obj, template_path)["spec"]["nodeName"] = "n1"
        _get(obj, template_path)["spec"]["containers"][0].setdefault(
            "resources", {}).setdefault("limits", {}).setdefault("nvidia.com/gpucores", "10")
    path = _write(tmp_path, yaml.safe_dump(obj))
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert code == 1
    label = f"{obj['kind']}/{obj['metadata']['name']}"
    assert out.splitlines() == [
        f"{path}: {label}: {_dotted(p)}: spec.nodeName is set, which bypasses the GPU "
        f"scheduler that assigns the GPUs; remove spec.nodeName (use a nodeSelector to pick "
        f"nodes)" for p in paths]
    assert f"{len(paths)} problem" in err


@pytest.mark.parametrize("api_version", ["example.com/v1", "training.example.org/v1beta1"])
def test_a_kind_of_another_api_group_passes_through(
        api_version: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [yaml.safe_load(text) for text, _ in CASES.values()]
    docs.append(yaml.safe_load(CASES["PyTorchJob"][0]) | {"kind": "Deployment"})
    for doc in docs:
        doc["apiVersion"] = api_version
    path = _write(tmp_path, yaml.safe_dump_all(docs))
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0 and err == ""
    assert list(yaml.safe_load_all(out)) == docs
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert code == 0 and "0 pods checked" in err


def test_a_volcano_job_is_not_read_as_a_batch_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: kind Job of any group was read at spec.template, which a Volcano Job lacks:
    # "Job/tensorflow-dist-mnist: spec.template: spec.template is missing".
    path = _write(tmp_path, VOLCANOJOB)
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert (code, out) == (0, ""), out
    assert "2 pods checked" in err


def test_missing_templates_are_reported_with_their_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytorch = yaml.safe_load(PYTORCHJOB)
    del pytorch["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    ray = yaml.safe_load(RAYCLUSTER)
    del ray["spec"]["headGroupSpec"]
    lws = yaml.safe_load(LWS)
    del lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]  # optional: the workers' is used
    jobset = yaml.safe_load(JOBSET)
    jobset["spec"]["replicatedJobs"] = "workers"
    path = _write(tmp_path, yaml.safe_dump_all([pytorch, ray, lws, jobset]))
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert code == 1
    assert out.splitlines() == [
        f"{path}: PyTorchJob/mnist: spec.pytorchReplicaSpecs.Worker.template is missing",
        f"{path}: RayCluster/raycluster-gpu: spec.headGroupSpec is missing",
        f"{path}: JobSet/pytorch: spec.replicatedJobs must be a map or a list",
    ]
    # Master, the two Ray worker groups and the LWS worker template, and the three above
    assert "7 pods checked, 3 problems" in err


KNATIVE = f"""
apiVersion: serving.knative.dev/v1
kind: Service
metadata: {{name: llm, namespace: serving}}
spec:
  template:
    metadata:
      annotations: {{autoscaling.knative.dev/min-scale: "1"}}
    spec:
      containerConcurrency: 4
      timeoutSeconds: 600
      containers:
      - image: vllm/vllm-openai:latest
        ports: [{{containerPort: 8000}}]
        resources: {{{GPU_LIMITS}}}
"""


def test_knative_templates_are_checked_and_printed_unchanged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the container has no name, as in Knative's own examples: Knative names it
    # user-container (`check` refused the template for want of a name)
    svc = yaml.safe_load(KNATIVE)
    path = _write(tmp_path, yaml.safe_dump(svc))
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert (code, out) == (0, "") and "1 pod checked, 0 problems" in err
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0 and yaml.safe_load(out) == svc
    assert err == (f"{path}: Service/llm: spec.template: not rewritten: Knative refuses the "
                   f"mutated fields (schedulerName, nodeSelector, hostPath volumes) unless its "
                   f"feature flags allow them; the webhook mutates the pods Knative creates\n")
    svc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] = "0.5"
    path.write_text(yaml.safe_dump(svc))
    code, out, _ = _run(capsys, "check", "-f", str(path))
    assert code == 1 and out.startswith(
        f'{path}: Service/llm: spec.template: container "user-container": '
        f"resources.limits[nvidia.com/gpu] is 0.5")


_KEYS = sorted({k.rstrip("?") for shape in CUSTOM_SHAPES.values() for p in shape.paths
                for k in p.split(".") if k != "*"} | {"Worker", "containers", "name", "image",
                                                      "resources", "limits", "nvidia.com/gpumem"})
_TREE = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=4), st.just("1000")),
    lambda x: st.lists(x, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), x, max_size=4),
    max_leaves=25)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(CUSTOM_SHAPES)), _TREE)
def test_random_custom_resources_never_crash_the_offline_tools(
        group_kind: tuple[str, str], spec: Any) -> None:
    group, kind = group_kind
    doc = {"apiVersion": f"{group}/v1", "kind": kind, "metadata": {"name": "x"}, "spec": spec}
    findings: list[Finding] = []
    (out,) = mutate_documents([doc], "<test>", Settings(), findings)
    for finding in findings:
        assert finding.error is not None or finding.result is not None
    if not any(f.result is not None and f.result.changed for f in findings):
        assert out == doc


@pytest.mark.parametrize("key", [0, 1])
def test_a_replica_map_with_a_number_for_a_key_is_rewritten_as_a_map(
        key: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # YAML reads an unquoted `1:` as the number 1 (kubectl sends it as "1"). Before, the map was
    # rewritten as a list of its keys: `pytorchReplicaSpecs: [1]`, the replica spec and its
    # template gone, exit 0 (key 0: a TypeError traceback).
    doc = yaml.safe_load(PYTORCHJOB)
    specs = doc["spec"]["pytorchReplicaSpecs"]
    doc["spec"]["pytorchReplicaSpecs"] = {key: specs["Worker"]}
    path = _write(tmp_path, yaml.safe_dump(doc))
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0, err
    (mutated,) = yaml.safe_load_all(out)
    replicas = mutated["spec"]["pytorchReplicaSpecs"]
    assert isinstance(replicas, dict) and list(replicas) == [key], replicas
    expected = mutate_pod(specs["Worker"]["template"], Settings(),
                          namespace=doc["metadata"].get("namespace"))
    assert expected.changed and replicas[key]["template"] == expected.pod


@pytest.mark.parametrize(("size", "cores", "warned"), [
    (4, 30, True), ("2", 20, True), (1, 30, False), (4, 50, False), (None, 30, False),
], ids=["group-of-4", "size-as-text", "group-of-1", "cores-50", "size-unset"])
def test_mutate_warns_of_a_multi_pod_lws_group_under_gpucores_below_50(
        size: Any, cores: int, warned: bool, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """LWS's webhook gives every container of the group's pods LWS_GROUP_SIZE (its size);
    the webhook's warning for one rank of a job spread over pods then reaches only the
    StatefulSet controller that creates them. ``gpuslice mutate`` says it where a person reads
    it, for the leader and worker templates; the templates are rewritten without the
    variable (LWS adds it to the pods)."""
    lws = yaml.safe_load(LWS.replace("nvidia.com/gpucores: 50", f"nvidia.com/gpucores: {cores}"))
    if size is None:
        del lws["spec"]["leaderWorkerTemplate"]["size"]
    else:
        lws["spec"]["leaderWorkerTemplate"]["size"] = size
    path = _write(tmp_path, yaml.safe_dump(lws))
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0, err
    lines = [line for line in err.splitlines() if "one rank of a job spread over pods" in line]
    expected = [f'{path}: LeaderWorkerSet/vllm: spec.leaderWorkerTemplate.{t}: warning: container '
                f'"{c}": gpucores {cores} with LWS_GROUP_SIZE={size} looks like'
                for t, c in (("leaderTemplate", "vllm-leader"), ("workerTemplate", "vllm-worker"))]
    assert [line[:len(e)] for line, e in zip(lines, expected)] == (expected if warned else [])
    assert len(lines) == (2 if warned else 0)
    (after,) = yaml.safe_load_all(out)
    assert "LWS_GROUP_SIZE" not in out
    assert after["spec"]["leaderWorkerTemplate"].get("size") == lws["spec"][
        "leaderWorkerTemplate"].get("size")


def test_several_unnamed_knative_containers_are_named_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = yaml.safe_load(KNATIVE)
    containers = svc["spec"]["template"]["spec"]["containers"]
    containers.append({"image": "sidecar", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}})
    path = _write(tmp_path, yaml.safe_dump(svc))
    code, out, _ = _run(capsys, "check", "-f", str(path))
    assert code == 1 and out.startswith(
        f'{path}: Service/llm: spec.template: container "user-container-1": '
        f"resources.limits[nvidia.com/gpu] is 0.5")
