"""The extender's HTTP verbs, with golden JSON (tests/placement/golden/*.json).

Each golden file holds the request kube-scheduler sends and the exact answer expected, run
against the small cluster in golden/cluster.json loaded into the placement state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from webhook.placement.extender import PLACEMENT_KEY, setup
from webhook.placement.state import ClusterState
from webhook.settings import Settings

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.stem for p in GOLDEN.glob("*.json") if p.stem != "cluster")


def cluster_state(settings: Settings) -> ClusterState:
    cluster = json.loads((GOLDEN / "cluster.json").read_text())
    state = ClusterState(settings)
    state.replace_nodes(cluster["nodes"])
    state.replace_pods(cluster["pods"], listed_at=0.0)
    return state


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    settings = Settings()
    app = web.Application()
    setup(app, settings, state=cluster_state(settings))
    return await aiohttp_client(app)


@pytest.mark.parametrize("name", CASES)
async def test_golden_exchange(client: Any, name: str) -> None:
    case = json.loads((GOLDEN / f"{name}.json").read_text())
    resp = await client.post(case["path"], json=case["request"])
    assert resp.status == case["status"]
    assert resp.content_type == "application/json"
    assert await resp.json() == case["response"]


def _args(pod: Any = None, **fields: Any) -> bytes:
    """ExtenderArgs for one GPU container (or ``pod``), on node gpu-a unless ``fields`` say."""
    pod = pod if pod is not None else {
        "metadata": {"name": "p", "uid": "u", "annotations": {"gpuslice.io/mutated": "0.1.0"}},
        "spec": {"containers": [{"name": "c", "resources": {
            "limits": {"nvidia.com/gpumem": "1000"}}}]}}
    return json.dumps({"Pod": pod} | (fields or {"NodeNames": ["gpu-a"]})).encode()


def _pod(metadata: Any = None, spec: Any = None) -> dict[str, Any]:
    return {"metadata": {} if metadata is None else metadata,
            "spec": {"containers": []} if spec is None else spec}


_BIND = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}


@pytest.mark.parametrize("path,body,message", [
    ("/scheduler/filter", b"{not json", "not valid JSON"),
    ("/scheduler/filter", b"[]", "ExtenderArgs must be a JSON object"),
    ("/scheduler/filter", b'{"NodeNames": ["a"]}', "ExtenderArgs.Pod must be a Pod object"),
    ("/scheduler/filter", b'{"Pod": {"metadata": {}, "spec": {}}, "NodeNames": "a"}',
     "NodeNames must be a list of strings"),
    ("/scheduler/prioritize", b'{"Pod": {"metadata": {}}}', "Pod.spec must be an object"),
    ("/scheduler/bind", b'{"PodName": "p", "PodNamespace": "ns", "Node": "n"}',
     "ExtenderBindingArgs.PodUID must be a non-empty string"),
    # Nodes (without nodeCacheCapable) whose items are not Node objects.
    ("/scheduler/filter", _args(Nodes={"items": ["gpu-a"]}),
     "Nodes.items[0] must be a Node object with a metadata.name string"),
    ("/scheduler/filter", _args(Nodes={"items": [{"metadata": "gpu-a"}]}),
     "Nodes.items[0] must be a Node object"),
    ("/scheduler/prioritize", _args(Nodes={"items": [{"metadata": {"name": "a"}}, 3]}),
     "Nodes.items[1] must be a Node object"),
    ("/scheduler/prioritize", _args(Nodes={"items": [{"metadata": {"name": 7}}]}),
     "Nodes.items[0] must be a Node object with a metadata.name string"),
    # A Pod whose containers, annotations or identity have the wrong types.
    ("/scheduler/filter", _args(_pod(spec={"containers": {"c": {}}})),
     "ExtenderArgs.Pod.spec.containers must be a list"),
    ("/scheduler/filter", _args(_pod(spec={"containers": ["c"]})),
     "ExtenderArgs.Pod.spec.containers[0] must be an object with a string name"),
    ("/scheduler/filter", _args(_pod(spec={"initContainers": [{"restartPolicy": "Always"}]})),
     "ExtenderArgs.Pod.spec.initContainers[0] must be an object with a string name"),
    ("/scheduler/prioritize", _args(_pod(spec={"containers": "abc"})),
     "ExtenderArgs.Pod.spec.containers must be a list"),
    ("/scheduler/prioritize", _args(_pod(spec={"initContainers": [None]})),
     "ExtenderArgs.Pod.spec.initContainers[0] must be an object"),
    ("/scheduler/filter", _args(_pod({"annotations": "gpu"})),
     "ExtenderArgs.Pod.metadata.annotations must be an object"),
    ("/scheduler/prioritize", _args(_pod({"annotations": ["gpuslice.io/mutated"]})),
     "ExtenderArgs.Pod.metadata.annotations must be an object"),
    ("/scheduler/filter", _args(_pod({"annotations": {"gpuslice.io/placement": 5}})),
     "ExtenderArgs.Pod.metadata.annotations values must be strings"),
    ("/scheduler/filter", _args(_pod({"uid": ["u"]})),
     "ExtenderArgs.Pod.metadata.uid must be a string"),
    ("/scheduler/prioritize", _args(_pod({"namespace": 1})),
     "ExtenderArgs.Pod.metadata.namespace must be a string"),
    # Bind args that are not ExtenderBindingArgs.
    ("/scheduler/bind", b"[]", "ExtenderBindingArgs must be a JSON object"),
    ("/scheduler/bind", json.dumps(_BIND | {"PodUID": 5}).encode(),
     "ExtenderBindingArgs.PodUID must be a non-empty string"),
    ("/scheduler/bind", json.dumps(_BIND | {"Node": ""}).encode(),
     "ExtenderBindingArgs.Node must be a non-empty string"),
    ("/scheduler/bind", json.dumps(_BIND | {"PodName": {"name": "p"}}).encode(),
     "ExtenderBindingArgs.PodName must be a non-empty string"),
])
async def test_malformed_extender_request_gets_400(client: Any, path: str, body: bytes,
                                                    message: str) -> None:
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert message in await resp.text()


async def test_get_on_a_verb_is_405(client: Any) -> None:
    resp = await client.get("/scheduler/filter")
    assert resp.status == 405


async def test_placement_object_reports_largest_gpu_and_ready_without_api(client: Any) -> None:
    placer = client.app[PLACEMENT_KEY]
    assert placer.ready() is True
    assert placer.largest_gpu_memory_mib() == 81920


async def test_largest_gpu_memory_is_none_before_any_inventory() -> None:
    app = web.Application()
    setup(app, Settings())
    assert app[PLACEMENT_KEY].largest_gpu_memory_mib() is None


async def test_filter_fails_softly_while_state_is_syncing(aiohttp_client: Any) -> None:
    settings = Settings(kube_enabled=True)
    app = web.Application()
    placer = setup(app, settings)
    app.on_startup.clear()  # no API here: the watches never start, the placer stays unsynced
    app.on_cleanup.clear()
    client = await aiohttp_client(app)
    assert placer.ready() is False
    case = json.loads((GOLDEN / "filter_headline.json").read_text())
    resp = await client.post("/scheduler/filter", json=case["request"])
    body = await resp.json()
    assert resp.status == 200
    assert body["NodeNames"] == [] and "still reading the cluster state" in body["Error"]



async def test_filter_never_answers_from_a_stale_result(client: Any) -> None:
    """Results are reused per request and node version: a change on the node shows at once."""
    case = json.loads((GOLDEN / "filter_headline.json").read_text())
    first = await (await client.post("/scheduler/filter", json=case["request"])).json()
    assert "gpu-a" in first["NodeNames"]
    state = client.app[PLACEMENT_KEY].state
    other = {"metadata": {"name": "x", "namespace": "team", "uid": "uid-x",
                          "annotations": {"gpuslice.io/devices.c": "GPU-a1"}},
             "spec": {"nodeName": "gpu-a", "containers": [{"name": "c", "resources": {
                 "limits": {"nvidia.com/gpumem": "20000"}}}]},
             "status": {"phase": "Running"}}
    state.apply_pod(other)
    second = await (await client.post("/scheduler/filter", json=case["request"])).json()
    assert "gpu-a" not in second["NodeNames"]
    assert "too little free memory" in second["FailedNodes"]["gpu-a"]
    state.delete_pod(other)
    third = await (await client.post("/scheduler/filter", json=case["request"])).json()
    assert third == first


@pytest.mark.parametrize("path", ["/scheduler/filter", "/scheduler/prioritize",
                                  "/scheduler/bind"])
async def test_deeply_nested_body_gets_400(client: Any, path: str) -> None:
    # json.loads raises RecursionError (not a ValueError) on deep nesting; a body of 200 KB of
    # '[' is well under aiohttp's size limit and must be a 400 like any other bad body.
    body = b"[" * 200_000 + b"]" * 200_000
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "nests too deeply" in await resp.text()


@pytest.mark.parametrize("path", ["/scheduler/filter", "/scheduler/prioritize",
                                  "/scheduler/bind"])
async def test_body_in_an_unknown_charset_gets_400(client: Any, path: str) -> None:
    # aiohttp decodes the body with the Content-Type's charset: an unknown one is a
    # LookupError, not a ValueError.
    resp = await client.post(path, data=_args(),
                             headers={"Content-Type": "application/json; charset=no-such"})
    assert resp.status == 400
    assert "charset" in await resp.text()


@pytest.mark.parametrize("path", ["/scheduler/filter", "/scheduler/prioritize",
                                  "/scheduler/preempt", "/scheduler/bind"])
async def test_body_that_does_not_decompress_gets_400_not_500(client: Any, path: str) -> None:
    # aiohttp decompresses a gzip or deflate body while it is read: one that does not
    # decompress raised RequestPayloadError out of the handler, an HTTP 500.
    resp = await client.post(path, data=_args(), headers={
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert resp.status == 400
    assert "request body cannot be read" in await resp.text()
    assert resp.headers.get("Connection", "").lower() == "close"
