"""The agent's judgement of a region's process slots (``webhook/node/liveness.py``) on a fake
procfs and a fake clock, at the edges a mutation run of it found untested: slots without a
full identity, a process that ends or is reused between two reads, zombies with and without
other threads, a token noted by another process, the time budget's exact bound, and dead
processes remembered rather than looked up again (the end-to-end cases, with the library and
real processes, are in ``test_metrics.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from webhook.node.liveness import Liveness, _ns_inode
from webhook.node.region import ProcessUsage

PIDNS = 4026532001  # the container's PID namespace: not the procfs's (no "self" link in it)
INODE = 777  # the region file's inode
UPTIME_TICKS = 10_000  # the fake procfs's uptime: every process below started before it


def fake_process(proc: Path, host: int, nspid: int, start: int, *, state: str = "S", threads: int = 1,
                 pidns: int = PIDNS, maps_inode: int | None = INODE) -> None:
    """A process in the fake procfs: stat (state, threads, start), status (NSpid), the ns/pid
    link and maps (mapping the region file of ``maps_inode``, or nothing)."""
    d = proc / str(host)
    (d / "ns").mkdir(parents=True, exist_ok=True)
    set_stat(proc, host, start, state=state, threads=threads)
    (d / "status").write_text(f"Name:\tpython\nNSpid:\t{host}\t{nspid}\n")
    if not (d / "ns" / "pid").is_symlink():
        os.symlink(f"pid:[{pidns}]", d / "ns" / "pid")
    line = f"7f0000000000-7f0000100000 rw-s 00000000 00:2f {maps_inode}    /region\n" if maps_inode else ""
    (d / "maps").write_text("559000000000-559000001000 r-xp 00000000 08:01 12    /usr/bin/python\n" + line)


def set_stat(proc: Path, host: int, start: int, *, state: str = "S", threads: int = 1) -> None:
    rest = ["0"] * 50
    rest[17], rest[19] = str(threads), str(start)
    (proc / str(host) / "stat").write_text(f"{host} (py thon) {state} " + " ".join(rest[1:]) + "\n")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "uptime").write_text(f"{UPTIME_TICKS / os.sysconf('SC_CLK_TCK'):.2f} 0.00\n")
    return root


def slot(pid: int = 7, start: int = 500, *, pidns: int = PIDNS, token: int = 7,
         held: bool | None = False) -> ProcessUsage:
    return ProcessUsage(pid=pid, used_bytes=(1 << 30,), pidns=pidns, start_time=start, token=token,
                        token_held=held)


def judge(live: Liveness, *slots: ProcessUsage) -> list[bool]:
    """One scrape."""
    live.begin()
    try:
        return [live.alive(s, INODE) for s in slots]
    finally:
        live.end()


def test_the_namespace_link_parses_at_its_first_character_and_refuses_what_it_cannot_read() -> None:
    assert _ns_inode("pid:[4026531836]") == 4026531836
    assert _ns_inode("[12]") == 12
    assert _ns_inode("pid:[]") is None
    assert _ns_inode("pid:[x]") is None
    assert _ns_inode("pid:4026531836") is None
    assert _ns_inode("pid:]1[") is None


@pytest.mark.parametrize("identity", [
    {"pid": 0}, {"pid": -3}, {"pidns": 0}, {"start": 0}],
    ids=["pid-0", "negative-pid", "no-namespace", "no-start-time"])
def test_a_slot_without_a_full_identity_counts_as_alive_without_a_look_up(proc: Path, identity) -> None:
    # nothing in this procfs could be it, and a look-up would find it gone: a slot whose
    # identity is not known (no /proc in its container, a slot read mid-registration) is
    # counted, never judged by what a partial identity happens to match
    fake_process(proc, 40, 1, 100, pidns=4026531836)
    live = Liveness(proc, clock=Clock())
    assert judge(live, slot(**identity, held=None)) == [True]
    assert judge(live, slot(pid=9, start=501, held=None)) == [False]  # a full one is looked up


def test_a_process_found_is_alive_and_one_not_in_the_procfs_is_gone(proc: Path) -> None:
    fake_process(proc, 4242, 7, 500)
    live = Liveness(proc, clock=Clock())
    assert judge(live, slot(), slot(pid=8, start=501)) == [True, False]
    assert live._host == {(PIDNS, 7, 500): 4242}


@pytest.mark.parametrize(("state", "threads", "alive"), [
    ("S", 1, True), ("R", 3, True), ("Z", 1, False), ("Z", 0, False), ("Z", 2, True), ("X", 1, False),
    ("X", 4, False)])
def test_a_killed_process_not_yet_reaped_holds_nothing_unless_other_threads_still_run(
        proc: Path, state: str, threads: int, alive: bool) -> None:
    # no token (NFS): only the procfs can tell; a zombie's memory went with it, unless the
    # thread group's other threads run on (a zombie leader), and X is a process being reaped
    fake_process(proc, 4242, 7, 500, state=state, threads=threads)
    assert judge(Liveness(proc, clock=Clock()), slot(token=0, held=None)) == [alive]


def test_a_process_that_ends_or_is_replaced_between_the_look_up_and_its_check_is_gone(
        proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process(proc, 4242, 7, 500)
    live = Liveness(proc, clock=Clock())
    assert judge(live, slot(token=0, held=None)) == [True]  # found: its host pid kept
    real = Liveness._stat
    for second in (None, (900, "S", 1)):  # gone; its pid another process's
        calls: list[int] = []

        def stat(self: Liveness, pid: int, second=second, calls=calls) -> tuple[int, str, int] | None:
            calls.append(pid)
            return real(self, pid) if len(calls) == 1 else second

        monkeypatch.setattr(Liveness, "_stat", stat)
        fresh = Liveness(proc, clock=Clock())
        assert judge(fresh, slot(token=0, held=None)) == [False]
        assert calls == [4242, 4242]


def test_a_process_whose_stat_cannot_be_read_counts_as_alive(proc: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fake_process(proc, 4242, 7, 500)
    real = Liveness._stat
    calls: list[int] = []

    def stat(self: Liveness, pid: int) -> tuple[int, str, int] | None:
        calls.append(pid)
        if len(calls) == 1:
            return real(self, pid)
        raise OSError("unparsable")

    monkeypatch.setattr(Liveness, "_stat", stat)
    assert judge(Liveness(proc, clock=Clock()), slot(token=0, held=None)) == [True]
    # and a stat unparsable from the start: not known, counted
    (proc / "4242" / "stat").write_text("4242 (python) S 1 2\n")
    monkeypatch.setattr(Liveness, "_stat", real)
    assert judge(Liveness(proc, clock=Clock()), slot(token=0, held=None)) == [True]


def test_a_token_not_held_is_settled_by_the_mapping_only_when_the_slots_own_process_took_it(
        proc: Path) -> None:
    # token == pid, not held: the process closed its descriptor (a daemon's closefrom) or
    # exec'd; it lives as gpuslice's only while it maps the region.  A token another process
    # took (a child sharing the parent's descriptor) says nothing of this one: alive
    fake_process(proc, 4242, 7, 500, maps_inode=None)
    fake_process(proc, 4343, 8, 501, maps_inode=INODE)
    live = Liveness(proc, clock=Clock())
    assert judge(live, slot(), slot(pid=8, start=501, token=8)) == [False, True]
    assert judge(live, slot(token=3), slot(token=0, held=None)) == [True, True]
    assert judge(live, slot(held=True, pid=99, start=1)) == [True]  # held: no look-up at all


def test_the_budget_is_spent_only_once_the_clock_passes_the_deadline(proc: Path) -> None:
    fake_process(proc, 100, 100, 300, pidns=4026531836)  # an entry to scan, at the deadline
    clock = Clock()
    live = Liveness(proc, budget=0.0, clock=clock)
    # at the deadline exactly, the look-up is still made: the gone process is found gone
    assert judge(live, slot(pid=9, start=501)) == [False]
    live = Liveness(proc, budget=0.0, clock=clock)
    live.begin()
    clock.now += 0.001
    assert live.alive(slot(pid=9, start=501), INODE) is True  # past it: not known, counted


def test_a_process_found_gone_is_remembered_and_not_looked_up_again(
        proc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "a dead process stays dead": no procfs scan for it in later scrapes, as long as a slot
    # names it; once none does, it is forgotten
    fake_process(proc, 4242, 7, 500)
    live = Liveness(proc, clock=Clock())
    scans: list[int] = []
    real = Liveness._scan

    def scan(self: Liveness) -> dict[int, list[int]]:
        if self._index is None:  # a scan of the procfs, not the scrape's index again
            scans.append(1)
        return real(self)

    monkeypatch.setattr(Liveness, "_scan", scan)
    gone = slot(pid=9, start=501)
    assert judge(live, gone, slot()) == [False, True]
    assert len(scans) == 1
    for _ in range(3):
        assert judge(live, gone, slot()) == [False, True]
    assert len(scans) == 1 and (PIDNS, 9, 501) in live._dead
    judge(live, slot())  # no slot names it any more
    assert (PIDNS, 9, 501) not in live._dead and live._host == {(PIDNS, 7, 500): 4242}
    judge(live)
    assert live._host == {}


# ---- the procfs index: when a process missing from it may still live --------------------------

class Ticking:
    """A clock that moves ``step`` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_process_missing_from_an_index_the_budget_cut_short_counts_as_alive(proc: Path) -> None:
    for host in range(100, 140):
        fake_process(proc, host, host, 200 + host, pidns=4026531836)
    # 40 processes; the clock passes the budget a few entries into the scan
    assert judge(Liveness(proc, budget=5.0, clock=Ticking(1.0)), slot(pid=9, start=501)) == [True]
    assert judge(Liveness(proc, budget=500.0, clock=Ticking(1.0)), slot(pid=9, start=501)) == [False]


def test_a_process_missing_from_an_index_of_unreadable_entries_counts_as_alive(proc: Path) -> None:
    fake_process(proc, 100, 100, 300, pidns=4026531836)
    (proc / "100" / "stat").write_text("100 (x) S 1\n")  # unparsable: the index is not complete
    assert judge(Liveness(proc, clock=Clock()), slot(pid=9, start=501)) == [True]
    # a procfs that cannot be listed at all: nothing is known gone
    assert judge(Liveness(proc / "nowhere", clock=Clock()), slot(pid=9, start=501)) == [True]


def test_a_procfs_whose_listing_fails_knows_no_process_gone(proc: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from webhook.node import liveness

    def refused(path: object) -> object:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(liveness.os, "scandir", refused)
    assert judge(Liveness(proc, clock=Clock()), slot(pid=9, start=501)) == [True]


def test_a_candidate_whose_namespace_cannot_be_read_may_be_the_one(proc: Path) -> None:
    fake_process(proc, 4242, 7, 500)
    (proc / "4242" / "ns" / "pid").unlink()
    (proc / "4242" / "ns" / "pid").write_text("")  # not a link: readlink fails (EINVAL)
    assert judge(Liveness(proc, clock=Clock()), slot()) == [True]
    # a candidate whose NSpid is not a number is not the one (and no error)
    fake_process(proc, 4343, 8, 501)
    (proc / "4343" / "status").write_text("Name:\tpython\nNSpid:\t4343\tx\n")
    (proc / "4444").mkdir()
    fake_process(proc, 4444, 9, 502)
    (proc / "4444" / "status").write_text("Name:\tpython\nNSpid:\n")
    assert judge(Liveness(proc, clock=Clock()), slot(pid=8, start=501), slot(pid=9, start=502)) == [False, False]


@pytest.mark.parametrize(("start", "alive"), [(UPTIME_TICKS - 2, False), (UPTIME_TICKS - 1, True),
                                              (UPTIME_TICKS, True), (UPTIME_TICKS + 50, True)])
def test_a_process_that_may_have_started_after_the_index_began_is_not_judged_gone(
        proc: Path, start: int, alive: bool) -> None:
    # by the procfs's uptime as the index began, less a tick of rounding
    fake_process(proc, 100, 100, 300, pidns=4026531836)
    assert judge(Liveness(proc, clock=Clock()), slot(start=start)) == [alive]


@pytest.mark.parametrize(("start", "alive"), [(499, False), (500, True), (600, True)])
def test_without_the_uptime_the_newest_process_indexed_bounds_the_index(
        proc: Path, start: int, alive: bool) -> None:
    (proc / "uptime").unlink()
    fake_process(proc, 100, 100, 100, pidns=4026531836)
    fake_process(proc, 101, 101, 500, pidns=4026531836)  # the newest: not the slot's (its NSpid)
    assert judge(Liveness(proc, clock=Clock()), slot(start=start)) == [alive]


def test_without_the_uptime_or_any_process_indexed_nothing_is_known_gone(proc: Path) -> None:
    (proc / "uptime").unlink()
    assert judge(Liveness(proc, clock=Clock()), slot(start=5)) == [True]


# ---- a procfs that may hide processes from the reader ------------------------------------------

def mountinfo(proc: Path, options: str, super_options: str = "rw", fstype: str = "proc",
              mountpoint: str | None = None) -> str:
    at = mountpoint or os.path.realpath(proc)
    return (f"22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
            f"35 22 0:5 / {at} {options} shared:12 - {fstype} {fstype} {super_options}\n")


@pytest.mark.parametrize(("text", "alive"), [
    ("hidden", True), ("hidepid=invisible in the super options", True), ("hidepid=0", False),
    ("hidepid=off", False), ("plain", False), ("another mount hidden", False),
    ("not proc", False), ("unparsable", True)])
def test_a_reader_without_roots_rights_on_a_hidepid_procfs_cannot_know_a_process_gone(
        proc: Path, monkeypatch: pytest.MonkeyPatch, text: str, alive: bool) -> None:
    from webhook.node import liveness
    lines = {"hidden": mountinfo(proc, "rw,nosuid,hidepid=2"),
             "hidepid=invisible in the super options": mountinfo(proc, "rw", "rw,hidepid=invisible"),
             "hidepid=0": mountinfo(proc, "rw,hidepid=0"),
             "hidepid=off": mountinfo(proc, "rw", "rw,hidepid=off"),
             "plain": mountinfo(proc, "rw,nosuid"),
             "another mount hidden": mountinfo(proc, "rw,hidepid=2", mountpoint="/elsewhere"),
             "not proc": mountinfo(proc, "rw,hidepid=2", fstype="tmpfs"),
             "unparsable": "35 22 0:5 / /proc rw\n"}[text]
    mount = proc.parent / "mountinfo"
    mount.write_text(lines)
    real_open = open

    def fake_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real_open(mount if path == "/proc/self/mountinfo" else path, *args, **kwargs)

    monkeypatch.setattr(liveness, "open", fake_open, raising=False)
    monkeypatch.setattr(liveness.os, "geteuid", lambda: 1000)
    assert judge(Liveness(proc, clock=Clock()), slot(pid=9, start=501)) == [alive]
    monkeypatch.setattr(liveness.os, "geteuid", lambda: 0)  # root sees every process anyway
    assert judge(Liveness(proc, clock=Clock()), slot(pid=9, start=501)) == [False]


# ---- the mapping of the region file -------------------------------------------------------------

def test_the_region_mapping_is_found_past_the_first_read_and_without_a_path(proc: Path) -> None:
    fake_process(proc, 4242, 7, 500)
    lib = "7f1000000000-7f1000001000 r-xp 00000000 08:01 99    /usr/lib/libfoo.so\n"
    region = f"7f2000000000-7f2000100000 rw-s 00000000 00:2f {INODE}    /region\n"
    (proc / "4242" / "maps").write_text(lib * 3000 + region)  # past the first 64 KiB read
    assert judge(Liveness(proc, clock=Clock()), slot()) == [True]
    (proc / "4242" / "maps").write_text(lib * 3000)
    assert judge(Liveness(proc, clock=Clock()), slot()) == [False]
    (proc / "4242" / "maps").write_text(f"7f2000000000-7f2000100000 rw-s 00000000 00:2f {INODE}\n")
    assert judge(Liveness(proc, clock=Clock()), slot()) == [True]  # listed without its path


def test_a_mapping_that_cannot_be_told_counts_the_process_alive_and_leaves_no_descriptor_open(
        proc: Path) -> None:
    fake_process(proc, 4242, 7, 500, maps_inode=None)
    fds = set(os.listdir("/proc/self/fd"))
    live = Liveness(proc, clock=Clock())
    assert judge(live, slot()) == [False]  # readable, no region: gone
    live.begin()
    assert live.alive(slot(), 0) is True  # no inode to look for
    live.end()
    (proc / "4242" / "maps").unlink()
    (proc / "4242" / "maps").mkdir()  # opens, but cannot be read
    assert judge(Liveness(proc, clock=Clock()), slot()) == [True]
    (proc / "4242" / "maps").rmdir()  # cannot be opened
    assert judge(Liveness(proc, clock=Clock()), slot()) == [True]
    assert set(os.listdir("/proc/self/fd")) == fds


def test_a_mapping_read_past_the_budget_counts_the_process_alive(proc: Path) -> None:
    fake_process(proc, 4242, 7, 500, maps_inode=None)
    # the scrape's start, the slot's check against the budget, then the maps read: past it
    for readings, alive in (([0.0, 0.5, 1.5], True), ([0.0, 0.5, 1.0], False)):  # at it: read
        it = iter(readings)
        clock = lambda it=it, last=readings[-1]: next(it, last)
        live = Liveness(proc, budget=1.0, clock=clock)
        live._host[(PIDNS, 7, 500)] = 4242  # found in an earlier scrape: no index needed
        live.begin()
        assert live.alive(slot(), INODE) is alive
