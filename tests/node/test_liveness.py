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
