"""The per-container state dirs: writable by every user of the container, removed after the pod.

Every container user must be able to create the container's region file, or each process of a
non-root container falls back to a region of its own (a budget of its own, and no metrics).
Kubelet creates a container's dir ``<pod-uid>/<container>`` (the webhook's ``subPathExpr``)
with the permission bits of the hostPath volume's root (not its sticky bit), so
:func:`share_state_dirs` keeps that root ``1777`` and gives pod and container dirs ``1777``
too, like ``/tmp``: every user may create the region file, and none may remove or replace
another user's (the library also refuses a region path that is a symlink or not a plain file
of its own). Run every round; it touches only what is not so yet. A symlinked root (an admin's
choice) is resolved once; nothing below it is followed.

The host keeps one dir per pod, ``/var/lib/gpuslice/containers/<pod-uid>/``, with one sub-dir
per container holding its region file. A pod dir is removed only when all of these hold:

- the pod list for this node came back from the API server (a failed or partial list removes
  nothing: an outage must never look like "no pods");
- its name is a pod UID (so a misconfigured ``--host-state-dir`` cannot wipe unrelated files);
- no pod on the node has that UID;
- it has not changed for ``grace`` seconds, which covers a pod whose dir the kubelet
  created before the API server lists the pod on this node. A change's time is the earlier of
  ``mtime`` and ``ctime``: a tenant can set its dir's ``mtime`` to any date (``touch -d``), but
  not ``ctime``, which the kernel sets to the time of the change.

The tree is removed without recursion and without following symbolic links: a tenant may have
left anything in it (a thousand nested dirs would exhaust Python's recursion in
``shutil.rmtree``), and a failure with one pod dir never keeps the others.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


SHARED_MODE = 0o1777
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_up(name: str | Path, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open the directory ``name`` (never a symlink; relative to ``dir_fd`` if given) and give
    it ``SHARED_MODE``; its descriptor (the caller closes it) and True if it had another mode."""
    fd = os.open(name, _NOFOLLOW_DIR, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_mode & 0o7777 == SHARED_MODE:
            return fd, False
        os.fchmod(fd, SHARED_MODE)
        return fd, True
    except BaseException:
        os.close(fd)
        raise


def share_state_dirs(state_dir: str | Path) -> list[str]:
    """Create the state root if missing and give it and the pod and container dirs under it
    ``SHARED_MODE``; return the paths changed (relative to the root, the root as ``.``).

    Every step below the root goes through the descriptor of the directory above, never a path:
    the root is ``1777``, so any user of the host can make a pod-UID-named dir there and swap it
    for a symbolic link (to ``/proc/1/root/etc``, say) between the check and the use, and a pod
    dir's path, reused, would have chmod'ed the link target's sub-dirs ``1777``."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    root_fd, changed_root = _open_up(os.path.realpath(state_dir))
    changed = ["."] if changed_root else []
    try:
        for pod in sorted(os.scandir(root_fd), key=lambda e: e.name):
            if not POD_UID.match(pod.name) or not pod.is_dir(follow_symlinks=False):
                continue
            try:
                pod_fd, opened = _open_up(pod.name, root_fd)
            except OSError as exc:  # a pod dir removed meanwhile, or not ours to change
                logger.warning("cannot open up state dir", extra={"path": pod.name,
                                                                  "error": str(exc)})
                continue
            try:
                if opened:
                    changed.append(pod.name)
                for ctr in sorted(os.scandir(pod_fd), key=lambda e: e.name):
                    if not ctr.is_dir(follow_symlinks=False):
                        continue
                    ctr_fd, opened = _open_up(ctr.name, pod_fd)
                    os.close(ctr_fd)
                    if opened:
                        changed.append(f"{pod.name}/{ctr.name}")
            except OSError as exc:  # a container dir removed meanwhile, or not ours
                logger.warning("cannot open up state dir", extra={"path": pod.name,
                                                                  "error": str(exc)})
            finally:
                os.close(pod_fd)
    finally:
        os.close(root_fd)
    return changed


def last_change(path: Path) -> float:
    """Newest change of the pod dir and its direct sub-dirs (containers starting later count)."""
    newest = _changed(path.lstat())
    try:
        for entry in os.scandir(path):
            try:
                newest = max(newest, _changed(entry.stat(follow_symlinks=False)))
            except OSError:
                pass
    except OSError:
        pass
    return newest


def _changed(st: os.stat_result) -> float:
    """When an inode last changed, as far as its owner cannot postpone it."""
    return min(st.st_mtime, st.st_ctime)


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
            if now - last_change(path) < grace:
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
            remove_tree(path)
        except OSError as exc:  # one pod dir must not keep the others
            logger.warning("cannot remove state dir", extra={"path": str(path),
                                                             "error": repr(exc)})
            continue
        removed.append(path.name)
        logger.info("state dir of a departed pod removed", extra={"pod_uid": path.name})
    return removed


def remove_tree(path: str | Path) -> None:
    """``rm -r`` of the directory ``path``, never following a symbolic link, holding one
    directory open at a time and using no recursion, however deep the tree.

    Going back up is through ``..``, which names wherever the directory is *now*: one moved
    meanwhile (the root is ``1777``: a user of the host may own the tree) would lead into
    another directory, whose files would then go too (another pod's region, and up from there).
    So each directory's identity is kept on the way down and ``..`` must be the one left."""
    fd = os.open(path, _NOFOLLOW_DIR)
    names: list[str] = []  # the path from ``path`` down to the directory ``fd`` is
    above: list[tuple[int, int]] = []  # the (st_dev, st_ino) of each directory on that path
    try:
        while True:
            child = _empty_but_one(fd)
            if child is not None:  # go down into the first sub-directory
                down = os.open(child, _NOFOLLOW_DIR, dir_fd=fd)
                st = os.fstat(fd)
                os.close(fd)
                fd, names = down, names + [child]
                above.append((st.st_dev, st.st_ino))
                continue
            if not names:
                break
            up = os.open("..", _NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = up
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != above.pop():
                raise OSError(errno.ESTALE, "a directory of the tree was moved out of it "
                                            "while it was removed", str(path))
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _empty_but_one(fd: int) -> str | None:
    """Remove every non-directory in the directory ``fd``; return a sub-directory's name, or
    None once it is empty."""
    while True:
        removed = False
        with os.scandir(fd) as entries:
            for entry in entries:
                if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                    return entry.name
                os.unlink(entry.name, dir_fd=fd)
                removed = True
        if not removed:  # a listing changed while it was read may have skipped some
            return None
