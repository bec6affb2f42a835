"""The contracts end to end: what a pod asks, what the extender accounts, what the interposer
enforces, across many pod shapes.

For each shape the pods go the whole way a cluster takes them:

1. the webhook's ``POST /mutate`` (an AdmissionReview, its JSON patch applied as the API server
   applies it), with the largest GPU the extender knows, as the service wires it;
2. the extender's ``filter``, ``prioritize`` and ``bind`` over HTTP against the fake API server
   (tests/fakekube.py), on two nodes whose GPUs differ in size and are partly used by other pods
   placed the same way before; the node the scheduler takes is the best scored; the device
   annotations come from the pod as the Binding left it;
3. kubelet and the NVIDIA container runtime, emulated: every env entry resolved (values with
   ``$(VAR)``, downward-API ``fieldRef``s to the pod's annotations and identity,
   ``resourceFieldRef``), the downwardAPI volume's files written, the hostPath state dir and
   its ``subPathExpr`` made, and ``NVIDIA_VISIBLE_DEVICES`` (GPU UUIDs) turned into the GPUs the
   fake driver shows the container (only those, in that order: ``FAKE_CUDA_DEVICES``). The
   container's paths (the limits file, the region) are mapped to the test's directories
   through its mounts;
4. the real interposer (release build) on the fake driver, in that environment: each visible
   device's cap (``cuMemGetInfo``, ``cuDeviceTotalMem``, NVML), an allocation past it, the
   compute limit and the GPUs in the region.

Then, per GPU, the budgets of every container placed on it (init containers as the phases they
run in) must add up to what the extender accounted there, to the byte, and fit the GPU; and
each container's cap must be what its pod asked.

Like the agent, the node annotation publishes NVML's total (``memoryMiB``), which the fake
driver's NVML reports 615 MiB above CUDA's, as an H200's does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from aiohttp import web
from fakekube import FakeKube
from prometheus_client import CollectorRegistry

from webhook import names
from webhook.admission.quantity import parse_quantity
from webhook.admission.server import AdmissionMetrics, MutateHandler
from webhook.node.audit import cap_from, cores_from
from webhook.node.region import Region, read_region
from webhook.placement.extender import PLACEMENT_KEY, setup
from webhook.placement.inventory import Gpu, inventory_json
from webhook.placement.placer import Placer
from webhook.settings import Settings

from .conftest import BUILD, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, charge, parse

MIB = 1 << 20
NVML_EXTRA_MIB = 615
"""NVML's total above CUDA's (an H200: 143,771 against 143,156 MiB)."""


def _uuid(label: str) -> str:
    return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, label)}"


# name -> [(uuid, CUDA's total in bytes)], in NVML order; one total is no whole number of MiB
NODES: dict[str, list[tuple[str, int]]] = {
    "node-a": [(_uuid("a16"), 16384 * MIB), (_uuid("a24"), 24576 * MIB),
               (_uuid("a40"), 40960 * MIB), (_uuid("a80"), 81920 * MIB)],
    "node-b": [(_uuid("b24"), 24576 * MIB + 700 * 1024), (_uuid("b48"), 49152 * MIB)],
}
PRODUCTS = {"node-a": "NVIDIA H200", "node-b": "NVIDIA L40S"}
CUDA_BYTES = {u: b for gpus in NODES.values() for u, b in gpus}
NVML_BYTES = {u: b + NVML_EXTRA_MIB * MIB for u, b in CUDA_BYTES.items()}
NVML_MIB = {u: b // MIB for u, b in NVML_BYTES.items()}
A16, A24, A40, A80 = (u for u, _ in NODES["node-a"])
B24, B48 = (u for u, _ in NODES["node-b"])


# ----- what the pods ask -----------------------------------------------------------------

@dataclass(frozen=True)
class Want:
    """What one container asked for, per GPU, written independently of the code under test."""

    count: int = 1
    mib: int | None = None
    pct: int | None = None
    """% of each GPU's memory (NVML's total, as published); None with ``mib``."""
    cores: int | None = None
    """% of compute; None = not limited. 100 = exclusive."""
    kind: str = "app"
    """app, init (runs before the app containers) or sidecar (init with restartPolicy Always)."""


def pod(name: str, containers: list[tuple[str, dict[str, Any]]], *,
        init: list[tuple[str, dict[str, Any]]] | None = None,
        annotations: dict[str, str] | None = None, sidecars: tuple[str, ...] = ()
        ) -> dict[str, Any]:
    """A user's pod: ``containers`` and ``init`` as (name, limits)."""
    def make(cname: str, limits: dict[str, Any]) -> dict[str, Any]:
        c: dict[str, Any] = {"name": cname, "image": "nvcr.io/nvidia/pytorch:24.08-py3"}
        if limits:
            c["resources"] = {"limits": limits}
        if cname in sidecars:
            c["restartPolicy"] = "Always"
        return c
    spec: dict[str, Any] = {"containers": [make(n, lim) for n, lim in containers]}
    if init:
        spec["initContainers"] = [make(n, lim) for n, lim in init]
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


GPU, MEM, PCT, CORES = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage",
                        "nvidia.com/gpucores")
LONG_NAME = "a-container-name-of-sixty-three-characters-for-the-hashed-keys0"
assert len(LONG_NAME) == 63


@dataclass(frozen=True)
class Shape:
    """Pods created in order (each mutated, placed and bound before the next), and what each
    of their GPU containers asked, by (pod, container)."""

    pods: tuple[dict[str, Any], ...]
    wants: dict[tuple[str, str], Want]
    pinned: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    """GPUs a container must get (its pod's UUID annotations name them)."""
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    """ConfigMaps the pods' ``envFrom`` names."""
    nodes: dict[str, str] = field(default_factory=dict)
    """The node a pod must land on (its GPU type annotations choose it)."""


# Other tenants, placed first in every shape: the GPUs are partly used when the pod comes.
RESIDENTS = (
    pod("resident-mib", [("main", {MEM: "10000", CORES: "50"})]),
    pod("resident-pct", [("main", {PCT: "25"})]),
    pod("resident-b", [("main", {GPU: "1", MEM: "20000"})],
        annotations={"gpuslice.io/gpu-uuid": B48}),
    pod("resident-a", [("main", {PCT: "40", CORES: "30"})],
        annotations={"gpuslice.io/gpu-uuid": A80}),
)
RESIDENT_WANTS = {("resident-mib", "main"): Want(mib=10000, cores=50),
                  ("resident-pct", "main"): Want(pct=25),
                  ("resident-b", "main"): Want(mib=20000),
                  ("resident-a", "main"): Want(pct=40, cores=30)}


def shape(*pods: dict[str, Any], wants: dict[tuple[str, str], Want],
          pinned: dict[tuple[str, str], tuple[str, ...]] | None = None,
          config_maps: dict[str, dict[str, str]] | None = None,
          nodes: dict[str, str] | None = None) -> Shape:
    return Shape((*RESIDENTS, *pods), {**RESIDENT_WANTS, **wants},
                 {("resident-b", "main"): (B48,), ("resident-a", "main"): (A80,),
                  **(pinned or {})}, config_maps or {}, nodes or {})


def tenant(p: dict[str, Any], env: list[dict[str, Any]], config_map: str) -> dict[str, Any]:
    """``p`` whose first container sets ``env`` and takes a ConfigMap's keys (``envFrom``)."""
    p["spec"]["containers"][0]["env"] = env
    p["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": config_map}}]
    return p


SHAPES: dict[str, Shape] = {
    "gpumem-mib-with-cores": shape(
        pod("p", [("main", {MEM: "3000", CORES: "25"})]),
        wants={("p", "main"): Want(mib=3000, cores=25)}),
    "gpumem-percentage": shape(
        pod("p", [("main", {PCT: "33"})]),
        wants={("p", "main"): Want(pct=33)}),
    "gpu-2-with-gpumem-per-gpu": shape(
        pod("p", [("main", {GPU: "2", MEM: "6000", CORES: "30"})]),
        wants={("p", "main"): Want(count=2, mib=6000, cores=30)}),
    "gpu-4-with-gpumem-per-gpu": shape(
        pod("p", [("main", {GPU: "4", MEM: "2000"})]),
        wants={("p", "main"): Want(count=4, mib=2000)}),
    "gpu-2-with-percentage-on-gpus-of-different-sizes": shape(
        pod("p", [("main", {GPU: "2", PCT: "33", CORES: "10"})],
            annotations={"gpuslice.io/gpu-uuid": f"{A16},{A80}"}),
        wants={("p", "main"): Want(count=2, pct=33, cores=10)},
        pinned={("p", "main"): (A16, A80)}),
    "gpucores-only": shape(
        pod("p", [("main", {CORES: "40"})]),
        wants={("p", "main"): Want(pct=100, cores=40)}),
    "whole-gpu": shape(
        pod("p", [("main", {GPU: "1"})]),
        wants={("p", "main"): Want(pct=100, cores=100)}),
    "two-whole-gpus": shape(
        pod("p", [("main", {GPU: "2"})]),
        wants={("p", "main"): Want(count=2, pct=100, cores=100)}),
    "exclusive-with-gpumem": shape(
        pod("p", [("main", {GPU: "1", MEM: "7000", CORES: "100"})]),
        wants={("p", "main"): Want(mib=7000, cores=100)}),
    "two-gpu-containers-and-one-without": shape(
        pod("p", [("train", {MEM: "4000", CORES: "20"}), ("infer", {PCT: "10", CORES: "20"}),
                  ("logs", {"cpu": "100m"})]),
        wants={("p", "train"): Want(mib=4000, cores=20), ("p", "infer"): Want(pct=10, cores=20)}),
    "init-container-with-a-gpu": shape(
        pod("p", [("main", {MEM: "2000"})], init=[("prep", {MEM: "8000", CORES: "60"})]),
        wants={("p", "main"): Want(mib=2000), ("p", "prep"): Want(mib=8000, cores=60,
                                                                 kind="init")}),
    "sidecar-then-init-container-with-gpus": shape(
        pod("p", [("main", {MEM: "2000", CORES: "20"})],
            init=[("setup", {}), ("side", {MEM: "1000", CORES: "10"}),
                  ("prep", {MEM: "9000", CORES: "50"})], sidecars=("side",)),
        wants={("p", "main"): Want(mib=2000, cores=20),
               ("p", "side"): Want(mib=1000, cores=10, kind="sidecar"),
               ("p", "prep"): Want(mib=9000, cores=50, kind="init")}),
    "sidecar-with-a-gpu": shape(
        pod("p", [("main", {PCT: "20"})], init=[("side", {MEM: "1000", CORES: "10"})],
            sidecars=("side",)),
        wants={("p", "main"): Want(pct=20), ("p", "side"): Want(mib=1000, cores=10,
                                                               kind="sidecar")}),
    "quantity-forms": shape(
        pod("p", [("main", {GPU: "2e0", MEM: "1k", CORES: 15})]),
        pod("q", [("main", {PCT: "5e1"})]),
        pod("r", [("main", {MEM: 4096})]),
        wants={("p", "main"): Want(count=2, mib=1000, cores=15), ("q", "main"): Want(pct=50),
               ("r", "main"): Want(mib=4096)}),
    "hami-annotations": shape(
        pod("p", [("main", {MEM: "5000"})],
            annotations={"nvidia.com/use-gpuuuid": A40, "hami.io/gpu-scheduler-policy": "spread"}),
        wants={("p", "main"): Want(mib=5000)},
        pinned={("p", "main"): (A40,)}),
    # a tenant's own limit env (dropped by the webhook) and envFrom (which it cannot strip)
    "tenant-env-and-envfrom": shape(
        tenant(pod("p", [("main", {MEM: "3000", CORES: "30"})]), [
            {"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "80g"},
            {"name": "CUDA_DEVICE_SM_LIMIT", "value": "0"},
            {"name": "GPUSLICE_MEMORY_PERCENT", "value": "100"},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "MY_REGION", "value": "$(CUDA_DEVICE_MEMORY_SHARED_CACHE)"}], "lift"),
        wants={("p", "main"): Want(mib=3000, cores=30)},
        config_maps={"lift": {"CUDA_DEVICE_MEMORY_LIMIT_0": "80g", "CUDA_DEVICE_SM_LIMIT_0": "0",
                              "GPUSLICE_MEMORY_PERCENT": "100",
                              "CUDA_DEVICE_MEMORY_LIMIT": "80g"}}),
    "gpu-type-annotations": shape(
        pod("p", [("main", {PCT: "30", CORES: "30"})],
            annotations={"nvidia.com/use-gputype": "l40s"}),
        pod("q", [("main", {MEM: "12000"})],
            annotations={"gpuslice.io/avoid-gpu-type": "H200", "gpuslice.io/placement": "spread"}),
        wants={("p", "main"): Want(pct=30, cores=30), ("q", "main"): Want(mib=12000)},
        nodes={"p": "node-b", "q": "node-b"}),
    "long-container-name": shape(
        pod("p", [(LONG_NAME, {PCT: "15", CORES: "5"})]),
        wants={("p", LONG_NAME): Want(pct=15, cores=5)}),
    # Two pods that fill one GPU exactly as the extender counts it: a percentage and the MiB
    # left beside it.
    "percentage-and-mib-filling-one-gpu": shape(
        pod("p", [("main", {PCT: "33"})], annotations={"gpuslice.io/gpu-uuid": A24}),
        pod("q", [("main", {MEM: str(NVML_MIB[A24] - NVML_MIB[A24] * 33 // 100)})],
            annotations={"gpuslice.io/gpu-uuid": A24}),
        wants={("p", "main"): Want(pct=33),
               ("q", "main"): Want(mib=NVML_MIB[A24] - NVML_MIB[A24] * 33 // 100)},
        pinned={("p", "main"): (A24,), ("q", "main"): (A24,)}),
}


# ----- the webhook and the extender, as the service wires them -----------------------------

class Cluster:
    """The fake API server with the nodes, and the service's mutate and extender routes."""

    def __init__(self, kube: FakeKube, http: Any) -> None:
        self.kube, self.http = kube, http

    @property
    def placer(self) -> Placer:
        return self.http.app[PLACEMENT_KEY]

    async def post(self, path: str, body: Any) -> Any:
        resp = await self.http.post(path, json=body)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """The API server's CREATE: the webhook's patch applied, then stored (a UID given)."""
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuidlib.uuid4()), "operation": "CREATE", "namespace": "ml",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": manifest}}
        answer = (await self.post("/mutate", review))["response"]
        assert answer["allowed"], answer
        patch = json.loads(base64.b64decode(answer["patch"]))
        mutated = jsonpatch.apply_patch(manifest, patch)
        for c in (*mutated["spec"].get("initContainers", ()), *mutated["spec"]["containers"]):
            resources = c.get("resources") or {}
            if resources.get("limits"):  # defaulting: a limit without a request sets it
                resources["requests"] = {**resources["limits"], **resources.get("requests", {})}
        return self.kube.put(mutated)

    async def schedule(self, created: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """kube-scheduler with the extender: filter, prioritize, the best node, bind."""
        nodes = list(NODES)
        filtered = await self.post("/scheduler/filter", {"Pod": created, "NodeNames": nodes})
        assert filtered["Error"] == "" and filtered["NodeNames"], filtered
        scores = await self.post("/scheduler/prioritize",
                                 {"Pod": created, "NodeNames": filtered["NodeNames"]})
        best = max(scores, key=lambda s: s["Score"])["Host"]  # the first of the best
        meta = created["metadata"]
        bound = await self.post("/scheduler/bind", {
            "PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
            "Node": best})
        assert bound["Error"] == "", bound
        # the watch confirms the allocation, as for any pod the extender sees bound
        uid = meta["uid"]
        for _ in range(500):
            alloc = self.placer.state.allocs.get(uid)
            if alloc is not None and not alloc.assumed:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the watch never confirmed {meta['name']}")
        stored = self.kube.get("pods", meta["name"], meta["namespace"])
        assert stored is not None and stored["spec"]["nodeName"] == best
        return best, stored


async def start_cluster(kube: FakeKube, aiohttp_client: Any) -> tuple[Cluster, Any]:
    for name, gpus in NODES.items():
        if kube.get("nodes", name) is not None:
            continue
        inventory = [Gpu(u, i, PRODUCTS[name], NVML_MIB[u], True)
                     for i, (u, _) in enumerate(gpus)]
        kube.put({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": name, "labels": {"gpu": "on"},
                               "annotations": {names.ANN_NODE_GPUS: inventory_json(inventory)}},
                  "spec": {}, "status": {}})
    settings = Settings(kube_enabled=True)
    api = kube.api_client()
    app = web.Application()
    placer = setup(app, settings, api_client=api)
    app.router.add_post("/mutate", MutateHandler(settings, AdmissionMetrics(CollectorRegistry()),
                                                 placer.largest_gpu_memory_mib).handle)
    http = await aiohttp_client(app)
    assert placer.sync is not None
    await asyncio.wait_for(placer.sync.ready.wait(), 5)
    return Cluster(kube, http), api


# ----- kubelet and the NVIDIA container runtime ---------------------------------------------

_ANNOTATION_PATH = re.compile(r"^metadata\.(annotations|labels)\['(.+)'\]$")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names replaced, ``$$`` an escaped ``$``,
    anything else left as written."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(one, text)


def field_value(p: dict[str, Any], path: str) -> str:
    """A downward-API ``fieldRef`` as kubelet resolves it (a missing annotation: empty)."""
    meta = p["metadata"]
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": p["spec"].get("nodeName"),
              "spec.serviceAccountName": p["spec"].get("serviceAccountName")}
    if path in simple:
        return str(simple[path] or "")
    m = _ANNOTATION_PATH.match(path)
    assert m is not None, f"kubelet refuses fieldPath {path!r}"
    return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))


def resource_value(container: dict[str, Any], ref: dict[str, Any]) -> str:
    where, _, name = ref["resource"].partition(".")
    amounts = (container.get("resources") or {}).get(where) or {}
    value = parse_quantity(amounts.get(name, "0")) / parse_quantity(ref.get("divisor", "1"))
    return str(-(-value.numerator // value.denominator))  # kubelet rounds up


def container_env(p: dict[str, Any], container: dict[str, Any],
                  config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The env as kubelet makes it: ``envFrom`` first, then ``env`` in order (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or ():
        data = config_maps[source["configMapRef"]["name"]]
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for entry in container.get("env") or ():
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = field_value(p, entry["valueFrom"]["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = resource_value(container, entry["valueFrom"]["resourceFieldRef"])
        else:
            raise AssertionError(f"env entry kubelet would need more for: {entry}")
    return env


@dataclass
class Started:
    """One container as the node starts it."""

    pod: dict[str, Any]
    name: str
    kind: str
    env: dict[str, str]
    """The process's environment as the runtime gives it (paths mapped to the test's)."""
    devices: list[str]
    """The GPUs the runtime shows it, in order."""
    region_path: Path


def start_container(root: Path, p: dict[str, Any], container: dict[str, Any], kind: str,
                    config_maps: dict[str, dict[str, str]]) -> Started:
    """What kubelet and the NVIDIA runtime make of one container of a bound pod."""
    env = container_env(p, container, config_maps)
    volumes = {v["name"]: v for v in p["spec"].get("volumes") or ()}
    uid = p["metadata"]["uid"]
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts") or ():
        volume = volumes[m["name"]]
        if "hostPath" in volume:
            host = volume["hostPath"]["path"]
            if host.startswith(names.HOST_LIBRARY_DIR):
                continue  # the library and its preload file: LD_PRELOAD below
            base = root / "host" / host.lstrip("/")
            assert volume["hostPath"].get("type") == "DirectoryOrCreate"
            base.mkdir(parents=True, exist_ok=True)
        elif "downwardAPI" in volume:
            base = root / "pods" / uid / "volumes" / m["name"]
            for item in volume["downwardAPI"]["items"]:
                path = base / item["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(field_value(p, item["fieldRef"]["fieldPath"]))
                path.chmod(volume["downwardAPI"].get("defaultMode", 0o644))
        else:
            raise AssertionError(f"volume kind not emulated: {volume}")
        sub = m.get("subPath") or expand(m.get("subPathExpr", ""), env)
        assert "$(" not in sub, f"subPathExpr {m.get('subPathExpr')} left unresolved"
        target = base / sub if sub else base
        if sub and "hostPath" in volume:
            target.mkdir(parents=True, exist_ok=True)  # kubelet makes a subPath's directory
        mounts[m["mountPath"]] = target

    def host_path(path: str) -> str:
        for mount in sorted(mounts, key=len, reverse=True):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(mounts[mount]) + path[len(mount):]
        raise AssertionError(f"{path} is on no mount of the container")

    limits_file = mounts[names.LIMITS_FILE]
    lines = []
    for line in limits_file.read_text().splitlines():
        key, _, value = line.partition("=")
        lines.append(f"{key}={host_path(value) if key == names.ENV_SHARED_CACHE else value}")
    mapped = root / "pods" / uid / f"limits-{container['name']}"
    mapped.write_text("".join(f"{line}\n" for line in lines))
    env[names.ENV_SHARED_CACHE] = host_path(env[names.ENV_SHARED_CACHE])
    env["GPUSLICE_LIMITS_FILE"] = str(mapped)  # the library's /etc/gpuslice/limits
    visible = env[names.ENV_VISIBLE_DEVICES]
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    assert devices and all(d in CUDA_BYTES for d in devices), f"the runtime cannot give {visible!r}"
    env["FAKE_CUDA_DEVICES"] = ",".join(f"{d}={CUDA_BYTES[d]}" for d in devices)
    env["FAKE_NVML_TOTAL_EXTRA"] = f"{NVML_EXTRA_MIB}m"
    return Started(p, container["name"], kind, env, devices,
                   Path(host_path(names.REGION_FILE)))


@dataclass
class Seen:
    """What the interposer showed and enforced in one container."""

    started: Started
    meminfo: list[tuple[int, int]]
    """Per CUDA ordinal: (cuMemGetInfo total, cuDeviceTotalMem)."""
    nvml: list[int]
    over_cap: list[int | None]
    """Per device: the result of an allocation 2 MiB past what fits (None: not tried)."""
    region: Region
    stderr: str


def run_container(started: Started) -> Seen:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("CUDA_", "GPUSLICE_", "FAKE_", "LIBCUDA_", "LD_", "NVIDIA_"))}
    env = {**base, **started.env, "LD_PRELOAD": str(BUILD / "libgpuslice.so"),
           "LD_LIBRARY_PATH": str(BUILD / "fake"), "LIBCUDA_LOG_LEVEL": "1"}
    cmds = ["init"]
    for i, _ in enumerate(started.devices):
        cmds += ["ctx", str(i), "meminfo", "totalmem", str(i), "nvml", str(i)]
    probe = subprocess.run([str(BUILD / "tests" / "gsprobe"), *cmds], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert probe.returncode == 0, probe.stderr
    lines = parse(probe.stdout)
    meminfo = [vals[1] for cmd, rc, vals in lines if cmd == "meminfo" and rc == CUDA_SUCCESS]
    totals = [vals[0] for cmd, rc, vals in lines if cmd == "totalmem" and rc == CUDA_SUCCESS]
    nvml = [vals[0] for cmd, rc, vals in lines if cmd == "nvml" and rc == 0]
    assert len(meminfo) == len(totals) == len(nvml) == len(started.devices), probe.stdout
    region = read_region(started.region_path)
    # a process of its own per device: all it may take, then 2 MiB more
    over: list[int | None] = []
    for i, dev in enumerate(region.devices):
        if not 0 < dev.limit_bytes < CUDA_BYTES[started.devices[i]]:
            over.append(None)
            continue
        fits = dev.limit_bytes // (2 * MIB) * 2 * MIB
        assert charge(fits) == fits
        res = subprocess.run([str(BUILD / "tests" / "gsprobe"), "init", "ctx", str(i), "alloc",
                              str(fits), "alloc", "2m"], env=env, capture_output=True,
                             text=True, timeout=60, check=False)
        allocs = [rc for cmd, rc, _ in parse(res.stdout) if cmd == "alloc"]
        assert allocs[:1] == [CUDA_SUCCESS], (res.stdout, res.stderr)
        over.append(allocs[1])
    return Seen(started, list(zip(meminfo, totals, strict=True)), nvml, over, region,
                probe.stderr)


# ----- the test -----------------------------------------------------------------------------

def _gpu_containers(p: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The containers the pod's mutation made GPU containers, with their kind, in spec order."""
    out = []
    for c in p["spec"].get("initContainers") or ():
        if any(e["name"] == names.ENV_POD_UID for e in c.get("env") or ()):
            out.append((c, "sidecar" if c.get("restartPolicy") == "Always" else "init"))
    for c in p["spec"]["containers"]:
        if any(e["name"] == names.ENV_POD_UID for e in c.get("env") or ()):
            out.append((c, "app"))
    return out


def expected_cap(want: Want, gpu: str) -> float:
    """The pod's ask on ``gpu``, in bytes (a percentage as an exact share of the published
    total)."""
    if want.mib is not None:
        return want.mib * MIB
    assert want.pct is not None
    return NVML_MIB[gpu] * MIB * want.pct / 100


def phase_demand(containers: list[tuple[Seen, Want]], value: Any) -> dict[str, int]:
    """A pod's demand per GPU from its containers' ``value(seen, want, device index)``: the app
    containers and sidecars together, each init container beside the sidecars declared before
    it; the largest of these phases."""
    def add(into: dict[str, int], seen: Seen, want: Want) -> None:
        for i, gpu in enumerate(seen.started.devices):
            into[gpu] = into.get(gpu, 0) + value(seen, want, i)
    running: dict[str, int] = {}
    order = {s.started.name: k for k, (s, _) in enumerate(containers)}
    for seen, want in containers:
        if want.kind != "init":
            add(running, seen, want)
    demand = dict(running)
    for seen, want in containers:
        if want.kind == "init":
            phase: dict[str, int] = {}
            for other, w in containers:
                if w.kind == "sidecar" and order[other.started.name] < order[seen.started.name]:
                    add(phase, other, w)
            add(phase, seen, want)
            for gpu, v in phase.items():
                demand[gpu] = max(demand.get(gpu, 0), v)
    return demand


@pytest.mark.parametrize("name", list(SHAPES))
async def test_what_the_pod_asked_is_what_the_extender_counts_and_the_interposer_enforces(
        name: str, built: Path, tmp_path: Path, aiohttp_client: Any) -> None:
    shape_ = SHAPES[name]
    async with FakeKube() as kube:
        cluster, api = await start_cluster(kube, aiohttp_client)
        try:
            placed = []
            for manifest in shape_.pods:
                created = await cluster.create(manifest)
                placed.append(await cluster.schedule(created))
            state = cluster.placer.state
            usage = {n: dict(state.nodes[n].usage) for n in NODES}
            allocs = {p["metadata"]["name"]: state.allocs[p["metadata"]["uid"]]
                      for _, p in placed}
        finally:
            await cluster.http.close()
            await api.close()
        # a restarted extender counts the same from the pods' device annotations
        again, api = await start_cluster(kube, aiohttp_client)
        try:
            assert {n: dict(again.placer.state.nodes[n].usage) for n in NODES} == usage
        finally:
            await again.http.close()
            await api.close()

    seen_by_node: dict[str, list[tuple[str, list[tuple[Seen, Want]]]]] = {n: [] for n in NODES}
    for node, p in placed:
        pname = p["metadata"]["name"]
        assert node == shape_.nodes.get(pname, node)
        annotations = p["metadata"]["annotations"]
        containers = _gpu_containers(p)
        assert {(pname, c["name"]) for c, _ in containers} == \
            {k for k in shape_.wants if k[0] == pname}
        for c in p["spec"].get("initContainers", []) + p["spec"]["containers"]:
            if all(c is not g for g, _ in containers):  # no GPU: none, whatever the image says
                assert {"name": names.ENV_VISIBLE_DEVICES, "value": names.NO_GPUS} in c["env"]
        pod_seen = []
        for c, kind in containers:
            want = shape_.wants[(pname, c["name"])]
            assert kind == want.kind
            started = start_container(tmp_path, p, c, kind, shape_.config_maps)
            if "MY_REGION" in started.env:  # a tenant's $(VAR) of ours resolves
                assert started.env["MY_REGION"] == names.REGION_FILE
            # the GPUs are those bind chose, one per slice, distinct, as the pod asked
            chosen = annotations[names.devices_annotation(c["name"])].split(",")
            assert started.devices == chosen
            assert len(set(chosen)) == want.count == len(chosen)
            assert set(chosen) <= {u for u, _ in NODES[node]}
            if (pname, c["name"]) in shape_.pinned:
                assert sorted(chosen) == sorted(shape_.pinned[(pname, c["name"])])
            assert tuple(chosen) == allocs[pname].assignment[c["name"]]
            seen = run_container(started)
            assert " error:" not in seen.stderr, seen.stderr
            region = seen.region
            assert (region.pod_uid, region.pod_name, region.namespace, region.container) == (
                p["metadata"]["uid"], pname, "ml", c["name"])
            assert [d.uuid for d in region.devices] == chosen
            req = next(r for r in allocs[pname].request.containers if r.name == c["name"])
            # the agent's outside check reads the cap from the pod's limits annotation
            limits = dict(line.split("=", 1) for line in
                          annotations[names.limits_annotation(c["name"])].splitlines())
            agent_cap = cap_from(limits)
            assert agent_cap is not None
            for i, gpu in enumerate(chosen):
                cap = region.devices[i].limit_bytes
                where = f"{pname}/{c['name']} on {gpu} ({NVML_MIB[gpu]} MiB)"
                # what the extender accounted for it
                assert cap == req.memory_on(NVML_MIB[gpu]) * MIB, (
                    f"{where}: the interposer caps at {cap} bytes "
                    f"({cap / MIB:.2f} MiB), the extender counts "
                    f"{req.memory_on(NVML_MIB[gpu])} MiB")
                # what the pod asked (a percentage's share within a MiB)
                assert 0 <= expected_cap(want, gpu) - cap < MIB, (where, cap)
                # what the agent's outside check holds it to
                assert agent_cap.on(NVML_BYTES[gpu]) == cap, (where, agent_cap)
                assert (cores_from(limits) or 0) == region.devices[i].sm_limit, where
                # what the container is told
                assert seen.meminfo[i] == (min(cap, CUDA_BYTES[gpu]),) * 2, where
                assert seen.nvml[i] == min(cap, NVML_BYTES[gpu]), where
                if seen.over_cap[i] is not None:
                    assert seen.over_cap[i] == CUDA_ERROR_OUT_OF_MEMORY, where
                # compute: the region's limit, what the extender reserved
                cores = want.cores if want.cores is not None else 0
                assert region.devices[i].sm_limit == (0 if cores >= 100 else cores), where
                assert req.cores == cores and req.exclusive == (cores >= 100), where
            pod_seen.append((seen, want))
        seen_by_node[node].append((pname, pod_seen))

    # per GPU: the budgets of everything placed on it, as the extender accounted them, fit it
    for node, pods in seen_by_node.items():
        mem: dict[str, int] = {}
        cores: dict[str, int] = {}
        exclusive: dict[str, int] = {}
        for _, containers in pods:
            for gpu, v in phase_demand(
                    containers, lambda s, _, i: s.region.devices[i].limit_bytes).items():
                mem[gpu] = mem.get(gpu, 0) + v
            for gpu, v in phase_demand(containers, lambda _, w, i: w.cores or 0).items():
                cores[gpu] = cores.get(gpu, 0) + v
                exclusive[gpu] = exclusive.get(gpu, 0) + (v >= 100)
        assert set(mem) == set(usage[node]), (node, mem, usage[node])
        for gpu, budget in mem.items():
            accounted = usage[node][gpu]
            assert budget == accounted.mem * MIB, (
                f"{node} {gpu}: the containers' caps add up to {budget} bytes "
                f"({budget / MIB:.2f} MiB), the extender accounted {accounted.mem} MiB")
            assert budget <= NVML_MIB[gpu] * MIB, (gpu, budget)
            assert cores[gpu] == accounted.cores <= 100, (gpu, cores[gpu], accounted)
            if exclusive[gpu]:
                assert accounted.slices == 1, (gpu, accounted)
