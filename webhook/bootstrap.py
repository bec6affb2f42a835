"""TLS bootstrap for ``tls_mode: secret``: the service's own CA and certificate, kept in a Secret.

On start (:func:`ensure_tls`, also run by the chart's init container as
``python -m webhook.bootstrap --config FILE``) and then periodically (:func:`rotation_loop`):

1. read Secret ``tls_secret_name`` in ``release_namespace``; create a CA and a serving
   certificate when it is absent, renew the serving certificate (same CA, so clients that
   trust the CA keep working) when it expires within 30 days or is unusable, and make a new CA
   only when the CA itself is expiring or broken (``ca.crt`` then carries the old CA too, or
   the ``ca.crt`` of a Secret without a usable CA key such as cert-manager's, or the replica's
   own when the Secret is gone, for a day, so the pods still serving a certificate it signed
   stay trusted). Two replicas racing to create it converge: the loser of the 409 uses the winner's;
   updates use the resourceVersion read, so a conflicting rotation is re-read, never clobbered;
2. set ``caBundle`` of every webhook in MutatingWebhookConfiguration ``webhook_config_name``
   with a JSON patch guarded by ``test`` operations (no request when it is already right);
3. write ``ca.crt``, ``tls.crt`` and ``tls.key`` into ``cert_dir`` atomically (only when they
   changed; the server reloads changed files).
   A certificate from a new CA is written only after step 2, so the service never serves one
   the caBundle does not trust yet; a renewal from the same CA is written before it.

The decisions are the pure :func:`assess`/:func:`renew`; the API calls retry transient errors
(connection failures, 429, 5xx) with backoff until a deadline. Certificates come from
:mod:`webhook.tls`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException

from webhook.settings import Settings, SettingsError, load_settings
from webhook.tls import (
    CA_CERT,
    RENEW_BEFORE,
    TLS_CERT,
    TLS_KEY,
    issue_serving_cert,
    new_ca,
    service_names,
    serving_problem,
    usable_ca,
    write_atomic,
)

logger = logging.getLogger(__name__)

SERVING_DAYS = 365
CHECK_INTERVAL_S = 600.0
RETRY_INTERVAL_S = 30.0
WATCH_TIMEOUT_S = 300
"""Seconds each watch request of the webhook configuration lasts (then it is made again)."""
REPAIR_GAP_S = 1.0
REPAIR_QUIET_S = 60.0
"""A caBundle repair this long after the last one waits no gap."""
TRANSIENT = {429, 500, 502, 503, 504}
CA_KEY = "ca.key"
PREVIOUS_CA_KEPT = dt.timedelta(days=1)
"""How long after a new CA's first serving certificate the previous CA stays in the bundle:
every replica re-reads the Secret every CHECK_INTERVAL_S, and a rollout is long over."""
T = TypeVar("T")


class BootstrapError(RuntimeError):
    """The certificates could not be put in place; the message says why and what to check."""


@dataclass(frozen=True)
class Material:
    """What the Secret holds: ``ca_bundle`` is the current CA first, then a previous one."""

    ca_bundle: bytes
    ca_key: bytes
    tls_crt: bytes
    tls_key: bytes

    def secret_data(self) -> dict[str, str]:
        raw = {CA_CERT: self.ca_bundle, CA_KEY: self.ca_key, TLS_CERT: self.tls_crt,
               TLS_KEY: self.tls_key}
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}

    @classmethod
    def from_secret_data(cls, data: dict[str, str] | None) -> Material | None:
        try:
            raw = {k: base64.b64decode(v, validate=True) for k, v in (data or {}).items()}
            return cls(raw[CA_CERT], raw[CA_KEY], raw[TLS_CERT], raw[TLS_KEY])
        except (KeyError, ValueError, TypeError):
            return None


def assess(m: Material | None, namespace: str, service: str, now: dt.datetime) -> str:
    """``"ok"``, ``"renew-serving"`` (the CA is fine), ``"new-ca"`` (none, or unusable) or
    ``"trim"`` (the bundle still carries a previous CA a day after the switch to this one)."""
    if m is None:
        return "new-ca"
    ca = usable_ca(m.ca_bundle, m.ca_key, now)
    if ca is None:
        return "new-ca"
    if serving_problem(m.tls_crt, m.tls_key, ca, service_names(namespace, service), now,
                       RENEW_BEFORE) is not None:
        return "renew-serving"
    if len(x509.load_pem_x509_certificates(m.ca_bundle)) > 1 and \
            now - x509.load_pem_x509_certificate(m.tls_crt).not_valid_before_utc > PREVIOUS_CA_KEPT:
        return "trim"
    return "ok"


def renew(m: Material | None, decision: str, namespace: str, service: str,
          now: dt.datetime, previous_bundle: bytes = b"") -> Material:
    """New material for ``decision`` (from :func:`assess`); ``"ok"`` returns ``m`` unchanged.

    A new CA's bundle carries the previous CA while it is valid: that of ``m``, or else the
    first CA of ``previous_bundle`` (the ``ca.crt`` of a Secret without a usable CA and key,
    such as cert-manager's after a switch from ``tls.mode=cert-manager``, or the one the
    replica serves when the Secret was deleted), so the pods still serving a certificate it
    signed stay trusted until they are replaced; ``"trim"`` drops it."""
    if decision == "ok" and m is not None:
        return m
    if decision == "trim" and m is not None:
        return Material(_first_pem(m.ca_bundle), m.ca_key, m.tls_crt, m.tls_key)
    if decision == "renew-serving" and m is not None:
        crt, key = issue_serving_cert(_first_pem(m.ca_bundle), m.ca_key, namespace, service,
                                      SERVING_DAYS)
        return Material(m.ca_bundle, m.ca_key, crt, key)
    ca_crt, ca_key = new_ca(common_name=f"gpuslice CA ({namespace}/{service})")
    crt, key = issue_serving_cert(ca_crt, ca_key, namespace, service, SERVING_DAYS)
    previous = m.ca_bundle if m is not None else previous_bundle
    return Material(ca_crt + _still_valid_ca(previous, now), ca_key, crt, key)


def _first_pem(bundle: bytes) -> bytes:
    return x509.load_pem_x509_certificates(bundle)[0].public_bytes(serialization.Encoding.PEM)


def _still_valid_ca(bundle: bytes, now: dt.datetime) -> bytes:
    """The first certificate of ``bundle`` if it is a CA that has not expired, so peers not
    yet rotated stay trusted; else nothing."""
    try:
        old = x509.load_pem_x509_certificates(bundle)[:1]
    except ValueError:
        return b""
    kept = b""
    for c in old:
        try:
            is_ca = c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if is_ca and c.not_valid_after_utc > now:
            kept += c.public_bytes(serialization.Encoding.PEM)
    return kept


def write_files(cert_dir: str | Path, m: Material) -> bool:
    """Write ca.crt, tls.key, tls.crt into ``cert_dir`` where they differ; True if any did."""
    d = Path(cert_dir)
    d.mkdir(parents=True, exist_ok=True)
    changed = False
    for name, data, mode in ((CA_CERT, m.ca_bundle, 0o644), (TLS_KEY, m.tls_key, 0o600),
                             (TLS_CERT, m.tls_crt, 0o644)):
        path = d / name
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        write_atomic(path, data, mode)
        changed = True
    return changed


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _first_ca(bundle: bytes) -> bytes | None:
    """The DER of the first certificate of a PEM bundle; None when there is none."""
    try:
        return x509.load_pem_x509_certificates(bundle)[0].public_bytes(
            serialization.Encoding.DER)
    except ValueError:
        return None


async def _call(op: Callable[[], Awaitable[T]], what: str, deadline: float,
                backoff: float) -> T:
    """Run one API call, retrying transient failures with backoff until ``deadline``."""
    loop = asyncio.get_running_loop()
    delay = backoff
    while True:
        try:
            return await op()
        except ApiException as exc:
            if exc.status not in TRANSIENT or loop.time() + delay > deadline:
                raise
            error = f"HTTP {exc.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if loop.time() + delay > deadline:
                raise BootstrapError(f"cannot reach the API server to {what}: {exc}") from exc
            error = str(exc) or type(exc).__name__
        logger.warning("API call failed; retrying", extra={"call": what, "error": error,
                                                           "retry_in_s": delay})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)


def _explain(exc: ApiException, what: str) -> BootstrapError:
    """The error for a refused call: its status, the API server's message, what to check."""
    hint = {401: " (the service account token was rejected)",
            403: " (check the chart's RBAC: Role <release>-tls and ClusterRole "
                 "<release>-webhook)"}.get(exc.status or 0, "")
    try:
        message = json.loads(exc.body).get("message") if exc.body else None
    except (ValueError, TypeError, AttributeError):
        message = None
    said = f": {message}" if isinstance(message, str) and message else ""
    return BootstrapError(f"cannot {what}: HTTP {exc.status} {exc.reason}{said}{hint}")


async def _settle_secret(core: client.CoreV1Api, settings: Settings, namespace: str,
                         deadline: float, backoff: float) -> Material:
    """Read, create or rotate the Secret until it holds usable material; return it."""
    name = settings.tls_secret_name
    what = f"read or write Secret {namespace}/{name}"
    for _ in range(5):
        try:
            secret: Any = await _call(lambda: core.read_namespaced_secret(name, namespace),
                                      what, deadline, backoff)
        except ApiException as exc:
            if exc.status != 404:
                raise _explain(exc, what) from exc
            secret = None
        now = dt.datetime.now(dt.UTC)
        current = Material.from_secret_data(secret.data) if secret is not None else None
        decision = assess(current, namespace, settings.service_name, now)
        if decision == "ok" and current is not None:
            return current
        # A Secret gone or without ca.crt: the CA this replica serves (the others too) stays
        # trusted while they take the new one.
        previous = _secret_ca_crt(secret.data if secret is not None else None) or \
            _read_file(Path(settings.cert_dir) / CA_CERT)
        fresh = renew(current, decision, namespace, settings.service_name, now, previous)
        version = secret.metadata.resource_version if secret is not None else None
        manifest = _secret_manifest(name, namespace, fresh, version)
        try:
            if secret is None:
                await _call(partial(core.create_namespaced_secret, namespace,
                                    manifest),  # type: ignore[arg-type]
                            what, deadline, backoff)
            else:
                await _call(partial(core.replace_namespaced_secret, name, namespace,
                                    manifest),  # type: ignore[arg-type]
                            what, deadline, backoff)
        except ApiException as exc:
            if exc.status == 409:  # another replica created or rotated it first: use theirs
                logger.info("TLS Secret changed concurrently; re-reading",
                            extra={"secret": f"{namespace}/{name}"})
                continue
            raise _explain(exc, what) from exc
        logger.info("TLS Secret written", extra={"secret": f"{namespace}/{name}",
                                                 "action": decision})
        return fresh
    raise BootstrapError(f"Secret {namespace}/{name} kept changing under us; giving up")


def _secret_ca_crt(data: dict[str, str] | None) -> bytes:
    try:
        return base64.b64decode((data or {}).get(CA_CERT) or "", validate=True)
    except (ValueError, TypeError):
        return b""


def _secret_manifest(name: str, namespace: str, m: Material,
                     resource_version: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {"app.kubernetes.io/name": "gpuslice",
                                       "app.kubernetes.io/managed-by": "gpuslice"}}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
            "type": "kubernetes.io/tls", "data": m.secret_data()}


async def _patch_ca_bundle(admission: client.AdmissionregistrationV1Api, name: str,
                           bundle: bytes, deadline: float, backoff: float) -> bool:
    """Set every webhook's caBundle; False when the configuration does not exist."""
    want = base64.b64encode(bundle).decode()
    what = f"patch the caBundle of MutatingWebhookConfiguration {name}"
    for _ in range(5):
        try:
            mwc: Any = await _call(lambda: admission.read_mutating_webhook_configuration(name),
                                   what, deadline, backoff)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _explain(exc, what) from exc
        ops: list[dict[str, Any]] = []
        for i, hook in enumerate(mwc.webhooks or []):
            if hook.client_config.ca_bundle != want:
                ops += [{"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name},
                        {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle",
                         "value": want}]
        if not ops:
            return True
        try:
            await _call(partial(admission.patch_mutating_webhook_configuration, name, ops),
                        what, deadline, backoff)
        except ApiException as exc:
            if exc.status in (409, 422):  # the list changed between read and patch: re-read
                continue
            raise _explain(exc, what) from exc
        logger.info("webhook caBundle set", extra={"webhook_configuration": name,
                                                   "webhooks": len(ops) // 2})
        return True
    raise BootstrapError(f"{what}: it kept changing under us; giving up")


async def _api_client(settings: Settings) -> client.ApiClient:
    conf = client.Configuration()
    try:
        if settings.kubeconfig:
            await config.load_kube_config(config_file=settings.kubeconfig,
                                          client_configuration=conf)
        else:
            config.load_incluster_config(client_configuration=conf)
    except (ConfigException, OSError) as exc:
        raise BootstrapError(f"no Kubernetes API access configured: {exc}") from exc
    return client.ApiClient(conf)


def _namespace(settings: Settings) -> str:
    pod_ns = os.environ.get("POD_NAMESPACE")
    if pod_ns and pod_ns != settings.release_namespace:
        raise BootstrapError(f"release_namespace is {settings.release_namespace!r} but this pod "
                             f"runs in {pod_ns!r}; the Service and its Secret live in the "
                             "release namespace: set release_namespace to the pod's namespace")
    return settings.release_namespace


async def reconcile(settings: Settings, api: client.ApiClient | None = None, *,
                    deadline_s: float = 120.0, backoff_s: float = 1.0) -> bool:
    """One pass of steps 1-3; True when the webhook configuration's caBundle is set."""
    namespace = _namespace(settings)
    deadline = asyncio.get_running_loop().time() + deadline_s
    own = api is None
    api = api or await _api_client(settings)
    try:
        material = await _settle_secret(client.CoreV1Api(api), settings, namespace, deadline,
                                        backoff_s)
        # A certificate from a new CA is served only once the caBundle trusts that CA: until
        # the patch is through (retried while the API server is busy) the old one, still
        # valid, keeps serving. One from the same CA can be served at once.
        new_ca = _first_ca(_read_file(Path(settings.cert_dir) / CA_CERT)) \
            != _first_ca(material.ca_bundle)
        written = not new_ca and write_files(settings.cert_dir, material)
        patched = await _patch_ca_bundle(client.AdmissionregistrationV1Api(api),
                                         settings.webhook_config_name, material.ca_bundle,
                                         deadline, backoff_s)
        if not patched:
            logger.warning("webhook configuration not found; caBundle not set yet",
                           extra={"webhook_configuration": settings.webhook_config_name})
        if write_files(settings.cert_dir, material) or written:
            logger.info("certificate files written", extra={"dir": settings.cert_dir})
        return patched
    finally:
        if own:
            await api.close()


async def ensure_tls(settings: Settings, api: client.ApiClient | None = None, *,
                     deadline_s: float = 120.0, backoff_s: float = 1.0) -> None:
    """Put usable certificates in the Secret and ``cert_dir`` and set the caBundle, or raise
    :class:`BootstrapError`."""
    await reconcile(settings, api, deadline_s=deadline_s, backoff_s=backoff_s)


class WatchError(Exception):
    """The watch of the webhook configuration failed (a non-2xx answer or an ERROR event)."""


async def _read_json(resp: Any) -> Any:
    """The body of a raw (``_preload_content=False``) response; raises on a non-2xx status."""
    try:
        body = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        raise WatchError(f"HTTP {resp.status}: {body.decode(errors='replace')[:300]}")
    return json.loads(body)


def _stale_ca_bundle(obj: dict[str, Any], cert_dir: str) -> bool:
    """Whether a webhook of ``obj`` lacks the caBundle this replica last wrote (``ca.crt``)."""
    ca = _read_file(Path(cert_dir) / CA_CERT)
    if not ca:
        return False  # not bootstrapped yet: nothing to compare with
    want = base64.b64encode(ca).decode()
    return any(((hook.get("clientConfig") or {}).get("caBundle") or "") != want
               for hook in obj.get("webhooks") or [])


async def watch_ca_bundle(settings: Settings, api: client.ApiClient | None, wake: asyncio.Event,
                          *, timeout_s: int = WATCH_TIMEOUT_S, backoff_s: float = 1.0,
                          backoff_max_s: float = 300.0) -> None:
    """Watch MutatingWebhookConfiguration ``webhook_config_name`` (one object, by field
    selector) and set ``wake`` whenever a webhook's caBundle is not the one in
    ``cert_dir/ca.crt``: what ``helm rollback`` (or an upgrade rendered without the chart's
    ``lookup``) leaves, or another replica's patch from an older read of the Secret. One
    watch request per ``timeout_s``; failures (403 where RBAC lacks ``watch`` included) back
    off up to ``backoff_max_s``, the periodic check going on regardless. Runs until cancelled."""
    name = settings.webhook_config_name
    loop = asyncio.get_running_loop()
    own = api is None
    delay = backoff_s

    def seen(obj: dict[str, Any]) -> None:
        if _stale_ca_bundle(obj, settings.cert_dir):
            wake.set()

    try:
        while True:
            try:
                if api is None:
                    api = await _api_client(settings)
                admission = client.AdmissionregistrationV1Api(api)
                selector = f"metadata.name={name}"
                listed = await _read_json(await admission.list_mutating_webhook_configuration(
                    field_selector=selector, _preload_content=False, _request_timeout=60))
                for obj in listed.get("items") or []:
                    seen(obj)
                rv = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                while True:
                    started = loop.time()
                    rv = await _watch_once(admission, selector, rv, timeout_s, seen)
                    delay = backoff_s
                    if loop.time() - started < 1.0:  # a server that ends watches at once
                        await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: back off, list again
                logger.warning("cannot watch the webhook configuration; relying on the "
                               "periodic check until it works", extra={
                                   "webhook_configuration": name, "error": str(exc) or
                                   type(exc).__name__, "retry_in_s": delay})
                await asyncio.sleep(delay)
                delay = min(delay * 2, backoff_max_s)
    finally:
        if own and api is not None:
            await api.close()


async def _watch_once(admission: client.AdmissionregistrationV1Api, selector: str, rv: str,
                      timeout_s: int, seen: Callable[[dict[str, Any]], None]) -> str:
    """One watch request from ``rv``; returns the last resourceVersion seen."""
    resp: Any = await admission.list_mutating_webhook_configuration(
        field_selector=selector, watch=True, resource_version=rv, allow_watch_bookmarks=True,
        timeout_seconds=timeout_s, _preload_content=False,
        _request_timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=timeout_s + 30))
    try:
        if not 200 <= resp.status <= 299:
            await _read_json(resp)
        while True:
            try:
                line = await resp.content.readline()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                    ConnectionResetError):
                return rv
            if not line or not line.endswith(b"\n"):
                return rv  # ended at its timeout, or cut inside an event
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise WatchError(f"HTTP {obj.get('code')}: {obj.get('message', '')}")
            rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
            if kind in ("ADDED", "MODIFIED"):
                seen(obj)
    finally:
        resp.release()


async def rotation_loop(settings: Settings, api: client.ApiClient | None = None, *,
                        interval_s: float = CHECK_INTERVAL_S,
                        retry_s: float = RETRY_INTERVAL_S, watch: bool = True,
                        repair_gap_s: float = REPAIR_GAP_S) -> None:
    """Re-run :func:`reconcile` every ``interval_s`` (``retry_s`` after a failure or while the
    webhook configuration is missing) until cancelled; errors are logged, never raised.

    With ``watch``, :func:`watch_ca_bundle` runs alongside and a caBundle changed under the
    service is set right at once rather than at the next check: the first repair right away,
    repeated ones at least ``repair_gap_s`` apart, the gap doubling (up to ``retry_s``) while
    something keeps changing it back, so a fight with another writer costs a few requests a
    minute at most."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    watcher = asyncio.create_task(watch_ca_bundle(settings, api, wake),
                                  name="gpuslice-ca-bundle-watch") if watch else None
    delay, gap, repaired_at = interval_s, repair_gap_s, -float("inf")
    try:
        while True:
            try:
                await asyncio.wait_for(wake.wait(), delay)
            except TimeoutError:
                pass
            if wake.is_set():
                now = loop.time()
                gap = repair_gap_s if now - repaired_at > REPAIR_QUIET_S \
                    else min(gap * 2, retry_s)
                await asyncio.sleep(max(0.0, repaired_at + gap - now))
                repaired_at = loop.time()
                logger.info("webhook caBundle changed under the service; setting it again",
                            extra={"webhook_configuration": settings.webhook_config_name})
            wake.clear()
            try:
                done = await reconcile(settings, api, deadline_s=min(120.0, retry_s * 4))
            except (BootstrapError, ApiException, OSError) as exc:  # OSError: writing cert_dir
                logger.error("certificate check failed; will retry", extra={"error": str(exc)})
                done = False
            except Exception:  # a bug must not end rotation for the life of the process
                logger.exception("certificate check failed unexpectedly; will retry")
                done = False
            delay = interval_s if done else retry_s
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m webhook.bootstrap --config FILE``: one :func:`ensure_tls`, for init containers."""
    from webhook.logs import setup_logging

    parser = argparse.ArgumentParser(prog="python -m webhook.bootstrap",
                                     description=main.__doc__)
    parser.add_argument("--config", metavar="FILE", help="gpuslice settings file")
    parser.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"kubeconfig": args.kubeconfig})
    except SettingsError as exc:
        print(f"gpuslice bootstrap: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(ensure_tls(settings))
    except BootstrapError as exc:
        logger.error("TLS bootstrap failed", extra={"error": str(exc)})
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
