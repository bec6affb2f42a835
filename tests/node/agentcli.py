"""The agent's command line for tests that run it as a process, without an API server."""

from __future__ import annotations

from pathlib import Path


def no_kube_args(tmp_path: Path, src: Path) -> list[str]:
    """``agent``'s arguments: the library from ``src``, host paths and /proc under ``tmp_path``,
    metrics on a free local port, JSON logs."""
    return ["--no-kube", "--library-source", str(src),
            "--host-library-dir", str(tmp_path / "lib"), "--host-state-dir", str(tmp_path / "state"),
            "--proc-root", str(tmp_path / "proc"), "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--log-format", "json"]
