"""The fake API server behaves like the real one for the calls gpuslice makes."""

from __future__ import annotations

import asyncio
import json

import pytest
from fakekube import FakeKube
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException


def _pod(name: str, node: str | None = None, phase: str = "Pending") -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec, "status": {"phase": phase}}


async def test_list_pods_with_field_selector_through_real_client() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("a", "n1"))
        kube.put(_pod("b", "n2"))
        kube.put(_pod("c", "n1", phase="Succeeded"))
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            pods = await v1.list_pod_for_all_namespaces(
                field_selector="spec.nodeName=n1,status.phase!=Succeeded")
            assert [p.metadata.name for p in pods.items] == ["a"]


async def test_node_status_patch_changes_only_status() -> None:
    async with FakeKube() as kube:
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"},
                  "status": {"capacity": {"cpu": "4"}}})
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            await v1.patch_node_status("n1", {"status": {"capacity": {"nvidia.com/gpu": "10"}},
                                              "metadata": {"labels": {"x": "y"}}})
            await v1.patch_node("n1", {"metadata": {"labels": {"a": "b"}},
                                       "status": {"capacity": {"cpu": "99"}}})
        node = kube.get("nodes", "n1")
        assert node["status"]["capacity"] == {"cpu": "4", "nvidia.com/gpu": "10"}
        assert node["metadata"]["labels"] == {"a": "b"}
        patch = kube.requests_to("PATCH", "/status$")[0]
        assert patch.content_type in ("application/strategic-merge-patch+json",
                                      "application/merge-patch+json",
                                      "application/json-patch+json")


async def test_binding_merges_annotations_and_conflicts_when_bound() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("p"))
        body = {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": "p", "namespace": "default",
                             "annotations": {"gpuslice.io/devices.c": "GPU-1"}},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            # The API server answers a Binding with a Status, which the generated client
            # cannot deserialise as V1Binding (a known client bug): read the raw response.
            resp = await v1.create_namespaced_pod_binding("p", "default", body,
                                                          _preload_content=False)
            assert resp.status == 201
            assert (await resp.json())["kind"] == "Status"
            again = await v1.create_namespaced_pod_binding("p", "default", body,
                                                           _preload_content=False)
            assert again.status == 409
            assert (await again.json())["reason"] == "Conflict"
            missing = await v1.create_namespaced_pod_binding("nope", "default", body,
                                                             _preload_content=False)
            assert missing.status == 404
        pod = kube.get("pods", "p", "default")
        assert pod["spec"]["nodeName"] == "n1"
        assert pod["metadata"]["annotations"] == {"gpuslice.io/devices.c": "GPU-1"}


async def test_delayed_write_is_applied_after_its_client_gave_up() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("p"))
        kube.delay("POST", "/pods/p/binding$", 0.3)
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            with pytest.raises(TimeoutError):
                await v1.create_namespaced_pod_binding("p", "default", body,
                                                       _preload_content=False,
                                                       _request_timeout=0.1)
            assert kube.get("pods", "p")["spec"].get("nodeName") is None
            await asyncio.sleep(0.4)
            assert kube.get("pods", "p")["spec"]["nodeName"] == "n1"
            loop = asyncio.get_running_loop()
            started = loop.time()
            await v1.read_namespaced_pod("p", "default")  # only the next request was held
            assert loop.time() - started < 0.2


async def test_watch_streams_events_from_resource_version() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("a"))
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            listed = await v1.list_namespaced_pod("default")
            rv = listed.metadata.resource_version

            async def later() -> None:
                await asyncio.sleep(0.05)
                kube.put(_pod("b"))
                kube.delete("pods", "a", "default")

            task = asyncio.create_task(later())
            seen = []
            w = watch.Watch()
            async with w.stream(v1.list_namespaced_pod, "default", resource_version=rv,
                                timeout_seconds=2) as stream:
                async for event in stream:
                    seen.append((event["type"], event["object"].metadata.name))
                    if len(seen) == 2:
                        w.stop()
            await task
        assert seen == [("ADDED", "b"), ("DELETED", "a")]


async def test_injected_failures_and_outage_return_status_objects() -> None:
    async with FakeKube() as kube:
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        kube.fail("GET", r"/nodes/n1$", 500)
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            with pytest.raises(ApiException) as err:
                await v1.read_node("n1")
            assert err.value.status == 500
            assert (await v1.read_node("n1")).metadata.name == "n1"
            kube.down = True
            with pytest.raises(ApiException) as err:
                await v1.read_node("n1")
            assert err.value.status == 503


async def test_create_conflict_and_replace_with_stale_version() -> None:
    async with FakeKube() as kube:
        secret = {"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": "s", "namespace": "ns"}, "data": {"a": "Yg=="}}
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            created = await v1.create_namespaced_secret("ns", secret)
            with pytest.raises(ApiException) as err:
                await v1.create_namespaced_secret("ns", secret)
            assert err.value.status == 409
            stale = dict(secret, metadata={"name": "s", "namespace": "ns",
                                           "resourceVersion": "1"})
            kube.put(dict(secret, data={"a": "Yw=="}))
            with pytest.raises(ApiException) as err:
                await v1.replace_namespaced_secret("s", "ns", stale)
            assert err.value.status == 409
            assert created.metadata.uid == kube.get("secrets", "s", "ns")["metadata"]["uid"]


async def _first_watch_line(v1: client.CoreV1Api) -> tuple[int, dict]:
    resp = await v1.list_pod_for_all_namespaces(watch=True, timeout_seconds=1,
                                                _preload_content=False)
    try:
        line = await resp.content.readline()
        return resp.status, json.loads(line) if line else {}
    finally:
        resp.release()


async def test_injected_watch_failures_come_as_http_errors_or_as_error_events() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("a"))
        kube.fail("GET", "/api/v1/pods$", 410, watch=True, as_event=True,
                  message="too old resource version")
        kube.fail("GET", "/api/v1/pods$", 500, watch=True)
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            assert [p.metadata.name for p in
                    (await v1.list_pod_for_all_namespaces()).items] == ["a"]  # lists unaffected
            status, event = await _first_watch_line(v1)
            assert status == 200 and event["type"] == "ERROR"
            assert event["object"] | {"message": ""} == {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "", "reason": "Expired", "code": 410}
            status, event = await _first_watch_line(v1)
            assert status == 500 and event["reason"] == "InternalError"
            status, event = await _first_watch_line(v1)
            assert status == 200 and event["type"] == "ADDED"  # the faults are used up
        assert [r.watch for r in kube.requests] == [False, True, True, True]
        with pytest.raises(ValueError, match="watch=True"):
            kube.fail("GET", "/pods$", 410, as_event=True)


async def test_throttled_requests_get_429_with_retry_after_as_plain_text() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("a"))
        kube.throttle("GET", "/api/v1/pods$", retry_after=3, watch=True)
        kube.throttle("GET", "/api/v1/pods$", watch=False)
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            with pytest.raises(ApiException) as info:
                await v1.list_pod_for_all_namespaces()
            assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
            assert info.value.body == "Too many requests, please try again later.\n"
            assert info.value.headers["Content-Type"].startswith("text/plain")
            resp = await v1.list_pod_for_all_namespaces(watch=True, _preload_content=False)
            try:
                assert resp.status == 429 and resp.headers["Retry-After"] == "3"
            finally:
                resp.release()
            assert len((await v1.list_pod_for_all_namespaces()).items) == 1  # used up
            status, event = await _first_watch_line(v1)
            assert status == 200 and event["type"] == "ADDED"


async def test_injected_list_failure_leaves_watches_alone() -> None:
    async with FakeKube() as kube:
        kube.put(_pod("a"))
        kube.fail("GET", "/api/v1/pods$", 503, watch=False)
        async with kube.api_client() as api:
            v1 = client.CoreV1Api(api)
            status, event = await _first_watch_line(v1)
            assert status == 200 and event["type"] == "ADDED"
            with pytest.raises(ApiException) as err:
                await v1.list_pod_for_all_namespaces()
            assert err.value.status == 503


async def test_end_watches_ends_open_watches_as_their_timeout_does() -> None:
    async with FakeKube() as kube, kube.api_client() as api:
        v1 = client.CoreV1Api(api)
        resp = await v1.list_pod_for_all_namespaces(watch=True, timeout_seconds=30,
                                                    _preload_content=False)
        for _ in range(100):
            if kube.open_watches == ["pods"]:
                break
            await asyncio.sleep(0.01)
        kube.end_watches()
        assert await asyncio.wait_for(resp.content.read(), 5) == b""
        assert resp.status == 200 and kube.open_watches == []
        resp.release()
