"""The gpuslice HTTPS service: the app factory (webhook + extender routes) and ``gpuslice serve``.

:func:`create_app` wires one :class:`~webhook.settings.Settings` into an aiohttp application:
``POST /mutate`` (admission), the scheduler extender under ``/scheduler/`` when placement is
enabled (``webhook.placement.extender.setup``), ``/healthz``, ``/readyz`` and ``/metrics`` (its
own Prometheus registry, shared with the extender through :data:`REGISTRY_KEY`). The serving
certificate lives in a :class:`~webhook.tls.CertStore` that reloads changed files in place.

:func:`cmd_serve` prepares the certificates for the TLS mode (``dev``: create them when absent;
``files``: only read them; ``secret``: ``webhook.bootstrap.ensure_tls`` then its rotation loop)
and serves HTTPS until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web
from kubernetes_asyncio.config import ConfigException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from webhook import __version__
from webhook.admission.server import AdmissionMetrics, MutateHandler
from webhook.settings import Settings
from webhook.tls import CertStore, ensure_dev_certs

logger = logging.getLogger(__name__)


class Placement(Protocol):
    """What the extender stores at ``webhook.placement.extender.PLACEMENT_KEY``."""

    def largest_gpu_memory_mib(self) -> int | None: ...

    def ready(self) -> bool: ...


SETTINGS_KEY = web.AppKey("gpuslice_settings", Settings)
REGISTRY_KEY = web.AppKey("gpuslice_registry", CollectorRegistry)
CERTS_KEY = web.AppKey("gpuslice_certs", CertStore)


def create_app(settings: Settings, *, cert_reload_interval: float = 2.0) -> web.Application:
    """Build the application; the certificate is loaded now if present, then watched."""
    app = web.Application(client_max_size=settings.max_body_bytes)
    registry = CollectorRegistry()
    certs = CertStore(settings.cert_dir, cert_reload_interval)
    certs.reload_if_changed()
    app[SETTINGS_KEY] = settings
    app[REGISTRY_KEY] = registry
    app[CERTS_KEY] = certs
    app.cleanup_ctx.append(_watch_certs)
    placement_key = _setup_placement(app, settings)

    def placement() -> Placement | None:
        return app.get(placement_key) if placement_key is not None else None  # type: ignore[call-overload]

    def largest_gpu_memory_mib() -> int | None:
        p = placement()
        return p.largest_gpu_memory_mib() if p is not None else None

    async def readyz(request: web.Request) -> web.Response:
        problems = []
        if not certs.loaded:
            problems.append(f"no serving certificate loaded from {settings.cert_dir}")
        if placement_key is not None:
            p = placement()
            if p is None or not p.ready():
                problems.append("placement state not ready")
        if problems:
            return web.json_response({"ready": False, "problems": problems}, status=503)
        return web.json_response({"ready": True})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/mutate", MutateHandler(settings, AdmissionMetrics(registry),
                                                 largest_gpu_memory_mib).handle)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    if settings.tls_mode == "secret":
        app.cleanup_ctx.append(_rotation)
    return app


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "version": __version__})


def _setup_placement(app: web.Application, settings: Settings) -> Any:
    """Register the extender; return its app key, or None when disabled or not installed."""
    if not settings.placement_enabled:
        return None
    try:
        from webhook.placement import extender
    except ModuleNotFoundError as exc:
        if exc.name not in ("webhook.placement.extender", "webhook.placement"):
            raise
        logger.warning("placement enabled but webhook.placement.extender is missing")
        return None
    extender.setup(app, settings)
    return extender.PLACEMENT_KEY


async def _watch_certs(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[CERTS_KEY].watch(), name="gpuslice-cert-watch")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _rotation(app: web.Application) -> AsyncIterator[None]:
    from webhook.bootstrap import rotation_loop

    task = asyncio.create_task(rotation_loop(app[SETTINGS_KEY]), name="gpuslice-cert-rotation")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def start_https(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve ``app`` over TLS with its certificate store; the caller cleans the runner up.

    Port 0 picks a free port (``runner.addresses[0][1]``).
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    # "" (None to asyncio): one socket per address family, IPv4 and IPv6
    site = web.TCPSite(runner, host or None, port, ssl_context=app[CERTS_KEY].context,
                       backlog=1024)
    await site.start()
    return runner


async def prepare_tls(settings: Settings) -> bool:
    """Make sure ``cert_dir`` holds the serving certificate the TLS mode promises."""
    if settings.tls_mode == "dev":
        try:
            ensure_dev_certs(settings.cert_dir, settings.release_namespace, settings.service_name)
        except OSError as exc:
            logger.error("cannot create development certificates",
                         extra={"dir": settings.cert_dir, "error": str(exc)})
            return False
    elif settings.tls_mode == "secret":
        from webhook.bootstrap import BootstrapError, ensure_tls

        try:
            await ensure_tls(settings)
        except BootstrapError as exc:
            logger.error("TLS bootstrap failed", extra={"error": str(exc)})
            return False
    return True


async def serve(settings: Settings) -> int:
    """Prepare the certificates for the TLS mode and serve until SIGTERM/SIGINT."""
    if not await prepare_tls(settings):
        return 1
    app = create_app(settings)
    if not app[CERTS_KEY].loaded:
        logger.error("no usable serving certificate; expected tls.crt and tls.key",
                     extra={"dir": settings.cert_dir})
        return 1
    try:
        runner = await start_https(app, settings.host, settings.port)
    except ConfigException as exc:  # the extender's API client, made at start-up
        logger.error("no Kubernetes API configuration; pass --kubeconfig, run in-cluster, or use "
                     "--no-kube", extra={"error": str(exc)})
        return 1
    except OSError as exc:
        logger.error("cannot listen", extra={"host": settings.host, "port": settings.port,
                                             "error": str(exc)})
        return 1
    # Everything built so far lives as long as the process: keep it out of the cyclic
    # garbage collector's full passes, which otherwise stall the loop for milliseconds.
    gc.freeze()
    # the sockets' own addresses: the default host "" listens on every address, one per family
    urls = [f"https://[{a[0]}]:{a[1]}" if ":" in str(a[0]) else f"https://{a[0]}:{a[1]}"
            for a in runner.addresses if isinstance(a, tuple)]
    logger.info("serving", extra={"url": " ".join(urls) or f"https://{settings.host}:{settings.port}",
                                  "version": __version__, "tls_mode": settings.tls_mode})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down")
        await runner.cleanup()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``gpuslice serve``: settings from the command line, then :func:`serve`."""
    from webhook.cli import settings_from_args
    from webhook.logs import setup_logging

    settings = settings_from_args(args)
    setup_logging(settings.log_level, settings.log_format)
    return asyncio.run(serve(settings))
