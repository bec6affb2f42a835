"""gpuslice's webhook among the other mutating webhooks that act on the same pod.

The API server calls the mutating webhooks in the order of their configurations' names (then
their order within one), applying each one's patch and defaulting the result (limits copied to
missing requests). gpuslice's entry has ``reinvocationPolicy: IfNeeded``: when a webhook called
after it changes the pod, it is called once more (round 1) with the pod as it then is, our own
first patch included; a webhook not called in round 0 is never called in round 1, and the
warnings of every call, reinvocations included, reach the client, each text once
(k8s.io/apiserver's mutating dispatcher and warning recorder). :func:`admit` plays that
dispatcher with gpuslice's real handler (its JSON patch applied as the API server applies it)
and models of the injectors: Istio's and Linkerd's proxies (plain and native sidecars), Vault's
agent, LeaderWorkerSet's env (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``,
put first in every container), Kueue's gate and JobSet's exclusive placement. Whichever runs
first (the order follows the release name), the pod stored must validate, its added containers
must see no GPU, the GPU containers keep theirs, and what the extender and the agent read must
agree with what the webhook wrote.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import jsonpatch
import pytest
from kubeschema import NEWEST, VERSIONS, assert_valid
from prometheus_client import CollectorRegistry

from webhook import names
from webhook.admission import review
from webhook.admission.mutate import VOLUME_LIMITS, mutate_pod
from webhook.admission.server import AdmissionMetrics, MutateHandler
from webhook.placement.request import admitted, pod_request
from webhook.settings import Settings

SETTINGS = Settings(placement_enabled=False)
CUDA = "nvcr.io/nvidia/pytorch:24.05-py3"
NO_GPUS = {"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS}


class Denied(Exception):
    """A webhook refused the pod (the API server answers the create with its message)."""


class Hook(NamedTuple):
    """One mutating webhook: its configuration's name orders it; ``call`` returns the new pod
    (or the same object when it changes nothing) and its warnings."""

    config: str
    call: Callable[[dict[str, Any]], tuple[dict[str, Any], list[str]]]
    reinvoke: bool = False
    match: Callable[[dict[str, Any]], bool] = lambda pod: True


class Admission(NamedTuple):
    pod: dict[str, Any]
    warnings: list[str]
    calls: list[tuple[int, str]]


def _canonical(quantity: Any) -> Any:
    """A whole decimal quantity as the API server writes it back: 8000 is "8k"."""
    text = str(quantity)
    if not (text.isascii() and text.isdigit()) or int(text) == 0:
        return str(int(text)) if text.isascii() and text.isdigit() else quantity
    value, suffix = int(text), 0
    while value % 1000 == 0 and suffix < 6:
        value, suffix = value // 1000, suffix + 1
    return f"{value}{['', 'k', 'M', 'G', 'T', 'P', 'E'][suffix]}"


def _defaulted(pod: dict[str, Any]) -> dict[str, Any]:
    """The API server's decoding and defaulting of a pod, the parts that matter here: a
    limit without a request gets the same request, quantities are written canonically."""
    for kind in ("initContainers", "containers"):
        for c in pod["spec"].get(kind) or ():
            resources = c.get("resources") or {}
            limits = resources.get("limits")
            if limits:
                requests = c["resources"].setdefault("requests", {})
                for k, v in limits.items():
                    requests.setdefault(k, v)
            for amounts in (resources.get("limits"), resources.get("requests")):
                for k, v in (amounts or {}).items():
                    amounts[k] = _canonical(v)
    return pod


def admit(pod: dict[str, Any], hooks: list[Hook]) -> Admission:
    """The pod as the API server stores it after its mutating webhooks (round 0, then round 1
    for the IfNeeded ones called before a change), with the warnings the client sees."""
    obj = _defaulted(copy.deepcopy(pod))
    ordered = sorted(hooks, key=lambda h: h.config)
    warnings: list[str] = []
    calls: list[tuple[int, str]] = []
    invoked: set[str] = set()   # reinvocable, called before the latest change
    reinvoke: set[str] = set()  # to call in round 1
    for round_ in (0, 1):
        if round_ == 1 and not reinvoke:
            break
        for hook in ordered:
            if not hook.match(obj) or round_ == 1 and hook.config not in reinvoke:
                continue
            calls.append((round_, hook.config))
            new, said = hook.call(copy.deepcopy(obj))
            warnings += [w for w in said if w not in warnings]
            if new != obj:
                obj = _defaulted(new)
                reinvoke |= invoked
                invoked = set()
            if hook.reinvoke:
                invoked.add(hook.config)
    return Admission(obj, warnings, calls)


def gpuslice(settings: Settings = SETTINGS, config: str = "gpuslice") -> Hook:
    """gpuslice's webhook as the chart configures it: its handler's answer, the JSON patch
    applied to the pod as received."""
    handler = MutateHandler(settings, AdmissionMetrics(CollectorRegistry()))

    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        request = {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                   "operation": "CREATE", "namespace": "ml", "object": pod}
        _, response = handler._decide(review.parse_review(json.dumps(
            {"apiVersion": review.API_VERSION, "kind": review.KIND,
             "request": request}).encode()))
        assert isinstance(response.body, bytes)
        answer = json.loads(response.body)["response"]
        if not answer["allowed"]:
            raise Denied(answer["status"]["message"])
        if "patch" not in answer:
            return pod, answer.get("warnings", [])
        patch = json.loads(base64.b64decode(answer["patch"]))
        return jsonpatch.apply_patch(pod, patch), answer.get("warnings", [])
    return Hook(config, call, reinvoke=True)


# ----- the other webhooks, as they change a pod -----

def _proxy(name: str, image: str, *, native: bool) -> dict[str, Any]:
    proxy: dict[str, Any] = {
        "name": name, "image": image, "args": ["proxy", "sidecar"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "ISTIO_META_POD_PORTS", "value": "[]"}],
        "resources": {"limits": {"cpu": "2", "memory": "1Gi"},
                      "requests": {"cpu": "100m", "memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsUser": 1337, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": f"{name}-data", "mountPath": "/var/lib/istio/data"},
                         {"name": f"{name}-podinfo", "mountPath": "/etc/istio/pod"}]}
    if native:
        proxy["restartPolicy"] = "Always"
    return proxy


def _iptables_init(name: str, image: str) -> dict[str, Any]:
    return {"name": name, "image": image, "args": ["istio-iptables", "-p", "15001"],
            "resources": {"limits": {"cpu": "2", "memory": "1Gi"},
                          "requests": {"cpu": "10m", "memory": "40Mi"}},
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                                "capabilities": {"add": ["NET_ADMIN", "NET_RAW"],
                                                 "drop": ["ALL"]}}}


def _mesh(config: str, proxy: str, init: str, status: str, *, native: bool,
          first: bool) -> Hook:
    """A service mesh's injector: an iptables init container and its proxy (appended, or first
    among the containers when the app must wait for it; a native sidecar, an init container
    that keeps running, after the iptables one), its volumes and status annotation. It skips a
    pod carrying its status (injected already)."""
    image = f"docker.io/{config}/proxy:1.22.0"

    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        meta, spec = pod["metadata"], pod["spec"]
        if status in (meta.get("annotations") or {}):
            return pod, []
        inits = spec.setdefault("initContainers", [])
        inits.append(_iptables_init(init, image))
        sidecar = _proxy(proxy, image, native=native)
        if native:
            inits.append(sidecar)
        elif first:
            spec["containers"].insert(0, sidecar)
        else:
            spec["containers"].append(sidecar)
        spec.setdefault("volumes", []).extend([
            {"name": f"{proxy}-data", "emptyDir": {}},
            {"name": f"{proxy}-podinfo", "downwardAPI": {"items": [
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}}])
        meta.setdefault("annotations", {})[status] = json.dumps(
            {"initContainers": [init], "containers": [proxy]})
        meta.setdefault("labels", {})[f"{config}.io/injected"] = "true"
        return pod, []
    return Hook(f"{config}-sidecar-injector", call)


def istio(*, native: bool = False, hold: bool = False) -> Hook:
    return _mesh("istio", "istio-proxy", "istio-init", "sidecar.istio.io/status",
                 native=native, first=hold)


def linkerd(*, native: bool = False) -> Hook:
    # Linkerd puts its proxy first (proxy-await, on by default).
    return _mesh("linkerd", "linkerd-proxy", "linkerd-init", "linkerd.io/proxy-version",
                 native=native, first=True)


def vault() -> Hook:
    """Vault's agent injector: an init agent, a sidecar agent, and the secrets volume mounted
    into every container already there."""
    def agent(name: str) -> dict[str, Any]:
        return {"name": name, "image": "hashicorp/vault:1.16.1", "args": ["agent"],
                "env": [{"name": "VAULT_CONFIG", "value": "e30="}],
                "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}},
                "securityContext": {"runAsUser": 100, "runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "home-" + name.rsplit("-", 1)[-1],
                                  "mountPath": "/home/vault"},
                                 {"name": "vault-secrets", "mountPath": "/vault/secrets"}]}

    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        meta, spec = pod["metadata"], pod["spec"]
        if (meta.get("annotations") or {}).get("vault.hashicorp.com/agent-inject-status"):
            return pod, []
        for kind in ("initContainers", "containers"):
            for c in spec.get(kind) or ():
                c.setdefault("volumeMounts", []).append(
                    {"name": "vault-secrets", "mountPath": "/vault/secrets"})
        spec.setdefault("initContainers", []).append(agent("vault-agent-init"))
        spec["containers"].append(agent("vault-agent"))
        spec.setdefault("volumes", []).extend(
            [{"name": "home-init", "emptyDir": {"medium": "Memory"}},
             {"name": "home-agent", "emptyDir": {"medium": "Memory"}},
             {"name": "vault-secrets", "emptyDir": {"medium": "Memory"}}])
        meta.setdefault("annotations", {})["vault.hashicorp.com/agent-inject-status"] = \
            "injected"
        return pod, []
    return Hook("vault-agent-injector-cfg", call)


LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"


def lws() -> Hook:
    """LeaderWorkerSet's pod webhook (sigs.k8s.io/lws pkg/utils/pod AddLWSVariables): its
    three variables first in every container's env (replacing any of the same name), taken
    from the pod's labels and its size annotation."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        meta, spec = pod["metadata"], pod["spec"]
        labels = meta.get("labels") or {}
        if "leaderworkerset.sigs.k8s.io/name" not in labels:
            return pod, []
        ours = [{"name": "LWS_LEADER_ADDRESS",
                 "value": f"{labels['leaderworkerset.sigs.k8s.io/name']}-0.vllm.ml"},
                {"name": "LWS_GROUP_SIZE", "value": meta["annotations"][LWS_SIZE]},
                {"name": "LWS_WORKER_INDEX",
                 "value": labels["leaderworkerset.sigs.k8s.io/worker-index"]}]
        taken = {e["name"] for e in ours}
        for kind in ("containers", "initContainers"):
            for c in spec.get(kind) or ():
                c["env"] = [*ours, *(e for e in c.get("env") or () if e["name"] not in taken)]
        return pod, []
    return Hook("lws-mutating-webhook-configuration", call)


def kueue() -> Hook:
    """Kueue's pod webhook for a pod in a queue: its admission gate and managed label."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        meta, spec = pod["metadata"], pod["spec"]
        if "kueue.x-k8s.io/queue-name" not in (meta.get("labels") or {}):
            return pod, []
        gate = {"name": "kueue.x-k8s.io/admission"}
        if gate not in spec.get("schedulingGates", []):
            spec.setdefault("schedulingGates", []).append(gate)
        meta["labels"]["kueue.x-k8s.io/managed"] = "true"
        return pod, []
    return Hook("kueue-mutating-webhook-configuration", call)


def jobset() -> Hook:
    """JobSet's pod webhook for exclusive placement: a follower pod gets its leader's
    topology as a node selector; the leader its (anti-)affinity."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        meta, spec = pod["metadata"], pod["spec"]
        annotations = meta.get("annotations") or {}
        key = annotations.get("alpha.jobset.sigs.k8s.io/exclusive-topology")
        if not key:
            return pod, []
        spec.setdefault("nodeSelector", {})[key] = "rack-7"
        return pod, []
    return Hook("jobset-mutating-webhook-configuration", call)


def gpu_sidecar(limits: dict[str, str]) -> Hook:
    """A webhook (rare) adding a sidecar that asks for GPU resources itself."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        if any(c["name"] == "profiler" for c in pod["spec"]["containers"]):
            return pod, []
        pod["spec"]["containers"].append({"name": "profiler", "image": CUDA,
                                          "resources": {"limits": dict(limits)}})
        return pod, []
    return Hook("profiler-injector", call)


# ----- pods -----

def gpu_pod(limits: dict[str, str] | None = None, *, env: list[dict[str, Any]] | None = None,
            labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "vllm-0-1", "namespace": "ml",
                            "labels": {"app": "vllm", **(labels or {})}}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
        "containers": [{"name": "main", "image": CUDA, "env": list(env or []),
                        "resources": {"limits": dict(limits or {
                            "nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000",
                            "nvidia.com/gpucores": "30"})},
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "volumes": [{"name": "data", "emptyDir": {}}]}}


def lws_worker(size: str = "2") -> dict[str, Any]:
    """A worker of a LeaderWorkerSet group of ``size`` pods, as its StatefulSet creates it."""
    return gpu_pod(labels={"leaderworkerset.sigs.k8s.io/name": "vllm",
                           "leaderworkerset.sigs.k8s.io/group-index": "0",
                           "leaderworkerset.sigs.k8s.io/worker-index": "1"},
                   annotations={LWS_SIZE: size})


# ----- what must hold of the pod stored -----

def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _gpu_containers(pod: dict[str, Any]) -> set[str]:
    return {c.name for c in pod_request(pod, SETTINGS).containers}


def check_stored(pod: dict[str, Any], gpu: set[str]) -> None:
    """The pod the API server would store: valid, every container but those in ``gpu`` sees
    no GPU and mounts none of gpuslice's volumes, each of ``gpu`` carries gpuslice's env once
    and its limits file, and a further pass would change nothing."""
    # Native sidecars (restartPolicy) are in the schema from 1.28, scheduling gates from 1.26.
    newer = pod["spec"].get("schedulingGates") or any(
        "restartPolicy" in c for c in pod["spec"].get("initContainers", []))
    assert_valid(pod, (NEWEST,) if newer else VERSIONS)
    # What the schema does not check and the API server's validation does.
    names_ = [c["name"] for c in _containers(pod)]
    assert len(set(names_)) == len(names_), names_
    volumes = [v["name"] for v in pod["spec"].get("volumes", [])]
    assert len(set(volumes)) == len(volumes), volumes
    for c in _containers(pod):
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(set(paths)) == len(paths), (c["name"], paths)
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), c["name"]
    assert admitted(pod)
    assert _gpu_containers(pod) == gpu
    ours = {"gpuslice-lib", "gpuslice-preload", "gpuslice-state", VOLUME_LIMITS}
    annotations = pod["metadata"]["annotations"]
    for c in _containers(pod):
        env = c.get("env", [])
        visible = [e for e in env if e["name"] == names.ENV_VISIBLE_DEVICES]
        mounted = {m["name"] for m in c.get("volumeMounts", [])} & ours
        if c["name"] in gpu:
            key = names.devices_annotation(c["name"])
            assert visible == [{"name": names.ENV_VISIBLE_DEVICES, "valueFrom": {"fieldRef": {
                "apiVersion": "v1", "fieldPath": f"metadata.annotations['{key}']"}}}]
            assert mounted == ours, c["name"]
            assert [e["name"] for e in env].count(names.ENV_POD_UID) == 1
            assert names.limits_annotation(c["name"]) in annotations
        else:
            assert env[0] == NO_GPUS and visible == [NO_GPUS], c["name"]
            assert not mounted, c["name"]
    limits_keys = {k for k in annotations if k.startswith(names.ANN_LIMITS_PREFIX)}
    assert limits_keys == {names.limits_annotation(n) for n in gpu}
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == VOLUME_LIMITS]
    assert sorted((i["path"], i["fieldRef"]["fieldPath"]) for i in volume["downwardAPI"]["items"]) \
        == sorted((n, f"metadata.annotations['{names.limits_annotation(n)}']") for n in gpu)
    again = mutate_pod(pod, SETTINGS, namespace="ml")
    assert again.allowed and again.pod == pod and again.warnings == ()


# ----- the tests -----

INJECTORS = {
    "istio": istio(), "istio-hold": istio(hold=True), "istio-native": istio(native=True),
    "linkerd": linkerd(), "linkerd-native": linkerd(native=True), "vault": vault(),
}
SIDECARS = {"istio": {"istio-init", "istio-proxy"}, "linkerd": {"linkerd-init", "linkerd-proxy"},
            "vault": {"vault-agent-init", "vault-agent"}}


@pytest.mark.parametrize("first", [True, False], ids=["gpuslice-first", "gpuslice-last"])
@pytest.mark.parametrize("injector", list(INJECTORS))
def test_containers_injected_by_another_webhook_see_no_gpu_whichever_runs_first(
        injector: str, first: bool) -> None:
    ours = gpuslice(config="gpuslice" if first else "zz-gpuslice")
    other = INJECTORS[injector]
    done = admit(gpu_pod(), [ours, other])
    # gpuslice first: called again once the injector changed the pod; last: once, after it
    assert done.calls == ([(0, ours.config), (0, other.config), (1, ours.config)] if first
                          else [(0, other.config), (0, ours.config)])
    pod = done.pod
    added = SIDECARS[injector.split("-")[0]]
    assert added <= {c["name"] for c in _containers(pod)}
    check_stored(pod, {"main"})
    assert done.warnings == []


def _rank_warnings(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "one rank of a job spread over pods" in w]


@pytest.mark.parametrize("first", [True, False], ids=["gpuslice-first", "gpuslice-last"])
def test_a_multi_pod_lws_worker_under_gpucores_30_is_warned_whichever_runs_first(
        first: bool) -> None:
    """LWS_GROUP_SIZE is the number of pods of the group: above 1 the worker's ranks are
    spread over pods. With gpuslice's configuration named first (the chart's default release
    name sorts before "lws"), LWS's webhook adds the variable after gpuslice's first pass: the
    reinvocation sees it, and its warning reaches the client like round 0's."""
    ours = gpuslice(config="gpuslice" if first else "zz-gpuslice")
    done = admit(lws_worker("2"), [ours, lws()])
    main = done.pod["spec"]["containers"][0]
    assert {"name": "LWS_GROUP_SIZE", "value": "2"} in main["env"]
    check_stored(done.pod, {"main"})
    (warning,) = _rank_warnings(done.warnings)
    assert 'container "main": gpucores 30 with LWS_GROUP_SIZE=2' in warning


@pytest.mark.parametrize(("size", "limits"), [
    ("1", None),
    ("4", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "50"}),
    ("4", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}),
], ids=["one-pod-group", "cores-50", "no-compute-limit"])
def test_no_lws_warning_where_the_group_is_one_pod_or_the_ranks_need_not_wait(
        size: str, limits: dict[str, str] | None) -> None:
    pod = lws_worker(size)
    if limits:
        pod["spec"]["containers"][0]["resources"]["limits"] = limits
    for config in ("gpuslice", "zz-gpuslice"):
        done = admit(pod, [gpuslice(config=config), lws()])
        check_stored(done.pod, {"main"})
        assert _rank_warnings(done.warnings) == []


def test_world_size_of_the_pod_and_lws_group_size_give_one_warning() -> None:
    """A WORLD_SIZE the pod carries is warned of in round 0; LWS's variables, put first in the
    env after that, do not turn it into a second warning in round 1."""
    pod = lws_worker("2")
    pod["spec"]["containers"][0]["env"] = [{"name": "WORLD_SIZE", "value": "2"}]
    done = admit(pod, [gpuslice(), lws()])
    check_stored(done.pod, {"main"})
    (warning,) = _rank_warnings(done.warnings)
    assert "WORLD_SIZE=2" in warning


def test_every_injector_at_once_with_kueue_jobset_and_lws() -> None:
    """A Kueue-queued LWS worker with JobSet-style exclusive placement, injected by Istio
    (native sidecar) and Vault: gpuslice's second pass leaves the others' work alone (gate,
    labels, selectors, mounts) and gives each added container no GPU."""
    pod = lws_worker("4")
    pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    pod["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] = \
        "topology.kubernetes.io/rack"
    done = admit(pod, [gpuslice(), istio(native=True), vault(), lws(), kueue(), jobset()])
    stored = done.pod
    check_stored(stored, {"main"})
    spec = stored["spec"]
    assert spec["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}]
    assert spec["nodeSelector"] == {SETTINGS.node_label_key: SETTINGS.node_label_value,
                                    "topology.kubernetes.io/rack": "rack-7"}
    assert spec["schedulerName"] == SETTINGS.scheduler_name
    main = spec["containers"][0]
    assert {"name": "vault-secrets", "mountPath": "/vault/secrets"} in main["volumeMounts"]
    assert [e["name"] for e in main["env"] if e["name"].startswith("LWS_")] == [
        "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"]
    assert len(_rank_warnings(done.warnings)) == 1
    assert stored["metadata"]["labels"]["kueue.x-k8s.io/managed"] == "true"


@pytest.mark.parametrize("limits", [
    {"nvidia.com/gpumem": "2000"},
    {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "10"},
], ids=["gpumem-only", "gpu-and-cores"])
def test_a_sidecar_a_later_webhook_gives_gpu_resources_is_made_a_gpu_container(
        limits: dict[str, str]) -> None:
    """Rare: the reinvocation sees the new container's GPU request and gives it the library,
    its caps and its own limits file, as if the pod had come with it."""
    done = admit(gpu_pod(), [gpuslice(), gpu_sidecar(limits)])
    check_stored(done.pod, {"main", "profiler"})
    profiler = done.pod["spec"]["containers"][-1]
    assert profiler["resources"]["limits"]["nvidia.com/gpu"] == limits.get("nvidia.com/gpu", "1")
    request = {c.name: c for c in pod_request(done.pod, SETTINGS).containers}["profiler"]
    assert request.count == 1


def test_a_sidecar_asking_for_zero_gpus_sees_none() -> None:
    done = admit(gpu_pod(), [gpuslice(), gpu_sidecar({"nvidia.com/gpu": "0"})])
    check_stored(done.pod, {"main"})


def limit_raiser(gpumem: str) -> Hook:
    """A policy webhook (Kyverno-style) that raises the GPU memory limit of every container
    asking for some: it runs after gpuslice, whose reinvocation sees the pod it mutated."""
    def call(pod: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        changed = False
        for c in pod["spec"]["containers"]:
            resources = c.get("resources") or {}
            limits = resources.get("limits") or {}
            if "nvidia.com/gpumem" in limits and limits["nvidia.com/gpumem"] != gpumem:
                limits["nvidia.com/gpumem"] = gpumem  # and the request, which must equal it
                resources.setdefault("requests", {})["nvidia.com/gpumem"] = gpumem
                changed = True
        return pod, ["gpumem raised by policy"] if changed else []
    return Hook("zz-gpu-policy", call)


def test_a_later_webhook_raising_the_limits_gets_the_new_caps_and_no_warning_of_our_own_env(
        ) -> None:
    # the reinvocation replaced the env and limits file its first pass wrote, and warned of
    # them as a user's ("env CUDA_DEVICE_MEMORY_LIMIT is managed by gpuslice; the value in the
    # pod was replaced"), which the user never wrote
    done = admit(gpu_pod(), [gpuslice(), limit_raiser("16000")])
    check_stored(done.pod, {"main"})
    main = done.pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env[names.ENV_MEMORY_LIMIT] == "16000m"
    limits = done.pod["metadata"]["annotations"][names.limits_annotation("main")]
    assert f"{names.ENV_MEMORY_LIMIT}=16000m" in limits.splitlines()
    assert not [w for w in done.warnings if "managed by gpuslice" in w], done.warnings


def test_a_users_own_value_of_our_env_is_still_warned_of_on_reinvocation() -> None:
    user = [{"name": names.ENV_MEMORY_LIMIT, "value": "99000m"}]
    done = admit(gpu_pod(env=user), [gpuslice(), limit_raiser("16000")])
    assert [w for w in done.warnings if names.ENV_MEMORY_LIMIT in w and "replaced" in w]
