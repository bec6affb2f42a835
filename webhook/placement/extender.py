"""The scheduler-extender HTTP edge: ``POST /scheduler/{filter,prioritize,preempt,bind}``.

Thin handlers: decode the body (a body that is not the extender wire format is an HTTP 400),
call the :class:`Placer`, encode its answer. Placement failures travel in the answer's
``FailedNodes`` / ``Error`` fields with HTTP 200, as kube-scheduler expects. Preempt has no
``Error`` field: before the first list of the cluster it answers HTTP 503, which the scheduler
takes as a failed preemption and retries after a back-off.

:func:`setup` registers the routes on the service's app, stores the :class:`Placer` at
``app[PLACEMENT_KEY]`` and, when ``settings.kube_enabled``, starts the watches on start-up
and stops them on clean-up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from kubernetes_asyncio import client, config

from webhook.admission.server import unreadable_body
from webhook.placement.model import WireError, binding_args, preemption_args
from webhook.placement.placer import NOT_READY, Placer
from webhook.placement.state import ClusterState
from webhook.settings import Settings

logger = logging.getLogger(__name__)

PLACEMENT_KEY: web.AppKey[Placer] = web.AppKey("gpuslice_placement", Placer)
"""Where :func:`setup` stores the :class:`Placer` (``largest_gpu_memory_mib()``, ``ready()``)."""

ApiFactory = Callable[[], Awaitable[client.ApiClient] | client.ApiClient]


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except RecursionError:  # not a ValueError: json.loads on deep nesting ("[[[[...")
        raise web.HTTPBadRequest(text="request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(text=f"request body is not valid JSON: {exc}") from exc
    except LookupError as exc:  # the Content-Type names a charset Python does not know
        raise web.HTTPBadRequest(text=f"request body has an unknown charset: {exc}") from exc
    except web.RequestPayloadError as exc:  # e.g. a Content-Encoding it does not decode to
        error = web.HTTPBadRequest(text=unreadable_body(exc))
        error.force_close()  # the rest of the body cannot be read: the connection ends
        raise error from exc


def _bad_request(exc: WireError) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=str(exc))


async def handle_filter(request: web.Request) -> web.Response:
    placer = request.app[PLACEMENT_KEY]
    try:
        return web.json_response(placer.filter(await _json_body(request)))
    except WireError as exc:
        raise _bad_request(exc) from exc


async def handle_prioritize(request: web.Request) -> web.Response:
    placer = request.app[PLACEMENT_KEY]
    try:
        return web.json_response(placer.prioritize(await _json_body(request)))
    except WireError as exc:
        raise _bad_request(exc) from exc


async def handle_preempt(request: web.Request) -> web.Response:
    placer = request.app[PLACEMENT_KEY]
    try:
        pod, proposed = preemption_args(await _json_body(request))
    except WireError as exc:
        raise _bad_request(exc) from exc
    if not placer.ready():
        raise web.HTTPServiceUnavailable(text=NOT_READY)
    return web.json_response(await placer.preempt(pod, proposed))


async def handle_bind(request: web.Request) -> web.Response:
    placer = request.app[PLACEMENT_KEY]
    try:
        args = binding_args(await _json_body(request))
    except WireError as exc:
        raise _bad_request(exc) from exc
    return web.json_response(await placer.bind(args))


async def default_api_client(settings: Settings) -> client.ApiClient:
    """An ApiClient from ``settings.kubeconfig``, or the in-cluster service account."""
    conf = client.Configuration()
    if settings.kubeconfig:
        await config.load_kube_config(config_file=settings.kubeconfig,
                                      client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    return client.ApiClient(conf)


def setup(app: web.Application, settings: Settings, *, state: ClusterState | None = None,
          api_client: client.ApiClient | ApiFactory | None = None) -> Placer:
    """Register the extender verbs and the placement state on ``app``.

    ``api_client`` (an ApiClient, or a factory called at start-up) replaces the one made from
    the settings; tests pass the fake API server's. The caller keeps ownership of an ApiClient
    passed in; one made here (by the default or a factory) is closed on clean-up.
    """
    placer = Placer(settings, state)
    app[PLACEMENT_KEY] = placer
    app.router.add_post("/scheduler/filter", handle_filter)
    app.router.add_post("/scheduler/prioritize", handle_prioritize)
    app.router.add_post("/scheduler/preempt", handle_preempt)
    app.router.add_post("/scheduler/bind", handle_bind)
    if not settings.kube_enabled:
        return placer

    owned: list[client.ApiClient] = []

    async def on_startup(_: web.Application) -> None:
        api: Any = api_client
        if isinstance(api, client.ApiClient):
            pass
        elif api is not None:
            api = api()
            if not isinstance(api, client.ApiClient):
                api = await api
            owned.append(api)
        else:
            api = await default_api_client(settings)
            owned.append(api)
        placer.attach(api)
        placer.start()
        logger.info("placement watches started")

    async def on_cleanup(_: web.Application) -> None:
        await placer.stop()
        for api in owned:
            await api.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return placer
