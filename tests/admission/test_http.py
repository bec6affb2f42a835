"""The webhook over real TLS through the app factory: wire format, errors, probes, metrics.

Error and edge responses are compared with golden JSON (``golden/http.json``: status,
Content-Type and body of each named request); set ``GPUSLICE_UPDATE_GOLDEN=1`` to rewrite it
after a deliberate change, then review the diff.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

import jsonpatch
import kubeschema
import pytest

from webhook import names
from webhook.admission import server as admission_server
from webhook.admission.mutate import mutate_pod
from webhook.service import REGISTRY_KEY
from webhook.settings import Settings

GOLDEN = Path(__file__).parent / "golden" / "http.json"
LIMIT = Settings().max_body_bytes
REVIEW_HEAD = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}


def _golden_requests(review: Any, gpu_pod: Any) -> dict[str, tuple[str | None, bytes]]:
    """name -> (Content-Type, body) of every request with a golden answer."""
    def j(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    ok = review(gpu_pod())
    no_uid = copy.deepcopy(ok)
    del no_uid["request"]["uid"]
    no_kind = copy.deepcopy(ok)
    del no_kind["request"]["kind"]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {}}
    return {
        "not_json": ("application/json", b"this is not json"),
        "empty_body": ("application/json", b""),
        "json_array": ("application/json", b"[1, 2]"),
        "invalid_utf8": ("application/json", b'{"a": "\xff\xfe"}'),
        "deeply_nested": ("application/json", b"[" * 100000 + b"]" * 100000),
        "wrong_kind": ("application/json", j({**ok, "kind": "Pod"})),
        "wrong_api_version": ("application/json",
                              j({**ok, "apiVersion": "admission.k8s.io/v1beta1"})),
        "no_request": ("application/json", j(REVIEW_HEAD)),
        "no_uid": ("application/json", j(no_uid)),
        "no_request_kind": ("application/json", j(no_kind)),
        "object_missing": ("application/json", j(review(None))),
        "object_not_a_pod": ("application/json", j(review(deployment))),
        "object_bad_containers": ("application/json", j(review(
            {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": "main"}}))),
        "wrong_content_type": ("text/plain", j(ok)),
        "no_content_type": (None, j(ok)),
        "too_large": ("application/json", b" " * (LIMIT + 1)),
        "pod_without_gpu": ("application/json", j(review(gpu_pod(limits={"cpu": "1"})))),
        "denied": ("application/json", j(review(gpu_pod(limits={"nvidia.com/gpu": "0.5"})))),
        "update_is_not_mutated": ("application/json", j(review(gpu_pod(), operation="UPDATE",
                                                               oldObject=gpu_pod()))),
        "delete_is_not_mutated": ("application/json", j(review(None, operation="DELETE",
                                                               oldObject=gpu_pod()))),
        "other_kind_is_not_mutated": ("application/json",
                                      j(review(deployment, kind="Deployment", group="apps"))),
        "subresource_is_not_mutated": ("application/json",
                                       j(review(gpu_pod(), operation="UPDATE",
                                                subResource="ephemeralcontainers"))),
        "kube_system_is_not_mutated": ("application/json",
                                       j(review(gpu_pod(), namespace="kube-system"))),
    }


def test_responses_match_golden_json(server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    got = {}
    for name, (content_type, body) in _golden_requests(make_review, make_gpu_pod).items():
        headers = {"Content-Type": content_type} if content_type else {}
        status, resp_headers, data = server.request("POST", "/mutate", body, headers)
        got[name] = {"status": status, "content_type": resp_headers.get("Content-Type"),
                     "body": json.loads(data)}
    if os.environ.get("GPUSLICE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name] == expected[name], name


def test_gpu_pod_gets_a_base64_json_patch_that_builds_the_mutated_pod(
        server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    pod = make_gpu_pod(limits={"nvidia.com/gpumem": "8000"})
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    pod["metadata"]["annotations"] = {"example.com/a~b": "x"}
    status, answer = server.post_review(make_review(pod, uid="uid-42"))
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "uid-42" and response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    expected = mutate_pod(pod, server.settings, namespace="team-a")
    assert jsonpatch.apply_patch(pod, patch) == expected.pod
    assert response["warnings"] == list(expected.warnings) and response["warnings"]


@pytest.mark.parametrize("env", [{"A": "b"}, 5, "abc"])
def test_a_sidecars_env_that_is_not_a_list_is_400_not_an_error(
        server: Any, make_review: Any, make_gpu_pod: Any, env: Any) -> None:
    """The other containers of a GPU pod are rewritten too (NVIDIA_VISIBLE_DEVICES=none): an
    env there that is not a list is a bad object, like one of a GPU container."""
    pod = make_gpu_pod(limits={"nvidia.com/gpumem": "8000"})
    pod["spec"]["containers"].append({"name": "side", "image": "x", "env": env})
    status, answer = server.post_review(make_review(pod))
    assert status == 400 and answer["error"] == "bad_request"
    assert "spec.containers[1].env must be a list" in answer["message"]


def test_with_hide_gpus_a_pod_without_gpus_gets_a_patch_and_by_default_none(
        server: Any, make_server: Any, make_review: Any, module_certs: Path) -> None:
    """hide_gpus_from_pods_without_gpus over HTTP: a CUDA image's pod that requests no GPU is
    patched (NVIDIA_VISIBLE_DEVICES=none, with the warning); by default it is admitted as is."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu"}, "spec": {
        "containers": [{"name": "app", "image": "nvidia/cuda",
                        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}
    status, answer = server.post_review(make_review(pod))
    assert status == 200 and answer["response"]["allowed"] and "patch" not in answer["response"]
    hiding = make_server(Settings(cert_dir=str(module_certs), tls_mode="files",
                                  placement_enabled=False, hide_gpus_from_pods_without_gpus=True))
    status, answer = hiding.post_review(make_review(pod))
    response = answer["response"]
    assert status == 200 and response["allowed"] and response["patchType"] == "JSONPatch"
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    assert patched["spec"]["containers"][0]["env"] == [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    assert patched["metadata"] == pod["metadata"]  # not marked as a gpuslice pod
    assert len(response["warnings"]) == 1 and "requests no GPU" in response["warnings"][0]


def test_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(server: Any) -> None:
    status, _, data = server.request("POST", "/mutate", b" " * LIMIT,
                                     {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"] == "bad_request"
    status, _, data = server.request("POST", "/mutate", b" " * (LIMIT + 1),
                                     {"Content-Type": "application/json"})
    assert status == 413 and json.loads(data)["error"] == "too_large"


def test_chunked_body_over_the_limit_is_413_while_reading(server: Any) -> None:
    chunks = (b" " * (1024 * 1024) for _ in range(8))  # no Content-Length: chunked
    status, _, data = server.request("POST", "/mutate", chunks,  # type: ignore[arg-type]
                                     {"Content-Type": "application/json"})
    assert status == 413
    assert json.loads(data) == {"error": "too_large",
                                "message": f"request body is larger than {LIMIT} bytes"}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_that_does_not_decompress_is_400_not_500(
        server: Any, make_review: Any, make_gpu_pod: Any, encoding: str) -> None:
    """aiohttp decompresses a gzip or deflate body while the handler reads it: one that does
    not decompress was an HTTP 500 (and no outcome counted). It is a malformed request: a 400
    with the JSON error body, and the connection closes (the rest of the body is unreadable)."""
    registry = server.app[REGISTRY_KEY]
    before = registry.get_sample_value("gpuslice_admission_requests_total",
                                       {"outcome": "bad_request"}) or 0.0
    body = json.dumps(make_review(make_gpu_pod())).encode()  # not compressed
    status, headers, data = server.request("POST", "/mutate", body, {
        "Content-Type": "application/json", "Content-Encoding": encoding})
    assert status == 400
    assert json.loads(data) == {
        "error": "bad_request",
        "message": f"request body cannot be read: Can not decode content-encoding: {encoding}"}
    assert headers.get("Connection", "").lower() == "close"
    assert registry.get_sample_value("gpuslice_admission_requests_total",
                                     {"outcome": "bad_request"}) == before + 1
    # a body that does decompress is read as any other
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    status, _, data = server.request("POST", "/mutate", packed, {
        "Content-Type": "application/json", "Content-Encoding": encoding})
    assert status == 200 and json.loads(data)["response"]["allowed"] is True


def test_unexpected_exception_is_a_logged_denial_not_a_500(
        server: Any, make_review: Any, make_gpu_pod: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(admission_server, "mutate_pod", explode)
    status, answer = server.post_review(make_review(make_gpu_pod(), uid="uid-boom"))
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is False and response["uid"] == "uid-boom"
    assert response["status"]["code"] == 500
    assert "internal error" in response["status"]["message"]
    assert "uid-boom" in response["status"]["message"]
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)


def test_a_quantity_of_thousands_of_digits_is_a_denial_not_an_internal_error(
        server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    """The API server passes a huge whole quantity on as plain digits; past Python's 4,300
    digit limit for int() it must still be a denial naming the field, not an exception."""
    pod = make_gpu_pod(limits={"nvidia.com/gpumem": "7" * 5000})
    status, answer = server.post_review(make_review(pod, uid="uid-digits"))
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is False and response["uid"] == "uid-digits"
    assert response["status"]["code"] == 403
    assert "nvidia.com/gpumem" in response["status"]["message"]


def test_healthz_and_readyz_answer_once_the_certificate_is_loaded(server: Any) -> None:
    status, _, data = server.request("GET", "/healthz")
    assert status == 200 and json.loads(data)["status"] == "ok"
    status, _, data = server.request("GET", "/readyz")
    assert status == 200 and json.loads(data) == {"ready": True}


def test_metrics_count_requests_by_outcome_and_time_them(
        server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    registry = server.app[REGISTRY_KEY]

    def count(outcome: str) -> float:
        return registry.get_sample_value("gpuslice_admission_requests_total",
                                         {"outcome": outcome}) or 0.0

    before = {o: count(o) for o in admission_server.OUTCOMES}
    observed = registry.get_sample_value("gpuslice_admission_duration_seconds_count") or 0.0
    server.post_review(make_review(make_gpu_pod()))
    server.post_review(make_review(make_gpu_pod(limits={"cpu": "1"})))
    server.post_review(make_review(make_gpu_pod(limits={"nvidia.com/gpu": "-1"})))
    server.post_review(b"nope")
    server.request("POST", "/mutate", b" " * (LIMIT + 1), {"Content-Type": "application/json"})

    status, headers, data = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = data.decode()
    for outcome in admission_server.OUTCOMES:
        assert f'gpuslice_admission_requests_total{{outcome="{outcome}"}}' in text
    assert "gpuslice_admission_duration_seconds_bucket" in text
    delta = {o: count(o) - before[o] for o in admission_server.OUTCOMES}
    assert delta == {"allowed_patched": 1, "allowed_unchanged": 1, "denied": 1,
                     "bad_request": 1, "too_large": 1, "error": 0}
    assert registry.get_sample_value("gpuslice_admission_duration_seconds_count") == observed + 5


def test_unknown_paths_and_methods_are_4xx(server: Any) -> None:
    assert server.request("GET", "/mutate")[0] == 405
    assert server.request("GET", "/nope")[0] == 404


def _debugged(pod: dict[str, Any], *debuggers: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["spec"]["ephemeralContainers"] = list(debuggers)
    return out


_CUDA_DEBUG = {"name": "debugger", "image": "nvidia/cuda", "stdin": True, "tty": True,
               "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}


def test_kubectl_debug_of_a_gpu_pod_gets_no_gpu(
        server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    """kubectl debug adds an ephemeral container through pods/ephemeralcontainers (an UPDATE).
    Under the pod's NVIDIA runtime a CUDA image's NVIDIA_VISIBLE_DEVICES=all would give it every
    GPU of the node, without the library or a cap: it gets none, like the pod's other
    containers that request no GPU. Ephemeral containers added before are left as they are
    (the API server refuses changes to them)."""
    created = mutate_pod(make_gpu_pod(), server.settings, namespace="team-a").pod
    assert created is not None
    before = _debugged(copy.deepcopy(created), {"name": "old", "image": "busybox"})
    after = _debugged(before, {"name": "old", "image": "busybox"}, _CUDA_DEBUG)
    status, answer = server.post_review(make_review(
        after, operation="UPDATE", subResource="ephemeralcontainers", oldObject=before))
    response = answer["response"]
    assert status == 200 and response["allowed"] and response.get("patchType") == "JSONPatch"
    patched = jsonpatch.apply_patch(after, json.loads(base64.b64decode(response["patch"])))
    assert patched["spec"]["ephemeralContainers"] == [
        {"name": "old", "image": "busybox"},
        {**_CUDA_DEBUG, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]
    patched["spec"]["ephemeralContainers"] = after["spec"]["ephemeralContainers"]
    assert patched == after  # nothing else changes
    kubeschema.assert_valid(jsonpatch.apply_patch(
        after, json.loads(base64.b64decode(response["patch"]))))
    # Re-invoked on its own output: nothing more to change.
    status, again = server.post_review(make_review(
        patched | {"spec": patched["spec"] | {"ephemeralContainers": [
            {"name": "old", "image": "busybox"},
            {**_CUDA_DEBUG, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]}},
        operation="UPDATE", subResource="ephemeralcontainers", oldObject=before))
    assert status == 200 and again["response"]["allowed"] and "patch" not in again["response"]


def test_kubectl_debug_of_a_gpu_pod_stripped_of_its_mark_still_gets_no_gpu(
        server: Any, make_review: Any, make_gpu_pod: Any) -> None:
    """The gpuslice.io/mutated annotation is the tenant's to remove (a pod UPDATE; the guard
    keeps only the devices and limits annotations): a GPU pod is known by its spec too, which
    no update changes, so a debugger added after the mark is gone still gets no GPU."""
    created = mutate_pod(make_gpu_pod(), server.settings, namespace="team-a").pod
    assert created is not None
    stripped = copy.deepcopy(created)
    del stripped["metadata"]["annotations"][names.ANN_MUTATED]
    status, answer = server.post_review(make_review(
        _debugged(stripped, _CUDA_DEBUG), operation="UPDATE", subResource="ephemeralcontainers",
        oldObject=stripped))
    response = answer["response"]
    assert status == 200 and response["allowed"] and response.get("patchType") == "JSONPatch"
    patched = jsonpatch.apply_patch(_debugged(stripped, _CUDA_DEBUG),
                                    json.loads(base64.b64decode(response["patch"])))
    assert patched["spec"]["ephemeralContainers"] == [
        {**_CUDA_DEBUG, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}]


def test_kubectl_debug_of_a_pod_without_gpus_is_left_alone_unless_hiding(
        server: Any, make_server: Any, make_review: Any, module_certs: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cpu"},
           "spec": {"containers": [{"name": "app", "image": "busybox"}]}}
    debug = make_review(_debugged(pod, _CUDA_DEBUG), operation="UPDATE",
                        subResource="ephemeralcontainers", oldObject=pod)
    status, answer = server.post_review(debug)
    assert status == 200 and answer["response"]["allowed"] and "patch" not in answer["response"]
    hiding = make_server(Settings(cert_dir=str(module_certs), tls_mode="files",
                                  placement_enabled=False, hide_gpus_from_pods_without_gpus=True))
    status, answer = hiding.post_review(debug)
    response = answer["response"]
    assert status == 200 and response["allowed"] and response["patchType"] == "JSONPatch"
    patched = jsonpatch.apply_patch(debug["request"]["object"],
                                    json.loads(base64.b64decode(response["patch"])))
    assert patched["spec"]["ephemeralContainers"][0]["env"] == [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    # the namespace is the review's (the object's metadata may lack it): kube-system's pods
    # are never changed, hiding or not (mutation testing: the object's own namespace alone was
    # read, and this debugger was patched)
    system = make_review(_debugged(pod, _CUDA_DEBUG), operation="UPDATE", namespace="kube-system",
                         subResource="ephemeralcontainers", oldObject=pod)
    status, answer = hiding.post_review(system)
    assert status == 200 and answer["response"]["allowed"] and "patch" not in answer["response"]
