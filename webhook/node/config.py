"""The node agent's settings: its command-line flags and the frozen object built from them.

``gpuslice agent`` is configured by flags only (the DaemonSet passes them). They are parsed
once into :class:`AgentSettings`, validated, and never read again; a bad value raises
:class:`~webhook.settings.SettingsError` naming the flag, which the CLI turns into exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from webhook import __version__, names
from webhook.settings import SettingsError, is_qualified_name

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]*$")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
OVER_LIMIT_ACTIONS = ("none", "evict")
PRIORITY_RESOURCE = "nvidia.com/priority"
"""HAMi's task priority resource by default (the webhook's ``resource_priority``)."""


@dataclass(frozen=True)
class AgentSettings:
    """Everything ``gpuslice agent`` is configured with."""

    node_name: str = ""
    """Name of the Node this agent runs on (flag --node-name, default env NODE_NAME)."""
    library_source: str = "/opt/gpuslice/libgpuslice.so"
    """The built interposer inside the agent image. Default /opt/gpuslice/libgpuslice.so."""
    host_library_dir: str = names.HOST_LIBRARY_DIR
    """Where the host's /usr/local/gpuslice is mounted in the agent. Default /usr/local/gpuslice."""
    preload_target: str = names.HOST_LIBRARY_DIR
    """Directory the library has inside GPU containers, written into ld.so.preload.
    Default /usr/local/gpuslice."""
    host_state_dir: str = names.HOST_STATE_DIR
    """Where the host's per-container state dirs are mounted. Default /var/lib/gpuslice/containers."""
    proc_root: str = "/proc"
    """The host's /proc (hostPID, or mounted e.g. at /host/proc), to see which libraries running
    processes map, which processes the outside checks see, and whether the processes of the
    region files' slots live (the memory metrics). Default /proc."""
    metrics_host: str = ""
    """Listen address of the metrics server. Default "": every address, IPv4 and IPv6 (the
    kubelet probes and Prometheus scrapes the pod's IP, an IPv6 one on IPv6 clusters)."""
    metrics_port: int = names.AGENT_METRICS_PORT
    """TCP port of /metrics and /healthz (0 = any free port, for tests). Default 9400."""
    interval: float = 60.0
    """Seconds between re-asserting the install, the node publication and the cleanup. Default 60."""
    cleanup_grace: float = 600.0
    """Seconds a pod's state dir must be unmodified before it may be removed for a pod the API
    does not list (covers the window before a new pod is visible). Default 600."""
    audit_interval: float = 10.0
    """Seconds between outside memory checks: each gpuslice container's GPU memory as NVML sees
    its processes hold it, against its cap (``webhook.node.audit``); 0 = off. Default 10."""
    over_limit_tolerance_mib: int = 0
    """MiB a container may hold past its cap before the check reports it. Default 0."""
    over_limit_action: str = "none"
    """What the check does about a container over its cap, beyond the metric, the log and a
    Warning Event: "none", or "evict" its pod (Eviction API). Default none."""
    over_limit_rounds: int = 3
    """Checks a container must be found over its cap in one episode before its pod is evicted;
    the episode ends after as many checks in a row under it. Default 3."""
    compute_window: float = 60.0
    """Seconds over which the outside compute check averages each container's share of each
    GPU's time (NVML's per-process utilisation, sampled every second) against its compute limit;
    0 = off (the check runs only with the memory check, ``audit_interval`` > 0). Default 60."""
    compute_tolerance: float = 10.0
    """Percentage points a container's share may exceed its compute limit by before the check
    reports it. Default 10."""
    compute_over_limit_action: str = "none"
    """What the compute check does about a container over its limit, beyond the metric, the
    log and a Warning Event: "none", or "evict" its pod once found over in
    ``over_limit_rounds`` checks. Default none."""
    offer_exclusive_process: bool = False
    """Offer GPUs whose compute mode is EXCLUSIVE_PROCESS (MPS's setting) instead of marking
    them unhealthy: only where the pods reach the MPS server (the operator mounts its pipe
    directory into them; gpuslice does not). Default false."""
    xid_check: bool = True
    """Read the GPUs' critical XID error events: a GPU that reports one, other than those an
    application causes (``inventory.APPLICATION_XIDS``) and ``skip_xids``, is Unhealthy until
    the agent restarts. --no-xid-check turns it off. Default on."""
    skip_xids: tuple[int, ...] = ()
    """More XIDs that do not count against a GPU (--skip-xids 63,74). Default none."""
    split_count: int = 10
    """Slices per physical GPU: nvidia.com/gpu capacity = healthy GPUs x this. Default 10."""
    resource_gpu: str = "nvidia.com/gpu"
    """Extended resource for the slice count. Default nvidia.com/gpu."""
    resource_mem: str = "nvidia.com/gpumem"
    """Extended resource for GPU memory in MiB. Default nvidia.com/gpumem."""
    resource_cores: str = "nvidia.com/gpucores"
    """Extended resource for compute in % of one GPU. Default nvidia.com/gpucores."""
    resource_priority: str = PRIORITY_RESOURCE
    """HAMi's task priority resource (the webhook's ``resource_priority``), which gives no
    device: the outside check judges a container the webhook gave no GPU that asks for it (and
    no other ``nvidia.com/`` resource). Default nvidia.com/priority."""
    kube_enabled: bool = True
    """Talk to the API server (publish, cleanup). --no-kube: install and metrics only."""
    kubeconfig: str | None = None
    """Path to a kubeconfig; None uses the in-cluster service account. Default None."""
    version: str = __version__
    """Version in the installed library's file name, libgpuslice.so.<version>. Default the
    package version."""
    log_level: str = "INFO"
    """Python logging level name. Default INFO."""
    log_format: str = "text"
    """"text" for humans, "json" for JSON lines. Default text."""

    def __post_init__(self) -> None:
        _validate(self)


def _fail(flag: str, value: Any, why: str) -> None:
    raise SettingsError(f"agent {flag}: {why} (got {value!r})")


def _validate(s: AgentSettings) -> None:
    if s.kube_enabled and (not s.node_name or len(s.node_name) > 253
                           or not _DNS_SUBDOMAIN.match(s.node_name)):
        _fail("--node-name", s.node_name,
              "must be the node's name (set --node-name or env NODE_NAME), or use --no-kube")
    for flag, path in (("--library-source", s.library_source),
                       ("--host-library-dir", s.host_library_dir),
                       ("--preload-target", s.preload_target),
                       ("--host-state-dir", s.host_state_dir),
                       ("--proc-root", s.proc_root)):
        if not isinstance(path, str) or not os.path.isabs(path) or "\n" in path:
            _fail(flag, path, "must be an absolute path")
    # ld.so splits /etc/ld.so.preload at white space and ':', and '#' starts a comment
    if any(c.isspace() or c in ":#" for c in s.preload_target):
        _fail("--preload-target", s.preload_target,
              "must contain no white space, ':' or '#' (ld.so.preload separators)")
    if not isinstance(s.metrics_port, int) or not 0 <= s.metrics_port <= 65535:
        _fail("--metrics-port", s.metrics_port, "must be a TCP port 0-65535")
    if not isinstance(s.metrics_host, str):
        _fail("--metrics-host", s.metrics_host, 'must be a listen address ("" for every address)')
    if not isinstance(s.interval, (int, float)) or not 0 < s.interval <= 86400:
        _fail("--interval", s.interval, "must be more than 0 and at most 86400 seconds")
    # (NaN passes "< 0", and no dir is then younger than the grace: each was removed at once)
    if not isinstance(s.cleanup_grace, (int, float)) or math.isnan(s.cleanup_grace) \
            or s.cleanup_grace < 0:
        _fail("--cleanup-grace", s.cleanup_grace, "must be >= 0 seconds")
    if not isinstance(s.audit_interval, (int, float)) or not 0 <= s.audit_interval <= 86400:
        _fail("--audit-interval", s.audit_interval, "must be 0 (off) to 86400 seconds")
    if not isinstance(s.over_limit_tolerance_mib, int) or s.over_limit_tolerance_mib < 0:
        _fail("--over-limit-tolerance-mib", s.over_limit_tolerance_mib, "must be >= 0")
    if s.over_limit_action not in OVER_LIMIT_ACTIONS:
        _fail("--over-limit-action", s.over_limit_action,
              f"must be one of {', '.join(OVER_LIMIT_ACTIONS)}")
    if not isinstance(s.over_limit_rounds, int) or not 1 <= s.over_limit_rounds <= 1000:
        _fail("--over-limit-rounds", s.over_limit_rounds, "must be an integer from 1 to 1000")
    if not isinstance(s.compute_window, (int, float)) or not (
            s.compute_window == 0 or 20 <= s.compute_window <= 3600):
        _fail("--compute-window", s.compute_window, "must be 0 (off) or 20 to 3600 seconds")
    if not isinstance(s.compute_tolerance, (int, float)) or not 0 <= s.compute_tolerance <= 100:
        _fail("--compute-tolerance", s.compute_tolerance,
              "must be 0 to 100 percentage points")
    if s.compute_over_limit_action not in OVER_LIMIT_ACTIONS:
        _fail("--compute-over-limit-action", s.compute_over_limit_action,
              f"must be one of {', '.join(OVER_LIMIT_ACTIONS)}")
    if not isinstance(s.skip_xids, tuple) or not all(
            isinstance(x, int) and 0 < x < 2 ** 32 for x in s.skip_xids):
        _fail("--skip-xids", s.skip_xids, "must be XID numbers separated by commas")
    if not isinstance(s.split_count, int) or not 1 <= s.split_count <= 1000:
        _fail("--split-count", s.split_count, "must be an integer from 1 to 1000")
    res = (s.resource_gpu, s.resource_mem, s.resource_cores)
    for flag, value in zip(("--resource-gpu", "--resource-mem", "--resource-cores",
                            "--resource-priority"), (*res, s.resource_priority)):
        if not is_qualified_name(value) or "/" not in value:
            _fail(flag, value, "must be a domain-prefixed resource name such as nvidia.com/gpu")
    if len(set(res)) != 3:
        _fail("--resource-*", res, "the three resource names must differ")
    if s.resource_priority in res:
        _fail("--resource-priority", s.resource_priority,
              "must differ from the GPU resource names")
    if not _VERSION.match(s.version) or len(s.version) > 64:
        _fail("version", s.version, "must be a version string such as 0.1.0")
    if s.log_level.upper() not in _LEVELS:
        _fail("--log-level", s.log_level, f"must be one of {', '.join(_LEVELS)}")
    if s.log_format not in ("text", "json"):
        _fail("--log-format", s.log_format, 'must be "text" or "json"')


def _xids(text: str) -> tuple[int, ...]:
    """``--skip-xids``: "63,74" (spaces and an empty list allowed) as (63, 74)."""
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not XID numbers separated by commas: {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the agent's flags to the ``gpuslice agent`` subcommand parser."""
    d = AgentSettings.__dataclass_fields__
    p.add_argument("--node-name", default=None,
                   help="this node's name (default: env NODE_NAME)")
    p.add_argument("--library-source", default=d["library_source"].default,
                   help="the built libgpuslice.so in the image (default %(default)s)")
    p.add_argument("--host-library-dir", default=d["host_library_dir"].default,
                   help="host /usr/local/gpuslice as mounted here (default %(default)s)")
    p.add_argument("--preload-target", default=d["preload_target"].default,
                   help="library dir inside GPU containers, for ld.so.preload "
                        "(default %(default)s)")
    p.add_argument("--host-state-dir", default=d["host_state_dir"].default,
                   help="host per-container state dirs as mounted here (default %(default)s)")
    p.add_argument("--proc-root", default=d["proc_root"].default,
                   help="the host's /proc (hostPID or a mount like /host/proc; "
                        "default %(default)s)")
    p.add_argument("--metrics-host", default=d["metrics_host"].default,
                   help="metrics listen address (default: every address, IPv4 and IPv6)")
    p.add_argument("--metrics-port", type=int, default=d["metrics_port"].default,
                   help="metrics port for /metrics and /healthz (default %(default)s)")
    p.add_argument("--interval", type=float, default=d["interval"].default,
                   help="seconds between re-asserts (default %(default)s)")
    p.add_argument("--cleanup-grace", type=float, default=d["cleanup_grace"].default,
                   help="seconds before an unlisted pod's state dir may go (default %(default)s)")
    p.add_argument("--audit-interval", type=float, default=d["audit_interval"].default,
                   help="seconds between outside memory checks, 0 = off (default %(default)s)")
    p.add_argument("--over-limit-tolerance-mib", type=int,
                   default=d["over_limit_tolerance_mib"].default,
                   help="MiB past its cap before a container is reported (default %(default)s)")
    p.add_argument("--over-limit-action", choices=OVER_LIMIT_ACTIONS,
                   default=d["over_limit_action"].default,
                   help="none, or evict the pod of a container over its cap "
                        "(default %(default)s)")
    p.add_argument("--over-limit-rounds", type=int, default=d["over_limit_rounds"].default,
                   help="checks over the cap (in one episode) before an eviction "
                        "(default %(default)s)")
    p.add_argument("--compute-window", type=float, default=d["compute_window"].default,
                   help="seconds over which the outside compute check averages a container's "
                        "share of a GPU's time, 0 = off (default %(default)s)")
    p.add_argument("--compute-tolerance", type=float, default=d["compute_tolerance"].default,
                   help="percentage points past its compute limit before a container is "
                        "reported (default %(default)s)")
    p.add_argument("--compute-over-limit-action", choices=OVER_LIMIT_ACTIONS,
                   default=d["compute_over_limit_action"].default,
                   help="none, or evict the pod of a container over its compute limit "
                        "(default %(default)s)")
    p.add_argument("--offer-exclusive-process-gpus", action="store_true",
                   help="offer GPUs in EXCLUSIVE_PROCESS compute mode (pods that reach an MPS "
                        "server) instead of marking them unhealthy")
    p.add_argument("--no-xid-check", action="store_true",
                   help="do not read the GPUs' critical XID error events")
    p.add_argument("--skip-xids", type=_xids, default=d["skip_xids"].default,
                   help="XIDs that do not count against a GPU, besides those applications "
                        "cause, comma-separated (default none)")
    p.add_argument("--split-count", type=int, default=d["split_count"].default,
                   help="slices per GPU (default %(default)s)")
    p.add_argument("--resource-gpu", default=d["resource_gpu"].default,
                   help="extended resource for slices (default %(default)s)")
    p.add_argument("--resource-mem", default=d["resource_mem"].default,
                   help="extended resource for GPU memory in MiB (default %(default)s)")
    p.add_argument("--resource-cores", default=d["resource_cores"].default,
                   help="extended resource for compute %% (default %(default)s)")
    p.add_argument("--resource-priority", default=d["resource_priority"].default,
                   help="HAMi's task priority resource, which gives no device "
                        "(default %(default)s)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig path (default: in-cluster)")
    p.add_argument("--no-kube", action="store_true",
                   help="no API server: install the library and serve metrics only")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", choices=["text", "json"], default="text")


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    """Build the validated settings from parsed ``gpuslice agent`` flags."""
    node_name = args.node_name if args.node_name is not None else os.environ.get("NODE_NAME", "")
    try:
        return AgentSettings(
            node_name=node_name,
            library_source=args.library_source,
            host_library_dir=args.host_library_dir,
            preload_target=args.preload_target,
            host_state_dir=args.host_state_dir,
            proc_root=args.proc_root,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            interval=args.interval,
            cleanup_grace=args.cleanup_grace,
            audit_interval=args.audit_interval,
            over_limit_tolerance_mib=args.over_limit_tolerance_mib,
            over_limit_action=args.over_limit_action,
            over_limit_rounds=args.over_limit_rounds,
            compute_window=args.compute_window,
            compute_tolerance=args.compute_tolerance,
            compute_over_limit_action=args.compute_over_limit_action,
            offer_exclusive_process=args.offer_exclusive_process_gpus,
            xid_check=not args.no_xid_check,
            skip_xids=args.skip_xids,
            split_count=args.split_count,
            resource_gpu=args.resource_gpu,
            resource_mem=args.resource_mem,
            resource_cores=args.resource_cores,
            resource_priority=args.resource_priority,
            kube_enabled=not args.no_kube,
            kubeconfig=args.kubeconfig,
            log_level=args.log_level,
            log_format=args.log_format,
        )
    except TypeError as exc:  # pragma: no cover - argparse gives the declared types
        raise SettingsError(str(exc)) from exc

