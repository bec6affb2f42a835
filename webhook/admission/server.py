"""The aiohttp edge of the admission webhook: ``POST /mutate`` and its metrics.

The handler decodes the review, calls the pure :func:`mutate_pod`, diffs the result against
the object as received and encodes the answer. Two error channels: a body we cannot answer is
an HTTP 400 (or 413 when too large) with ``{"error", "message"}``; a pod we will not admit is
``allowed: false``. An unexpected exception while handling a well-formed review is logged and
answered as a denial (the pod is refused, fail-closed, with a message pointing at the logs):
never an HTTP 500, and never an unmutated GPU pod let through.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from webhook.admission import review
from webhook.admission.diff import patch_json
from webhook.admission.mutate import BadObject, mutate_ephemeral, mutate_pod
from webhook.settings import Settings

logger = logging.getLogger(__name__)

OUTCOMES = ("allowed_patched", "allowed_unchanged", "denied", "bad_request", "too_large",
            "error")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_JSON_TYPES = ("application/json",)


class AdmissionMetrics:
    """Requests by outcome and a latency histogram, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        requests = Counter("gpuslice_admission_requests", "Admission reviews by outcome.",
                           ["outcome"], registry=registry)
        self.by_outcome = {o: requests.labels(outcome=o) for o in OUTCOMES}
        self.latency = Histogram("gpuslice_admission_duration_seconds",
                                 "Time to answer one admission review.",
                                 buckets=_LATENCY_BUCKETS, registry=registry)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        body=json.dumps({"error": code, "message": message}).encode())


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


def _review(answer: review.AdmissionReview) -> web.Response:
    return _json(review.encode_json(answer).encode())


class MutateHandler:
    """``POST /mutate``; ``max_gpu_memory`` tells the largest GPU in the cluster, if known."""

    def __init__(self, settings: Settings, metrics: AdmissionMetrics,
                 max_gpu_memory: Callable[[], int | None] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.max_gpu_memory = max_gpu_memory

    async def handle(self, request: web.Request) -> web.Response:
        """The aiohttp handler (a coroutine function, so aiohttp calls it directly)."""
        start = time.perf_counter()
        outcome, response = await self._handle(request)
        self.metrics.by_outcome[outcome].inc()
        self.metrics.latency.observe(time.perf_counter() - start)
        return response

    async def _handle(self, request: web.Request) -> tuple[str, web.Response]:
        limit = self.settings.max_body_bytes
        if request.headers.get("Content-Type") != "application/json" \
                and request.content_type not in _JSON_TYPES:
            return "bad_request", _error(
                400, "bad_request",
                f"Content-Type must be application/json, got {request.content_type!r}")
        if request.content_length is not None and request.content_length > limit:
            return "too_large", _too_large(limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return "too_large", _too_large(limit)
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding it does not decode to
            response = _error(400, "bad_request", unreadable_body(exc))
            response.force_close()  # the rest of the body cannot be read: the connection ends
            return "bad_request", response
        try:
            admission = review.parse_review(body)
        except review.BadReview as exc:
            return "bad_request", _error(400, "bad_request", str(exc))
        uid = admission["uid"]
        try:
            return self._decide(admission)
        except (review.BadReview, BadObject) as exc:
            return "bad_request", _error(400, "bad_request", f"request.object: {exc}"
                                         if isinstance(exc, BadObject) else str(exc))
        except RecursionError:
            return "bad_request", _error(400, "bad_request", "request.object nests too deeply")
        except Exception:
            logger.exception("admission failed", extra={"uid": uid})
            return "error", _review(review.denied(
                uid, f"gpuslice webhook internal error (request uid {uid}); the pod was not "
                     f"admitted, see the gpuslice logs", code=500))

    def _decide(self, admission: review.AdmissionRequest) -> tuple[str, web.Response]:
        uid = admission["uid"]
        if review.is_ephemeral_update(admission):
            pod = review.pod_object(admission)
            result = mutate_ephemeral(pod, admission.get("oldObject"), self.settings,
                                      namespace=admission.get("namespace"))
            patch = patch_json(pod, result.pod) if result.changed else "[]"
            return ("allowed_patched" if patch != "[]" else "allowed_unchanged",
                    _json(review.encode_allowed(uid, warnings=list(result.warnings),
                                                patch_json=patch)))
        if not review.is_pod_create(admission):
            return "allowed_unchanged", _json(review.encode_allowed(uid))
        pod = review.pod_object(admission)
        max_mem = self.settings.max_gpu_memory_mib or self._cluster_max_memory()
        result = mutate_pod(pod, self.settings, namespace=admission.get("namespace"),
                            max_gpu_memory_mib=max_mem)
        warnings = list(result.warnings)
        if not result.allowed:
            logger.info("pod denied", extra={"uid": uid, "reason": result.message})
            return "denied", _review(review.denied(uid, result.message, warnings))
        patch = patch_json(pod, result.pod) if result.changed else "[]"
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("pod admitted", extra={"uid": uid, "ops": len(json.loads(patch))})
        return ("allowed_patched" if patch != "[]" else "allowed_unchanged",
                _json(review.encode_allowed(uid, warnings=warnings, patch_json=patch)))


    def _cluster_max_memory(self) -> int | None:
        if self.max_gpu_memory is None:
            return None
        try:
            return self.max_gpu_memory()
        except Exception:  # the inventory is advisory: never fail admission on it
            logger.exception("largest GPU memory unknown")
            return None


def unreadable_body(exc: web.RequestPayloadError) -> str:
    """Why a request body could not be read (a gzip or deflate body that does not decompress,
    say): aiohttp's own message, without its status prefix."""
    why = getattr(exc.__cause__, "message", None) or " ".join(str(exc).split())
    return f"request body cannot be read: {why}"


def _too_large(limit: int) -> web.Response:
    return _error(413, "too_large", f"request body is larger than {limit} bytes")
