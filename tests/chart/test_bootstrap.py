"""TLS bootstrap (tls_mode=secret) against the fake API server through the real client."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import socket
import ssl
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from fakekube import FakeKube

from webhook import bootstrap, tls
from webhook.bootstrap import BootstrapError, Material
from webhook.settings import Settings, load_settings

NS, SERVICE, SECRET, MWC = "gpuslice-system", "gpuslice", "gpuslice-tls", "gpuslice"
SECRET_PATH = f"/api/v1/namespaces/{NS}/secrets"
MWC_PATH = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{MWC}"


@pytest.fixture(autouse=True)
def _no_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


def settings(cert_dir: Path, **kw: Any) -> Settings:
    return Settings(cert_dir=str(cert_dir), tls_mode="secret", kube_enabled=True,
                    release_namespace=NS, service_name=SERVICE, tls_secret_name=SECRET,
                    webhook_config_name=MWC, **kw)


def webhook_configuration(ca_bundle: str | None = None) -> dict[str, Any]:
    hooks = []
    for name in ("pods.gpuslice.io", "other.gpuslice.io"):
        client_config: dict[str, Any] = {"service": {"name": SERVICE, "namespace": NS,
                                                     "path": "/mutate"}}
        if ca_bundle:
            client_config["caBundle"] = ca_bundle
        hooks.append({"name": name, "clientConfig": client_config,
                      "admissionReviewVersions": ["v1"], "sideEffects": "None"})
    return {"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration", "metadata": {"name": MWC}, "webhooks": hooks}


def secret_data(kube: FakeKube) -> dict[str, bytes]:
    obj = kube.get("secrets", SECRET, NS)
    assert obj is not None
    return {k: base64.b64decode(v) for k, v in obj["data"].items()}


def put_secret(kube: FakeKube, m: Material) -> None:
    kube.put({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
              "metadata": {"name": SECRET, "namespace": NS}, "data": m.secret_data()})


def material(ca_days: int = 3650, serving_days: int = 365, service: str = SERVICE) -> Material:
    ca_crt, ca_key = tls.new_ca(days=ca_days)
    crt, key = tls.issue_serving_cert(ca_crt, ca_key, NS, service, serving_days)
    return Material(ca_crt, ca_key, crt, key)


def days_left(pem: bytes) -> float:
    cert = x509.load_pem_x509_certificate(pem)
    return (cert.not_valid_after_utc - dt.datetime.now(dt.UTC)).total_seconds() / 86400


def writes(kube: FakeKube) -> list[Any]:
    return [r for r in kube.requests if r.method in ("POST", "PUT", "PATCH", "DELETE")]


async def test_first_start_creates_secret_writes_files_and_patches_ca_bundle(
        tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)

        assert [(r.method, r.path) for r in kube.requests] == [
            ("GET", f"{SECRET_PATH}/{SECRET}"), ("POST", SECRET_PATH),
            ("GET", MWC_PATH), ("PATCH", MWC_PATH)]
        create = kube.requests[1]
        assert create.content_type == "application/json"
        assert create.body["kind"] == "Secret" and create.body["type"] == "kubernetes.io/tls"
        assert create.body["metadata"]["name"] == SECRET
        assert set(create.body["data"]) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}

        data = secret_data(kube)
        ca = x509.load_pem_x509_certificate(data["ca.crt"])
        serving = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
        serving.verify_directly_issued_by(ca)
        sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"{SERVICE}.{NS}.svc" in sans.get_values_for_type(x509.DNSName)
        assert (tmp_path / "ca.crt").read_bytes() == data["ca.crt"]
        assert (tmp_path / "tls.key").read_bytes() == data["tls.key"]
        assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600
        assert not (tmp_path / "ca.key").exists()  # the CA key stays in the Secret only

        bundle = base64.b64encode(data["ca.crt"]).decode()
        patch = kube.requests[3]
        assert patch.content_type == "application/json-patch+json"
        assert patch.body == [
            {"op": "test", "path": "/webhooks/0/name", "value": "pods.gpuslice.io"},
            {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": bundle},
            {"op": "test", "path": "/webhooks/1/name", "value": "other.gpuslice.io"},
            {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": bundle}]
        stored = kube.get("mutatingwebhookconfigurations", MWC)
        assert stored is not None
        assert [h["clientConfig"]["caBundle"] for h in stored["webhooks"]] == [bundle, bundle]
        assert stored["webhooks"][0]["clientConfig"]["service"]["path"] == "/mutate"


async def test_second_start_reuses_the_secret_and_writes_nothing(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path / "a"), api)
            first = secret_data(kube)
            kube.requests.clear()
            await bootstrap.ensure_tls(settings(tmp_path / "b"), api)
        assert writes(kube) == []
        assert (tmp_path / "b" / "tls.crt").read_bytes() == first["tls.crt"]
        assert (tmp_path / "b" / "ca.crt").read_bytes() == first["ca.crt"]


async def test_racing_replicas_converge_on_one_certificate(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            await asyncio.gather(bootstrap.ensure_tls(settings(tmp_path / "r1"), api),
                                 bootstrap.ensure_tls(settings(tmp_path / "r2"), api))
        creates = [r for r in kube.requests if r.method == "POST"]
        assert len(creates) == 2  # both tried; the second got 409 AlreadyExists
        data = secret_data(kube)
        for replica in ("r1", "r2"):
            assert (tmp_path / replica / "tls.crt").read_bytes() == data["tls.crt"]
            assert (tmp_path / replica / "ca.crt").read_bytes() == data["ca.crt"]
        stored = kube.get("mutatingwebhookconfigurations", MWC)
        assert stored is not None
        assert stored["webhooks"][0]["clientConfig"]["caBundle"] == \
            base64.b64encode(data["ca.crt"]).decode()


async def test_serving_cert_near_expiry_is_renewed_from_the_same_ca(tmp_path: Path) -> None:
    old = material(serving_days=10)
    async with FakeKube() as kube:
        put_secret(kube, old)
        kube.put(webhook_configuration(base64.b64encode(old.ca_bundle).decode()))
        version = kube.get("secrets", SECRET, NS)["metadata"]["resourceVersion"]  # type: ignore[index]
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
        replace = writes(kube)
        assert [(r.method, r.path) for r in replace] == [("PUT", f"{SECRET_PATH}/{SECRET}")]
        assert replace[0].body["metadata"]["resourceVersion"] == version
        data = secret_data(kube)
        assert data["ca.crt"] == old.ca_bundle and data["ca.key"] == old.ca_key
        assert data["tls.crt"] != old.tls_crt and days_left(data["tls.crt"]) > 300
        assert (tmp_path / "tls.crt").read_bytes() == data["tls.crt"]


async def test_expiring_ca_is_replaced_and_the_old_ca_stays_in_the_bundle(
        tmp_path: Path) -> None:
    old = material(ca_days=10, serving_days=10)
    async with FakeKube() as kube:
        put_secret(kube, old)
        kube.put(webhook_configuration(base64.b64encode(old.ca_bundle).decode()))
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
        data = secret_data(kube)
        cas = x509.load_pem_x509_certificates(data["ca.crt"])
        assert len(cas) == 2
        assert cas[1] == x509.load_pem_x509_certificate(old.ca_bundle)
        assert days_left(cas[0].public_bytes(serialization.Encoding.PEM)) > 3000
        x509.load_pem_x509_certificate(data["tls.crt"]).verify_directly_issued_by(cas[0])
        patches = [r for r in kube.requests if r.method == "PATCH"]
        assert len(patches) == 1
        assert patches[0].body[1]["value"] == base64.b64encode(data["ca.crt"]).decode()


@pytest.mark.parametrize("broken", ["garbage", "other-service", "missing-key",
                                    "signed-by-another-ca", "key-does-not-match"])
async def test_unusable_secret_content_is_replaced(tmp_path: Path, broken: str) -> None:
    good, other = material(), material()
    if broken == "garbage":
        bad = Material(b"not a cert", good.ca_key, good.tls_crt, good.tls_key)
    elif broken == "other-service":
        bad = material(service="someone-else")
    elif broken == "signed-by-another-ca":
        bad = Material(good.ca_bundle, good.ca_key, other.tls_crt, other.tls_key)
    elif broken == "key-does-not-match":
        bad = Material(good.ca_bundle, good.ca_key, good.tls_crt, other.tls_key)
    else:
        bad = good
    async with FakeKube() as kube:
        put_secret(kube, bad)
        if broken == "missing-key":
            obj = kube.get("secrets", SECRET, NS)
            assert obj is not None
            del obj["data"]["tls.key"]
            kube.put(obj)
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
        data = secret_data(kube)
        assert bootstrap.assess(Material.from_secret_data(
            kube.get("secrets", SECRET, NS)["data"]), NS, SERVICE,  # type: ignore[index]
            dt.datetime.now(dt.UTC)) == "ok"
        assert (tmp_path / "tls.crt").read_bytes() == data["tls.crt"]
        if broken in ("other-service", "signed-by-another-ca", "key-does-not-match"):
            assert data["ca.crt"] == bad.ca_bundle  # the CA was fine: only the cert is new
            assert data["tls.crt"] != bad.tls_crt


async def test_conflicting_rotation_is_reread_not_clobbered(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        put_secret(kube, material(serving_days=5))
        kube.put(webhook_configuration())
        kube.fail("PUT", f"{SECRET_PATH}/{SECRET}$", 409, message="the object has been modified")
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
        secret_ops = [r.method for r in kube.requests if r.path.startswith(SECRET_PATH)]
        assert secret_ops == ["GET", "PUT", "GET", "PUT"]
        assert days_left(secret_data(kube)["tls.crt"]) > 300


async def test_transient_api_errors_are_retried(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        kube.fail("GET", f"{SECRET_PATH}/{SECRET}$", 503, times=2)
        kube.fail("PATCH", MWC_PATH, 429)
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api, backoff_s=0.01)
        assert len(kube.requests_to("GET", f"{SECRET_PATH}/{SECRET}$")) == 3
        assert len(kube.requests_to("PATCH", MWC_PATH)) == 2
        assert (tmp_path / "tls.crt").exists()


async def test_forbidden_write_fails_with_an_rbac_hint(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.fail("POST", f"{SECRET_PATH}$", 403, message="secrets is forbidden")
        async with kube.api_client() as api:
            with pytest.raises(BootstrapError, match=r"HTTP 403.*RBAC"):
                await bootstrap.ensure_tls(settings(tmp_path), api)


async def test_forbidden_read_says_what_the_api_server_said(tmp_path: Path) -> None:
    said = ('secrets "gpuslice-tls" is forbidden: User "system:serviceaccount:gpuslice-system:'
            'gpuslice" cannot get resource "secrets" in the namespace "gpuslice-system"')
    async with FakeKube() as kube:
        kube.fail("GET", f"{SECRET_PATH}/{SECRET}$", 403, message=said)
        async with kube.api_client() as api:
            with pytest.raises(BootstrapError) as err:
                await bootstrap.ensure_tls(settings(tmp_path), api)
    assert str(err.value) == (
        f"cannot read or write Secret {NS}/{SECRET}: HTTP 403 Forbidden: {said} (check the "
        "chart's RBAC: Role <release>-tls and ClusterRole <release>-webhook)")


async def test_api_outage_past_the_deadline_fails_clearly(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.down = True
        async with kube.api_client() as api:
            with pytest.raises(BootstrapError, match="HTTP 503"):
                await bootstrap.ensure_tls(settings(tmp_path), api, deadline_s=0.3,
                                           backoff_s=0.05)
        assert len(kube.requests) >= 3


async def test_missing_webhook_configuration_is_not_fatal(tmp_path: Path) -> None:
    async with FakeKube() as kube:
        async with kube.api_client() as api:
            done = await bootstrap.reconcile(settings(tmp_path), api)
        assert done is False
        assert (tmp_path / "tls.crt").read_bytes() == secret_data(kube)["tls.crt"]


async def test_pod_namespace_other_than_release_namespace_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "elsewhere")
    with pytest.raises(BootstrapError, match="release_namespace"):
        await bootstrap.ensure_tls(settings(tmp_path))


async def test_rotation_loop_follows_another_replicas_rotation_and_survives_outages(
        tmp_path: Path) -> None:
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
            kube.down = True
            task = asyncio.create_task(bootstrap.rotation_loop(
                settings(tmp_path), api, interval_s=0.05, retry_s=0.05))
            await asyncio.sleep(0.3)
            assert not task.done()  # failures are logged, not raised
            kube.down = False
            rotated = material()  # what another replica stored (a whole new CA)
            put_secret(kube, rotated)
            bundle = base64.b64encode(rotated.ca_bundle).decode()
            for _ in range(100):  # the files are written first, then the caBundle patched
                now = kube.get("mutatingwebhookconfigurations", MWC)
                assert now is not None
                if (tmp_path / "tls.crt").read_bytes() == rotated.tls_crt and \
                        now["webhooks"][0]["clientConfig"]["caBundle"] == bundle:
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (tmp_path / "ca.crt").read_bytes() == rotated.ca_bundle
        stored = kube.get("mutatingwebhookconfigurations", MWC)
        assert stored is not None
        assert stored["webhooks"][0]["clientConfig"]["caBundle"] == \
            base64.b64encode(rotated.ca_bundle).decode()


async def test_rotation_loop_survives_a_cert_dir_it_cannot_write(tmp_path: Path) -> None:
    """An OSError from writing the files is logged and retried, like an API failure."""
    cert_dir = tmp_path / "certs"
    cert_dir.write_text("a file where the directory should be")
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        async with kube.api_client() as api:
            task = asyncio.create_task(bootstrap.rotation_loop(
                settings(cert_dir), api, interval_s=0.05, retry_s=0.05))
            await asyncio.sleep(0.3)
            assert not task.done()  # the failures did not end rotation
            cert_dir.unlink()
            for _ in range(100):
                if (cert_dir / "tls.crt").exists():
                    break
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (cert_dir / "tls.crt").read_bytes() == secret_data(kube)["tls.crt"]


async def test_init_container_command_bootstraps_through_a_kubeconfig(tmp_path: Path) -> None:
    """``python -m webhook.bootstrap --config`` as the chart's init container runs it."""
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({
            "release_namespace": NS, "service_name": SERVICE, "tls_secret_name": SECRET,
            "webhook_config_name": MWC, "cert_dir": str(tmp_path / "certs"),
            "kube_enabled": True, "log_format": "json"}))
        env = {k: v for k, v in os.environ.items() if k != "POD_NAMESPACE"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "webhook.bootstrap", "--config", str(config),
            "--kubeconfig", str(kubeconfig), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out.decode()
        assert (tmp_path / "certs" / "tls.crt").read_bytes() == secret_data(kube)["tls.crt"]
        assert b'"msg": "TLS Secret written"' in out


def test_init_container_command_rejects_a_bad_config(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("split_count: 0\n")
    assert bootstrap.main(["--config", str(config)]) == 2
    assert "split_count" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _https_get(port: int, path: str, cafile: Path, server_name: str) -> bytes:
    """GET over TLS verified as the API server verifies the webhook: CA file + serverName."""
    context = ssl.create_default_context(cafile=str(cafile))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                                   server_hostname=server_name)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n"
                 .encode())
    data = await reader.read()
    writer.close()
    return data


async def test_serve_in_secret_mode_answers_the_way_the_scheduler_calls_it(
        tmp_path: Path) -> None:
    """`gpuslice serve --tls-mode secret` (the chart's webhook container): the certificate it
    serves verifies against the Secret's ca.crt for serverName <service>.<ns>.svc on
    127.0.0.1, as the API server checks it with the caBundle."""
    async with FakeKube() as kube:
        kube.put(webhook_configuration())
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
        port = _free_port()
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({
            "release_namespace": NS, "service_name": SERVICE, "tls_secret_name": SECRET,
            "webhook_config_name": MWC, "cert_dir": str(tmp_path / "certs"), "port": port,
            "host": "127.0.0.1", "log_format": "json"}))
        env = {k: v for k, v in os.environ.items() if k != "POD_NAMESPACE"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "webhook", "serve", "--config", str(config), "--kube",
            "--tls-mode", "secret", "--kubeconfig", str(kubeconfig), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            answer = b""
            for _ in range(150):
                try:
                    answer = await _https_get(port, "/healthz", tmp_path / "certs" / "ca.crt",
                                              f"{SERVICE}.{NS}.svc")
                    break
                except (OSError, ssl.SSLError):
                    await asyncio.sleep(0.1)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert (tmp_path / "certs" / "ca.crt").read_bytes() == secret_data(kube)["ca.crt"]
        finally:
            proc.terminate()
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, out.decode()


async def test_rotation_loop_survives_an_unexpected_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a check raises (a bug included) is logged and the check retried: rotation lasts
    as long as the process."""
    calls: list[int] = []

    async def reconcile(*_args: object, **_kwargs: object) -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("a bug")
        return True

    monkeypatch.setattr(bootstrap, "reconcile", reconcile)
    task = asyncio.create_task(bootstrap.rotation_loop(
        settings(tmp_path / "certs"), None, interval_s=0.05, retry_s=0.02))
    for _ in range(200):
        if len(calls) >= 4:
            break
        await asyncio.sleep(0.02)
    assert not task.done() and len(calls) >= 4  # two failures, then checks at the interval
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# A release or namespace name an operator may well choose: the Service name (up to 40
# characters) and the namespace (up to 63) together exceed the 64 characters X.509 allows a
# common name, which the SANs, not the subject, carry for TLS anyway.
LONG_NAMES = [("gpuslice-production-cluster-eu-west-1", "gpuslice-system"),
              ("gpuslice", "ml-platform-shared-gpu-sharing-for-research-teams-prod")]


@pytest.mark.parametrize(("release", "namespace"), LONG_NAMES, ids=["release", "namespace"])
async def test_first_start_works_for_long_release_and_namespace_names(
        release: str, namespace: str, render: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rendered = render(release=release, namespace=namespace)
    config = tmp_path / "config.yaml"
    [name] = [c["metadata"]["name"] for c in rendered.all("ConfigMap")
              if c["metadata"]["name"].endswith("-config")]
    config.write_text(yaml.safe_dump(rendered.config(name)))
    s = load_settings(config, {"cert_dir": str(tmp_path / "certs")})
    mwc = rendered.one("MutatingWebhookConfiguration")
    monkeypatch.setenv("POD_NAMESPACE", namespace)
    async with FakeKube() as kube:
        kube.put(mwc)
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(s, api)
        stored = kube.get("secrets", s.tls_secret_name, namespace)
        assert stored is not None
    serving = x509.load_pem_x509_certificate((tmp_path / "certs" / "tls.crt").read_bytes())
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"{s.service_name}.{namespace}.svc" in sans.get_values_for_type(x509.DNSName)


def test_previous_ca_leaves_the_bundle_a_day_after_the_switch() -> None:
    """The previous CA (ours before a rotation, or cert-manager's after a switch of tls.mode)
    is trusted while pods may still serve a certificate it signed, not for years after."""
    now = dt.datetime.now(dt.UTC)
    old = material()
    rotated = bootstrap.renew(None, "new-ca", NS, SERVICE, now, old.ca_bundle)
    assert len(x509.load_pem_x509_certificates(rotated.ca_bundle)) == 2
    assert bootstrap.assess(rotated, NS, SERVICE, now + dt.timedelta(hours=23)) == "ok"
    assert bootstrap.assess(rotated, NS, SERVICE, now + dt.timedelta(hours=25)) == "trim"
    trimmed = bootstrap.renew(rotated, "trim", NS, SERVICE, now + dt.timedelta(hours=25))
    assert x509.load_pem_x509_certificates(trimmed.ca_bundle) == \
        x509.load_pem_x509_certificates(rotated.ca_bundle)[:1]
    assert (trimmed.ca_key, trimmed.tls_crt, trimmed.tls_key) == \
        (rotated.ca_key, rotated.tls_crt, rotated.tls_key)
    assert bootstrap.assess(trimmed, NS, SERVICE, now + dt.timedelta(hours=25)) == "ok"


def test_a_previous_bundle_that_is_no_ca_is_not_kept() -> None:
    """Only a CA that has not expired is carried over: not a serving certificate someone put
    in ca.crt, nor garbage."""
    now = dt.datetime.now(dt.UTC)
    leaf = material().tls_crt
    for previous in (leaf, b"not a certificate", b""):
        fresh = bootstrap.renew(None, "new-ca", NS, SERVICE, now, previous)
        assert len(x509.load_pem_x509_certificates(fresh.ca_bundle)) == 1
    expired = material(ca_days=1).ca_bundle
    fresh = bootstrap.renew(None, "new-ca", NS, SERVICE, now + dt.timedelta(days=2), expired)
    assert len(x509.load_pem_x509_certificates(fresh.ca_bundle)) == 1


async def test_the_check_trims_the_previous_ca_from_secret_and_ca_bundle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = dt.datetime.now(dt.UTC)
    monkeypatch.setattr(tls, "_validity", lambda days: (now - dt.timedelta(days=2),
                                                        now + dt.timedelta(days=days)))
    current, previous = material(), material()
    both = Material(current.ca_bundle + previous.ca_bundle, current.ca_key, current.tls_crt,
                    current.tls_key)
    monkeypatch.undo()
    async with FakeKube() as kube:
        put_secret(kube, both)
        kube.put(webhook_configuration(base64.b64encode(both.ca_bundle).decode()))
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(settings(tmp_path), api)
        data = secret_data(kube)
        assert data["ca.crt"] == current.ca_bundle and data["tls.crt"] == current.tls_crt
        stored = kube.get("mutatingwebhookconfigurations", MWC)
        assert stored is not None
        assert stored["webhooks"][0]["clientConfig"]["caBundle"] == \
            base64.b64encode(current.ca_bundle).decode()
        assert (tmp_path / "ca.crt").read_bytes() == current.ca_bundle
