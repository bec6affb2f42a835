"""The service's settings: one frozen, validated object built once at start-up.

Sources, later ones winning: the embedded defaults below, a YAML file (``--config``), then
command-line flags. A bad value raises :class:`SettingsError` naming the field, and the CLI
turns that into a start-up failure; nothing reads configuration at request time.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_qualified_name(value: object) -> bool:
    """True for a Kubernetes qualified name (``[prefix/]name``), e.g. ``nvidia.com/gpu``."""
    return isinstance(value, str) and len(value) <= 253 and bool(_QUALIFIED_NAME.match(value))


class SettingsError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True)
class Settings:
    """Everything the webhook and the extender are configured with."""

    # --- resource names (HAMi's by default, so HAMi pods work unchanged) ---
    resource_gpu: str = "nvidia.com/gpu"
    """Extended resource: number of GPUs (slices of distinct GPUs). Default nvidia.com/gpu."""
    resource_mem: str = "nvidia.com/gpumem"
    """Extended resource: MiB of GPU memory per GPU. Default nvidia.com/gpumem."""
    resource_mem_percent: str = "nvidia.com/gpumem-percentage"
    """Extended resource: % (1-100) of each GPU's memory. Default nvidia.com/gpumem-percentage."""
    resource_cores: str = "nvidia.com/gpucores"
    """Extended resource: % (1-100) of each GPU's compute. Default nvidia.com/gpucores."""
    resource_priority: str = "nvidia.com/priority"
    """HAMi's task priority resource (HAMi's ``resourcePriority``), which gpuslice does not
    have: read past with a warning, no device (the chart's scheduler ignores it, as HAMi's
    does). Default nvidia.com/priority."""

    # --- what the webhook writes at pod level ---
    node_label_key: str = "gpu"
    """Label key of managed GPU nodes, written into nodeSelector. Default "gpu"."""
    node_label_value: str = "on"
    """Label value of managed GPU nodes. Default "on"."""
    scheduler_name: str = "gpuslice-scheduler"
    """schedulerName written into GPU pods (the chart's scheduler profile)."""
    runtime_class_name: str | None = None
    """runtimeClassName written into GPU pods (e.g. "nvidia"); None leaves it alone."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """Tolerations added to GPU pods (Kubernetes Toleration objects). Default none."""
    namespace_mode: str = "opt-out"
    """"opt-out": every namespace unless labelled gpuslice.io/webhook=disabled; "opt-in":
    only namespaces labelled gpuslice.io/webhook=enabled."""
    release_namespace: str = "gpuslice-system"
    """Namespace gpuslice runs in; never mutated (nor is kube-system)."""
    hide_gpus_from_pods_without_gpus: bool = False
    """Also give every container of pods that request no GPU ``NVIDIA_VISIBLE_DEVICES=none``
    (the containers of GPU pods that request none always get it). Where the NVIDIA runtime is
    the nodes' default, a pod from a CUDA image otherwise sees every GPU of its node, uncapped.
    Default false: GPU infrastructure pods (the GPU Operator's, DCGM exporters) would lose their
    GPUs unless their namespaces are excluded from the webhook."""

    # --- placement ---
    split_count: int = 10
    """Maximum number of slices (containers) sharing one physical GPU. Default 10."""
    default_policy: str = "binpack"
    """Placement policy when a pod does not choose: "binpack" or "spread"."""
    placement_enabled: bool = True
    """Serve the scheduler-extender verbs under /scheduler/. Default true."""
    kube_enabled: bool = False
    """Talk to the Kubernetes API (watches, binds, TLS bootstrap). Off in local dev mode."""
    kubeconfig: str | None = None
    """Path to a kubeconfig; None uses the in-cluster service account when kube_enabled."""
    scheduler_lease: str | None = None
    """``<namespace>/<name>`` of the Lease the kube-scheduler replicas elect their leader with
    (the chart's). After it changes hands, GPU binds wait until a Binding of the previous
    leader's extender can no longer be applied (its reservation was in that replica's memory
    only). None: no check (one scheduler, or leader election off)."""
    restart_marker: str | None = None
    """Path of a file kept across restarts of the service's container but not of its pod (the
    chart's /tmp emptyDir). Found at start-up, it means an earlier process of this container
    may have sent Bindings the API server can still apply, whose reservations died with it:
    GPU binds then wait as after a change of scheduler leader. None: no such wait."""
    max_gpu_memory_mib: int | None = None
    """Largest GPU memory (MiB) any node offers, for denying impossible requests; None =
    unknown (the extender's inventory is used when it has one)."""

    # --- HTTP / TLS ---
    host: str = ""
    """Listen address. Default "": every address, IPv4 and IPv6 (a pod's IP is an IPv6 one on
    IPv6 and IPv6-first dual-stack clusters; https://127.0.0.1:8443 works locally)."""
    port: int = 8443
    """HTTPS port for /mutate, /scheduler/*, /healthz, /readyz, /metrics. Default 8443."""
    cert_dir: str = "certs"
    """Directory with ca.crt, tls.crt, tls.key. Default "certs" (dev certs made on start)."""
    tls_mode: str = "dev"
    """"dev": make a CA and serving cert in cert_dir if absent; "files": only read them
    (cert-manager mounts); "secret": bootstrap into a Secret and patch the caBundle."""
    service_name: str = "gpuslice"
    """Service name, for certificate SANs and the caBundle patch."""
    webhook_config_name: str = "gpuslice"
    """Name of the MutatingWebhookConfiguration whose caBundle tls_mode=secret patches."""
    tls_secret_name: str = "gpuslice-tls"
    """Secret that holds the CA and serving certificate in tls_mode=secret."""
    max_body_bytes: int = 7 * 1024 * 1024
    """Largest accepted request body in bytes; larger gets HTTP 413. Default 7 MiB."""

    # --- logging ---
    log_level: str = "INFO"
    """Python logging level name. Default INFO."""
    log_format: str = "text"
    """"text" for humans, "json" for JSON lines (production)."""

    def __post_init__(self) -> None:
        _validate(self)

    @functools.cached_property
    def resource_names(self) -> tuple[str, str, str, str]:
        """The four GPU resource names, in the order gpu, mem, mem-percent, cores."""
        return (self.resource_gpu, self.resource_mem, self.resource_mem_percent,
                self.resource_cores)

    @property
    def node_selector(self) -> dict[str, str]:
        """The nodeSelector entry written into GPU pods."""
        return {self.node_label_key: self.node_label_value}


def _fail(name: str, value: Any, why: str) -> None:
    raise SettingsError(f"setting {name!r}: {why} (got {value!r})")


def _validate(s: Settings) -> None:
    names = s.resource_names
    for f in ("resource_gpu", "resource_mem", "resource_mem_percent", "resource_cores",
              "resource_priority", "node_label_key"):
        v = getattr(s, f)
        if not is_qualified_name(v):
            _fail(f, v, "must be a qualified Kubernetes name such as nvidia.com/gpu")
    if len(set(names)) != 4:
        _fail("resource_*", names, "the four resource names must differ")
    if s.resource_priority in names:
        _fail("resource_priority", s.resource_priority, "must differ from the GPU resource names")
    if not isinstance(s.node_label_value, str) or not _LABEL_VALUE.match(s.node_label_value) \
            or len(s.node_label_value) > 63:
        _fail("node_label_value", s.node_label_value, "must be a valid label value")
    for f in ("scheduler_name", "release_namespace", "service_name", "webhook_config_name",
              "tls_secret_name"):
        v = getattr(s, f)
        if not isinstance(v, str) or not v or len(v) > 253 or not re.match(
                r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", v):
            _fail(f, v, "must be a lowercase DNS name")
    if s.scheduler_lease is not None:
        parts = s.scheduler_lease.split("/") if isinstance(s.scheduler_lease, str) else []
        if len(parts) != 2 or not all(
                p and len(p) <= 253 and re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", p)
                for p in parts):
            _fail("scheduler_lease", s.scheduler_lease, "must be <namespace>/<name> or null")
    if s.restart_marker is not None and (not isinstance(s.restart_marker, str)
                                         or not s.restart_marker):
        _fail("restart_marker", s.restart_marker, "must be a file path or null")
    if s.runtime_class_name is not None and (
            not isinstance(s.runtime_class_name, str) or not _DNS_LABEL.match(s.runtime_class_name)):
        _fail("runtime_class_name", s.runtime_class_name, "must be a DNS label or null")
    if not isinstance(s.tolerations, tuple):
        _fail("tolerations", s.tolerations, "must be a list of tolerations")
    allowed_tol = {"key", "operator", "value", "effect", "tolerationSeconds"}
    for t in s.tolerations:
        if not isinstance(t, Mapping) or not set(t) <= allowed_tol:
            _fail("tolerations", t, f"each toleration is a mapping with keys among {sorted(allowed_tol)}")
        if t.get("operator", "Equal") not in ("Equal", "Exists"):
            _fail("tolerations", t, "operator must be Equal or Exists")
        if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            _fail("tolerations", t, "effect must be NoSchedule, PreferNoSchedule or NoExecute")
        # The rest of the API server's ValidateTolerations: one it refuses fails every GPU pod.
        key, value = ("" if t.get(k) is None else t[k] for k in ("key", "value"))
        if not isinstance(key, str) or key and not is_qualified_name(key):
            _fail("tolerations", t, "key must be a label key such as nvidia.com/gpu")
        if not key and t.get("operator") != "Exists":
            _fail("tolerations", t, "operator must be Exists when key is empty")
        if t.get("operator") == "Exists" and value:
            _fail("tolerations", t, "value must be empty when operator is Exists")
        if not isinstance(value, str) or not _LABEL_VALUE.match(value) or len(value) > 63:
            _fail("tolerations", t, "value must be a valid label value")
        seconds = t.get("tolerationSeconds")
        if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool)
                                    or t.get("effect") != "NoExecute"):
            _fail("tolerations", t, "tolerationSeconds must be an integer, with effect NoExecute")
    if s.namespace_mode not in ("opt-out", "opt-in"):
        _fail("namespace_mode", s.namespace_mode, 'must be "opt-out" or "opt-in"')
    if not isinstance(s.split_count, int) or isinstance(s.split_count, bool) \
            or not 1 <= s.split_count <= 1000:
        _fail("split_count", s.split_count, "must be an integer from 1 to 1000")
    if s.default_policy not in ("binpack", "spread"):
        _fail("default_policy", s.default_policy, 'must be "binpack" or "spread"')
    for f in ("placement_enabled", "kube_enabled", "hide_gpus_from_pods_without_gpus"):
        if not isinstance(getattr(s, f), bool):
            _fail(f, getattr(s, f), "must be true or false")
    if s.max_gpu_memory_mib is not None and (
            not isinstance(s.max_gpu_memory_mib, int) or isinstance(s.max_gpu_memory_mib, bool)
            or s.max_gpu_memory_mib <= 0):
        _fail("max_gpu_memory_mib", s.max_gpu_memory_mib, "must be a positive integer or null")
    if not isinstance(s.port, int) or isinstance(s.port, bool) or not 1 <= s.port <= 65535:
        _fail("port", s.port, "must be a TCP port 1-65535")
    if not isinstance(s.host, str):
        _fail("host", s.host, 'must be a listen address ("" for every address)')
    if not isinstance(s.cert_dir, str):
        _fail("cert_dir", s.cert_dir, "must be a directory path")
    if s.kubeconfig is not None and not isinstance(s.kubeconfig, str):
        _fail("kubeconfig", s.kubeconfig, "must be a file path or null")
    if s.tls_mode not in ("dev", "files", "secret"):
        _fail("tls_mode", s.tls_mode, 'must be "dev", "files" or "secret"')
    if not isinstance(s.max_body_bytes, int) or s.max_body_bytes < 1024:
        _fail("max_body_bytes", s.max_body_bytes, "must be an integer >= 1024")
    if not isinstance(s.log_level, str) \
            or s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        _fail("log_level", s.log_level, "must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    if s.log_format not in ("text", "json"):
        _fail("log_format", s.log_format, 'must be "text" or "json"')


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def settings_from_mapping(data: Mapping[str, Any], base: Settings | None = None) -> Settings:
    """Build settings from a mapping (YAML keys may use - or _), over ``base`` or defaults."""
    if not isinstance(data, Mapping):
        raise SettingsError(f"settings must be a mapping, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            raise SettingsError(f"unknown setting {key!r}; known: {', '.join(sorted(_FIELDS))}")
        if name == "tolerations":
            if not isinstance(value, list):
                raise SettingsError(f"setting 'tolerations': must be a list (got {value!r})")
            value = tuple(value)
        values[name] = value
    try:
        return dataclasses.replace(base or Settings(), **values)
    except TypeError as exc:  # pragma: no cover - replace only raises for unknown names
        raise SettingsError(str(exc)) from exc


def load_settings(path: str | Path | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Defaults, then the YAML file at ``path`` (if any), then ``overrides`` (flags)."""
    settings = Settings()
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise SettingsError(f"settings file {path} is not valid YAML: {exc}") from exc
        settings = settings_from_mapping(raw, settings)
    if overrides:
        settings = settings_from_mapping(
            {k: v for k, v in overrides.items() if v is not None}, settings)
    return settings
