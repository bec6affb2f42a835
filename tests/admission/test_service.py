"""The service around the webhook: placement wiring, TLS modes, and ``gpuslice serve`` itself."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import webhook.placement
from webhook.service import SETTINGS_KEY, create_app, prepare_tls
from webhook.settings import Settings
from webhook.tls import CA_CERT, TLS_CERT, ensure_dev_certs

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


class FakePlacement:
    def __init__(self) -> None:
        self.is_ready = False
        self.largest: int | None = None

    def largest_gpu_memory_mib(self) -> int | None:
        if self.largest == -1:
            raise RuntimeError("inventory broken")
        return self.largest

    def ready(self) -> bool:
        return self.is_ready


@pytest.fixture
def fake_extender(monkeypatch: pytest.MonkeyPatch) -> FakePlacement:
    """Stand in for webhook.placement.extender through its documented interface."""
    placement = FakePlacement()
    module = types.ModuleType("webhook.placement.extender")
    key = web.AppKey("fake_placement", FakePlacement)
    calls: list[Settings] = []

    def setup(app: web.Application, settings: Settings) -> None:
        calls.append(settings)
        app[key] = placement

    module.setup = setup  # type: ignore[attr-defined]
    module.PLACEMENT_KEY = key  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "webhook.placement.extender", module)
    monkeypatch.setattr(webhook.placement, "extender", module, raising=False)
    placement.calls = calls  # type: ignore[attr-defined]
    return placement


def _review(limits: dict[str, str]) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}]}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE", "namespace": "default", "object": pod}}


async def test_placement_gates_readiness_and_bounds_gpumem(
        tmp_path: Path, fake_extender: FakePlacement) -> None:
    ensure_dev_certs(tmp_path, "ns", "svc")
    settings = Settings(cert_dir=str(tmp_path), tls_mode="files")
    app = create_app(settings)
    assert fake_extender.calls == [settings]  # type: ignore[attr-defined]
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/readyz")
        assert resp.status == 503
        assert (await resp.json())["problems"] == ["placement state not ready"]
        fake_extender.is_ready = True
        assert (await client.get("/readyz")).status == 200

        async def allowed(limits: dict[str, str]) -> tuple[bool, str]:
            resp = await client.post("/mutate", json=_review(limits))
            body = (await resp.json())["response"]
            return body["allowed"], body.get("status", {}).get("message", "")

        assert await allowed({"nvidia.com/gpumem": "50000"}) == (True, "")
        fake_extender.largest = 40960
        ok, message = await allowed({"nvidia.com/gpumem": "50000"})
        assert not ok and "largest GPU in the cluster has 40960 MiB" in message
        assert (await allowed({"nvidia.com/gpumem": "40960"}))[0]
        fake_extender.largest = -1  # an inventory failure never blocks admission
        assert (await allowed({"nvidia.com/gpumem": "50000"}))[0]


async def test_configured_max_gpu_memory_wins_over_the_inventory(
        tmp_path: Path, fake_extender: FakePlacement) -> None:
    fake_extender.largest, fake_extender.is_ready = 81920, True
    app = create_app(Settings(cert_dir=str(tmp_path), max_gpu_memory_mib=16384))
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/mutate", json=_review({"nvidia.com/gpumem": "20000"}))
        assert (await resp.json())["response"]["allowed"] is False


async def test_missing_extender_module_is_tolerated(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "webhook.placement.extender", None)
    monkeypatch.delattr(webhook.placement, "extender", raising=False)
    ensure_dev_certs(tmp_path, "ns", "svc")
    app = create_app(Settings(cert_dir=str(tmp_path)))
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/readyz")).status == 200


async def test_secret_mode_bootstraps_then_rotates_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    module = types.ModuleType("webhook.bootstrap")

    async def ensure_tls(settings: Settings) -> None:
        events.append("ensure_tls")
        ensure_dev_certs(settings.cert_dir, "ns", "svc")

    async def rotation_loop(settings: Settings) -> None:
        events.append("rotation started")
        try:
            await asyncio.Event().wait()
        finally:
            events.append("rotation stopped")

    module.ensure_tls = ensure_tls  # type: ignore[attr-defined]
    module.rotation_loop = rotation_loop  # type: ignore[attr-defined]
    module.BootstrapError = RuntimeError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "webhook.bootstrap", module)
    settings = Settings(cert_dir=str(tmp_path), tls_mode="secret", placement_enabled=False)
    assert await prepare_tls(settings)
    app = create_app(settings)
    assert app[SETTINGS_KEY] is settings
    async with TestClient(TestServer(app)) as client:
        await asyncio.sleep(0.01)
        assert (await client.get("/readyz")).status == 200
    assert events == ["ensure_tls", "rotation started", "rotation stopped"]


async def test_failed_secret_bootstrap_stops_start_up_with_a_logged_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from webhook import bootstrap

    async def ensure_tls(settings: Settings) -> None:
        raise bootstrap.BootstrapError("forbidden: cannot create secrets (check the RBAC)")

    monkeypatch.setattr(bootstrap, "ensure_tls", ensure_tls)
    settings = Settings(cert_dir=str(tmp_path), tls_mode="secret", placement_enabled=False)
    assert not await prepare_tls(settings)
    assert [r.error for r in caplog.records if r.msg == "TLS bootstrap failed"] == [
        "forbidden: cannot create secrets (check the RBAC)"]


async def test_dev_mode_creates_missing_certs_and_files_mode_does_not(tmp_path: Path) -> None:
    assert await prepare_tls(Settings(cert_dir=str(tmp_path / "files"), tls_mode="files"))
    assert not (tmp_path / "files" / TLS_CERT).exists()
    assert await prepare_tls(Settings(cert_dir=str(tmp_path / "dev"), tls_mode="dev"))
    assert (tmp_path / "dev" / TLS_CERT).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpuslice(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-m", "webhook", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_gpuslice_serve_dev_mode_makes_certs_serves_https_and_stops_on_sigterm(
        tmp_path: Path) -> None:
    port = _free_port()
    proc = _gpuslice("serve", "--cert-dir", str(tmp_path), "--host", "127.0.0.1",
                     "--port", str(port), "--set", "placement_enabled=false")
    try:
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and status != 200:
            assert proc.poll() is None, proc.communicate()
            try:
                ctx = ssl.create_default_context(cafile=str(tmp_path / CA_CERT))
                with urllib.request.urlopen(f"https://localhost:{port}/readyz", context=ctx,
                                            timeout=5) as resp:
                    status = resp.status
            except OSError:
                time.sleep(0.1)
        assert status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "serving" in err and "shutting down" in err


@pytest.mark.parametrize(("config", "field"), [
    ("split_count: 0\n", "split_count"),
    ("tls_mode: maybe\n", "tls_mode"),
    ("resource_gpu: 'not a name!'\n", "resource_gpu"),
    ("tolerations: [{key: a, operator: Sometimes}]\n", "tolerations"),
    ("no_such_setting: 1\n", "no_such_setting"),
])
def test_bad_setting_stops_serve_with_a_message_naming_the_field(
        tmp_path: Path, config: str, field: str) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(config)
    proc = _gpuslice("serve", "--config", str(path), "--cert-dir", str(tmp_path / "c"))
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "configuration error" in err and field in err
    assert not (tmp_path / "c").exists(), "nothing may start before settings are valid"


def test_serve_in_files_mode_without_certificates_exits_1(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = _gpuslice("serve", "--tls-mode", "files", "--cert-dir", str(tmp_path),
                     "--port", str(_free_port()), "--set", "placement_enabled=false", env=env)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "no usable serving certificate" in err


@pytest.mark.parametrize("kubeconfig", [None, "missing"])
def test_serve_with_the_api_but_no_configuration_for_it_exits_1_saying_so(
        tmp_path: Path, kubeconfig: str | None) -> None:
    # `serve --kube` outside a cluster (no service account) or with a kubeconfig that is not
    # there: the extender's API client, made at start-up, ended the process with a traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    extra = ["--kubeconfig", str(tmp_path / "none")] if kubeconfig else []
    proc = _gpuslice("serve", "--kube", *extra, "--tls-mode", "dev", "--cert-dir", str(tmp_path / "c"),
                     "--port", str(_free_port()), env={**env, "PYTHONUNBUFFERED": "1"})
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "no Kubernetes API configuration; pass --kubeconfig, run in-cluster, or use --no-kube" in err
    assert "Traceback" not in err


async def test_the_real_extender_is_wired_in_when_placement_is_enabled(tmp_path: Path) -> None:
    pytest.importorskip("webhook.placement.extender")
    ensure_dev_certs(tmp_path, "ns", "svc")
    app = create_app(Settings(cert_dir=str(tmp_path)))  # placement on, Kubernetes API off
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/readyz")).status == 200
        assert (await client.post("/scheduler/filter", json={})).status != 404
        resp = await client.post("/mutate", json=_review({"nvidia.com/gpumem": "1000"}))
        assert (await resp.json())["response"]["allowed"] is True
