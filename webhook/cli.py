"""The ``gpuslice`` command line: one entry point, one subcommand per job.

Subcommands import their implementation lazily so ``gpuslice check`` in a CI pipeline does not
pay for the server, the Kubernetes client or NVML.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from webhook import __version__
from webhook.settings import Settings, SettingsError, load_settings, settings_from_mapping


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(raw) if raw else ""
    return out


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build the settings from --config, the explicit flags and --set KEY=VALUE."""
    overrides: dict[str, Any] = {}
    for name in ("host", "port", "cert_dir", "tls_mode", "log_level", "log_format",
                 "kubeconfig"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(args, "kube", None) is not None:
        overrides["kube_enabled"] = args.kube
    settings = load_settings(getattr(args, "config", None), overrides)
    # --set last, and apart: load_settings passes over None (a flag not given), while
    # --set KEY=null sets a setting to null (runtime_class_name, scheduler_lease...)
    sets = _parse_set(getattr(args, "set", None) or [])
    return settings_from_mapping(sets, settings) if sets else settings


def _settings_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML settings file (see README)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                   help="override one setting, e.g. --set split_count=4 (repeatable)")


def _run(target: str) -> Callable[[argparse.Namespace], int]:
    module_name, _, func = target.partition(":")

    def call(args: argparse.Namespace) -> int:
        module = importlib.import_module(module_name)
        return int(getattr(module, func)(args) or 0)

    return call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuslice", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpuslice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the admission webhook and scheduler extender (HTTPS)")
    _settings_flags(p)
    p.add_argument("--host", help="listen address (default: every address, IPv4 and IPv6)")
    p.add_argument("--port", type=int, help="HTTPS port (default 8443)")
    p.add_argument("--cert-dir", help="directory with ca.crt/tls.crt/tls.key (default certs)")
    p.add_argument("--tls-mode", choices=["dev", "files", "secret"], help="see README")
    p.add_argument("--kube", action=argparse.BooleanOptionalAction, default=None,
                   help="talk to the Kubernetes API (watches, binds, TLS bootstrap)")
    p.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", choices=["text", "json"])
    p.set_defaults(func=_run("webhook.service:cmd_serve"))

    p = sub.add_parser("mutate", help="print the mutated objects of a manifest (offline)")
    _settings_flags(p)
    p.add_argument("-f", "--filename", required=True, action="append", metavar="FILE",
                   help="YAML/JSON manifest, multi-document allowed; - for stdin; repeatable")
    p.set_defaults(func=_run("webhook.admission.offline:cmd_mutate"))

    p = sub.add_parser("check", help="exit 1 listing every denial in a manifest (offline)")
    _settings_flags(p)
    p.add_argument("-f", "--filename", required=True, action="append", metavar="FILE",
                   help="YAML/JSON manifest(s); - for stdin; repeatable")
    p.set_defaults(func=_run("webhook.admission.offline:cmd_check"))

    p = sub.add_parser("certs", help="create a development CA and serving certificate")
    p.add_argument("--dir", default="certs", help="output directory (default certs)")
    p.add_argument("--namespace", default="gpuslice-system",
                   help="namespace of the Service, for the SANs (default gpuslice-system)")
    p.add_argument("--service", default="gpuslice", help="Service name (default gpuslice)")
    p.add_argument("--days", type=int, default=365, help="validity of the serving cert")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(func=_run("webhook.tls:cmd_certs"))

    p = sub.add_parser("agent", help="run the node agent (DaemonSet)")
    try:
        agent = importlib.import_module("webhook.node.agent")
        agent.add_arguments(p)
    except ImportError:  # pragma: no cover - only while the agent is absent
        pass
    p.set_defaults(func=_run("webhook.node.agent:cmd_agent"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SettingsError as exc:
        print(f"gpuslice: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
