"""The answer as it travels, over the case table and seeded random pods: its patch rebuilds the pod.

For every case of ``cases/*.yaml`` and a few hundred random pod shapes (seeded, so a failure
is reproducible by its id), the review goes through the handler's own decision path and the
answer bytes are decoded as the API server does: the base64 JSON patch, applied to the pod as
received, must give exactly :func:`mutate_pod`'s result, with an RFC 6902 patch (paths escaped
with ``~0``/``~1``, ``add`` only where the key or index is new, ``replace`` only where it
exists), and the warnings and denials must be the mutation's own. The random shapes cover
what the mutation rewrites: reserved env names and mounts, our volumes, annotations with ``/``
and ``~``, selectors, schedulers, runtime classes, tolerations, non-ASCII values, invalid
requests and ephemeral containers added by ``kubectl debug``.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import random
from typing import Any

import jsonpatch
import pytest
from prometheus_client import CollectorRegistry

from tests.admission.test_cases import CASES
from webhook import names
from webhook.admission import review
from webhook.admission.encode import encode_json
from webhook.admission.mutate import mutate_ephemeral, mutate_pod
from webhook.admission.server import AdmissionMetrics, MutateHandler
from webhook.settings import Settings, settings_from_mapping

SEEDS = range(400)
SETTINGS = (
    Settings(placement_enabled=False),
    Settings(placement_enabled=False, runtime_class_name="nvidia",
             tolerations=({"key": "gpu", "operator": "Exists"},
                          {"key": "nvidia.com/gpu", "operator": "Exists",
                           "effect": "NoSchedule"})),
    Settings(placement_enabled=False, hide_gpus_from_pods_without_gpus=True,
             node_label_key="gpuslice.io/node", scheduler_name="sched-x"),
)
_LIMITS = [
    {"nvidia.com/gpumem": "8000"}, {"nvidia.com/gpu": "2"}, {"nvidia.com/gpucores": "30"},
    {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": "20"},
    {"nvidia.com/gpu": 1, "nvidia.com/priority": "1"}, {"nvidia.com/mig-1g.10gb": "1"},
    {"nvidia.com/gpu": "0"}, {"cpu": "2", "memory": "1Gi"}, {},
    {}, {},
]
_ENV_NAMES = [names.ENV_VISIBLE_DEVICES, names.ENV_MEMORY_LIMIT, names.ENV_POD_UID,
              names.ENV_SM_LIMIT, "CUDA_DEVICE_SM_LIMIT_0", "GPUSLICE_X", "HOME", "WORLD_SIZE",
              "PET_NNODES", "A/B~C", "ÜBER"]
_MOUNTS = [("data", "/data"), ("gpuslice-lib", "/x"), ("cfg", "/etc/ld.so.preload"),
           ("gpuslice-limits", "/etc/gpuslice/limits"), ("state", "/var/run/gpuslice/sub"),
           ("etc", "/etc"), ("t~1", "/a/b"), ("gpuslice-state", "/var/run/gpuslice")]
_VOLUMES = ["data", "gpuslice-lib", "gpuslice-preload", "gpuslice-state", "gpuslice-limits",
            "cfg/x~y"]
_ANNOTATIONS = [names.ANN_PLACEMENT, names.HAMI_POLICY, names.ANN_MUTATED, "a/b~c", "é",
                names.devices_annotation("main"), names.limits_annotation("main"),
                names.limits_annotation("gone"), "prometheus.io/scrape"]
_ANNOTATION_VALUES = ["spread", "binpack", "numa,spread", "GPU-1", "x", "true", "\u00e9\u2603",
                      'quote " and \\', "CUDA_DEVICE_MEMORY_LIMIT=80g\n"]


def _container(rng: random.Random, name: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": "registry.example.com/x:1"}
    limits = dict(rng.choice(_LIMITS)) if rng.random() < 0.97 else {"nvidia.com/gpumem": "x"}
    if limits or rng.random() < 0.3:
        resources: dict[str, Any] = {"limits": {"cpu": "1", **limits}}
        if rng.random() < 0.5:
            resources["requests"] = dict(limits)
        container["resources"] = resources
    if rng.random() < 0.7:
        container["env"] = [
            {"name": rng.choice(_ENV_NAMES), "value": rng.choice(["1", "all", "none", "8", "é"])}
            if rng.random() < 0.8 else
            {"name": rng.choice(_ENV_NAMES),
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
            for _ in range(rng.randrange(0, 6))]
    if rng.random() < 0.7:
        mounts = rng.sample(_MOUNTS, rng.randrange(0, 4))
        container["volumeMounts"] = [{"name": n, "mountPath": p, **(
            {"readOnly": True} if rng.random() < 0.3 else {})} for n, p in mounts]
    if rng.random() < 0.05:
        container["securityContext"] = {"privileged": rng.random() < 0.5}
    elif rng.random() < 0.05:
        container["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    return container


def random_pod(seed: int) -> dict[str, Any]:
    """A pod shape for ``seed``: mostly valid GPU pods, some denied, some without GPUs."""
    rng = random.Random(seed)
    pool = ["main", "side", "a" * 63, "b.c", "x-1"]
    rng.shuffle(pool)
    containers = [_container(rng, n) for n in pool[:rng.randrange(1, 4)]]
    spec: dict[str, Any] = {"containers": containers}
    if rng.random() < 0.4:
        spec["initContainers"] = [_container(rng, n) for n in ["init", "init-2"][
            :rng.randrange(0, 3)]]
    if rng.random() < 0.6:
        spec["volumes"] = [{"name": n, "emptyDir": {}} for n in
                           rng.sample(_VOLUMES, rng.randrange(0, 4))]
    if rng.random() < 0.4:
        spec["nodeSelector"] = {k: rng.choice(["on", "off"]) for k in
                                rng.sample(["gpu", "zone", "gpuslice.io/node"], 2)}
    if rng.random() < 0.4:
        spec["schedulerName"] = rng.choice(["default-scheduler", "gpuslice-scheduler", "other"])
    if rng.random() < 0.3:
        spec["runtimeClassName"] = rng.choice(["nvidia", "runc"])
    if rng.random() < 0.3:
        spec["tolerations"] = [{"key": "gpu", "operator": "Exists"}] if rng.random() < 0.5 \
            else [{"key": "other", "operator": "Exists"}]
    if rng.random() < 0.05:
        spec["nodeName"] = "node-1"
    if rng.random() < 0.05:
        spec["os"] = {"name": rng.choice(["linux", "windows"])}
    if rng.random() < 0.2:
        spec["ephemeralContainers"] = [{"name": "debug-old", "image": "busybox"}]
    metadata: dict[str, Any] = {"name": f"pod-{seed}", "labels": {"app": "x"}}
    if rng.random() < 0.7:
        metadata["annotations"] = {k: rng.choice(_ANNOTATION_VALUES) for k in
                                   rng.sample(_ANNOTATIONS, rng.randrange(0, 4))}
    if rng.random() < 0.1:
        metadata["namespace"] = rng.choice(["kube-system", "team-a"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec,
            "status": {}}


def _answer(handler: MutateHandler, admission: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The handler's outcome and decoded answer (as bytes on the wire, then parsed)."""
    outcome, response = handler._decide(review.parse_review(json.dumps(
        {"apiVersion": review.API_VERSION, "kind": review.KIND, "request": admission}).encode()))
    assert isinstance(response.body, bytes)
    return outcome, json.loads(response.body)["response"]


def _check_patch_ops(received: Any, patch: list[dict[str, Any]]) -> None:
    """Every op is a valid RFC 6902 add, remove or replace against the document so far."""
    doc = copy.deepcopy(received)
    for op in patch:
        assert set(op) == ({"op", "path"} if op["op"] == "remove" else {"op", "path", "value"})
        pointer = jsonpatch.JsonPointer(op["path"])
        assert all(p.replace("~0", "").replace("~1", "").find("~") < 0
                   for p in op["path"].split("/")), op["path"]
        parent, last = pointer.to_last(doc)
        if op["op"] == "add":
            assert not (isinstance(parent, dict) and last in parent), f"add over {op['path']}"
        elif op["op"] == "replace" or op["op"] == "remove":
            assert isinstance(parent, list) and isinstance(last, int) and last < len(parent) \
                or isinstance(parent, dict) and last in parent, op
        else:
            raise AssertionError(f"unexpected op {op}")
        doc = jsonpatch.apply_patch(doc, [op])


def _check(settings: Settings, pod: dict[str, Any], namespace: str | None,
           max_mem: int | None = None, old: dict[str, Any] | None = None) -> str:
    received = copy.deepcopy(pod)
    settings = dataclasses.replace(settings, max_gpu_memory_mib=max_mem)
    handler = MutateHandler(settings, AdmissionMetrics(CollectorRegistry()))
    admission: dict[str, Any] = {
        "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE" if old is None else "UPDATE", "object": pod,
        **({"namespace": namespace} if namespace else {})}
    if old is not None:
        admission.update(subResource="ephemeralcontainers", oldObject=old)
        result = mutate_ephemeral(pod, old, settings, namespace=namespace)
    else:
        result = mutate_pod(pod, settings, namespace=namespace, max_gpu_memory_mib=max_mem)
    outcome, answer = _answer(handler, admission)
    assert pod == received, "the handler changed its input"
    assert answer["uid"] == "u-1"
    assert answer.get("warnings", []) == list(result.warnings)
    if not result.allowed:
        assert outcome == "denied" and answer["allowed"] is False
        assert answer["status"]["message"] == result.message
        return outcome
    assert answer["allowed"] is True
    if not result.changed:
        assert outcome == "allowed_unchanged" and "patch" not in answer
        return outcome
    assert outcome == "allowed_patched" and answer["patchType"] == "JSONPatch"
    text = base64.b64decode(answer["patch"], validate=True)
    patch = json.loads(text)
    assert patch and text == encode_json(patch).encode(), "not the compact encoding"
    _check_patch_ops(received, patch)
    assert jsonpatch.apply_patch(received, patch) == result.pod
    return outcome


@pytest.mark.parametrize("case", CASES)
def test_case_answer_patch_rebuilds_the_mutated_pod(case: dict[str, Any]) -> None:
    _check(settings_from_mapping(case.get("settings") or {},
                                 Settings(placement_enabled=False)),
           case["input"], case.get("namespace"), case.get("max_gpu_memory_mib"))


def test_random_answers_patch_rebuilds_the_mutated_pod() -> None:
    outcomes: dict[str, int] = {}
    for seed in SEEDS:
        pod = random_pod(seed)
        settings = SETTINGS[seed % len(SETTINGS)]
        outcome = _check(settings, pod, "team-a" if seed % 4 else None)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if pod["spec"].get("ephemeralContainers") and outcome == "allowed_patched":
            mutated = mutate_pod(pod, settings, namespace="team-a").pod
            assert mutated is not None
            debug = copy.deepcopy(mutated)
            debug["spec"]["ephemeralContainers"] = [
                *debug["spec"]["ephemeralContainers"],
                {"name": "debug", "image": "busybox",
                 "env": [{"name": names.ENV_VISIBLE_DEVICES, "value": "all"}],
                 "volumeMounts": [{"name": "gpuslice-lib", "mountPath": "/x"}]}]
            _check(settings, debug, "team-a", old=mutated)
    # Every outcome is exercised, mostly patches.
    assert outcomes["allowed_patched"] >= 200 and outcomes["denied"] >= 50, outcomes
    assert outcomes["allowed_unchanged"] >= 50, outcomes
