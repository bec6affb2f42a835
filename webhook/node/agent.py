"""``gpuslice agent``: the node agent's entry point (one per GPU node, in a DaemonSet).

This module stays light, because the CLI imports it to build its parser for every subcommand:
the flags live in :mod:`webhook.node.config`, the loop (NVML, Kubernetes client, metrics) in
:mod:`webhook.node.loop`, imported only when the agent actually runs.

Start-up order: validate the flags (a bad one exits 2), read the built library (missing or not
an ELF file: the image is broken, exit 2), then run the loop until SIGTERM/SIGINT (exit 0,
promptly: :func:`webhook.node.loop.serve`).
"""

from __future__ import annotations

import argparse
import logging

from webhook.logs import setup_logging
from webhook.node.config import add_arguments, settings_from_args

__all__ = ["add_arguments", "cmd_agent"]

logger = logging.getLogger(__name__)


def cmd_agent(args: argparse.Namespace) -> int:
    """Validate the flags, read the library, run the agent until SIGTERM."""
    settings = settings_from_args(args)
    setup_logging(settings.log_level, settings.log_format)
    from webhook.node import install, loop

    try:
        library = install.read_library(settings.library_source)
    except install.InstallError as exc:
        logger.error("the agent image has no usable library", extra={"error": str(exc)})
        return 2
    return loop.serve(settings, library)
