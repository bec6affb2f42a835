"""``gpuslice mutate`` and ``gpuslice check``: manifests in, mutated manifests / denials out."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kubeschema import assert_valid

from webhook.admission.mutate import mutate_pod
from webhook.admission.offline import TEMPLATE_PATHS, Finding, mutate_documents
from webhook.cli import main
from webhook.settings import Settings


def _container(name: str, limits: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "resources": {"limits": limits}}


def _template(limits: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "x"}},
            "spec": {"containers": [_container("main", limits)]}}


def _workload(kind: str, limits: dict[str, str], name: str | None = None) -> dict[str, Any]:
    api = {"Job": "batch/v1", "CronJob": "batch/v1", "ReplicationController": "v1"}.get(
        kind, "apps/v1")
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "x"}}, "template": _template(limits)}
    if kind == "StatefulSet":
        spec["serviceName"] = "x"
    if kind in ("Job", "CronJob"):
        spec = {"template": _template(limits)}
        spec["template"]["spec"]["restartPolicy"] = "Never"
    if kind == "ReplicationController":
        spec["selector"] = {"app": "x"}
    if kind == "CronJob":
        spec = {"schedule": "*/5 * * * *", "jobTemplate": {"spec": spec}}
    return {"apiVersion": api, "kind": kind,
            "metadata": {"name": name or kind.lower(), "namespace": "team-a"}, "spec": spec}


GPU = {"nvidia.com/gpumem": "4000"}
BAD = {"nvidia.com/gpu": "0.5"}


def _pod(name: str, limits: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [_container("main", limits)]}}


def _manifest() -> list[dict[str, Any]]:
    return ([_pod("pod", GPU)] + [_workload(k, GPU) for k in TEMPLATE_PATHS]
            + [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"},
                "data": {"nvidia.com/gpu": "1"}},
               {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"},
                "spec": {"ports": [{"port": 80}]}},
               _pod("cpu-only", {"cpu": "1"})])


def _template_of(obj: dict[str, Any]) -> dict[str, Any]:
    node: Any = obj
    for key in TEMPLATE_PATHS.get(obj["kind"], ()):
        node = node[key]
    return node


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_mutate_takes_several_files_in_order(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # `check -f a -f b` reads both; `mutate -f a -f b` printed b alone (the last -f won)
    docs = _manifest()
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(yaml.safe_dump_all(docs[:2]))
    second.write_text(yaml.safe_dump_all(docs[2:4]))
    code, out, err = _run(capsys, "mutate", "-f", str(first), "-f", str(second))
    assert code == 0, err
    assert [d["kind"] for d in yaml.safe_load_all(out)] == [d["kind"] for d in docs[:4]]


def test_mutate_prints_every_document_with_pods_and_templates_mutated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = _manifest()
    path = tmp_path / "app.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0, err
    result = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in result] == [d["kind"] for d in docs]
    settings = Settings()
    for before, after in zip(docs, result):
        if before["kind"] in ("ConfigMap", "Service") or before["metadata"]["name"] == "cpu-only":
            assert after == before
            continue
        expected = mutate_pod(_template_of(before), settings, namespace="team-a").pod
        assert _template_of(after) == expected
        if before["kind"] != "Pod":
            assert after["metadata"] == before["metadata"]
        assert_valid(after)
    # The stock scheduler keeps seeing the limits, with the GPU count made explicit.
    deployment = result[1 + list(TEMPLATE_PATHS).index("Deployment")]
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpumem": "4000", "nvidia.com/gpu": "1"}
    # The limits annotations are printed as literal blocks, a line of the file a line.
    assert ("    gpuslice.io/limits.main: |\n      CUDA_DEVICE_MEMORY_LIMIT=4000m\n"
            "      CUDA_DEVICE_MEMORY_SHARED_CACHE=/var/run/gpuslice/region\n") in out


def test_mutate_reads_stdin_json_and_list_kinds(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"apiVersion": "v1", "kind": "List",
           "items": [_pod("a", GPU), _workload("Deployment", GPU)]}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(doc)))
    code, out, _ = _run(capsys, "mutate", "-f", "-")
    assert code == 0
    (result,) = yaml.safe_load_all(out)
    assert result["kind"] == "List"
    assert result["items"][0] == mutate_pod(_pod("a", GPU), Settings()).pod
    assert "gpuslice.io/mutated" in result["items"][1]["spec"]["template"]["metadata"][
        "annotations"]


def test_mutate_uses_settings_from_flags(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(_pod("p", GPU)))
    code, out, _ = _run(capsys, "mutate", "-f", str(path), "--set", "scheduler_name=other",
                        "--set", "runtime_class_name=nvidia")
    assert code == 0
    spec = yaml.safe_load(out)["spec"]
    assert spec["schedulerName"] == "other" and spec["runtimeClassName"] == "nvidia"


def test_mutate_reports_denials_and_warnings_on_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pod = _pod("p", GPU)
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all([pod, _pod("bad", BAD)]))
    code, out, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 1
    assert len(list(yaml.safe_load_all(out))) == 2
    assert f"{path}: Pod/p: warning: container \"main\": env NVIDIA_VISIBLE_DEVICES" in err
    assert f'{path}: Pod/bad: container "main": resources.limits[nvidia.com/gpu] is 0.5' in err


def test_placement_annotations_on_a_workload_instead_of_its_template_are_warned_of(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pods get the template's annotations, not the Deployment's or Job's own: a placement
    written there was silently without effect (Project-HAMi/HAMi#882)."""
    job = _workload("Job", GPU, name="train")
    job["metadata"]["annotations"] = {"gpuslice.io/placement": "spread",
                                      "nvidia.com/use-gputype": "A100",
                                      "team": "a"}
    deployment = _workload("Deployment", GPU, name="serve")
    deployment["metadata"]["annotations"] = {"gpuslice.io/placement": "spread"}
    deployment["spec"]["template"]["metadata"]["annotations"] = {"gpuslice.io/placement": "spread"}
    cpu_job = _workload("Job", {"cpu": "1"}, name="cpu")
    cpu_job["metadata"]["annotations"] = {"gpuslice.io/placement": "spread"}
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([job, deployment, cpu_job]))
    code, _, err = _run(capsys, "mutate", "-f", str(path))
    assert code == 0
    warned = [line for line in err.splitlines() if "not on its pod template" in line]
    tail = "its pods do not get it (set it in spec.template.metadata.annotations)"
    assert warned == [
        f"{path}: Job/train: warning: annotation {key} is on the Job, not on its pod template: {tail}"
        for key in ("gpuslice.io/placement", "nvidia.com/use-gputype")]


def test_check_passes_clean_manifests(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump_all(_manifest()))
    code, out, err = _run(capsys, "check", "-f", str(path))
    assert code == 0 and out == ""
    assert "9 pods checked, 0 problems" in err


def test_check_lists_every_denial_with_file_object_and_container(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_job = _workload("Job", {"nvidia.com/gpumem": "100", "nvidia.com/gpumem-percentage": "5"},
                        name="train")
    generated = _pod("ignored", BAD)
    generated["metadata"] = {"generateName": "worker-"}
    privileged = _pod("root", GPU)
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    privileged["spec"]["nodeName"] = "n1"
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(yaml.safe_dump_all([_pod("fine", GPU), bad_job]))
    second.write_text(yaml.safe_dump_all([generated, privileged]))
    code, out, err = _run(capsys, "check", "-f", str(first), "-f", str(second))
    assert code == 1
    assert out.splitlines() == [
        (f'{first}: Job/train: container "main": nvidia.com/gpumem and '
         f"nvidia.com/gpumem-percentage are both set; use one of them"),
        (f'{second}: Pod/worker-*: container "main": resources.limits[nvidia.com/gpu] is 0.5; '
         f"it must be a whole number (to share a GPU, ask for 1 GPU with gpumem or "
         f"gpumem-percentage)"),
        (f"{second}: Pod/root: spec.nodeName is set, which bypasses the GPU scheduler that "
         f"assigns the GPUs; remove spec.nodeName (use a nodeSelector to pick nodes)"),
        (f'{second}: Pod/root: container "main": privileged containers see every GPU of the '
         f"node, so they cannot get a GPU slice; remove securityContext.privileged"),
    ]
    assert "4 pods checked, 4 problems" in err


def test_check_reports_objects_that_are_not_pod_shaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all([
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
         "spec": {"replicas": 1}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
         "spec": {"containers": "main"}}]))
    code, out, _ = _run(capsys, "check", "-f", str(path))
    assert code == 1
    assert out.splitlines() == [f"{path}: Deployment/d: spec.template: spec.template is missing",
                                f"{path}: Pod/p: spec.containers must be a list"]


def test_a_namespace_that_is_not_a_string_is_reported_not_a_crash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # found by the random-documents test: an empty list passed the shape check as "no
    # namespace" and then failed as a set member
    gpu = {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpumem": "1000"}}}
    path = tmp_path / "ns.yaml"
    path.write_text(yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": []},
         "spec": {"containers": [gpu]}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "d", "namespace": ["ml"]},
         "spec": {"template": {"metadata": {}, "spec": {"containers": [gpu]}}}}]))
    code, out, _ = _run(capsys, "check", "-f", str(path))
    assert code == 1
    assert [line.split(": ", 2)[2] for line in out.splitlines()] == [
        "metadata.namespace must be a string", "spec.template: metadata.namespace must be a string"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"),
    ("a: [unclosed\n", "not valid YAML/JSON"),
])
def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  content: str | None, message: str) -> None:
    path = tmp_path / "in.yaml"
    if content is not None:
        path.write_text(content)
    for command in ("check", "mutate"):
        code, _, err = _run(capsys, command, "-f", str(path))
        assert code == 2 and message in err and str(path) in err


ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6),
              st.sampled_from(["Pod", "Deployment", "CronJob", "1", "0.5", "nvidia.com/gpu"])),
    lambda x: st.lists(x, max_size=3) | st.dictionaries(
        st.sampled_from(["kind", "spec", "metadata", "template", "jobTemplate", "containers",
                         "initContainers", "name", "resources", "limits", "requests",
                         "nvidia.com/gpu", "nvidia.com/gpumem", "env", "namespace", "items",
                         "annotations", "volumes", "volumeMounts", "securityContext"]),
        x, max_size=4), max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(ANY, max_size=3))
def test_random_documents_never_crash_the_offline_tools(docs: list[Any]) -> None:
    path_docs: list[Any] = []
    for doc in docs:
        if isinstance(doc, dict):
            doc.setdefault("kind", "Pod")
        path_docs.append(doc)
    findings: list[Finding] = []
    out = mutate_documents(path_docs, "<test>", Settings(), findings)
    assert len(out) == len([d for d in path_docs if d is not None])
    for finding in findings:
        assert finding.error is not None or finding.result is not None


def test_mutate_keeps_timestamps_as_the_text_kubectl_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # kubectl (go-yaml) reads an unquoted timestamp as the string it is written as. Before,
    # PyYAML read it as a datetime and wrote it back as `2024-01-01 10:00:00+00:00`: the
    # container's env value, the annotation and the ConfigMap's value all changed, exit 0.
    stamp = "2024-01-01T10:00:00Z"
    path = tmp_path / "in.yaml"
    path.write_text(f"""\
apiVersion: apps/v1
kind: Deployment
metadata: {{name: d, annotations: {{built: {stamp}}}}}
spec:
  selector: {{matchLabels: {{app: d}}}}
  template:
    metadata: {{labels: {{app: d}}}}
    spec:
      containers:
      - name: c
        image: cuda
        env: [{{name: BUILT, value: {stamp}}}]
        resources: {{limits: {{nvidia.com/gpu: 1, nvidia.com/gpumem: 1024}}}}
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: c}}
data: {{when: {stamp}, day: 2024-01-01}}
""")
    assert main(["mutate", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    deployment, config = yaml.load_all(out, Loader=yaml.BaseLoader)  # every scalar as text
    assert deployment["metadata"]["annotations"]["built"] == stamp
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "BUILT", "value": stamp} in container["env"]
    assert "gpuslice.io/mutated" in deployment["spec"]["template"]["metadata"]["annotations"]
    assert config["data"] == {"when": stamp, "day": "2024-01-01"}


def test_mutate_keeps_a_torchrun_range_as_the_text_kubectl_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `1:4` (torchrun's elastic --nnodes, PET_NNODES) is a string to kubectl; PyYAML's YAML 1.1
    # read it as the base-60 number 64. Before, mutate printed `--nnodes 64` and
    # `PET_NNODES: 64` (which kubectl refuses: not a string), and neither tool warned of the
    # elastic job's ranks in other pods under gpucores 30, as the webhook does.
    path = tmp_path / "in.yaml"
    path.write_text("""\
apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - name: c
    image: pytorch
    command: [torchrun, --nnodes, 1:4, train.py]
    env: [{name: PET_NNODES, value: 1:4}, {name: T, value: 10:30:00.5}]
    resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpucores: 30}}
""")
    assert main(["mutate", "-f", str(path)]) == 0
    out, err = capsys.readouterr()
    (pod,) = yaml.load_all(out, Loader=yaml.BaseLoader)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["torchrun", "--nnodes", "1:4", "train.py"]
    assert [e for e in container["env"] if e["name"] in ("PET_NNODES", "T")] == [
        {"name": "PET_NNODES", "value": "1:4"}, {"name": "T", "value": "10:30:00.5"}]
    assert "PET_NNODES=1:4 looks like one rank of a job spread over pods" in err


def test_a_lone_equals_sign_is_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `=` unquoted is a string to kubectl; PyYAML tagged it as YAML 1.1's `value` and could not
    # construct it. Before: "not valid YAML/JSON", exit 2, for a manifest kubectl applies.
    path = tmp_path / "in.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {sep: =}\n")
    assert main(["mutate", "-f", str(path)]) == 0
    (config,) = yaml.load_all(capsys.readouterr().out, Loader=yaml.BaseLoader)
    assert config["data"] == {"sep": "="}
    assert main(["check", "-f", str(path)]) == 0
