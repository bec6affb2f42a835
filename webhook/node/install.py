"""Installs the interposer library on the host, atomically and versioned, and garbage-collects
old versions that nothing uses any more.

Layout in the host library dir (``/usr/local/gpuslice``):

- ``libgpuslice.so.<version>``: the library. If a file of that name already exists with
  different bytes (a rebuilt image with an unchanged version), it is never touched: the new
  build goes to ``libgpuslice.so.<version>-<first 8 hex of its SHA-256>`` instead. An existing
  file with identical bytes (under either name) is reused, so restarts do not churn.
- ``ld.so.preload``: one line, ``<preload-target>/<file name>``. GPU containers bind-mount this
  file as ``/etc/ld.so.preload``. A file bind mount pins the inode, so replacing the file by
  rename leaves every running container on the version it started with (one container never
  mixes library versions on its shared region) while new containers get the new one.

Every write is a temp file in the same directory, ``fsync``, ``rename``, then ``fsync`` of the
directory: a reader sees the old file or the new one, never a partial one.

Removal: an old ``libgpuslice.so.*`` goes only when no process maps it (``<proc>/*/maps``,
matched by device and inode, and by file name) and no running mount namespace's
``/etc/ld.so.preload`` names it (read through ``<proc>/<pid>/root``; a container whose
entrypoint is static would otherwise lose its library before its next dynamic process), and
the library dir's own ``ld.so.preload`` does not name it (read after the scan: another agent of
the node, in a rolling update's overlap or a rollback, may have pointed it at its version). If
any process cannot be inspected, nothing is removed that round. /proc does not show the
processes of a sandboxed pod (Kata's VM, gVisor's user-space kernel; the webhook mounts the
library into such pods as into any other), so where the agent lists the node's pods, no old
library goes while a GPU pod's container runs that started before the host's ld.so.preload
last changed (or within :data:`PINNED_MARGIN_S` after): its bind mount names the library of
then, which may be any older one. An install and the removals each hold an exclusive
``flock`` on the library dir, so another agent's removal never falls between an install's
finding its library in place and pointing ld.so.preload at it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from webhook.node.files import NotPlainFile, read_plain_file, read_plain_file_in_root

logger = logging.getLogger(__name__)

LIB_STEM = "libgpuslice.so"
PRELOAD_NAME = "ld.so.preload"
PRELOAD_READ_LIMIT = 1 << 16
"""Bytes of a container's ld.so.preload read (a real one names a library or two)."""
TMP_PREFIX = ".gpuslice-tmp-"
STALE_TMP_SECONDS = 600.0
PINNED_MARGIN_S = 60.0
"""How long after the host's ld.so.preload changed a container's start may still have pinned
the file before it: the runtime makes a container's mounts before it starts it (a sandbox's
VM boots in between), the API server gives start times in whole seconds, and its list may
show a container running some seconds after it started."""
_ELF_MAGIC = b"\x7fELF"
_MAPS_LINE = re.compile(
    r"^\S+\s+\S+\s+\S+\s+(?P<major>[0-9a-fA-F]+):(?P<minor>[0-9a-fA-F]+)\s+(?P<ino>\d+)\s+"
    r"(?P<path>.*)$")


class InstallError(Exception):
    """The library could not be read or installed; the message says what to fix."""


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install` did."""

    library: Path
    """Host path of the library that ld.so.preload now names."""
    preload_line: str
    """The line in ld.so.preload (the path inside GPU containers)."""
    library_written: bool
    """True when the library file was newly written (False: an identical file was reused)."""
    preload_written: bool
    """True when ld.so.preload changed."""


def read_library(path: str | Path) -> bytes:
    """The built library's bytes; :class:`InstallError` if absent or not an ELF file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InstallError(f"cannot read the library {path}: {exc.strerror}") from exc
    if not data.startswith(_ELF_MAGIC):
        raise InstallError(f"{path} is not an ELF shared library")
    return data


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _same_content(path: Path, data: bytes, digest: str) -> bool:
    try:
        if path.stat().st_size != len(data):
            return False
        return _digest(path.read_bytes()) == digest
    except OSError:
        return False


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new file, never a partial one."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _dir_locked(host: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the library dir itself, for as long as the block runs.

    Two agents of one node (a rolling update's overlap, a rollback) share the dir: one must not
    remove a library between the other's finding it in place and pointing ld.so.preload at it.
    The lock goes with the holder's descriptor, so a killed agent leaves no lock behind. Where
    the filesystem has no such lock (NFS emulates it with a write lock, which a directory
    cannot take), the block runs unlocked, as before there was one."""
    fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            logger.debug("library dir not locked", extra={"dir": str(host), "error": str(exc)})
        yield
    finally:
        os.close(fd)


def install(data: bytes, host_dir: str | Path, preload_target: str, version: str) -> InstallResult:
    """Install ``data`` as the current library and point ld.so.preload at it (idempotent)."""
    host = Path(host_dir)
    digest = _digest(data)
    plain = host / f"{LIB_STEM}.{version}"
    hashed = host / f"{LIB_STEM}.{version}-{digest[:8]}"
    try:
        host.mkdir(parents=True, exist_ok=True)
        with _dir_locked(host):
            return _install_locked(data, host, preload_target, digest, plain, hashed)
    except OSError as exc:
        raise InstallError(f"cannot install into {host}: {exc}") from exc


def _install_locked(data: bytes, host: Path, preload_target: str, digest: str, plain: Path,
                    hashed: Path) -> InstallResult:
    written = False
    if _same_content(plain, data, digest):
        target = plain
    elif _same_content(hashed, data, digest):
        target = hashed
    else:
        target = hashed if plain.exists() else plain
        if target.exists():
            raise InstallError(f"{target} exists with other content; refusing to overwrite")
        atomic_write(target, data, 0o755)
        written = True
        logger.info("library installed", extra={"path": str(target), "sha256": digest})
    line = f"{preload_target.rstrip('/')}/{target.name}"
    preload = host / PRELOAD_NAME
    want = (line + "\n").encode()
    try:
        current = preload.read_bytes()
    except FileNotFoundError:
        current = None
    preload_written = current != want
    if preload_written:
        atomic_write(preload, want, 0o644)
        logger.info("ld.so.preload updated", extra={"path": str(preload), "line": line})
    return InstallResult(target, line, written, preload_written)


@dataclass
class ProcScan:
    """What running processes use, from one pass over ``<proc>``."""

    mapped_inodes: set[tuple[int, int]] = field(default_factory=set)
    """(st_dev, st_ino) of every mapped file whose path contains libgpuslice."""
    mapped_names: set[str] = field(default_factory=set)
    """Base names of those files."""
    preloaded_names: set[str] = field(default_factory=set)
    """Base names of libgpuslice files named by some mount namespace's /etc/ld.so.preload."""
    processes: int = 0
    complete: bool = True
    """False when some process could not be inspected (then nothing may be removed)."""
    first_error: str = ""
    """The first inspection failure, for the log (e.g. EACCES under an AppArmor profile)."""

    def fail(self, where: Path, exc: OSError) -> None:
        if self.complete:
            self.first_error = f"{where}: {exc.strerror or exc}"
        self.complete = False


def scan_proc(proc_root: str | Path) -> ProcScan:
    """Which libgpuslice files running processes map or will preload."""
    scan = ProcScan()
    proc = Path(proc_root)
    seen_ns: set[tuple[str, int, int]] = set()
    try:
        pids = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError as exc:
        scan.fail(proc, exc)
        return scan
    for pid in pids:
        base = proc / pid
        try:
            maps = (base / "maps").read_text(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        except OSError as exc:
            scan.fail(base / "maps", exc)
            continue
        scan.processes += 1
        for line in maps.splitlines():
            if LIB_STEM not in line:
                continue
            m = _MAPS_LINE.match(line)
            if not m:
                continue
            dev = os.makedev(int(m["major"], 16), int(m["minor"], 16))
            scan.mapped_inodes.add((dev, int(m["ino"])))
            scan.mapped_names.add(os.path.basename(m["path"].removesuffix(" (deleted)")))
        try:
            ns = os.readlink(base / "ns" / "mnt")
        except (FileNotFoundError, ProcessLookupError):
            continue
        except OSError as exc:
            scan.fail(base / "ns" / "mnt", exc)
            continue
        # One read per root of a mount namespace, once it has answered: a process of the
        # container that chrooted sees another /etc, and one that exits meanwhile reads as no
        # file; neither may stand for the container's other processes.
        try:
            root = os.stat(base / "root")
        except (FileNotFoundError, ProcessLookupError):
            continue
        except OSError as exc:
            scan.fail(base / "root", exc)
            continue
        where = (ns, root.st_dev, root.st_ino)
        if where in seen_ns:
            continue
        # The container's own file: a FIFO, device, loop or endless file there must neither
        # hang nor exhaust the agent. ld.so reads no such file either: it names nothing.
        try:
            text = read_plain_file_in_root(base / "root", f"/etc/{PRELOAD_NAME}",
                                           PRELOAD_READ_LIMIT).decode(errors="replace")
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError, NotPlainFile):
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue
            scan.fail(base / "root", exc)
            continue
        seen_ns.add(where)
        for token in re.split(r"[\s:]+", text):
            if LIB_STEM in token:
                scan.preloaded_names.add(os.path.basename(token))
    return scan


def _named_by_host_preload(host: Path) -> set[str] | None:
    """Base names of the libgpuslice files the host's ld.so.preload names now (what containers
    starting now will preload); None, logged, if it cannot be read (then nothing may go)."""
    try:
        text = read_plain_file(host / PRELOAD_NAME, PRELOAD_READ_LIMIT).decode(errors="replace")
    except FileNotFoundError:
        return set()
    except OSError as exc:
        logger.warning("cannot read the library dir's ld.so.preload; old libraries kept",
                       extra={"dir": str(host), "error": str(exc)})
        return None
    return {os.path.basename(t) for t in re.split(r"[\s:]+", text) if LIB_STEM in t}


@dataclass
class LibraryCleanup:
    """What one clean-up of the library dir did (:func:`clean_up_libraries`)."""

    removed: list[str] = field(default_factory=list)
    """Names removed: old library versions and stale temp files."""
    kept: list[str] = field(default_factory=list)
    """Old library versions left in place: in use, or not known not to be."""
    blocked: str = ""
    """Why no old library could be judged this time ("" when they were): a process that could
    not be inspected, the host's ld.so.preload unreadable, the dir not lockable."""


def remove_unused(host_dir: str | Path, current: Path, proc_root: str | Path,
                  now: float | None = None) -> list[str]:
    """Remove old library versions nothing uses and stale temp files; return what went."""
    return clean_up_libraries(host_dir, current, proc_root, now).removed


def clean_up_libraries(host_dir: str | Path, current: Path, proc_root: str | Path,
                       now: float | None = None, *,
                       oldest_container: float | None = None) -> LibraryCleanup:
    """As :func:`remove_unused`, and say what was kept and whether the clean-up was blocked.

    ``oldest_container``: where the agent has the API server's list of the node's pods, when
    the oldest running container of a GPU pod started (Unix time; ``math.inf`` for none), and
    None where it has no API server (then ``<proc>`` alone tells). While one runs that started
    before the host's ``ld.so.preload`` last changed, or within :data:`PINNED_MARGIN_S` after,
    every old library stays (see the module's notes)."""
    host = Path(host_dir)
    now = time.time() if now is None else now
    out = LibraryCleanup()
    candidates: list[Path] = []
    try:
        entries = list(os.scandir(host))
    except OSError as exc:
        logger.warning("cannot list the library dir", extra={"dir": str(host), "error": str(exc)})
        out.blocked = f"cannot list {host}: {exc}"
        return out
    for entry in entries:
        path = host / entry.name
        if entry.name.startswith(TMP_PREFIX):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                    path.unlink()
                    out.removed.append(entry.name)
            except OSError:
                pass
        elif entry.name.startswith(LIB_STEM + ".") and entry.name != current.name \
                and entry.is_file(follow_symlinks=False):
            candidates.append(path)
    if not candidates:
        return out
    out.kept = sorted(p.name for p in candidates)
    scan = scan_proc(proc_root)
    if not scan.complete:
        logger.warning("some processes could not be inspected; old libraries kept (the agent "
                       "needs the host's /proc, SYS_PTRACE and no AppArmor confinement)",
                       extra={"proc": str(proc_root), "error": scan.first_error})
        out.blocked = f"a process could not be inspected: {scan.first_error}"
        return out
    try:
        with _dir_locked(host):  # no other agent's install in between
            if not _pinned(host, oldest_container, now, out):
                _remove(candidates, host, scan, out)
    except OSError as exc:
        logger.warning("cannot lock the library dir; old libraries kept",
                       extra={"dir": str(host), "error": str(exc)})
        out.blocked = f"cannot lock {host}: {exc}"
    return out


def _pinned(host: Path, oldest_container: float | None, now: float,
            out: LibraryCleanup) -> bool:
    """Whether a running GPU container may have pinned an ld.so.preload that names an old
    library (then none may go): one started before the host's file last changed, or so soon
    after that its mounts may have been made before. Within that time of a change, too: the
    API server may not list a container started just before it as running yet."""
    if oldest_container is None:
        return False
    try:
        changed = (host / PRELOAD_NAME).stat().st_mtime
    except OSError as exc:
        logger.warning("cannot read the library dir's ld.so.preload; old libraries kept",
                       extra={"dir": str(host), "error": str(exc)})
        out.blocked = f"cannot stat {host / PRELOAD_NAME}: {exc}"
        return True
    pinned = min(oldest_container, now) < changed + PINNED_MARGIN_S
    if pinned:
        logger.debug("old libraries kept: a GPU container may have started with one",
                     extra={"preload_changed": changed, "oldest_container": oldest_container})
    return pinned


def _remove(candidates: list[Path], host: Path, scan: ProcScan, out: LibraryCleanup) -> None:
    """Remove the candidates that neither the scan nor the host's ld.so.preload finds in use
    (the library dir locked); move their names from ``out.kept`` to ``out.removed``."""
    for path in candidates:
        try:
            st = path.stat()
        except OSError:
            continue
        if ((st.st_dev, st.st_ino) in scan.mapped_inodes or path.name in scan.mapped_names
                or path.name in scan.preloaded_names):
            continue
        # Read now, after the scan, before each removal: another agent (the old pod's last
        # round beside the new pod's first in a rolling update, a rollback) may have pointed
        # the host's file at its own library meanwhile, and containers starting now mount it.
        named = _named_by_host_preload(host)
        if named is None:
            out.blocked = f"cannot read {host / PRELOAD_NAME}"
            return
        if path.name in named:
            continue
        try:
            path.unlink()
        except OSError as exc:
            logger.warning("cannot remove old library", extra={"path": str(path),
                                                               "error": str(exc)})
            continue
        out.kept.remove(path.name)
        out.removed.append(path.name)
        logger.info("old library removed", extra={"path": str(path)})
