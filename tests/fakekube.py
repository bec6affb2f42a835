"""An in-process fake Kubernetes API server that speaks the real JSON wire format.

No API server can run on the test machines, so code that talks to one is tested against this:
an aiohttp server on loopback, used through the real ``kubernetes_asyncio`` client. It keeps
objects in memory and implements what gpuslice uses, with the API server's semantics where
they matter to callers:

* core/v1 ``nodes`` (and the ``status`` subresource: status changes through the main resource
  are ignored, other changes through ``status`` are ignored), ``pods`` (``binding`` and
  ``eviction`` subresources, field selectors on ``spec.nodeName``/``status.phase``/``metadata.name``),
  ``secrets``, ``configmaps``, ``namespaces``, ``events``;
  ``admissionregistration.k8s.io/v1`` ``mutatingwebhookconfigurations``; and any other plural
  under a group path, generically.
* create (409 AlreadyExists, ``generateName``), get/list (label and field selectors), replace
  (409 Conflict on a stale ``resourceVersion``), patch (merge, strategic-merge treated as merge,
  JSON patch; other content types get 415), delete, and watches (``?watch=true``: one JSON event
  per line from ``resourceVersion``; 410 Expired once compacted).
* errors are real ``Status`` objects; :meth:`FakeKube.fail` injects them (on watches too:
  as an HTTP error, or as the ``ERROR`` event a watch sends for an expired resourceVersion),
  :meth:`FakeKube.end_watches` ends the open watches as their timeout does,
  :meth:`FakeKube.drop_watches` cuts their connections in the middle of an event, and
  :attr:`FakeKube.down` makes every request a 503, for outage tests;
  :meth:`FakeKube.throttle` answers as the API server sheds load (429, ``Retry-After``);
  :meth:`FakeKube.garble` answers requests with a body that is not JSON (a proxy's page);
  :meth:`FakeKube.delay` makes requests slow (answered, and carried out, only after a delay,
  whether or not the client still waits: the API server does not stop a write whose client
  gave up).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Self

import jsonpatch
from aiohttp import web

KINDS = {
    "nodes": "Node", "pods": "Pod", "secrets": "Secret", "configmaps": "ConfigMap",
    "namespaces": "Namespace", "events": "Event", "services": "Service",
    "mutatingwebhookconfigurations": "MutatingWebhookConfiguration", "leases": "Lease",
}
CLUSTER_SCOPED = {"nodes", "namespaces", "mutatingwebhookconfigurations"}
GROUP_OF = {"mutatingwebhookconfigurations": "admissionregistration.k8s.io/v1",
            "leases": "coordination.k8s.io/v1"}
PLURAL_OF = {kind: plural for plural, kind in KINDS.items()}
REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid",
           429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


def status_object(code: int, message: str, reason: str | None = None,
                  details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``metav1.Status`` as the API server sends it."""
    out: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                           "status": "Success" if code < 400 else "Failure",
                           "message": message, "reason": reason or REASONS.get(code, ""),
                           "code": code}
    if details:
        out["details"] = details
    return out


class ApiError(Exception):
    def __init__(self, code: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


_DROP = "drop"  # a watcher's queue item: cut the connection mid-event


def _is_watch(method: str, query: Any) -> bool:
    return method == "GET" and query.get("watch", "").lower() in ("true", "1")


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any

    @property
    def watch(self) -> bool:
        """A watch (``?watch=true``) rather than a get or list."""
        return _is_watch(self.method, self.query)


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int
    message: str
    watch: bool | None
    as_event: bool


@dataclass
class _Throttle:
    method: str
    pattern: re.Pattern[str]
    retry_after: int
    times: int
    watch: bool | None


@dataclass
class _Garble:
    method: str
    pattern: re.Pattern[str]
    status: int
    body: bytes
    times: int
    apply: bool


@dataclass
class _Delay:
    method: str
    pattern: re.Pattern[str]
    seconds: float
    times: int


@dataclass
class _Watcher:
    plural: str
    namespace: str | None
    field_selector: str
    label_selector: str
    queue: asyncio.Queue[dict[str, Any] | str | None] = field(default_factory=asyncio.Queue)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _lookup(obj: dict[str, Any], dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def _matches_fields(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if _lookup(obj, key) == value:
                return False
        else:
            key, _, value = term.partition("==" if "==" in term else "=")
            if _lookup(obj, key) != value:
                return False
    return True


def _matches_labels(obj: dict[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, _, value = term.partition("==" if "==" in term else "=")
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKube:
    """The fake API server. Use as ``async with FakeKube() as kube``."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.requests: list[RecordedRequest] = []
        self._down = False
        self._faults: list[_Fault] = []
        self._garbles: list[_Garble] = []
        self._throttles: list[_Throttle] = []
        self._delays: list[_Delay] = []
        self._closing = asyncio.Event()  # ends the delays at exit
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._compacted_rv = 0
        self._watchers: list[_Watcher] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ----- lifecycle -----
    async def __aenter__(self) -> Self:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing.set()
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def down(self) -> bool:
        """While true every request gets a 503 and open watches are closed (an outage)."""
        return self._down

    @down.setter
    def down(self, value: bool) -> None:
        self._down = value
        if value:
            self.end_watches()

    @property
    def open_watches(self) -> list[str]:
        """The resource (plural) of each watch being served now."""
        return [w.plural for w in self._watchers]

    def end_watches(self) -> None:
        """End every open watch normally, as the API server does at its ``timeoutSeconds``."""
        for w in self._watchers:
            w.queue.put_nowait(None)

    def drop_watches(self) -> None:
        """Cut every open watch's connection in the middle of an event (half a line written,
        then the connection closed), as a proxy or a restarting API server does."""
        for w in self._watchers:
            w.queue.put_nowait(_DROP)

    def bookmark_watches(self) -> None:
        """Send every open watch a ``BOOKMARK`` event at the latest resourceVersion (an object
        of the watched kind with only ``metadata.resourceVersion``), as the API server does
        about once a minute to watches that asked for ``allowWatchBookmarks``."""
        for w in self._watchers:
            w.queue.put_nowait({"type": "BOOKMARK", "object": {
                "kind": KINDS.get(w.plural, ""), "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._last_rv)}}})

    def error_watches(self, code: int = 410, message: str = "too old resource version") -> None:
        """Send every open watch an ``ERROR`` event holding a ``code`` Status after the events
        queued before it, then end it (mid-stream, where :meth:`fail` answers a new watch)."""
        for w in self._watchers:
            w.queue.put_nowait({"type": "ERROR", "object": status_object(code, message)})
            w.queue.put_nowait(None)

    def configuration(self) -> Any:
        from kubernetes_asyncio import client
        conf = client.Configuration(host=self.url)
        conf.verify_ssl = False
        return conf

    def api_client(self) -> Any:
        """A real ``kubernetes_asyncio.client.ApiClient`` pointed at this server."""
        from kubernetes_asyncio import client
        return client.ApiClient(self.configuration())

    # ----- direct object access for tests -----
    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace ``obj`` directly (no request), emitting a watch event."""
        obj = copy.deepcopy(obj)
        plural = PLURAL_OF[obj["kind"]]
        meta = obj.setdefault("metadata", {})
        ns = None if plural in CLUSTER_SCOPED else meta.setdefault("namespace", "default")
        key = (plural, ns, meta["name"])
        existed = key in self.objects
        if existed:
            meta.setdefault("uid", self.objects[key]["metadata"]["uid"])
        self._stamp(obj, new=not existed)
        self.objects[key] = obj
        self._emit("MODIFIED" if existed else "ADDED", plural, obj)
        return copy.deepcopy(obj)

    def get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        if plural not in CLUSTER_SCOPED and namespace is None:
            namespace = "default"
        obj = self.objects.get((plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def delete(self, plural: str, name: str, namespace: str | None = None) -> None:
        if plural not in CLUSTER_SCOPED and namespace is None:
            namespace = "default"
        obj = self.objects.pop((plural, namespace, name))
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._emit("DELETED", plural, obj)

    def fail(self, method: str, path_regex: str, status: int, times: int = 1,
             message: str = "injected failure", *, watch: bool | None = None,
             as_event: bool = False) -> None:
        """Answer the next ``times`` matching requests with a ``status`` Status object.

        ``watch``: match only watches (True) or only other requests (False); a list and a
        watch share their path. ``as_event``: answer a watch as the API server reports an
        expired resourceVersion (HTTP 200, then one ``ERROR`` event holding the Status, then
        the end of the stream) instead of with an HTTP error.
        """
        if as_event and watch is not True:
            raise ValueError("as_event applies to watches: pass watch=True")
        self._faults.append(_Fault(method.upper(), re.compile(path_regex), status, times,
                                   message, watch, as_event))

    def throttle(self, method: str, path_regex: str, times: int = 1, retry_after: int = 1, *,
                 watch: bool | None = None) -> None:
        """Answer the next ``times`` matching requests as the API server's max-in-flight and
        priority-and-fairness filters refuse a request they shed: HTTP 429 with a
        ``Retry-After: <retry_after>`` header and a plain-text body (``http.Error``), not a
        Status object. ``watch`` as in :meth:`fail`."""
        self._throttles.append(_Throttle(method.upper(), re.compile(path_regex), retry_after,
                                         times, watch))

    def garble(self, method: str, path_regex: str, status: int = 200,
               body: bytes = b"<html>OK</html>", times: int = 1, *, apply: bool = True) -> None:
        """Answer the next ``times`` matching requests (not watches) with ``status`` and a
        ``text/html`` ``body`` that is not JSON, as a proxy in front of the API server may.
        ``apply``: the request is carried out first (its real answer is replaced)."""
        self._garbles.append(_Garble(method.upper(), re.compile(path_regex), status, body,
                                     times, apply))

    def delay(self, method: str, path_regex: str, seconds: float, times: int = 1) -> None:
        """Hold the next ``times`` matching requests (not watches) for ``seconds`` before
        handling them as usual (faults and garbles included): a slow or unresponsive API
        server. A client that gives up meanwhile does not stop the request."""
        self._delays.append(_Delay(method.upper(), re.compile(path_regex), seconds, times))

    def compact(self) -> None:
        """Forget the watch history: watches from an older resourceVersion get 410 Expired."""
        self._compacted_rv = self._last_rv
        self._history.clear()

    def requests_to(self, method: str, path_regex: str) -> list[RecordedRequest]:
        pattern = re.compile(path_regex)
        return [r for r in self.requests if r.method == method.upper() and pattern.search(r.path)]

    # ----- internals -----
    def _next_rv(self) -> int:
        self._last_rv = next(self._rv)
        return self._last_rv

    def _stamp(self, obj: dict[str, Any], new: bool) -> None:
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._next_rv())
        if new:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def _emit(self, kind: str, plural: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._history.append((rv, plural, event))
        for w in self._watchers:
            if self._watch_wants(w, plural, obj):
                w.queue.put_nowait(event)

    @staticmethod
    def _watch_wants(w: _Watcher, plural: str, obj: dict[str, Any]) -> bool:
        return (w.plural == plural
                and (w.namespace is None or obj["metadata"].get("namespace") == w.namespace)
                and _matches_fields(obj, w.field_selector)
                and _matches_labels(obj, w.label_selector))

    @staticmethod
    def _parse_path(path: str) -> tuple[str, str, str | None, str | None, str | None]:
        """Return (group_version, plural, namespace, name, subresource)."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            gv, rest = "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
        else:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        plural, name = rest[0], rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if plural in CLUSTER_SCOPED and ns is not None:
            raise ApiError(404, f"{plural} is not namespaced")
        return gv, plural, ns, name, sub

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        ctype = request.content_type
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append(RecordedRequest(request.method, request.path,
                                             dict(request.query), ctype, body))
        for delay in self._delays:
            if delay.times > 0 and delay.method in (request.method, "*") \
                    and not _is_watch(request.method, request.query) \
                    and delay.pattern.search(request.path):
                delay.times -= 1
                try:
                    await asyncio.wait_for(self._closing.wait(), delay.seconds)
                except TimeoutError:
                    pass
                break
        try:
            if self.down:
                raise ApiError(503, "the API server is unavailable")
            watching = _is_watch(request.method, request.query)
            for throttle in self._throttles:
                if throttle.times > 0 and throttle.method in (request.method, "*") \
                        and throttle.watch in (None, watching) \
                        and throttle.pattern.search(request.path):
                    throttle.times -= 1
                    return web.Response(
                        status=429, text="Too many requests, please try again later.\n",
                        headers={"Retry-After": str(throttle.retry_after),
                                 "X-Content-Type-Options": "nosniff"})
            for fault in self._faults:
                if fault.times > 0 and fault.method in (request.method, "*") \
                        and fault.watch in (None, watching) \
                        and fault.pattern.search(request.path):
                    fault.times -= 1
                    if fault.as_event:
                        return await self._error_event(request, status_object(
                            fault.status, fault.message))
                    raise ApiError(fault.status, fault.message)
            if raw and not isinstance(body, (dict, list)):
                raise ApiError(400, "the request body is not valid JSON")
            for garble in self._garbles:
                if garble.times > 0 and garble.method in (request.method, "*") \
                        and not watching and garble.pattern.search(request.path):
                    garble.times -= 1
                    if garble.apply:
                        await self._dispatch(request, body)
                    return web.Response(body=garble.body, status=garble.status,
                                        content_type="text/html")
            return await self._dispatch(request, body)
        except ApiError as exc:
            return web.json_response(status_object(exc.code, exc.message, exc.reason),
                                     status=exc.code)

    async def _dispatch(self, request: web.Request, body: Any) -> web.StreamResponse:
        gv, plural, ns, name, sub = self._parse_path(request.path)
        method, q = request.method, request.query
        if plural not in CLUSTER_SCOPED and name is None and ns is None and method != "GET":
            raise ApiError(405, "the server does not allow this method on this path")
        if name is None:
            if _is_watch(method, q):
                return await self._watch(request, plural, ns)
            if method == "GET":
                return web.json_response(self._list(gv, plural, ns, q))
            if method == "POST":
                return web.json_response(self._create(gv, plural, ns, body), status=201)
            raise ApiError(405, "method not allowed")
        key = (plural, None if plural in CLUSTER_SCOPED else ns, name)
        if sub == "binding" and plural == "pods" and method == "POST":
            return web.json_response(self._bind(key, body), status=201)
        if sub == "eviction" and plural == "pods" and method == "POST":
            return web.json_response(self._evict(key, body), status=201)
        if sub not in (None, "status"):
            raise ApiError(404, f"unknown subresource {sub}")
        current = self.objects.get(key)
        if current is None and method != "POST":
            raise ApiError(404, f'{plural} "{name}" not found', "NotFound")
        if method == "GET":
            return web.json_response(current)
        if method == "DELETE":
            self.delete(plural, name, key[1])
            return web.json_response(current)
        if method in ("PUT", "PATCH"):
            assert current is not None
            if method == "PUT":
                if not isinstance(body, dict):
                    raise ApiError(400, "replace needs an object")
                rv = (body.get("metadata") or {}).get("resourceVersion")
                if rv and rv != current["metadata"]["resourceVersion"]:
                    raise ApiError(409, f'Operation cannot be fulfilled on {plural} "{name}": '
                                   "the object has been modified; please apply your changes "
                                   "to the latest version and try again", "Conflict")
                updated = copy.deepcopy(body)
            else:
                updated = self._apply_patch(current, request.content_type, body)
            updated = self._scope_update(current, updated, plural, sub)
            updated.setdefault("metadata", {})
            for keep in ("uid", "creationTimestamp", "name", "namespace"):
                if keep in current["metadata"]:
                    updated["metadata"][keep] = current["metadata"][keep]
            updated.setdefault("kind", current.get("kind"))
            updated.setdefault("apiVersion", current.get("apiVersion"))
            self._stamp(updated, new=False)
            self.objects[key] = updated
            self._emit("MODIFIED", plural, updated)
            return web.json_response(updated)
        raise ApiError(405, "method not allowed")

    @staticmethod
    def _scope_update(current: dict[str, Any], updated: dict[str, Any], plural: str,
                      sub: str | None) -> dict[str, Any]:
        """The status subresource changes only status; the main resource never changes it."""
        if plural not in ("nodes", "pods"):
            return updated
        if sub == "status":
            out = copy.deepcopy(current)
            out["status"] = updated.get("status", {})
            return out
        out = copy.deepcopy(updated)
        if "status" in current:
            out["status"] = copy.deepcopy(current["status"])
        else:
            out.pop("status", None)
        return out

    @staticmethod
    def _apply_patch(current: dict[str, Any], ctype: str, body: Any) -> dict[str, Any]:
        if ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            if not isinstance(body, dict):
                raise ApiError(400, "a merge patch must be a JSON object")
            return merge_patch(current, body)
        if ctype == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "a JSON patch must be a JSON array")
            try:
                return jsonpatch.apply_patch(current, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, f"the JSON patch cannot be applied: {exc}") from exc
        raise ApiError(415, f"the body of the request was in an unknown format - accepted "
                       f"media types include: application/json-patch+json, "
                       f"application/merge-patch+json, application/apply-patch+yaml "
                       f"(got {ctype!r})")

    def _list(self, gv: str, plural: str, ns: str | None, q: Any) -> dict[str, Any]:
        items = [copy.deepcopy(o) for (p, o_ns, _), o in sorted(self.objects.items(),
                                                               key=lambda kv: str(kv[0]))
                 if p == plural and (ns is None or o_ns == ns)
                 and _matches_fields(o, q.get("fieldSelector", ""))
                 and _matches_labels(o, q.get("labelSelector", ""))]
        for item in items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {"kind": KINDS.get(plural, plural.capitalize()) + "List", "apiVersion": gv,
                "metadata": {"resourceVersion": str(self._last_rv)}, "items": items}

    def _create(self, gv: str, plural: str, ns: str | None, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "create needs an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise ApiError(422, "metadata.name: Required value", "Invalid")
        if plural not in CLUSTER_SCOPED:
            if meta.get("namespace") not in (None, ns):
                raise ApiError(400, "the namespace of the object does not match the request")
            meta["namespace"] = ns
        key = (plural, ns if plural not in CLUSTER_SCOPED else None, meta["name"])
        if key in self.objects:
            raise ApiError(409, f'{plural} "{meta["name"]}" already exists', "AlreadyExists")
        obj.setdefault("kind", KINDS.get(plural, plural.capitalize()))
        obj.setdefault("apiVersion", gv)
        meta.pop("resourceVersion", None)
        self._stamp(obj, new=True)
        self.objects[key] = obj
        self._emit("ADDED", plural, obj)
        return copy.deepcopy(obj)

    def _bind(self, key: tuple[str, str | None, str], body: Any) -> dict[str, Any]:
        pod = self.objects.get(key)
        if pod is None:
            raise ApiError(404, f'pods "{key[2]}" not found', "NotFound")
        if not isinstance(body, dict) or not (body.get("target") or {}).get("name"):
            raise ApiError(400, "Binding needs target.name")
        if (pod.get("spec") or {}).get("nodeName"):
            raise ApiError(409, f'Operation cannot be fulfilled on pods/binding "{key[2]}": '
                           f'pod {key[2]} is already assigned to node '
                           f'"{pod["spec"]["nodeName"]}"', "Conflict")
        pod = copy.deepcopy(pod)
        pod.setdefault("spec", {})["nodeName"] = body["target"]["name"]
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if annotations:
            pod["metadata"].setdefault("annotations", {}).update(annotations)
        self._stamp(pod, new=False)
        self.objects[key] = pod
        self._emit("MODIFIED", "pods", pod)
        return status_object(201, "", "")

    def _evict(self, key: tuple[str, str | None, str], body: Any) -> dict[str, Any]:
        """The Eviction API without disruption budgets (inject a 429 with :meth:`fail` for one
        that refuses): the pod is deleted, unless ``deleteOptions.preconditions.uid`` names
        another pod (409)."""
        if not isinstance(body, dict) or body.get("kind") != "Eviction":
            raise ApiError(400, "an eviction needs an Eviction object")
        if (body.get("metadata") or {}).get("name") != key[2]:
            raise ApiError(400, "name in URL does not match name in Eviction object")
        if key not in self.objects:
            raise ApiError(404, f'pods "{key[2]}" not found', "NotFound")
        uid = ((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
        if uid and uid != self.objects[key]["metadata"]["uid"]:
            raise ApiError(409, f"Precondition failed: UID in precondition: {uid}, UID in "
                           f"object meta: {self.objects[key]['metadata']['uid']}", "Conflict")
        self.delete("pods", key[2], key[1])
        return status_object(201, "", "")

    @staticmethod
    async def _error_event(request: web.Request, status: dict[str, Any]) -> web.StreamResponse:
        """A watch whose one event is an ``ERROR`` holding ``status`` (the HTTP status is 200)."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
        return response

    async def _watch(self, request: web.Request, plural: str,
                     ns: str | None) -> web.StreamResponse:
        q = request.query
        w = _Watcher(plural, ns, q.get("fieldSelector", ""), q.get("labelSelector", ""))
        since = q.get("resourceVersion", "")
        if since and since != "0" and int(since) < self._compacted_rv:
            return await self._error_event(request, status_object(
                410, f"too old resource version: {since} ({self._compacted_rv})", "Expired"))
        if since and since != "0":
            initial = [copy.deepcopy(e) for rv, p, e in self._history
                       if rv > int(since) and p == plural
                       and self._watch_wants(w, plural, e["object"])]
        else:
            initial = [{"type": "ADDED", "object": copy.deepcopy(o)}
                       for (p, _, _), o in self.objects.items() if self._watch_wants(w, p, o)]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self._watchers.append(w)
        timeout = float(q.get("timeoutSeconds", "0") or 0) or None
        try:
            for event in initial:
                await response.write(json.dumps(event).encode() + b"\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout else None
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(w.queue.get(), remaining)
                except TimeoutError:
                    break
                if event is None or self.down:
                    break
                if event == _DROP:
                    await response.write(b'{"type": "MODIFIED", "object": {"kind": "Po')
                    if request.transport is not None:
                        request.transport.close()
                    break
                await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(w)
        return response
