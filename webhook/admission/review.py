"""The ``admission.k8s.io/v1`` AdmissionReview wire format: typed shapes, decoding, responses.

:func:`parse_review` turns a request body into an :class:`AdmissionRequest` or raises
:class:`BadReview` (the HTTP 400 channel: the API server sent something that is not a review we
can answer). :func:`allowed` and :func:`denied` build the response review (the admission
channel: a well-formed pod we admit, possibly patched, or refuse with a message).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal, NotRequired, TypedDict

from webhook.admission.encode import encode_json, encode_patch

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
PATCH_TYPE: Literal["JSONPatch"] = "JSONPatch"


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict):
    group: str
    version: str
    resource: str


class AdmissionRequest(TypedDict):
    uid: str
    kind: GroupVersionKind
    operation: str
    resource: NotRequired[GroupVersionResource]
    subResource: NotRequired[str]
    requestKind: NotRequired[GroupVersionKind]
    name: NotRequired[str]
    namespace: NotRequired[str]
    userInfo: NotRequired[dict[str, Any]]
    object: NotRequired[dict[str, Any] | None]
    oldObject: NotRequired[dict[str, Any] | None]
    dryRun: NotRequired[bool]
    options: NotRequired[dict[str, Any] | None]


class Status(TypedDict):
    code: int
    reason: str
    message: str


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]
    warnings: NotRequired[list[str]]
    status: NotRequired[Status]


class AdmissionReview(TypedDict):
    apiVersion: str
    kind: str
    request: NotRequired[AdmissionRequest]
    response: NotRequired[AdmissionResponse]


class BadReview(ValueError):
    """The body is not an AdmissionReview we can answer (HTTP 400); the message says why."""


def parse_review(body: bytes) -> AdmissionRequest:
    """Decode and check the envelope of an AdmissionReview v1 request."""
    try:
        review = json.loads(body)
    except RecursionError:
        raise BadReview("request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadReview(f"request body is not JSON: {exc}") from None
    if not isinstance(review, dict):
        raise BadReview("request body must be a JSON object (an AdmissionReview)")
    if review.get("kind") != KIND or review.get("apiVersion") != API_VERSION:
        raise BadReview(
            f"expected kind {KIND} with apiVersion {API_VERSION}, got kind "
            f"{_show(review.get('kind'))} with apiVersion {_show(review.get('apiVersion'))}")
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid must be a non-empty string")
    kind = request.get("kind")
    if not isinstance(kind, dict) or not all(
            isinstance(kind.get(k), str) for k in ("group", "version", "kind")):
        raise BadReview("request.kind must be an object with string group, version and kind")
    if not isinstance(request.get("operation"), str):
        raise BadReview("request.operation must be a string")
    for key in ("namespace", "subResource"):
        if key in request and request[key] is not None and not isinstance(request[key], str):
            raise BadReview(f"request.{key} must be a string")
    return request  # type: ignore[return-value]  # checked above, extra keys tolerated


def is_pod_create(request: AdmissionRequest) -> bool:
    """True for the CREATE of a Pod itself (not a subresource): the only thing we mutate."""
    kind = request["kind"]
    return (request["operation"] == "CREATE" and kind["group"] == "" and kind["kind"] == "Pod"
            and not request.get("subResource"))


def is_ephemeral_update(request: AdmissionRequest) -> bool:
    """True for an UPDATE of a Pod's ``ephemeralcontainers`` subresource (kubectl debug)."""
    kind = request["kind"]
    return (request["operation"] == "UPDATE" and kind["group"] == "" and kind["kind"] == "Pod"
            and request.get("subResource") == "ephemeralcontainers")


def pod_object(request: AdmissionRequest) -> dict[str, Any]:
    """The Pod of a pod CREATE request, or :class:`BadReview` when it is missing or not a Pod."""
    pod = request.get("object")
    if not isinstance(pod, dict):
        raise BadReview("request.object must be the Pod being created")
    if pod.get("kind", "Pod") != "Pod" or pod.get("apiVersion", "v1") != "v1":
        raise BadReview(f"request.object is not a v1 Pod (kind {_show(pod.get('kind'))})")
    return pod


def allowed(uid: str, patch: list[dict[str, Any]] | None = None,
            warnings: list[str] | None = None) -> AdmissionReview:
    """An allowing response, with a JSON patch when there is something to change."""
    response: AdmissionResponse = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = PATCH_TYPE
        response["patch"] = base64.b64encode(encode_patch(patch).encode()).decode("ascii")
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def encode_allowed(uid: str, patch: list[dict[str, Any]] | None = None,
                   warnings: list[str] | None = None, *,
                   patch_json: str | None = None) -> bytes:
    """``encode_json(allowed(...))`` as bytes, assembled without re-scanning the patch.

    The hot path of the webhook: the patch comes as operations or, already encoded, as
    ``patch_json`` (:func:`~webhook.admission.diff.patch_json`; ``[]`` is no patch), and its
    base64 is spliced in as it is (it needs no JSON escaping) instead of going through the
    encoder a second time.
    """
    if patch_json is None and patch:
        patch_json = encode_patch(patch)
    head = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":'
    out = [head, encode_json(uid).encode(), b',"allowed":true']
    if patch_json and patch_json != "[]":
        out += [b',"patchType":"JSONPatch","patch":"',
                base64.b64encode(patch_json.encode()), b'"']
    if warnings:
        out += [b',"warnings":', encode_json(warnings).encode()]
    out.append(b"}}")
    return b"".join(out)


def denied(uid: str, message: str, warnings: list[str] | None = None,
           code: int = 403) -> AdmissionReview:
    """A refusing response whose message tells the user what to fix."""
    response: AdmissionResponse = {
        "uid": uid, "allowed": False,
        "status": {"code": code, "reason": "Forbidden" if code == 403 else "InternalError",
                   "message": message},
    }
    if warnings:
        response["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) \
        else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."
