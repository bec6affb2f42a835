"""Certificates: a development CA and serving certificate, and a server context that reloads them.

* :func:`new_ca` / :func:`issue_serving_cert` make PEM pairs with ``cryptography`` (ECDSA
  P-256); the serving certificate names ``<service>``, ``<service>.<ns>``, ``<service>.<ns>.svc``,
  ``<service>.<ns>.svc.cluster.local``, ``localhost``, ``127.0.0.1`` and ``::1``.
* :func:`usable_ca` / :func:`serving_problem` tell whether a CA can still issue and whether a
  serving pair can still serve (it loads, matches, is issued by the CA, names the service,
  and is not about to expire); the secret-mode bootstrap decides with them too.
* :func:`ensure_dev_certs` writes ``ca.crt``/``ca.key``/``tls.crt``/``tls.key`` into a
  directory (atomically, keys 0600) unless a usable pair is there, reusing a usable CA;
  ``gpuslice certs`` is :func:`cmd_certs`.
* :class:`CertStore` owns the server's :class:`ssl.SSLContext`. It watches ``tls.crt`` and
  ``tls.key`` and loads a changed, matching pair into a fresh context, to which the listener's
  context hands every new handshake, so new connections get the new certificate without a
  restart, whatever its key type; a broken pair is logged and the old one kept.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger(__name__)

CA_CERT, CA_KEY, TLS_CERT, TLS_KEY = "ca.crt", "ca.key", "tls.crt", "tls.key"
CA_DAYS = 3650
RENEW_BEFORE = dt.timedelta(days=30)
CN_MAX = 64  # bytes in an X.509 common name (RFC 5280 ub-common-name)
"""A CA or serving certificate that expires sooner than this is replaced."""


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def new_ca(days: int = CA_DAYS, common_name: str = "gpuslice development CA") -> tuple[bytes, bytes]:
    """Return (certificate PEM, key PEM) of a new self-signed CA."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _common_name(common_name))])
    start, end = _validity(days)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _common_name(text: str) -> str:
    """``text`` cut to the 64 bytes X.509 allows a common name (a longer one is refused)."""
    return text.encode()[:CN_MAX].decode(errors="ignore")


def service_names(namespace: str, service: str) -> list[str]:
    """The DNS names a serving certificate for ``service`` in ``namespace`` carries."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local", "localhost"]


def issue_serving_cert(ca_cert_pem: bytes, ca_key_pem: bytes, namespace: str, service: str,
                       days: int = 365) -> tuple[bytes, bytes]:
    """Return (certificate PEM, key PEM) of a serving certificate signed by the given CA."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _key()
    start, end = _validity(days)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in service_names(namespace, service)]
    sans += [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             x509.IPAddress(ipaddress.ip_address("::1"))]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        _serving_common_name(namespace,
                                                                             service))]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(min(end, ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False,
                                         False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _serving_common_name(namespace: str, service: str) -> str:
    """The service's DNS name where it fits a common name, else the bare service name (clients
    check the SANs, which carry every name in full)."""
    fqdn = f"{service}.{namespace}.svc"
    return fqdn if len(fqdn.encode()) <= CN_MAX else _common_name(service)


def _spki(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


def usable_ca(cert_pem: bytes, key_pem: bytes, now: dt.datetime) -> x509.Certificate | None:
    """The CA (the first certificate of ``cert_pem``) when ``key_pem`` is its key and it is
    valid for longer than :data:`RENEW_BEFORE`; None otherwise."""
    try:
        ca = x509.load_pem_x509_certificates(cert_pem)[0]
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    if _spki(key.public_key()) != _spki(ca.public_key()) \
            or ca.not_valid_after_utc - now < RENEW_BEFORE:
        return None
    return ca


def serving_problem(cert_pem: bytes, key_pem: bytes, ca: x509.Certificate, names: list[str],
                    now: dt.datetime, renew_before: dt.timedelta = RENEW_BEFORE) -> str | None:
    """Why the pair cannot keep serving ``names`` for ``ca``; None when it can."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return "the certificate or its key cannot be read"
    if _spki(key.public_key()) != _spki(cert.public_key()):
        return "the key does not match the certificate"
    try:
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return "the certificate was not issued by the CA for a DNS name"
    missing = [n for n in names if n not in sans.get_values_for_type(x509.DNSName)]
    if missing:
        return f"the certificate does not name {', '.join(missing)}"
    if cert.not_valid_after_utc - now < renew_before:
        return f"the certificate expires on {cert.not_valid_after_utc.isoformat()}"
    return None


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def ensure_dev_certs(directory: str | Path, namespace: str, service: str, days: int = 365,
                     force: bool = False) -> bool:
    """Make sure ``directory`` holds a usable CA and serving pair; True if anything was written.

    The serving pair is kept while :func:`serving_problem` finds none (it expires within 30
    days, or a third of ``days`` when that is shorter, so a short-lived pair is not renewed on
    every start); otherwise it is issued again, by the existing CA (``ca.crt`` + ``ca.key``)
    when that is usable, so clients that trust it keep working. ``force`` replaces everything.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_pem, ca_key = (b"", b"") if force else (_read(d / CA_CERT), _read(d / CA_KEY))
    try:
        ca_cert: x509.Certificate | None = x509.load_pem_x509_certificates(ca_pem)[0]
    except ValueError:
        ca_cert = None
    names = service_names(namespace, service)
    renew_before = min(RENEW_BEFORE, dt.timedelta(days=days) / 3)
    why = "forced" if force else "no CA certificate" if ca_cert is None else serving_problem(
        _read(d / TLS_CERT), _read(d / TLS_KEY), ca_cert, names, now, renew_before)
    if why is None:
        return False
    if usable_ca(ca_pem, ca_key, now) is None:
        ca_pem, ca_key = new_ca()
        write_atomic(d / CA_KEY, ca_key, 0o600)
        write_atomic(d / CA_CERT, ca_pem)
    cert, key = issue_serving_cert(ca_pem, ca_key, namespace, service, days)
    write_atomic(d / TLS_KEY, key, 0o600)
    write_atomic(d / TLS_CERT, cert)
    logger.info("development certificates written", extra={"dir": str(d), "reason": why})
    return True


def cmd_certs(args: argparse.Namespace) -> int:
    """``gpuslice certs``: create the development CA and serving certificate."""
    if args.days < 1:
        print("gpuslice certs: --days must be at least 1")
        return 2
    try:
        written = ensure_dev_certs(args.dir, args.namespace, args.service, args.days,
                                   args.force)
    except OSError as exc:
        print(f"gpuslice certs: cannot write {args.dir}: {exc.strerror}")
        return 1
    d = Path(args.dir)
    if written:
        print(f"wrote {d / CA_CERT}, {d / CA_KEY}, {d / TLS_CERT}, {d / TLS_KEY} "
              f"(names: {', '.join(service_names(args.namespace, args.service))}, 127.0.0.1)")
    else:
        print(f"certificates already in {d}; keeping them (--force replaces them)")
    return 0


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What the loaded serving certificate is."""

    serial: int
    not_after: dt.datetime
    subject: str


def _server_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class CertStore:
    """The server's SSL context, serving the pair loaded last from ``tls.crt``/``tls.key``.

    Loading a pair into a context that holds one of another key type would keep both (one per
    key type) and go on serving the old one to clients that accept either; so each pair gets a
    fresh context, and the listener's context (:attr:`context`) switches every handshake to it
    from its SNI callback, which OpenSSL runs for every ClientHello, with a server name or not.
    """

    def __init__(self, cert_dir: str | Path, interval: float = 2.0) -> None:
        self.cert_file = Path(cert_dir) / TLS_CERT
        self.key_file = Path(cert_dir) / TLS_KEY
        self.interval = interval
        self.context = _server_context()
        self.context.sni_callback = self._use_current
        self._current: ssl.SSLContext | None = None
        self.info: CertInfo | None = None
        self._signature: tuple[int, ...] | None = None
        self._failed: tuple[int, ...] | None = None

    @property
    def loaded(self) -> bool:
        return self.info is not None

    def _use_current(self, conn: ssl.SSLObject, server_name: str | None,
                     listener: ssl.SSLContext) -> None:
        if self._current is not None:
            conn.context = self._current

    def _stat(self) -> tuple[int, ...] | None:
        try:
            a, b = self.cert_file.stat(), self.key_file.stat()
        except OSError:
            return None
        return (a.st_mtime_ns, a.st_size, a.st_ino, b.st_mtime_ns, b.st_size, b.st_ino)

    def reload_if_changed(self) -> bool:
        """Load the pair if the files changed since the last load; True when a new one is live."""
        signature = self._stat()
        if signature is None or signature in (self._signature, self._failed):
            return False
        try:
            cert_pem, key_pem = self.cert_file.read_bytes(), self.key_file.read_bytes()
            info = self._load(cert_pem, key_pem)
        except (OSError, ValueError, TypeError, UnsupportedAlgorithm, ssl.SSLError) as exc:
            # TypeError: a passphrase-protected key; UnsupportedAlgorithm: a key type this
            # OpenSSL lacks. Raised here, they ended the watch: no certificate loaded again.
            self._failed = signature  # retried when the files change again
            logger.error("serving certificate not loaded; keeping the previous one",
                         extra={"cert": str(self.cert_file), "error": str(exc)})
            return False
        self._signature = signature
        self.info = info
        logger.info("serving certificate loaded",
                    extra={"serial": f"{info.serial:x}", "not_after": info.not_after.isoformat(),
                           "subject": info.subject})
        return True

    def _load(self, cert_pem: bytes, key_pem: bytes) -> CertInfo:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        if _spki(key.public_key()) != _spki(cert.public_key()):
            raise ValueError("tls.key does not match tls.crt")
        # load_cert_chain takes paths: load the exact bytes checked above from a private copy.
        context = _server_context()
        with tempfile.TemporaryDirectory(prefix="gpuslice-tls-") as tmp:
            cert_path, key_path = Path(tmp) / TLS_CERT, Path(tmp) / TLS_KEY
            write_atomic(key_path, key_pem, 0o600)
            write_atomic(cert_path, cert_pem)
            context.load_cert_chain(cert_path, key_path)
        self._current = context
        return CertInfo(cert.serial_number, cert.not_valid_after_utc, cert.subject.rfc4514_string())

    async def watch(self) -> None:
        """Poll the files every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.reload_if_changed()
