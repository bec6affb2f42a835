"""Whether the process of a region's live slot still lives, judged from the agent as the
interposer's own sweep judges it (``interposer/src/liveness.c``), read-only.

A process that ends without its exit handlers (SIGKILL, the OOM killer, ``_exit``) leaves its
slot live, with its usage, until another process of its container starts and sweeps it; in a
pod whose CUDA processes are all gone (a finished Job kept around, a shell whose CUDA child was
killed) nobody ever does. The agent must not count that memory, nor reclaim it: the region is
the container's, and the agent never writes it.

The judgement, cheapest first, and the process counted as alive whenever it cannot be told (a
figure may show memory nobody holds, never hide memory that may be held):

1. Its liveness token held (:func:`webhook.node.region.token_held`, asked when the region is
   read): alive. Only a process of the container holds it (the one that registered, or a child
   sharing its descriptor).
2. Otherwise (no token: NFS, where tokens are off; or the token not held: the process died,
   exec'd, or closed its descriptor) the process is looked up by its identity in the host's
   procfs (``--proc-root``, where every pod's processes are seen, as the library GC also
   needs): pid in its container's namespace, that namespace's inode, start time. Its host pid
   is the slot's pid where the namespace is the procfs's own (a hostPID pod); otherwise one
   pass over the procfs per scrape, at most, indexes every process by start time (one read of
   ``<proc>/<pid>/stat`` each), and the few started in the same clock tick are told apart by
   the last pid of ``NSpid`` (``status``, readable by anyone) and the ``ns/pid`` link.
   A host pid found stays known (a process keeps it for life): later scrapes read one ``stat``.
3. Not found (where the procfs shows every process: not one mounted ``hidepid`` to a reader
   without root's rights; and started before the scan began, by the procfs's ``uptime``: one
   that started during the scrape is not in its index), or a zombie without other threads: dead (and remembered as dead: a
   dead process stays dead). Found with its token noted but not held: alive only if it still maps the region
   file (``<proc>/<pid>/maps``: a program that closed its descriptors keeps the mapping, an
   exec takes both); the device is not compared, as btrfs and overlayfs name it otherwise in
   maps than ``stat`` does, so a match on another device counts it (the safe side).

Work per scrape is bounded: only slots that hold memory are judged, and the lookups of step 2
and the maps reads stop at a time budget, after which the slots left count as alive.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from webhook.node.audit import stat_fields
from webhook.node.region import ProcessUsage

BUDGET = 0.5
"""Seconds of procfs lookups one scrape may spend (then the slots left count as alive)."""

_GONE = -1
_UNKNOWN = 0


def _ns_inode(link: str) -> int | None:
    """``pid:[4026531836]`` -> 4026531836"""
    start, end = link.find("["), link.rfind("]")
    try:
        return int(link[start + 1:end]) if 0 <= start < end else None
    except ValueError:
        return None


class Liveness:
    """Judges the process slots of the regions one scrape reads (:meth:`begin`, then
    :meth:`alive` per slot, then :meth:`end`)."""

    def __init__(self, proc_root: str | Path = "/proc", *, budget: float = BUDGET,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = Path(proc_root)
        self._budget = budget
        self._clock = clock
        self._deadline = 0.0
        self._index: dict[int, list[int]] | None = None  # start ticks -> host pids, this scrape
        self._index_complete = False
        self._index_ticks: int | None = None  # ticks since boot as the index began (None: unknown)
        self._own_ns: int | None = None  # the procfs's PID namespace, where it is ours (0: not)
        self._all: bool | None = None  # whether the procfs shows this reader every process
        self._dead: set[tuple[int, int, int]] = set()  # (pidns, pid, start time) found gone
        self._host: dict[tuple[int, int, int], int] = {}  # identity -> its host pid
        self._used_dead: set[tuple[int, int, int]] = set()
        self._used_host: set[tuple[int, int, int]] = set()

    def begin(self) -> None:
        self._deadline = self._clock() + self._budget
        self._index = None
        self._used_dead, self._used_host = set(), set()

    def end(self) -> None:
        """Forget the identities no slot named in this scrape (reclaimed, or their region gone)."""
        self._dead &= self._used_dead
        self._host = {k: v for k, v in self._host.items() if k in self._used_host}
        self._index = None

    def alive(self, p: ProcessUsage, region_inode: int) -> bool:
        if p.token_held:
            return True
        ident = (p.pidns, p.pid, p.start_time)
        if p.pid <= 0 or not p.pidns or not p.start_time:
            return True  # no identity to look up (no /proc in the container)
        if ident in self._dead:
            self._used_dead.add(ident)
            return False
        if self._clock() > self._deadline:
            return True
        host = self._host_pid(ident)
        if host == _UNKNOWN:
            return True
        if host != _GONE:
            try:
                stat = self._stat(host)
            except OSError:
                return True
            if stat is None or stat[0] != p.start_time:
                host = _GONE  # it ended between the look-up and now
            elif stat[1] == "X" or (stat[1] == "Z" and stat[2] <= 1):
                host = _GONE  # killed, not reaped: its memory is gone (unless threads still run)
        if host == _GONE:
            self._dead.add(ident)
            self._used_dead.add(ident)
            return False
        self._used_host.add(ident)
        # the same process: another program since an exec, or one that closed its descriptor?
        return p.token_held is None or p.token != p.pid or self._maps(host, region_inode)

    # ---- the host pid of an identity ---------------------------------------------------

    def _host_pid(self, ident: tuple[int, int, int]) -> int:
        """Its host pid, _GONE (surely no such process) or _UNKNOWN."""
        pidns, pid, start = ident
        known = self._host.get(ident)
        if known is None and pidns == self._own_namespace():
            known = pid
        if known is not None:
            try:
                stat = self._stat(known)
            except OSError:
                return _UNKNOWN
            if stat is None:
                return _GONE if self._sees_all() else _UNKNOWN
            return known if stat[0] == start else _GONE
        index = self._scan()
        unsure = not self._index_complete or not self._sees_all() or self._after_index(start, index)
        for host in index.get(start, ()):
            try:
                nspid = self._nspid(host)
                if nspid != pid:
                    continue
                if _ns_inode(os.readlink(self._proc / str(host) / "ns" / "pid")) == pidns:
                    self._host[ident] = host
                    return host
            except (FileNotFoundError, ProcessLookupError):
                continue
            except OSError:
                unsure = True  # (its namespace unreadable: it may be the one)
        return _UNKNOWN if unsure else _GONE

    def _after_index(self, start: int, index: dict[int, list[int]]) -> bool:
        """Whether a process of start time ``start`` may have started after the index began
        (then its absence from it says nothing: found gone, a process of another container
        that started during the scrape was remembered dead and its memory left out of every
        scrape for its whole life, `test_metrics.py -k after_the_scan`). By the procfs's
        uptime when the index began; where that is unknown, by the newest process indexed."""
        if self._index_ticks is not None:
            return start >= self._index_ticks - 1
        return not index or start >= max(index)

    def _own_namespace(self) -> int:
        if self._own_ns is None:
            self._own_ns = 0
            try:
                if int(os.readlink(self._proc / "self")) == os.getpid():
                    self._own_ns = os.stat(self._proc / "self" / "ns" / "pid").st_ino
            except (OSError, ValueError):
                pass
        return self._own_ns

    def _sees_all(self) -> bool:
        """False where a process missing from the procfs may only be hidden from this reader: a
        procfs mounted with ``hidepid`` and a reader without root's rights (the agent has them)."""
        if self._all is None:
            self._all = True
            if os.geteuid() != 0:
                try:
                    target = os.path.realpath(self._proc)
                    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                        for line in f:
                            # "id parent maj:min root mountpoint options ... - type source super"
                            words = line.split()
                            sep = words.index("-")
                            if words[4] == target and words[sep + 1] == "proc":
                                options = words[5].split(",") + words[sep + 3].split(",")
                                self._all = not any(
                                    o.startswith("hidepid=") and o[8:] not in ("0", "off")
                                    for o in options)
                except (OSError, ValueError, IndexError):
                    self._all = False
        return self._all

    def _scan(self) -> dict[int, list[int]]:
        """Every process of the procfs by start time, once per scrape, within the budget."""
        if self._index is not None:
            return self._index
        index: dict[int, list[int]] = {}
        complete = True
        try:
            uptime = float((self._proc / "uptime").read_text().split()[0])
            self._index_ticks = int(uptime * os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            self._index_ticks = None
        try:
            with os.scandir(self._proc) as entries:
                for entry in entries:
                    if not entry.name.isdigit():
                        continue
                    if self._clock() > self._deadline:
                        complete = False
                        break
                    try:
                        stat = self._stat(int(entry.name))
                    except OSError:
                        complete = False
                        continue
                    if stat is not None:
                        index.setdefault(stat[0], []).append(int(entry.name))
        except OSError:
            complete = False
        self._index, self._index_complete = index, complete
        return index

    # ---- procfs reads -----------------------------------------------------------------

    def _stat(self, pid: int) -> tuple[int, str, int] | None:
        """(start time, state, threads) of ``<proc>/<pid>/stat``; None if there is no such
        process; OSError if it cannot be read (or parsed)."""
        try:
            text = (self._proc / str(pid) / "stat").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            return None
        fields = stat_fields(text)  # field 3 (state) on: 20 = threads, 22 = start
        try:
            return int(fields[19]), fields[0], int(fields[17])
        except (IndexError, ValueError) as exc:
            raise OSError(f"unparsable {self._proc}/{pid}/stat") from exc

    def _nspid(self, pid: int) -> int | None:
        """Its pid in its own PID namespace: the last of ``NSpid`` in ``<proc>/<pid>/status``."""
        for line in (self._proc / str(pid) / "status").read_text(errors="replace").splitlines():
            if line.startswith("NSpid:"):
                words = line.split()
                return int(words[-1]) if len(words) > 1 and words[-1].isdigit() else None
        return None

    def _maps(self, pid: int, inode: int) -> bool:
        """Whether process ``pid`` maps a file of inode ``inode``; True where it cannot be told
        (maps unreadable, the budget spent, no inode)."""
        if not inode:
            return True
        want = str(inode).encode()
        try:
            fd = os.open(self._proc / str(pid) / "maps", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            rest = b""
            while True:
                if self._clock() > self._deadline:
                    return True
                chunk = os.read(fd, 1 << 16)
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop() if chunk else b""
                # "start-end perms offset MAJ:MIN inode  path"
                if any(len(w := line.split(None, 5)) >= 5 and w[4] == want for line in lines):
                    return True
                if not chunk:
                    return False
        except OSError:
            return True
        finally:
            os.close(fd)
