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
import copy
import datetime as dt
import json
import os
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

import pytest
import yaml
from aiohttp import web
from chart.conftest import CHART, RELEASE, helm_binary, load_all
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fakekube import FakeKube

from webhook import bootstrap, tls
from webhook.bootstrap import Material
from webhook.service import create_app, start_https
from webhook.settings import Settings

NS, SERVICE, SECRET = "gpuslice-system", "gpuslice", "gpuslice-tls"


@pytest.fixture(autouse=True)
def _no_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


def _kubeconfig(kube: FakeKube, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    return path


def _settings(cert_dir: Path, mwc: str, kubeconfig: Path | None = None) -> Settings:
    return Settings(cert_dir=str(cert_dir), tls_mode="secret", kube_enabled=True,
                    release_namespace=NS, service_name=SERVICE, tls_secret_name=SECRET,
                    webhook_config_name=mwc, placement_enabled=False,
                    kubeconfig=str(kubeconfig) if kubeconfig else None)


async def _verifies(context: ssl.SSLContext, port: int) -> bool:
    """Whether the certificate served on ``port`` verifies in ``context`` for the Service name."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=f"{SERVICE}.{NS}.svc"), 5)
    except ssl.SSLError:
        return False
    writer.close()
    return True


async def admits(kube: FakeKube, mwc: str, port: int) -> bool:
    """Whether the API server would reach the webhook: the serving certificate verifies
    against the first webhook's caBundle."""
    obj = kube.get("mutatingwebhookconfigurations", mwc)
    bundle = ((obj or {}).get("webhooks") or [{}])[0].get("clientConfig", {}).get("caBundle")
    if not bundle:
        return False  # the system roots: the private CA is not among them
    context = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    return await _verifies(context, port)


async def refused_for(kube: FakeKube, mwc: str, port: int, limit_s: float) -> float:
    """Seconds until :func:`admits` holds again (``limit_s`` if it does not by then)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if await admits(kube, mwc, port):
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    return limit_s


class Replica:
    """One webhook pod: its init container's bootstrap, then the served app with its rotation."""

    def __init__(self, kube: FakeKube, tmp: Path, name: str, mwc: str) -> None:
        self.kube, self.mwc = kube, mwc
        self.settings = _settings(tmp / name, mwc, _kubeconfig(kube, tmp / f"{name}.kubeconfig"))
        self.port = 0
        self._runner: Any = None

    async def start(self) -> None:
        async with self.kube.api_client() as api:
            await bootstrap.ensure_tls(self.settings, api)  # the init container
        app = create_app(self.settings, cert_reload_interval=0.05)
        self._runner = await start_https(app, "127.0.0.1", 0)
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        await self._runner.cleanup()


@pytest.fixture
async def chart_mwc(render: Any) -> dict[str, Any]:
    """The chart's webhook configuration as `helm install` creates it (nothing to look up)."""
    return render({"tls": {"mode": "secret"}}).one("MutatingWebhookConfiguration")


@pytest.fixture
async def replica(tmp_path: Path, chart_mwc: dict[str, Any]) -> AsyncIterator[Replica]:
    async with FakeKube() as kube:
        kube.put(chart_mwc)
        r = Replica(kube, tmp_path, "r1", chart_mwc["metadata"]["name"])
        await r.start()
        try:
            yield r
        finally:
            await r.stop()


def _rolled_back(kube: FakeKube, chart_mwc: dict[str, Any], ca_bundle: str | None) -> None:
    """The live configuration after `helm rollback` to the install's revision.

    Helm applies a three-way strategic merge patch (the current revision's manifest, the
    target's, the live object): the current revision's manifest carries the caBundle the chart
    looked up at upgrade, the install's has none, so Helm deletes it from every webhook.
    ``ca_bundle`` instead leaves that one (a revision rendered while an older CA was live).
    """
    obj = kube.get("mutatingwebhookconfigurations", chart_mwc["metadata"]["name"])
    assert obj is not None
    for hook in obj["webhooks"]:
        hook["clientConfig"].pop("caBundle", None)
        if ca_bundle:
            hook["clientConfig"]["caBundle"] = ca_bundle
    kube.put(obj)


OLD_CA = base64.b64encode(tls.new_ca()[0]).decode()


@pytest.mark.parametrize("left", [None, OLD_CA], ids=["no-ca-bundle", "older-ca-bundle"])
async def test_rollback_that_drops_the_ca_bundle_is_repaired_within_seconds(
        replica: Replica, chart_mwc: dict[str, Any], left: str | None) -> None:
    """Before: the caBundle came back at the next periodic check, 600 s later (GPU pods refused
    all that time; the test gave up after 10 s). The service watches its configuration now."""
    kube = replica.kube
    assert await admits(kube, replica.mwc, replica.port)
    await asyncio.sleep(0.5)  # the service is serving and watching, as after a rollout
    _rolled_back(kube, chart_mwc, left)
    assert not await admits(kube, replica.mwc, replica.port)
    refused = await refused_for(kube, replica.mwc, replica.port, 10.0)
    assert refused < 3.0, f"GPU pods refused for {refused:.1f} s after the rollback"


async def test_two_replicas_restore_the_ca_bundle_once_and_do_not_flap(
        tmp_path: Path, chart_mwc: dict[str, Any]) -> None:
    """Both replicas see the caBundle vanish; they patch it back (each read the same Secret)
    and then stay quiet: their own patches do not set them off again."""
    name = chart_mwc["metadata"]["name"]
    async with FakeKube() as kube:
        kube.put(chart_mwc)
        a, b = Replica(kube, tmp_path, "a", name), Replica(kube, tmp_path, "b", name)
        await a.start()
        await b.start()
        try:
            await asyncio.sleep(0.5)
            start = len(kube.requests)
            _rolled_back(kube, chart_mwc, None)
            assert await refused_for(kube, name, a.port, 10.0) < 3.0
            assert await admits(kube, name, b.port)
            await asyncio.sleep(3.0)
            later = kube.requests[start:]
            patches = [r for r in later if r.method == "PATCH"]
            assert 1 <= len(patches) <= 2, [r.body for r in patches]
            assert [r for r in later if r.method in ("PUT", "POST")] == []  # Secret untouched
            assert len([r for r in later if not r.watch]) <= 12  # a handful of reads in all
        finally:
            await a.stop()
            await b.stop()


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


async def test_the_watch_names_its_one_object_as_rbac_requires(
        replica: Replica, render: Any) -> None:
    """The ClusterRole pins the configuration by resourceNames; the API server authorizes a
    list or watch under such a rule only with a metadata.name field selector naming it."""
    await asyncio.sleep(0.3)
    kube, name = replica.kube, replica.mwc
    reads = [r for r in kube.requests
             if r.method == "GET" and r.path.endswith("/mutatingwebhookconfigurations")]
    assert reads and any(r.watch for r in reads)
    assert {r.query.get("fieldSelector") for r in reads} == {f"metadata.name={name}"}
    role = render({"tls": {"mode": "secret"}}).one("ClusterRole", "gpuslice-webhook")
    [rule] = [r for r in role["rules"] if r["resources"] == ["mutatingwebhookconfigurations"]]
    assert rule["resourceNames"] == [name] and {"list", "watch"} <= set(rule["verbs"])


async def test_a_watch_refused_by_rbac_backs_off_and_the_periodic_check_goes_on(
        tmp_path: Path, chart_mwc: dict[str, Any]) -> None:
    """An operator's own RBAC without list/watch: the watch is retried with a growing back-off
    (a few requests, not a flood); the checks at the interval still set the caBundle."""
    name = chart_mwc["metadata"]["name"]
    async with FakeKube() as kube:
        kube.put(chart_mwc)
        kube.fail("GET", "/mutatingwebhookconfigurations$", 403, times=1000,
                  message="cannot watch resource")
        s = _settings(tmp_path / "certs", name)
        async with kube.api_client() as api:
            await bootstrap.ensure_tls(s, api)
            _rolled_back(kube, chart_mwc, None)
            task = asyncio.create_task(bootstrap.rotation_loop(s, api, interval_s=1.0))
            await asyncio.sleep(2.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        refused = [r for r in kube.requests if r.path.endswith("/mutatingwebhookconfigurations")]
        assert 1 <= len(refused) <= 3  # at 0 s, 1 s, 3 s
        live = kube.get("mutatingwebhookconfigurations", name)
        assert live is not None and live["webhooks"][0]["clientConfig"].get("caBundle")


async def test_switch_from_cert_manager_to_secret_keeps_the_old_pods_trusted(
        tmp_path: Path, chart_mwc: dict[str, Any]) -> None:
    """`helm upgrade --set tls.mode=secret` over cert-manager: the old pods serve cert-manager's
    certificate until the rollout replaces them, while the first new pod's init container finds
    cert-manager's Secret (ca.crt, tls.crt, tls.key; no ca.key), makes its own CA and sets the
    caBundle. Before: the caBundle held the new CA only, so the API server refused every call
    that reached an old pod for the rest of the rollout; now the new CA and cert-manager's."""
    name = chart_mwc["metadata"]["name"]
    cm_ca, cm_key = tls.new_ca(common_name="gpuslice-ca")
    cm_crt, cm_tls_key = tls.issue_serving_cert(cm_ca, cm_key, NS, SERVICE, 90)
    old_dir = tmp_path / "old"
    bootstrap.write_files(old_dir, Material(cm_ca, b"", cm_crt, cm_tls_key))
    old_app = create_app(Settings(cert_dir=str(old_dir), tls_mode="files",
                                  placement_enabled=False), cert_reload_interval=0.05)
    old = await start_https(old_app, "127.0.0.1", 0)
    try:
        async with FakeKube() as kube:
            kube.put({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                      "metadata": {"name": SECRET, "namespace": NS},
                      "data": {k: base64.b64encode(v).decode() for k, v in (
                          ("ca.crt", cm_ca), ("tls.crt", cm_crt), ("tls.key", cm_tls_key))}})
            mwc = copy.deepcopy(chart_mwc)  # rendered in secret mode: `lookup` kept the injected CA
            for hook in mwc["webhooks"]:
                hook["clientConfig"]["caBundle"] = base64.b64encode(cm_ca).decode()
            kube.put(mwc)
            assert await admits(kube, name, old.addresses[0][1])
            new = Replica(kube, tmp_path, "new", name)
            await new.start()
            try:
                assert await admits(kube, name, new.port)
                assert await admits(kube, name, old.addresses[0][1]), \
                    "the old pods' certificate is no longer trusted"
            finally:
                await new.stop()
    finally:
        await old.cleanup()


class SchedulerClient:
    """The chart's kube-scheduler container calling its extender: the client that
    ``makeTransport`` (pkg/scheduler/extender.go) builds once, when the scheduler starts, from
    the extender's ``tlsConfig`` (``restclient.TLSConfigFor`` reads ``caFile`` then, and never
    again); ``caFile`` in the chart's cert dir is read from ``cert_dir``."""

    def __init__(self, tls_config: dict[str, Any], chart_cert_dir: str, cert_dir: Path) -> None:
        if tls_config.get("insecure"):
            assert not tls_config.get("caFile")  # TLSConfigFor refuses both
            self.context = ssl.create_default_context()
            self.context.check_hostname, self.context.verify_mode = False, ssl.CERT_NONE
        else:
            ca_file = Path(tls_config["caFile"])
            assert str(ca_file.parent) == chart_cert_dir
            self.context = ssl.create_default_context(cadata=(cert_dir / ca_file.name).read_text())
        self.server_name = tls_config.get("serverName") or "127.0.0.1"

    async def reaches(self, port: int) -> bool:
        """Whether a call to the extender on 127.0.0.1 gets past TLS (and is answered)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=self.context, server_hostname=self.server_name), 5)
        except ssl.SSLError:
            return False
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer.startswith(b"HTTP/1.1 200")


async def _wait_for(predicate: Any, limit_s: float = 5.0) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["secret", "cert-manager"])
async def test_the_scheduler_reaches_its_extender_after_the_ca_changes_under_it(
        tmp_path: Path, render: Any, mode: str) -> None:
    """The kube-scheduler container reads its extender CA once, at start; nothing restarts it
    when the CA changes in a running pod: in secret mode a new CA when the Secret is deleted
    (or its CA expires), in cert-manager mode a serving certificate renewed by an issuer whose
    CA changed (an external issuer's, or the release's own CA renewed with a new key). Before:
    the webhook served the new certificate at once (caBundle updated, pods admitted), but every
    extender call failed the scheduler's TLS check until the pod was restarted: GPU pods
    unschedulable (`ignorable: false`). The scheduler no longer pins a CA on the pod's loopback."""
    rendered = render({"tls": {"mode": mode}})
    ksc = rendered.config("gpuslice-scheduler")
    chart_cert_dir = rendered.config("gpuslice-config")["cert_dir"]
    [extender] = ksc["extenders"]
    assert extender["urlPrefix"].startswith("https://127.0.0.1:")  # the pod's own loopback
    mwc = rendered.one("MutatingWebhookConfiguration")
    async with FakeKube() as kube:
        kube.put(mwc)
        name = mwc["metadata"]["name"]
        if mode == "secret":
            replica = Replica(kube, tmp_path, "r1", name)
            await replica.start()
            stop, port, cert_dir = replica.stop, replica.port, Path(replica.settings.cert_dir)
        else:  # the mounted Secret, as cert-manager issued it
            cert_dir = tmp_path / "cm"
            ca, ca_key = tls.new_ca(common_name="gpuslice-ca")
            crt, key = tls.issue_serving_cert(ca, ca_key, NS, SERVICE, 90)
            bootstrap.write_files(cert_dir, Material(ca, b"", crt, key))
            app = create_app(Settings(cert_dir=str(cert_dir), tls_mode="files",
                                      placement_enabled=False), cert_reload_interval=0.05)
            runner = await start_https(app, "127.0.0.1", 0)
            stop, port = runner.cleanup, runner.addresses[0][1]
        try:
            scheduler = SchedulerClient(extender["tlsConfig"], chart_cert_dir, cert_dir)
            assert await scheduler.reaches(port)
            before = (cert_dir / "tls.crt").read_bytes()
            if mode == "secret":
                kube.delete("secrets", SECRET, NS)
                async with kube.api_client() as api:  # the service's next check
                    assert await bootstrap.reconcile(replica.settings, api)
            else:
                ca, ca_key = tls.new_ca(common_name="gpuslice-ca")
                crt, key = tls.issue_serving_cert(ca, ca_key, NS, SERVICE, 90)
                bootstrap.write_files(cert_dir, Material(ca, b"", crt, key))
            assert (cert_dir / "tls.crt").read_bytes() != before

            async def serving_the_new_one() -> bool:
                return await admits_with(cert_dir, port)
            assert await _wait_for(serving_the_new_one), "the new certificate is not served"
            assert await scheduler.reaches(port), \
                "the scheduler's extender calls fail after the CA changed"
        finally:
            await stop()


async def admits_with(cert_dir: Path, port: int) -> bool:
    """Whether the certificate served verifies against ``cert_dir/ca.crt`` as it is now (what
    the caBundle holds once it is set)."""
    context = ssl.create_default_context(cafile=str(cert_dir / "ca.crt"))
    return await _verifies(context, port)


def _self_signed_ca(key: Any, common_name: str) -> bytes:
    """A CA certificate for ``key`` as cert-manager's SelfSigned issuer makes it (the subject
    from the Certificate's commonName, the key identifier from the key)."""
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


async def test_the_release_ca_renewed_by_cert_manager_still_trusts_the_served_certificate(
        tmp_path: Path, render: Any) -> None:
    """tls.mode=cert-manager with the release's own CA: cert-manager renews the CA Certificate
    at two thirds of its 10 years; at the serving certificate's next renewal the Secret's
    ca.crt becomes the renewed CA and cainjector puts it alone into the caBundle at once, while
    every pod serves the previous certificate until the kubelet refreshes its Secret volume
    (about a minute). cert-manager 1.18 and later make a new key at a renewal unless the
    Certificate says `rotationPolicy: Never`; before, the chart's CA said nothing: the renewed
    CA did not verify the served certificate and GPU pods were refused meanwhile."""
    spec = render({"tls": {"mode": "cert-manager"}}).one("Certificate", "gpuslice-ca")["spec"]
    assert spec["isCA"] is True
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _self_signed_ca(ca_key, spec["commonName"])
    served_crt, served_key = tls.issue_serving_cert(
        ca, ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()), NS, SERVICE, 365)
    cert_dir = tmp_path / "mounted"  # the pods' view of the Secret
    bootstrap.write_files(cert_dir, Material(ca, b"", served_crt, served_key))
    runner = await start_https(create_app(Settings(cert_dir=str(cert_dir), tls_mode="files",
                                                   placement_enabled=False)), "127.0.0.1", 0)
    try:
        policy = spec["privateKey"].get("rotationPolicy", "Always")  # cert-manager >= 1.18
        renewed_key = ca_key if policy == "Never" else ec.generate_private_key(ec.SECP256R1())
        injected = tmp_path / "injected"  # the caBundle once cainjector set it
        injected.mkdir()
        (injected / "ca.crt").write_bytes(_self_signed_ca(renewed_key, spec["commonName"]))
        assert await admits_with(injected, runner.addresses[0][1]), \
            "the renewed CA does not verify the certificate the pods still serve"
    finally:
        await runner.cleanup()


class LookupCluster:
    """Just enough of an API server for `helm template --dry-run=server` (the real helm
    binary), which renders as `helm upgrade` does, `lookup` included: discovery of the kinds
    the chart renders, the live objects in ``objects``, 404 for any other; it writes nothing."""

    def __init__(self, kinds: list[dict[str, Any]], objects: list[dict[str, Any]]) -> None:
        self.groups: dict[str, list[dict[str, Any]]] = {}
        for obj in kinds:
            kind = obj["kind"]
            plural = kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s"
            entry = {"name": plural, "singularName": kind.lower(), "kind": kind,
                     "namespaced": "namespace" in obj["metadata"],
                     "verbs": ["get", "list", "create", "update", "patch"]}
            if entry not in self.groups.setdefault(obj["apiVersion"], []):
                self.groups[obj["apiVersion"]].append(entry)
        self.objects = {self._path(o): o for o in objects}
        self.runner: Any = None
        self.url = ""

    def _path(self, obj: dict[str, Any]) -> str:
        gv = obj["apiVersion"]
        [entry] = [e for e in self.groups[gv] if e["kind"] == obj["kind"]]
        ns = obj["metadata"].get("namespace")
        return "/".join(["/api" if gv == "v1" else f"/apis/{gv}",
                         *(["namespaces", ns] if ns else []), entry["name"],
                         obj["metadata"]["name"]])

    async def _handle(self, request: web.Request) -> web.Response:
        path, groups = request.path, [gv for gv in self.groups if gv != "v1"]
        if path == "/version":
            return web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": gv.split("/")[0], "versions": [{"groupVersion": gv,
                                                         "version": gv.split("/")[1]}],
                 "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                for gv in groups]})
        gv = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
        if gv in self.groups:
            return web.json_response({"kind": "APIResourceList", "apiVersion": "v1",
                                      "groupVersion": gv, "resources": self.groups[gv]})
        if request.method == "GET" and path in self.objects:
            return web.json_response(self.objects[path])
        items = [o for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path]
        if request.method == "GET" and items:  # a collection (`lookup` with no name)
            return web.json_response({"kind": items[0]["kind"] + "List",
                                      "apiVersion": items[0]["apiVersion"],
                                      "metadata": {"resourceVersion": "1"}, "items": items})
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": "NotFound", "code": 404}, status=404)

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def upgrade_render(self, values: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
        """The objects `helm upgrade` with ``values`` would apply to this cluster."""
        code, out, err = await self.upgrade_render_raw(values, tmp)
        assert code == 0, err
        return load_all(out)

    async def upgrade_render_raw(self, values: dict[str, Any], tmp: Path,
                                 release: str = RELEASE, namespace: str = NS) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of that render, for renders that must fail."""
        binary = helm_binary()
        if binary is None:
            pytest.skip("helm not found: run `bash scripts/setup.sh` (puts it at .tools/helm)")
        kubeconfig = tmp / "helm.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        (tmp / "values.json").write_text(json.dumps(values))
        proc = await asyncio.create_subprocess_exec(
            binary, "template", release, str(CHART), "--namespace", namespace, "--dry-run=server",
            "--disable-openapi-validation", "--kubeconfig", str(kubeconfig),
            "-f", str(tmp / "values.json"), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **{f"HELM_{d}_HOME": str(tmp / "helm") for d in
                                  ("CACHE", "CONFIG", "DATA")}})
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()


def _helm_three_way(original: dict[str, Any], target: dict[str, Any],
                    live: dict[str, Any]) -> dict[str, Any]:
    """The live webhook configuration after Helm's client-side upgrade (a three-way strategic
    merge; webhooks merge by name): a caBundle the previous revision's manifest carried and the
    new one does not is deleted; one the new manifest carries is set."""
    result = copy.deepcopy(live)
    before = {h["name"]: h["clientConfig"] for h in original["webhooks"]}
    after = {h["name"]: h["clientConfig"] for h in target["webhooks"]}
    for hook in result["webhooks"]:
        if "caBundle" in after.get(hook["name"], {}):
            hook["clientConfig"]["caBundle"] = after[hook["name"]]["caBundle"]
        elif "caBundle" in before.get(hook["name"], {}):
            hook["clientConfig"].pop("caBundle", None)
    return result


async def test_switch_from_secret_to_cert_manager_keeps_the_ca_bundle_until_cainjector_sets_it(
        tmp_path: Path, render: Any) -> None:
    """`helm upgrade --set tls.mode=cert-manager` over secret mode (Helm's client-side
    upgrade, Helm 3's): the previous revision's manifest carried the caBundle its `lookup`
    found, the chart's cert-manager render did not look it up, so Helm deleted it: every GPU
    pod refused until cert-manager has issued and cainjector injected its CA (for as long as
    cert-manager cannot issue: an issuerRef wrong, cert-manager busy). The pods meanwhile serve
    the secret mode's certificate (the old ones until replaced, the new ones from the Secret
    they mount until cert-manager reissues it): the caBundle that trusts it now stays."""
    kinds = render({"tls": {"mode": "cert-manager"}}).objects + \
        render({"tls": {"mode": "secret"}}).objects
    ca, ca_key = tls.new_ca()
    crt, key = tls.issue_serving_cert(ca, ca_key, NS, SERVICE, 365)
    bundle = base64.b64encode(ca).decode()
    live = copy.deepcopy(render({"tls": {"mode": "secret"}}).one("MutatingWebhookConfiguration"))
    for hook in live["webhooks"]:  # the service's patch
        hook["clientConfig"]["caBundle"] = bundle
    live["metadata"].setdefault("labels", {})["app.kubernetes.io/managed-by"] = "Helm"
    live["metadata"]["annotations"] = {"meta.helm.sh/release-name": RELEASE,
                                       "meta.helm.sh/release-namespace": NS}
    async with LookupCluster(kinds, [live]) as cluster:
        previous = next(o for o in await cluster.upgrade_render({}, tmp_path)
                        if o["kind"] == "MutatingWebhookConfiguration")
        assert previous["webhooks"][0]["clientConfig"]["caBundle"] == bundle  # looked up
        switched = next(o for o in await cluster.upgrade_render(
            {"tls": {"mode": "cert-manager"}}, tmp_path)
            if o["kind"] == "MutatingWebhookConfiguration")
    assert "cert-manager.io/inject-ca-from" in switched["metadata"]["annotations"]
    after = _helm_three_way(previous, switched, live)
    cert_dir = tmp_path / "certs"
    bootstrap.write_files(cert_dir, Material(ca, ca_key, crt, key))
    runner = await start_https(create_app(Settings(cert_dir=str(cert_dir), tls_mode="files",
                                                   placement_enabled=False)), "127.0.0.1", 0)
    try:
        async with FakeKube() as kube:
            kube.put(after)
            assert await admits(kube, live["metadata"]["name"], runner.addresses[0][1]), \
                "the upgrade took the caBundle away before cainjector set one"
    finally:
        await runner.cleanup()


async def test_a_deleted_secret_leaves_the_other_replicas_trusted(
        tmp_path: Path, chart_mwc: dict[str, Any]) -> None:
    """The Secret deleted under running replicas (by hand, to force a new CA, or by a tool):
    the first replica to check makes a new CA and sets the caBundle. Before, to the new CA
    alone, the old one having gone with the Secret: the API server refused every call that
    reached another replica until that one had read the new Secret and reloaded its
    certificate. The CA the replica served until then stays in the bundle for the day."""
    name = chart_mwc["metadata"]["name"]
    async with FakeKube() as kube:
        kube.put(chart_mwc)
        a, b = Replica(kube, tmp_path, "a", name), Replica(kube, tmp_path, "b", name)
        await a.start()
        await b.start()
        try:
            assert await admits(kube, name, b.port)
            kube.delete("secrets", SECRET, NS)
            refused: list[float] = []
            async with kube.api_client() as api:  # a's next check
                task = asyncio.create_task(bootstrap.reconcile(a.settings, api))
                start = time.monotonic()
                while not task.done() or time.monotonic() - start < 1.0:
                    if not await admits(kube, name, b.port):
                        refused.append(time.monotonic())
                    await asyncio.sleep(0.005)
                assert await task
            assert await admits(kube, name, a.port)
            assert not refused, f"calls reaching replica b refused for " \
                f"{refused[-1] - refused[0]:.3f} s (its certificate reloads every 0.05 s here)"
        finally:
            await a.stop()
            await b.stop()


async def test_a_second_release_in_another_namespace_is_refused(tmp_path: Path, render: Any) -> None:
    """Release "gpuslice" lives in gpuslice-system; "other" is installed in another namespace.
    No cluster-scoped name is shared, so Helm installed it: two kube-schedulers of one name
    booking the same GPUs (each extender its own books), two agents writing one host path, two
    webhooks mutating every GPU pod. `lookup` finds the first release's webhook configuration
    now, and the second is refused with what to do; the first's own upgrade goes on."""
    kinds = render({"tls": {"mode": "secret"}}).objects
    live = copy.deepcopy(render({"tls": {"mode": "secret"}}).one("MutatingWebhookConfiguration"))
    live["metadata"]["annotations"] = {"meta.helm.sh/release-name": RELEASE,
                                       "meta.helm.sh/release-namespace": NS}
    async with LookupCluster(kinds, [live]) as cluster:
        code, _, err = await cluster.upgrade_render_raw({}, tmp_path, release="other",
                                                        namespace="other-ns")
        assert code != 0
        assert f'gpuslice is installed already (release "{RELEASE}" in namespace "{NS}"): one ' \
               "release per cluster" in err
        code, _, err = await cluster.upgrade_render_raw({}, tmp_path, release=RELEASE,
                                                        namespace="other-ns")
        assert code != 0 and "one release per cluster" in err  # its name, another namespace
        assert await cluster.upgrade_render({}, tmp_path)  # the release itself: upgraded
