"""Properties of the pure mutation over generated pods: pure, idempotent, patchable, total."""

from __future__ import annotations

import copy
import itertools
import posixpath
from typing import Any

import jsonpatch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from webhook import names
from webhook.admission.diff import pod_patch
from webhook.admission.mutate import _normal_path, mutate_pod
from webhook.settings import Settings

SETTINGS = Settings(runtime_class_name="nvidia",
                    tolerations=({"key": "gpu", "operator": "Exists"},))
QUANTITY = st.sampled_from(["1", "2", "0", "100", "8000", "50", "0.5", "-1", "1k", "1Gi", "x",
                            1, 3, 101, 17])
VALID_LIMITS = st.sampled_from([
    {"nvidia.com/gpumem": "8000"}, {"nvidia.com/gpu": "2"}, {"nvidia.com/gpucores": "30"},
    {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": 100},
    {"nvidia.com/gpumem": "1k", "cpu": "1"}, {"cpu": "2"}, {}])
RESOURCE = st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpumem",
                            "nvidia.com/gpumem-percentage", "nvidia.com/gpucores", "cpu"])
ENV_NAME = st.sampled_from([names.ENV_VISIBLE_DEVICES, names.ENV_MEMORY_LIMIT,
                            names.ENV_POD_UID, "CUDA_DEVICE_SM_LIMIT_0", "GPUSLICE_X", "HOME",
                            "PATH"])
ENV = st.fixed_dictionaries({"name": ENV_NAME, "value": st.sampled_from(["1", "all", "x"])})
MOUNT = st.fixed_dictionaries({
    "name": st.sampled_from(["data", "gpuslice-lib", "cfg", "gpuslice-limits"]),
    "mountPath": st.sampled_from(["/data", "/etc/ld.so.preload", "/var/run/gpuslice", "/x",
                                  "/etc/gpuslice/limits"])})
LIMIT_LINES = (names.ENV_MEMORY_LIMIT, names.ENV_MEMORY_PERCENT, names.ENV_SM_LIMIT,
               names.ENV_SHARED_CACHE)


def _container(name: str, limits: dict[str, Any], requests: dict[str, Any],
               env: list[Any], mounts: list[Any], privileged: bool | None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": "busybox"}
    if limits or requests:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests
                                                        else {})}
    if env:
        container["env"] = env
    if mounts:
        container["volumeMounts"] = mounts
    if privileged is not None:
        container["securityContext"] = {"privileged": privileged}
    return container


def containers(pool: list[str]) -> st.SearchStrategy[list[dict[str, Any]]]:
    """Up to three containers with distinct names from ``pool``, mostly valid requests."""
    one = st.builds(
        _container, st.sampled_from(pool),
        st.one_of(*[VALID_LIMITS] * 6, st.dictionaries(RESOURCE, QUANTITY, max_size=3)),
        st.one_of(*[st.just({})] * 6, st.dictionaries(RESOURCE, QUANTITY, max_size=2)),
        st.lists(ENV, max_size=4),
        st.lists(MOUNT, max_size=2, unique_by=lambda m: m["mountPath"]),
        st.sampled_from([None] * 8 + [False, True]))
    return st.lists(one, max_size=3, unique_by=lambda c: c["name"])


POD = st.builds(
    lambda containers, init, annotations, selector, node, ns: {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", **({"namespace": ns} if ns else {}),
                     **({"annotations": annotations} if annotations else {})},
        "spec": {"containers": containers, **({"initContainers": init} if init else {}),
                 **({"nodeSelector": selector} if selector else {}),
                 **({"nodeName": node} if node else {}),
                 "volumes": [{"name": "data", "emptyDir": {}}]}},
    containers(["main", "side", "a" * 63]).filter(bool),
    containers(["init", "x-1", "b" * 63]),
    st.dictionaries(st.sampled_from([names.ANN_PLACEMENT, "a/b~c",
                                     names.devices_annotation("main"),
                                     names.limits_annotation("main"),
                                     names.limits_annotation("gone")]),
                    st.sampled_from(["spread", "binpack", "GPU-1", "x",
                                     "CUDA_DEVICE_MEMORY_LIMIT=80g\n"]), max_size=3),
    st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["on", "off"]),
                    max_size=2),
    st.sampled_from([None] * 7 + ["node-1"]),
    st.sampled_from([None, "team", "kube-system"]))


@settings(max_examples=300, deadline=None)
@given(POD)
def test_mutation_is_pure_idempotent_and_its_patch_rebuilds_it(pod: dict[str, Any]) -> None:
    received = copy.deepcopy(pod)
    result = mutate_pod(pod, SETTINGS)
    assert pod == received
    event("denied" if not result.allowed else "changed" if result.changed else "unchanged")
    if not result.allowed:
        assert result.pod is None and result.message
        return
    if not result.changed:
        assert result.pod is pod and not result.warnings
        return
    mutated = result.pod
    assert mutated is not None
    assert jsonpatch.apply_patch(received, pod_patch(received, mutated)) == mutated
    again = mutate_pod(mutated, SETTINGS)
    assert again.pod == mutated and again.warnings == ()
    assert pod_patch(mutated, again.pod) == []
    assert mutated["metadata"]["annotations"][names.ANN_MUTATED]
    annotations = mutated["metadata"]["annotations"]
    assert not any(k.startswith(names.ANN_DEVICES_PREFIX) for k in annotations)
    gpu_names = []
    for container in mutated["spec"].get("initContainers", []) + mutated["spec"]["containers"]:
        env = [e["name"] for e in container.get("env", ())]
        if names.ENV_CONTAINER not in env:
            continue  # not a GPU container: left as the user wrote it
        gpu_names.append(container["name"])
        ours = [n for n in env if n.startswith(("GPUSLICE_", "CUDA_DEVICE_")) or n in (
            names.ENV_VISIBLE_DEVICES,)]
        assert len(ours) == len(set(ours)), "each of our env names at most once"
        paths = [m["mountPath"] for m in container.get("volumeMounts", ())]
        assert len(paths) == len(set(paths)), "no mount path twice"
        assert {"name": "gpuslice-limits", "mountPath": names.LIMITS_FILE,
                "subPath": container["name"], "readOnly": True} in container["volumeMounts"]
        # The limits file says what the env says, line for line.
        lines = [f"{e['name']}={e['value']}\n" for e in container["env"]
                 if e["name"] in LIMIT_LINES]
        assert annotations[names.limits_annotation(container["name"])] == "".join(lines)
    assert sorted(k for k in annotations if k.startswith(names.ANN_LIMITS_PREFIX)) == sorted(
        names.limits_annotation(n) for n in gpu_names)
    volumes = [v["name"] for v in mutated["spec"]["volumes"]]
    assert len(volumes) == len(set(volumes))
    [limits] = [v for v in mutated["spec"]["volumes"] if v["name"] == "gpuslice-limits"]
    assert [i["path"] for i in limits["downwardAPI"]["items"]] == gpu_names


def test_normal_path_is_posix_normpath_of_the_rooted_path() -> None:
    """The shortcut for paths already normal agrees with ``posixpath.normpath`` everywhere
    (every path of up to 7 characters from ``/``, ``.`` and a letter)."""
    for size in range(8):
        for chars in itertools.product("/.a", repeat=size):
            path = "".join(chars)
            assert _normal_path(path) == posixpath.normpath("/" + path.lstrip("/")), path
