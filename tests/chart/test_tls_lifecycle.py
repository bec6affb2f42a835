"""The webhook configuration's caBundle through the Helm lifecycle (tls.mode=secret).

The service runs as the chart's webhook container does (``create_app`` in secret mode, its
rotation started by the app, API access through a kubeconfig) against the fake API server, with
the chart's own MutatingWebhookConfiguration. :func:`admits` asks what the API server asks
before it calls the webhook: does the TLS handshake with the Service verify against the
configuration's ``caBundle`` for ``<service>.<namespace>.svc``? A configuration without one
verifies against the API server's system roots, which do not hold the service's private CA: every
GPU pod is refused (``failurePolicy: Fail``).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from fakekube import FakeKube

from webhook import bootstrap, tls
from webhook.bootstrap import Material
from webhook.settings import Settings

NS, SERVICE, SECRET = "gpuslice-system", "gpuslice", "gpuslice-tls"


@pytest.fixture(autouse=True)
def _no_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


def _settings(cert_dir: Path, mwc: str, kubeconfig: Path | None = None) -> Settings:
    return Settings(cert_dir=str(cert_dir), tls_mode="secret", kube_enabled=True,
                    release_namespace=NS, service_name=SERVICE, tls_secret_name=SECRET,
                    webhook_config_name=mwc, placement_enabled=False,
                    kubeconfig=str(kubeconfig) if kubeconfig else None)


@pytest.fixture
async def chart_mwc(render: Any) -> dict[str, Any]:
    """The chart's webhook configuration as `helm install` creates it (nothing to look up)."""
    return render({"tls": {"mode": "secret"}}).one("MutatingWebhookConfiguration")


async def test_new_ca_is_in_the_ca_bundle_before_the_service_serves_a_certificate_it_signed(
        tmp_path: Path, chart_mwc: dict[str, Any]) -> None:
    """A CA rotation writes the new serving certificate and sets the caBundle (new and old CA).
    The files used to come first: while the patch was retried (an API server busy for a few
    seconds) the service served a certificate the caBundle did not trust."""
    name = chart_mwc["metadata"]["name"]
    ca_crt, ca_key = tls.new_ca(days=10)  # expiring: the check makes a new CA
    crt, key = tls.issue_serving_cert(ca_crt, ca_key, NS, SERVICE, 10)
    old = Material(ca_crt, ca_key, crt, key)
    cert_dir = tmp_path / "certs"
    bootstrap.write_files(cert_dir, old)
    async with FakeKube() as kube:
        kube.put({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                  "metadata": {"name": SECRET, "namespace": NS}, "data": old.secret_data()})
        mwc = kube.put(chart_mwc)
        for hook in mwc["webhooks"]:
            hook["clientConfig"]["caBundle"] = base64.b64encode(old.ca_bundle).decode()
        kube.put(mwc)
        kube.fail("PATCH", f"mutatingwebhookconfigurations/{name}$", 503, times=3)
        untrusted = 0
        async with kube.api_client() as api:
            task = asyncio.create_task(bootstrap.reconcile(_settings(cert_dir, name), api,
                                                           backoff_s=0.2))
            while not task.done():
                live = kube.get("mutatingwebhookconfigurations", name)
                assert live is not None
                trusted = x509.load_pem_x509_certificates(base64.b64decode(
                    live["webhooks"][0]["clientConfig"]["caBundle"]))
                serving = x509.load_pem_x509_certificate((cert_dir / "tls.crt").read_bytes())
                if not any(_issued_by(serving, ca) for ca in trusted):
                    untrusted += 1
                await asyncio.sleep(0.01)
            assert await task
        serving = x509.load_pem_x509_certificate((cert_dir / "tls.crt").read_bytes())
        assert serving.serial_number != x509.load_pem_x509_certificate(crt).serial_number
        assert untrusted == 0, f"served an untrusted certificate for ~{untrusted * 0.01:.1f} s"


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception):  # noqa: BLE001 - InvalidSignature and friends
        return False
    return cert.not_valid_after_utc > dt.datetime.now(dt.UTC)
