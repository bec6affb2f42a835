"""Keeps :class:`ClusterState` current from the API server: list, then watch, then resync.

One loop per resource (nodes, pods), each: list (raw JSON, no model deserialisation, in pages
of ``page_size`` with ``continue`` tokens), replace
the state's view, watch from the list's ``resourceVersion`` and apply events; a watch that
ends, or whose connection is cut (even inside an event), is resumed from the last event seen,
a ``410 Gone`` or any other error leads to a fresh list,
and every ``resync_s`` the loop lists again anyway. ``ready`` is set once both resources have
been listed, so a restarted extender answers only after it has rebuilt every allocation from
the pods' device annotations.

Back-off, as client-go's reflector: before listing again after a failure the loop sleeps
``backoff_s``, doubled after each failure up to ``backoff_max_s``; it goes back to
``backoff_s`` only once the list/watch has run without failing for ``backoff_reset_s``. A
``410`` (the watch's version was compacted) after such a healthy stretch is the normal end of
a long watch and is listed again at once; a ``410`` soon after the list (a server that
compacts faster than we list) backs off like any error, so a cluster-wide list is never
repeated in a tight loop. A list refused with ``429`` (the API server sheds load) is sent
again no sooner than its ``Retry-After``; a watch so refused is made again from the same
version after the back-off, and no sooner than its ``Retry-After``, rather than answered with
a list of every object, the heaviest request the loop makes (the reflector, too, watches again
after a 429).

Pods are watched without a field selector: a pod that finishes must be seen as MODIFIED (the
API server reports a pod leaving a selector as DELETED, but not every server does).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from webhook.placement.state import ClusterState

logger = logging.getLogger(__name__)


class ResourceExpired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class Throttled(Exception):
    """The API server refused the watch with 429 (it sheds load); ``retry_after_s``: its
    ``Retry-After`` (0 when absent or not a number of seconds)."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"HTTP 429, Retry-After {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


class ApiStatusError(Exception):
    """The API server answered with a non-2xx status."""

    def __init__(self, status: int, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        """The ``Retry-After`` (seconds) of a 429; 0 otherwise."""


class BadResponse(Exception):
    """The API server answered 2xx with a body that is not JSON (a proxy's page, a cut body)."""


def retry_after_s(headers: Any) -> float:
    """A 429's ``Retry-After`` in seconds (0 when absent or not a number of seconds)."""
    value = str(headers.get("Retry-After") or "")
    return float(value) if value.isdigit() else 0.0


async def read_json(resp: Any) -> Any:
    """Body of a raw (``_preload_content=False``) response; raises :class:`ApiStatusError` on
    a non-2xx status and :class:`BadResponse` on a 2xx body that is not JSON."""
    try:
        body = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        message = body.decode(errors="replace")
        try:
            message = json.loads(body).get("message", message)
        except (ValueError, AttributeError, RecursionError):
            pass
        raise ApiStatusError(resp.status, message,
                             retry_after_s(resp.headers) if resp.status == 429 else 0.0)
    try:
        return json.loads(body) if body else None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadResponse(f"HTTP {resp.status} answer is not JSON: {exc}") from None


class ClusterSync:
    """The list/watch loops of nodes and pods."""

    def __init__(self, state: ClusterState, api: client.ApiClient, *, resync_s: float = 300.0,
                 watch_timeout_s: int = 240, backoff_s: float = 0.5,
                 backoff_max_s: float = 30.0, backoff_reset_s: float = 60.0,
                 page_size: int = 500, collect_s: float = 3600.0) -> None:
        self.state = state
        self.core = client.CoreV1Api(api)
        self.resync_s = resync_s
        """Seconds between full lists, failures or not."""
        self.watch_timeout_s = watch_timeout_s
        """Seconds the API server keeps one watch open (it then ends it; we resume it)."""
        self.backoff_s = backoff_s
        """Seconds slept before listing again after the first failure."""
        self.backoff_max_s = backoff_max_s
        """Cap (seconds) of the back-off, which doubles with each failure."""
        self.backoff_reset_s = backoff_reset_s
        """Seconds without a failure after which the back-off starts again at ``backoff_s``."""
        self.page_size = page_size
        self.collect_s = collect_s
        """Seconds between the full collections that free what the freezes kept (see _loop)."""
        self._collected_at = time.monotonic()
        self._listed: set[str] = set()
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop("nodes", self.core.list_node, self._on_nodes,
                                           self._on_node_event), name="gpuslice-watch-nodes"),
            asyncio.create_task(self._loop("pods", self.core.list_pod_for_all_namespaces,
                                           self._on_pods, self._on_pod_event),
                                name="gpuslice-watch-pods"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ----- state updates -----
    def _on_nodes(self, items: list[dict[str, Any]], listed_at: float, rv: str) -> None:
        self.state.replace_nodes(items)

    def _on_pods(self, items: list[dict[str, Any]], listed_at: float, rv: str) -> None:
        self.state.replace_pods(items, listed_at, rv)

    def _on_node_event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.state.delete_node(str((obj.get("metadata") or {}).get("name")))
        else:
            self.state.apply_node(obj)

    def _on_pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.state.delete_pod(obj)
        else:
            self.state.apply_pod(obj)

    # ----- the loop -----
    async def _loop(self, what: str, lister: Callable[..., Awaitable[Any]],
                    on_list: Callable[[list[dict[str, Any]], float, str], None],
                    on_event: Callable[[str, dict[str, Any]], None]) -> None:
        backoff = self.backoff_s
        healthy_since: float | None = None  # when the list that followed the last failure came in
        while True:
            try:
                listed_at = time.monotonic()
                rv, items = await self._list(lister)
                on_list(items, listed_at, rv)
                count = len(items)
                del items
                # The state just built is long-lived: move it (and everything else alive)
                # out of the cyclic collector's generations, so full collections do not
                # rescan tens of thousands of allocations and stall filter calls (measured:
                # 100-300 ms pauses at 16k pods). The state holds no reference cycles, so
                # nothing of it frozen that is later dropped is leaked: reference counting
                # frees it. What else was alive, though (the connections being served: ~1 kB
                # each), dies later in reference cycles no collection looks at; so at most
                # once per ``collect_s`` everything is unfrozen and collected first.
                if time.monotonic() - self._collected_at >= self.collect_s:
                    gc.unfreeze()
                    gc.collect()
                    self._collected_at = time.monotonic()
                gc.freeze()
                logger.info("listed", extra={"resource": what, "count": count})
                self._listed.add(what)
                if self._listed >= {"nodes", "pods"}:
                    self.ready.set()
                if healthy_since is None:
                    healthy_since = time.monotonic()
                throttled = 0
                while time.monotonic() - listed_at < self.resync_s:
                    started = time.monotonic()
                    try:
                        rv = await self._watch(lister, rv, on_event)
                    except Throttled as exc:  # watched again from rv: no list
                        delay = max(min(self.backoff_s * 2 ** throttled, self.backoff_max_s),
                                    min(exc.retry_after_s, self.backoff_max_s))
                        throttled += 1
                        logger.warning("watch throttled by the API server; watching again",
                                       extra={"resource": what, "retry_s": delay})
                        await asyncio.sleep(delay)
                        continue
                    throttled = 0
                    if time.monotonic() - started < 1.0:  # a server that ends watches at once
                        await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: back off, then list again
                healthy = healthy_since is not None \
                    and time.monotonic() - healthy_since >= self.backoff_reset_s
                healthy_since = None
                if healthy:
                    backoff = self.backoff_s
                if isinstance(exc, ResourceExpired) and healthy:
                    logger.info("watch expired; listing again", extra={"resource": what})
                    continue
                # a 429: no sooner than the API server asks (bounded by the cap)
                delay = max(backoff, min(getattr(exc, "retry_after_s", 0.0), self.backoff_max_s))
                if isinstance(exc, ResourceExpired):
                    logger.warning("watch expired soon after the list; listing again after a "
                                   "back-off", extra={"resource": what, "retry_s": delay})
                else:
                    logger.warning("list/watch failed; retrying", extra={
                        "resource": what, "error": repr(exc), "retry_s": delay})
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def _list(self, lister: Callable[..., Awaitable[Any]]) -> tuple[str, list[Any]]:
        """All objects, in pages of ``page_size``; returns (resourceVersion, items)."""
        items: list[Any] = []
        token = ""
        while True:
            page = await read_json(await lister(limit=self.page_size, _continue=token or None,
                                                _preload_content=False, _request_timeout=60))
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return str(meta.get("resourceVersion") or ""), items

    async def _watch(self, lister: Callable[..., Awaitable[Any]], rv: str,
                     on_event: Callable[[str, dict[str, Any]], None]) -> str:
        """One watch request from ``rv``; returns the last resourceVersion seen."""
        resp = await lister(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                            timeout_seconds=self.watch_timeout_s, _preload_content=False,
                            _request_timeout=aiohttp.ClientTimeout(
                                sock_connect=30, sock_read=self.watch_timeout_s + 30))
        try:
            if resp.status == 410:
                raise ResourceExpired("watch resourceVersion too old")
            if resp.status == 429:
                raise Throttled(retry_after_s(resp.headers))
            if not 200 <= resp.status <= 299:
                await read_json(resp)
            while True:
                try:
                    line = await resp.content.readline()
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                        ConnectionResetError) as exc:
                    logger.info("watch connection dropped; resuming from the last event",
                                extra={"error": repr(exc)})
                    return rv
                if not line or not line.endswith(b"\n"):
                    # ended (at its timeout), or cut inside an event: resumed from the last
                    # whole one, which the API server then sends again
                    return rv
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise ResourceExpired(obj.get("message", ""))
                    raise ApiStatusError(int(obj.get("code") or 500), obj.get("message", ""))
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    on_event(kind, obj)
        finally:
            resp.release()
