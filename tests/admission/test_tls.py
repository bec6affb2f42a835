"""Development certificates and the serving certificate's reload without a restart."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import os
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from webhook.service import CERTS_KEY, create_app
from webhook.settings import Settings
from webhook.tls import (
    CA_CERT,
    CA_KEY,
    TLS_CERT,
    TLS_KEY,
    CertStore,
    cmd_certs,
    ensure_dev_certs,
    issue_serving_cert,
    new_ca,
    service_names,
    serving_problem,
    write_atomic,
)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_dev_certs_name_the_service_in_every_form_and_loopback(tmp_path: Path) -> None:
    assert ensure_dev_certs(tmp_path, "gpu-ns", "hook", days=30)
    cert, ca = _cert(tmp_path / TLS_CERT), _cert(tmp_path / CA_CERT)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "hook", "hook.gpu-ns", "hook.gpu-ns.svc", "hook.gpu-ns.svc.cluster.local", "localhost"]
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    assert ExtendedKeyUsageOID.SERVER_AUTH in cert.extensions.get_extension_for_class(
        x509.ExtendedKeyUsage).value
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    days = (cert.not_valid_after_utc - cert.not_valid_before_utc).days
    assert 29 <= days <= 30
    assert (tmp_path / TLS_KEY).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / CA_KEY).stat().st_mode & 0o777 == 0o600


def test_existing_certs_are_kept_and_an_existing_ca_is_reused(tmp_path: Path) -> None:
    ensure_dev_certs(tmp_path, "ns", "svc")
    first = (tmp_path / TLS_CERT).read_bytes()
    assert not ensure_dev_certs(tmp_path, "ns", "svc")
    assert (tmp_path / TLS_CERT).read_bytes() == first
    ca = (tmp_path / CA_CERT).read_bytes()
    (tmp_path / TLS_CERT).unlink()
    assert ensure_dev_certs(tmp_path, "ns", "svc")
    assert (tmp_path / CA_CERT).read_bytes() == ca
    _cert(tmp_path / TLS_CERT).verify_directly_issued_by(_cert(tmp_path / CA_CERT))
    assert ensure_dev_certs(tmp_path, "ns", "svc", force=True)
    assert (tmp_path / CA_CERT).read_bytes() != ca


def test_gpuslice_certs_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(dir=str(tmp_path / "c"), namespace="prod", service="gs", days=10,
                              force=False)
    assert cmd_certs(args) == 0
    out = capsys.readouterr().out
    assert "gs.prod.svc" in out
    # every file it wrote is named, the CA's key too (it was left out)
    assert all(str(tmp_path / "c" / f) in out for f in ("ca.crt", "ca.key", "tls.crt", "tls.key"))
    serial = _cert(tmp_path / "c" / TLS_CERT).serial_number
    assert cmd_certs(args) == 0 and "keeping them" in capsys.readouterr().out
    assert cmd_certs(argparse.Namespace(**{**vars(args), "force": True})) == 0
    assert _cert(tmp_path / "c" / TLS_CERT).serial_number != serial
    assert cmd_certs(argparse.Namespace(**{**vars(args), "days": 0})) == 2


def _peer_cert(server: Any) -> x509.Certificate:
    """The certificate a new client connection (no SNI: an IP address) is served."""
    async def handshake() -> x509.Certificate:
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.port,
                                                        ssl=server.ssl)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return x509.load_der_x509_certificate(der)

    return asyncio.run(handshake())


def _peer_serial(server: Any) -> int:
    return _peer_cert(server).serial_number


def _replace_serving_cert(cert_dir: Path) -> int:
    cert, key = issue_serving_cert((cert_dir / CA_CERT).read_bytes(),
                                   (cert_dir / CA_KEY).read_bytes(), "gpuslice-system",
                                   "gpuslice")
    write_atomic(cert_dir / TLS_KEY, key, 0o600)
    write_atomic(cert_dir / TLS_CERT, cert)
    return x509.load_pem_x509_certificate(cert).serial_number


def _wait_for_serial(server: Any, serial: int) -> int:
    deadline = time.monotonic() + 10
    seen = _peer_serial(server)
    while seen != serial and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = _peer_serial(server)
    return seen


def test_new_connections_get_the_replaced_certificate_without_restart(
        tmp_path: Path, make_server: Any) -> None:
    ensure_dev_certs(tmp_path, "gpuslice-system", "gpuslice")
    first = _cert(tmp_path / TLS_CERT).serial_number
    server = make_server(Settings(cert_dir=str(tmp_path), tls_mode="files",
                                  placement_enabled=False), cert_reload_interval=0.05)
    assert _peer_serial(server) == first
    second = _replace_serving_cert(tmp_path)
    assert _wait_for_serial(server, second) == second
    assert server.app[CERTS_KEY].info.serial == second  # type: ignore[union-attr]
    assert server.request("GET", "/readyz")[0] == 200

    # A pair that does not match is refused; the server keeps the last good certificate.
    _, other_key = new_ca()
    write_atomic(tmp_path / TLS_KEY, other_key, 0o600)
    os.utime(tmp_path / TLS_CERT)
    time.sleep(0.3)
    assert _peer_serial(server) == second
    third = _replace_serving_cert(tmp_path)
    assert _wait_for_serial(server, third) == third


async def test_readyz_is_503_until_a_certificate_appears(tmp_path: Path) -> None:
    settings = Settings(cert_dir=str(tmp_path), tls_mode="files", placement_enabled=False)
    app = create_app(settings, cert_reload_interval=0.05)
    async with TestClient(TestServer(app)) as client:  # plain HTTP: only readiness is tested
        resp = await client.get("/readyz")
        assert resp.status == 503
        assert (await resp.json())["problems"] == [
            f"no serving certificate loaded from {tmp_path}"]
        ensure_dev_certs(tmp_path, "ns", "svc")
        for _ in range(100):
            resp = await client.get("/readyz")
            if resp.status == 200:
                break
            await asyncio.sleep(0.05)
        assert resp.status == 200


def test_cert_store_context_serves_tls_1_2_or_newer(tmp_path: Path) -> None:
    ensure_dev_certs(tmp_path, "ns", "svc")
    app = create_app(Settings(cert_dir=str(tmp_path), placement_enabled=False))
    store: Any = app[CERTS_KEY]
    assert store.loaded and store.context.minimum_version == ssl.TLSVersion.TLSv1_2


def _rsa_serving_pair(cert_dir: Path) -> tuple[bytes, bytes]:
    """An RSA serving pair issued by the directory's (ECDSA) CA, for the same names."""
    ca_cert = _cert(cert_dir / CA_CERT)
    ca_key: Any = serialization.load_pem_private_key((cert_dir / CA_KEY).read_bytes(), None)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.UTC)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rsa")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _install(cert_dir: Path, kind: str) -> int:
    """Put a new serving pair with a ``kind`` ("ec" or "rsa") key in place; its serial."""
    if kind == "ec":
        return _replace_serving_cert(cert_dir)
    cert, key = _rsa_serving_pair(cert_dir)
    write_atomic(cert_dir / TLS_KEY, key, 0o600)
    write_atomic(cert_dir / TLS_CERT, cert)
    return x509.load_pem_x509_certificate(cert).serial_number


@pytest.mark.parametrize("first,then", [("ec", "rsa"), ("rsa", "ec")])
def test_reloaded_pair_with_another_key_type_is_what_new_connections_get(
        tmp_path: Path, make_server: Any, first: str, then: str) -> None:
    """One context loaded with an ECDSA pair and then an RSA pair holds both and kept
    serving the old ECDSA certificate to clients that accept either."""
    ensure_dev_certs(tmp_path, "gpuslice-system", "gpuslice")
    old = _install(tmp_path, first)
    server = make_server(Settings(cert_dir=str(tmp_path), tls_mode="files",
                                  placement_enabled=False), cert_reload_interval=0.05)
    assert _peer_serial(server) == old
    new = _install(tmp_path, then)
    assert _wait_for_serial(server, new) == new
    key_type = rsa.RSAPublicKey if then == "rsa" else ec.EllipticCurvePublicKey
    assert isinstance(_peer_cert(server).public_key(), key_type)
    assert server.request("GET", "/readyz")[0] == 200


def _expired_pair(d: Path) -> tuple[bytes, bytes]:
    return issue_serving_cert((d / CA_CERT).read_bytes(), (d / CA_KEY).read_bytes(), "ns",
                              "svc", days=0)


def _expiring_pair(d: Path) -> tuple[bytes, bytes]:
    return issue_serving_cert((d / CA_CERT).read_bytes(), (d / CA_KEY).read_bytes(), "ns",
                              "svc", days=20)


def _mismatched_pair(d: Path) -> tuple[bytes, bytes]:
    return (d / TLS_CERT).read_bytes(), new_ca()[1]


def _half_written_pair(d: Path) -> tuple[bytes, bytes]:
    return (d / TLS_CERT).read_bytes()[:100], (d / TLS_KEY).read_bytes()


def _other_ca_pair(d: Path) -> tuple[bytes, bytes]:
    return issue_serving_cert(*new_ca(), "ns", "svc")


def _other_service_pair(d: Path) -> tuple[bytes, bytes]:
    return issue_serving_cert((d / CA_CERT).read_bytes(), (d / CA_KEY).read_bytes(), "old-ns",
                              "svc")


@pytest.mark.parametrize("damage", [_expired_pair, _expiring_pair, _mismatched_pair,
                                    _half_written_pair, _other_ca_pair, _other_service_pair],
                         ids=lambda f: f.__name__.strip("_"))
def test_dev_certs_replace_a_serving_pair_that_cannot_serve_and_keep_the_ca(
        tmp_path: Path, damage: Any) -> None:
    ensure_dev_certs(tmp_path, "ns", "svc")
    ca = (tmp_path / CA_CERT).read_bytes()
    cert, key = damage(tmp_path)
    write_atomic(tmp_path / TLS_KEY, key, 0o600)
    write_atomic(tmp_path / TLS_CERT, cert)
    assert ensure_dev_certs(tmp_path, "ns", "svc")
    assert (tmp_path / CA_CERT).read_bytes() == ca  # clients that trust it keep working
    assert serving_problem((tmp_path / TLS_CERT).read_bytes(), (tmp_path / TLS_KEY).read_bytes(),
                           _cert(tmp_path / CA_CERT), service_names("ns", "svc"),
                           dt.datetime.now(dt.UTC)) is None
    assert CertStore(tmp_path).reload_if_changed()  # what `serve` then loads
    assert not ensure_dev_certs(tmp_path, "ns", "svc")


def test_dev_certs_for_another_service_name_the_new_service(tmp_path: Path) -> None:
    ensure_dev_certs(tmp_path, "ns", "svc")
    assert ensure_dev_certs(tmp_path, "prod", "hook")
    sans = _cert(tmp_path / TLS_CERT).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "hook.prod.svc" in sans.get_values_for_type(x509.DNSName)


def test_dev_certs_replace_an_expiring_ca(tmp_path: Path) -> None:
    ca, ca_key = new_ca(days=10)
    write_atomic(tmp_path / CA_KEY, ca_key, 0o600)
    write_atomic(tmp_path / CA_CERT, ca)
    assert ensure_dev_certs(tmp_path, "ns", "svc")
    assert (tmp_path / CA_CERT).read_bytes() != ca
    _cert(tmp_path / TLS_CERT).verify_directly_issued_by(_cert(tmp_path / CA_CERT))
    assert (_cert(tmp_path / CA_CERT).not_valid_after_utc - dt.datetime.now(dt.UTC)).days > 3000


async def test_cert_watch_outlives_a_pair_it_cannot_read(tmp_path: Path) -> None:
    """A passphrase-protected key (or one of a type this OpenSSL lacks) dropped into cert_dir
    is logged and skipped like any broken pair; the watch goes on and loads the next good one
    (a watch that ended there would serve the old certificate until it expired)."""
    ensure_dev_certs(tmp_path, "gpuslice-system", "gpuslice")
    store = CertStore(tmp_path, interval=0.01)
    assert store.reload_if_changed()
    task = asyncio.create_task(store.watch())
    try:
        key = serialization.load_pem_private_key((tmp_path / TLS_KEY).read_bytes(), None)
        encrypted = key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"secret"))
        write_atomic(tmp_path / TLS_KEY, encrypted, 0o600)
        await asyncio.sleep(0.1)
        assert not task.done(), f"the certificate watch ended: {task.exception()!r}"
        second = _replace_serving_cert(tmp_path)
        for _ in range(200):
            if store.info is not None and store.info.serial == second:
                break
            await asyncio.sleep(0.01)
        assert store.info is not None and store.info.serial == second
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
