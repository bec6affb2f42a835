"""Garbage-collects the per-container state dirs of pods that are no longer on this node.

The host keeps one dir per pod, ``/var/lib/gpuslice/containers/<pod-uid>/``, with one sub-dir
per container holding its region file. A pod dir is removed only when all of these hold:

- the pod list for this node came back from the API server (a failed or partial list removes
  nothing: an outage must never look like "no pods");
- its name is a pod UID (so a misconfigured ``--host-state-dir`` cannot wipe unrelated files);
- no pod on the node has that UID;
- it has not been modified for ``grace`` seconds, which covers a pod whose dir the kubelet
  created before the API server lists the pod on this node.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _last_change(path: Path) -> float:
    """Newest mtime of the pod dir and its direct sub-dirs (containers starting later count)."""
    newest = path.lstat().st_mtime
    try:
        for entry in os.scandir(path):
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                pass
    except OSError:
        pass
    return newest


def stale_pod_dirs(state_dir: str | Path, live_uids: Iterable[str], grace: float,
                   now: float | None = None) -> list[Path]:
    """Pod dirs under ``state_dir`` whose pod is not live and that are older than ``grace``."""
    root = Path(state_dir)
    live = set(live_uids)
    now = time.time() if now is None else now
    out: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        if not POD_UID.match(entry.name) or entry.name in live:
            continue
        path = root / entry.name
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if now - _last_change(path) < grace:
                continue
        except OSError:
            continue
        out.append(path)
    return sorted(out)


def remove_stale(state_dir: str | Path, live_uids: Iterable[str], grace: float,
                 now: float | None = None) -> list[str]:
    """Remove the stale pod dirs (see :func:`stale_pod_dirs`); return the removed pod UIDs."""
    removed: list[str] = []
    for path in stale_pod_dirs(state_dir, live_uids, grace, now):
        try:
            shutil.rmtree(path)
        except OSError as exc:
            logger.warning("cannot remove state dir", extra={"path": str(path),
                                                             "error": str(exc)})
            continue
        removed.append(path.name)
        logger.info("state dir of a departed pod removed", extra={"pod_uid": path.name})
    return removed
