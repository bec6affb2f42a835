"""Property: no body, however random or truncated, makes the webhook answer HTTP 500.

Every answer is 200 (an AdmissionReview echoing the uid, whose patch applies to the object),
400 or 413, always with a JSON body.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
              st.text(max_size=12),
              st.sampled_from(["0.5", "-1", "1Gi", "100", "0", "1e3", "CREATE", "Pod", "v1"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)

BASE_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "namespace": "team-a", "annotations": {"a/b": "c"}},
    "spec": {
        "initContainers": [{"name": "init", "image": "x",
                            "resources": {"limits": {"nvidia.com/gpumem": "100"}}}],
        "containers": [{"name": "main", "image": "x",
                        "env": [{"name": "A", "value": "1"}],
                        "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                        "securityContext": {"privileged": False},
                        "resources": {"limits": {"nvidia.com/gpu": "1",
                                                 "nvidia.com/gpucores": "50"},
                                      "requests": {"nvidia.com/gpu": "1"}}},
                       {"name": "side", "image": "x",
                        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                        "resources": {"limits": {"cpu": "1"}}}],
        "volumes": [{"name": "v", "emptyDir": {}}],
        "nodeSelector": {"x": "y"}, "tolerations": [],
    },
}
BASE: dict[str, Any] = {
    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
    "request": {"uid": "fuzz-uid", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE", "namespace": "team-a", "object": BASE_POD},
}
BASE_BYTES = json.dumps(BASE).encode()
PATHS = [
    ("request",), ("request", "uid"), ("request", "kind"), ("request", "kind", "kind"),
    ("request", "operation"), ("request", "namespace"), ("request", "object"),
    ("request", "subResource"),
    ("request", "object", "metadata"), ("request", "object", "metadata", "annotations"),
    ("request", "object", "metadata", "annotations", "gpuslice.io/placement"),
    ("request", "object", "spec"), ("request", "object", "spec", "nodeName"),
    ("request", "object", "spec", "containers"), ("request", "object", "spec", "volumes"),
    ("request", "object", "spec", "nodeSelector"), ("request", "object", "spec", "tolerations"),
    ("request", "object", "spec", "initContainers"),
    ("request", "object", "spec", "containers", 0),
    ("request", "object", "spec", "containers", 0, "name"),
    ("request", "object", "spec", "containers", 0, "env"),
    ("request", "object", "spec", "containers", 0, "env", 0),
    ("request", "object", "spec", "containers", 0, "volumeMounts"),
    ("request", "object", "spec", "containers", 0, "securityContext"),
    ("request", "object", "spec", "containers", 0, "resources"),
    ("request", "object", "spec", "containers", 0, "resources", "limits"),
    ("request", "object", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"),
    ("request", "object", "spec", "containers", 0, "resources", "limits",
     "nvidia.com/gpumem-percentage"),
    ("request", "object", "spec", "containers", 0, "resources", "requests"),
    ("request", "object", "spec", "containers", 0, "resources", "requests", "nvidia.com/gpu"),
    ("request", "object", "spec", "containers", 1),
    ("request", "object", "spec", "containers", 1, "env"),
    ("request", "object", "spec", "containers", 1, "env", 0),
    ("request", "object", "spec", "containers", 1, "env", 0, "name"),
    ("request", "object", "spec", "containers", 1, "resources"),
    ("request", "object", "spec", "containers", 1, "resources", "limits"),
]


def _check(server: Any, body: bytes, content_type: str = "application/json") -> None:
    status, _headers, data = server.request("POST", "/mutate", body,
                                           {"Content-Type": content_type})
    assert status in (200, 400, 413), (status, data[:300])
    answer = json.loads(data)
    if status != 200:
        assert set(answer) == {"error", "message"} and answer["message"]
        return
    request = json.loads(body)["request"]
    response = answer["response"]
    assert response["uid"] == request["uid"] and isinstance(response["allowed"], bool)
    if "patch" in response:
        patch = json.loads(base64.b64decode(response["patch"]))
        jsonpatch.apply_patch(request["object"], patch)
    if not response["allowed"]:
        assert response["status"]["message"]


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key] if isinstance(doc, dict) and key in doc or isinstance(doc, list) \
            and isinstance(key, int) and key < len(doc) else None
        if doc is None:
            return
    if isinstance(doc, dict) or isinstance(doc, list) and isinstance(path[-1], int) \
            and path[-1] < len(doc):
        doc[path[-1]] = value


@settings(max_examples=90, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PATHS), JSON), min_size=1, max_size=3))
def test_reviews_with_random_values_never_get_a_500(server: Any, edits: Any) -> None:
    review = copy.deepcopy(BASE)
    for path, value in edits:
        _set(review, path, value)
    _check(server, json.dumps(review).encode())


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, len(BASE_BYTES)),
       st.sampled_from(["application/json", "application/json; charset=utf-8",
                        "text/plain", "application/x-yaml", ""]))
def test_truncated_reviews_never_get_a_500(server: Any, cut: int, content_type: str) -> None:
    _check(server, BASE_BYTES[:cut], content_type)


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=512))
def test_random_bytes_never_get_a_500(server: Any, body: bytes) -> None:
    _check(server, body)
