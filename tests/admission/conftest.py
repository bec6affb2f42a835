"""Fixtures for the admission HTTP tests: development certificates and a real TLS server.

``TLSServer`` runs ``webhook.service.create_app`` behind ``start_https`` on a free loopback
port in a background thread with its own event loop, so tests (and hypothesis) can talk to it
with a plain synchronous HTTPS client, exactly as the API server would: over TLS, verifying the
certificate against the development CA.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from webhook.service import create_app, start_https
from webhook.settings import Settings
from webhook.tls import CA_CERT, ensure_dev_certs


class TLSServer:
    """The service on https://127.0.0.1:<port>, served from a background event loop."""

    def __init__(self, settings: Settings, cert_reload_interval: float = 2.0) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app: web.Application = self.call(self._create(cert_reload_interval))
        self.runner: web.AppRunner = self.call(start_https(self.app, "127.0.0.1", 0))
        self.port: int = self.runner.addresses[0][1]
        self.ssl = ssl.create_default_context(cafile=str(Path(settings.cert_dir) / CA_CERT))

    async def _create(self, interval: float) -> web.Application:
        return create_app(self.settings, cert_reload_interval=interval)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ssl,
                                           timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def post_review(self, review: Any, content_type: str = "application/json"
                    ) -> tuple[int, Any]:
        body = review if isinstance(review, bytes) else json.dumps(review).encode()
        status, _, data = self.request("POST", "/mutate", body,
                                       {"Content-Type": content_type})
        return status, json.loads(data)

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def module_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    ensure_dev_certs(d, "gpuslice-system", "gpuslice")
    return d


@pytest.fixture(scope="module")
def server(module_certs: Path) -> Iterator[TLSServer]:
    """One webhook (placement off, default limits) for the tests of a module."""
    srv = TLSServer(Settings(cert_dir=str(module_certs), tls_mode="files",
                             placement_enabled=False))
    yield srv
    srv.close()


def review(obj: Any, *, operation: str = "CREATE", kind: str = "Pod", group: str = "",
           namespace: str | None = "team-a", uid: str = "3b8f2f5e-1d9c-4b7e-9a51-0c2d6c1e7f10",
           **extra: Any) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview request as the API server sends it."""
    request: dict[str, Any] = {
        "uid": uid, "kind": {"group": group, "version": "v1", "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
        "operation": operation, "userInfo": {"username": "alice"},
        "object": obj, "oldObject": None, "dryRun": False, **extra,
    }
    if namespace is not None:
        request["namespace"] = namespace
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def gpu_pod(name: str = "infer", limits: dict[str, Any] | None = None,
            **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {
                "limits": limits if limits is not None else {"nvidia.com/gpumem": "8000"}}}],
                **spec}}


@pytest.fixture
def make_review() -> Any:
    return review


@pytest.fixture
def make_gpu_pod() -> Any:
    return gpu_pod


@pytest.fixture
def make_server() -> Iterator[Any]:
    """Start extra servers (own settings, reload interval); all are closed after the test."""
    started: list[TLSServer] = []

    def start(settings: Settings, cert_reload_interval: float = 2.0) -> TLSServer:
        srv = TLSServer(settings, cert_reload_interval)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.close()
