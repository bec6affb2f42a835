"""Library install: atomic, versioned, never overwriting a library in use; old versions GC'd
only when no process maps them and no container's ld.so.preload names them."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from webhook.node import install
from webhook.node.install import InstallError, remove_unused, scan_proc

LIB_V1 = b"\x7fELF" + b"build-one" * 100
LIB_V1_REBUILT = b"\x7fELF" + b"build-two" * 100
TARGET = "/usr/local/gpuslice"


def _maps_line(path: Path, shown_as: str) -> str:
    st = path.stat()
    return (f"7f0000000000-7f0000001000 r-xp 00000000 {os.major(st.st_dev):02x}:"
            f"{os.minor(st.st_dev):02x} {st.st_ino}    {shown_as}\n")


def _proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    return proc


def _process(proc: Path, pid: int, maps: str = "", mnt_ns: str | None = None,
             preload: str | None = None) -> None:
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "maps").write_text(maps)
    os.symlink(mnt_ns or f"mnt:[{4026530000 + pid}]", d / "ns" / "mnt")
    if preload is not None:
        (d / "root" / "etc").mkdir(parents=True)
        (d / "root" / "etc" / "ld.so.preload").write_text(preload)


def test_install_writes_the_versioned_library_and_the_preload_line(tmp_path: Path) -> None:
    r = install.install(LIB_V1, tmp_path, TARGET, "0.1.0")
    assert r.library == tmp_path / "libgpuslice.so.0.1.0"
    assert r.library.read_bytes() == LIB_V1
    assert r.library.stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "ld.so.preload").read_text() == "/usr/local/gpuslice/libgpuslice.so.0.1.0\n"
    assert r.library_written and r.preload_written
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_install_again_rewrites_nothing(tmp_path: Path) -> None:
    first = install.install(LIB_V1, tmp_path, TARGET, "0.1.0")
    ino = (first.library.stat().st_ino, (tmp_path / "ld.so.preload").stat().st_ino)
    again = install.install(LIB_V1, tmp_path, TARGET, "0.1.0")
    assert not again.library_written and not again.preload_written
    assert (again.library.stat().st_ino, (tmp_path / "ld.so.preload").stat().st_ino) == ino


def test_same_version_with_other_bytes_never_overwrites_and_gets_a_hash_name(
        tmp_path: Path) -> None:
    old = install.install(LIB_V1, tmp_path, TARGET, "0.1.0").library
    with old.open("rb") as mapped_elsewhere:
        r = install.install(LIB_V1_REBUILT, tmp_path, TARGET, "0.1.0")
        assert old.read_bytes() == LIB_V1  # the name still holds the old build
        assert mapped_elsewhere.read() == LIB_V1
    sha8 = install._digest(LIB_V1_REBUILT)[:8]
    assert r.library.name == f"libgpuslice.so.0.1.0-{sha8}"
    assert r.library.read_bytes() == LIB_V1_REBUILT
    assert (tmp_path / "ld.so.preload").read_text() == f"{TARGET}/libgpuslice.so.0.1.0-{sha8}\n"
    # restarting with the rebuilt image reuses the hashed file instead of churning
    again = install.install(LIB_V1_REBUILT, tmp_path, TARGET, "0.1.0")
    assert again.library == r.library and not again.library_written


def test_preload_is_replaced_by_rename_so_running_containers_keep_their_version(
        tmp_path: Path) -> None:
    install.install(LIB_V1, tmp_path, TARGET, "0.1.0")
    # a container's bind mount of ld.so.preload holds the old inode open
    with (tmp_path / "ld.so.preload").open() as container_view:
        install.install(LIB_V1_REBUILT, tmp_path, TARGET, "0.2.0")
        assert container_view.read() == f"{TARGET}/libgpuslice.so.0.1.0\n"
    assert (tmp_path / "ld.so.preload").read_text() == f"{TARGET}/libgpuslice.so.0.2.0\n"


def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install.install(LIB_V1, tmp_path, TARGET, "0.1.0")

    def broken_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(InstallError, match="No space left"):
        install.install(LIB_V1_REBUILT, tmp_path, TARGET, "0.2.0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ld.so.preload",
                                                          "libgpuslice.so.0.1.0"]
    assert (tmp_path / "ld.so.preload").read_text() == f"{TARGET}/libgpuslice.so.0.1.0\n"


def test_read_library_rejects_missing_and_non_elf_files(tmp_path: Path) -> None:
    with pytest.raises(InstallError, match="cannot read"):
        install.read_library(tmp_path / "absent.so")
    (tmp_path / "text.so").write_text("not a library")
    with pytest.raises(InstallError, match="not an ELF"):
        install.read_library(tmp_path / "text.so")
    (tmp_path / "ok.so").write_bytes(LIB_V1)
    assert install.read_library(tmp_path / "ok.so") == LIB_V1


def test_old_version_no_process_uses_is_removed_current_kept(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    _process(proc, 1, maps="7f00-7f01 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    assert remove_unused(lib, cur, proc) == [old.name]
    assert sorted(p.name for p in lib.iterdir()) == ["ld.so.preload", cur.name]


def test_old_version_mapped_by_a_process_is_kept_matched_by_inode(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    # the container sees the file under another path: only device and inode identify it
    _process(proc, 4242, maps=_maps_line(old, "/usr/local/gpuslice/libgpuslice.so.renamed"))
    assert remove_unused(lib, cur, proc) == []
    assert old.exists()
    scan = scan_proc(proc)
    assert scan.processes == 1 and (old.stat().st_dev, old.stat().st_ino) in scan.mapped_inodes


def test_old_version_named_by_a_containers_preload_is_kept(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    # a static entrypoint maps nothing, but its container's pinned /etc/ld.so.preload names 0.1.0
    _process(proc, 7, maps="", preload=f"{TARGET}/{old.name}\n")
    assert remove_unused(lib, cur, proc) == []
    assert old.exists()


def test_nothing_is_removed_when_a_process_cannot_be_inspected(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    _process(proc, 1)
    (proc / "2" / "maps").mkdir(parents=True)  # reading it fails with an error other than ENOENT
    scan = scan_proc(proc)
    assert not scan.complete and scan.first_error.startswith(str(proc / "2" / "maps"))
    assert remove_unused(lib, cur, proc) == []
    assert old.exists()


def test_exited_processes_are_skipped_not_fatal(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    (proc / "3").mkdir()  # the process exited between listing and reading
    scan = scan_proc(proc)
    assert scan.complete and scan.processes == 0


def test_stale_temp_files_are_removed_and_fresh_ones_kept(tmp_path: Path) -> None:
    cur = install.install(LIB_V1, tmp_path, TARGET, "0.1.0").library
    stale = tmp_path / (install.TMP_PREFIX + "old")
    fresh = tmp_path / (install.TMP_PREFIX + "new")
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    now = fresh.stat().st_mtime + 5
    os.utime(stale, (now - 3600, now - 3600))
    assert remove_unused(tmp_path, cur, _proc(tmp_path), now=now) == [stale.name]
    assert fresh.exists()


def _scan_in_time(proc: Path, seconds: float = 10.0) -> install.ProcScan:
    """scan_proc in a thread: a scan that blocks fails the test instead of hanging it."""
    import threading
    out: list[install.ProcScan] = []
    worker = threading.Thread(target=lambda: out.append(scan_proc(proc)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, "scan_proc blocked"
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "endless", "directory", "loop"])
def test_a_containers_preload_that_is_no_plain_file_names_nothing_and_hangs_nothing(
        tmp_path: Path, kind: str) -> None:
    # any container on the node owns its /etc: the agent reads it through /proc/<pid>/root
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    _process(proc, 7)
    etc = proc / "7" / "root" / "etc"
    etc.mkdir(parents=True)
    preload = etc / "ld.so.preload"
    if kind == "fifo":
        os.mkfifo(preload)  # opening it for reading would wait for a writer
    elif kind == "endless":
        preload.symlink_to("/dev/zero")  # reading it to the end would never end
    elif kind == "directory":
        preload.mkdir()
    else:
        preload.symlink_to(preload)
    scan = _scan_in_time(proc)
    assert scan.complete and scan.processes == 1 and not scan.preloaded_names
    assert remove_unused(lib, cur, proc) == [old.name]  # ld.so preloads nothing from it either


def test_a_huge_preload_file_is_read_in_part(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    name = f"{TARGET}/libgpuslice.so.0.1.0"
    _process(proc, 7, preload=name + "\n" + "x" * (8 << 20) + f"\n{TARGET}/libgpuslice.so.9\n")
    scan = _scan_in_time(proc)
    assert scan.preloaded_names == {"libgpuslice.so.0.1.0"}  # the first 64 KiB only


def _in_pid_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """List the fake <proc> in pid order, as the kernel lists /proc."""
    real = os.scandir

    def ordered(path: object) -> list[os.DirEntry[str]]:
        with real(path) as it:  # type: ignore[call-overload]
            entries = list(it)
        return sorted(entries, key=lambda e: (not e.name.isdigit(),
                                              int(e.name) if e.name.isdigit() else 0, e.name))

    monkeypatch.setattr(install.os, "scandir", ordered)


@pytest.mark.parametrize("first", ["chrooted", "exited"])
def test_a_container_is_read_through_each_root_of_its_mount_namespace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    # Two processes of one container share its mount namespace. The first one listed has
    # another root (it chrooted into an empty dir) or exits between the namespace read and the
    # preload read; the container's own root still names 0.1.0 for its next dynamic process
    # (the entrypoint is static and maps nothing). Removing 0.1.0 makes ld.so ignore it there.
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    ns = "mnt:[4026532999]"
    _process(proc, 7, mnt_ns=ns)
    if first == "chrooted":
        (proc / "7" / "root").mkdir()  # a chroot with no /etc/ld.so.preload
    _process(proc, 8, mnt_ns=ns, preload=f"{TARGET}/{old.name}\n")
    _in_pid_order(monkeypatch)
    assert "libgpuslice.so.0.1.0" in scan_proc(proc).preloaded_names
    assert remove_unused(lib, cur, proc) == []
    assert old.exists()


@pytest.mark.parametrize("openat2", ["kernel", "none"])
@pytest.mark.parametrize("link", ["absolute", "etc", "dotdot", "loop"])
def test_a_containers_preload_link_is_resolved_in_its_own_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, link: str, openat2: str) -> None:
    # ld.so resolves /etc/ld.so.preload inside the container's root; the agent followed the
    # links from its own: a container (or a process of it that chroots) made it read any file
    # of the host as root (hostPID: /proc/1/root/...); one that fails to read (a write-only
    # sysctl) made every scan incomplete, so no old library was ever removed; one naming a
    # library kept it; and the file ld.so does read, in the container, went unread. Where the
    # kernel has no openat2 (before 5.6, or a seccomp profile that denies it: ENOSYS or EPERM)
    # the fallback followed the links above the file from the agent's root (a container's /etc
    # made a link to a dir of the host read the host's file) and none at the file.
    from webhook.node import files
    if openat2 == "kernel":
        try:
            os.close(files._openat2(-100, "/", os.O_PATH, 0))  # AT_FDCWD
        except OSError as exc:
            pytest.skip(f"no openat2 here ({exc})")
    else:
        def enosys(*_: object) -> int:
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
        monkeypatch.setattr(files, "_openat2", enosys)
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    stale = install.install(LIB_V1 + b"2", lib, TARGET, "0.1.5").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    _process(proc, 7)
    root = proc / "7" / "root"
    (root / "etc").mkdir(parents=True)
    (root / "usr").mkdir()
    (root / "usr" / "preload").write_text(f"{TARGET}/{old.name}\n")  # what ld.so reads
    if link == "absolute":  # to a file of the agent's (the host's) that root may not read
        (root / "etc" / "ld.so.preload").symlink_to("/proc/sys/vm/drop_caches")
        (root / "proc" / "sys" / "vm").mkdir(parents=True)
        os.symlink("/usr/preload", root / "proc" / "sys" / "vm" / "drop_caches")
    elif link == "etc":  # the directory above, a link to one of the agent's (the host's)
        outside = tmp_path / "host-etc"
        outside.mkdir()
        (outside / "ld.so.preload").write_text(f"{TARGET}/{stale.name}\n")
        os.rmdir(root / "etc")
        (root / "etc").symlink_to(outside)
    elif link == "dotdot":
        (root / "etc" / "ld.so.preload").symlink_to("../../../../../../../../usr/preload")
    else:  # links that lead to each other, through the dir above: ld.so reads nothing (ELOOP)
        (root / "etc" / "ld.so.preload").symlink_to("/usr/loop/ld.so.preload")
        (root / "usr" / "loop").symlink_to("/etc")
    scan = _scan_in_time(proc)
    assert scan.complete, scan.first_error
    if link in ("etc", "loop"):  # no such file in the container's root: ld.so preloads nothing
        assert not scan.preloaded_names
        assert sorted(remove_unused(lib, cur, proc)) == sorted([old.name, stale.name])
    else:
        assert scan.preloaded_names == {old.name}
        assert remove_unused(lib, cur, proc) == [stale.name]
        assert old.exists()


def _preload_names_an_existing_library(lib: Path) -> bool:
    line = (lib / "ld.so.preload").read_text().strip()
    return (lib / os.path.basename(line)).is_file()


def test_an_overlapping_older_agent_never_removes_the_library_the_preload_names(
        tmp_path: Path) -> None:
    """Two agents on one node (a rolling update: the old pod's last round beside the new pod's
    first; or helm rollback): the old one's removal must not take the library that the host's
    ld.so.preload names now, or every container starting meanwhile runs without the interposer
    (ld.so ignores a preload it cannot find)."""
    lib = tmp_path / "lib"
    proc = _proc(tmp_path)
    _process(proc, 1)
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library  # agent A (0.1.0)
    new = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library  # agent B (0.2.0)
    assert remove_unused(lib, old, proc) == []  # agent A's removal, after B's install
    assert new.exists() and _preload_names_an_existing_library(lib)


def test_a_preload_switched_during_the_scan_keeps_its_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other agent points ld.so.preload at its library while this one reads /proc (a scan
    of every process takes a while): what the preload names is read after the scan."""
    lib = tmp_path / "lib"
    proc = _proc(tmp_path)
    _process(proc, 1)
    new = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library  # agent B
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library  # agent A: preload -> 0.1.0
    real_scan = install.scan_proc

    def scan_while_b_installs(proc_root: str | Path) -> install.ProcScan:
        install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0")  # agent B's next round
        return real_scan(proc_root)

    monkeypatch.setattr(install, "scan_proc", scan_while_b_installs)
    assert remove_unused(lib, old, proc) == []
    assert new.exists() and _preload_names_an_existing_library(lib)


def test_a_removal_beside_an_install_never_leaves_the_preload_naming_a_missing_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent A (0.1.0) finds its library in place and is about to point ld.so.preload at it
    while agent B (0.2.0) removes 0.1.0, which the preload does not name yet: the two must not
    interleave, or the preload names a file that is gone (no interposer in new containers)."""
    import threading
    lib = tmp_path / "lib"
    proc = _proc(tmp_path)
    _process(proc, 1)
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library  # agent A, an earlier round
    new = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library  # agent B: -> 0.2.0
    real_write = install.atomic_write
    b_removed: list[list[str]] = []
    b_threads: list[threading.Thread] = []

    def write_while_b_removes(path: Path, data: bytes, mode: int) -> None:
        if path.name == install.PRELOAD_NAME:
            b = threading.Thread(target=lambda: b_removed.append(remove_unused(lib, new, proc)),
                                 daemon=True)
            b.start()
            b_threads.append(b)
            b.join(0.5)  # B's removal runs now, unless it has to wait for A's install
        real_write(path, data, mode)

    monkeypatch.setattr(install, "atomic_write", write_while_b_removes)
    install.install(LIB_V1, lib, TARGET, "0.1.0")  # agent A's round
    b_threads[0].join(10)
    assert b_removed == [[]]
    assert old.exists() and _preload_names_an_existing_library(lib)


def test_a_filesystem_without_flock_still_installs_and_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")  # NFS: a directory takes no lock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    _process(proc, 1)
    assert remove_unused(lib, cur, proc) == [old.name]


@pytest.mark.parametrize(("call", "nth"), [
    ("fchmod", 1), ("fsync", 1), ("rename", 1), ("fsync", 2),  # the library
    ("fchmod", 2), ("fsync", 3), ("rename", 2), ("fsync", 4),  # then ld.so.preload
])
def test_an_agent_killed_at_any_step_of_an_upgrade_leaves_a_usable_node(
        tmp_path: Path, call: str, nth: int) -> None:
    """SIGKILL (an OOM kill, a node drain's force) at the nth such call of an upgrade from
    0.1.0 to 0.2.0: the preload names a whole library either way, and the next agent's start
    installs 0.2.0 and, later, clears what the dead one left."""
    import signal
    lib = tmp_path / "lib"
    install.install(LIB_V1, lib, TARGET, "0.1.0")
    pid = os.fork()
    if pid == 0:  # the agent that gets killed
        try:
            seen = [0]
            real = getattr(os, call)

            def killing(*a: object) -> object:
                seen[0] += 1
                if seen[0] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*a)

            setattr(os, call, killing)
            install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    line = (lib / "ld.so.preload").read_text()
    named = lib / os.path.basename(line.strip())
    assert line.endswith("\n") and named.read_bytes() in (LIB_V1, LIB_V1_REBUILT)
    r = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0")  # the next agent
    assert r.library.read_bytes() == LIB_V1_REBUILT
    assert (lib / "ld.so.preload").read_text() == f"{TARGET}/libgpuslice.so.0.2.0\n"
    proc = _proc(tmp_path)
    later = time.time() + install.STALE_TMP_SECONDS + 1
    remove_unused(lib, r.library, proc, now=later)
    assert sorted(p.name for p in lib.iterdir()) == ["ld.so.preload", "libgpuslice.so.0.2.0"]


def test_a_read_only_library_dir_needs_no_write_when_all_is_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose /usr went read-only (an image-based OS, a remount after disk errors): a
    restart of the same version writes nothing, so it succeeds (the lock needs no write
    either); another version fails with the filesystem's reason, and nothing changes."""
    import tempfile
    lib = tmp_path / "lib"
    first = install.install(LIB_V1, lib, TARGET, "0.1.0")

    def read_only(*a: object, **kw: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    again = install.install(LIB_V1, lib, TARGET, "0.1.0")
    assert again.library == first.library and not again.preload_written
    with pytest.raises(InstallError, match="Read-only file system"):
        install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0")
    assert (lib / "ld.so.preload").read_text() == f"{TARGET}/libgpuslice.so.0.1.0\n"
    assert sorted(p.name for p in lib.iterdir()) == ["ld.so.preload", "libgpuslice.so.0.1.0"]


def test_no_old_library_goes_while_a_gpu_container_may_have_pinned_a_preload_naming_it(
        tmp_path: Path) -> None:
    """/proc shows no process of a sandboxed pod (Kata, gVisor): the oldest running GPU
    container's start, from the API server, keeps every old library where it may have bind-
    mounted the host's ld.so.preload before it last changed; None (no API server) does not."""
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    proc = _proc(tmp_path)
    changed = (lib / "ld.so.preload").stat().st_mtime
    later = changed + 3600
    clean = install.clean_up_libraries
    # started before the change, or so soon after that its mounts may predate it
    for started in (changed - 10, changed + install.PINNED_MARGIN_S - 1):
        got = clean(lib, cur, proc, later, oldest_container=started)
        assert got.removed == [] and got.kept == [old.name] and not got.blocked
    # no GPU container, but the change is too recent for the pod list to show every one
    got = clean(lib, cur, proc, changed + 1, oldest_container=float("inf"))
    assert got.removed == [] and got.kept == [old.name]
    assert old.exists()
    got = clean(lib, cur, proc, later, oldest_container=changed + install.PINNED_MARGIN_S + 1)
    assert got.removed == [old.name] and got.kept == [] and not got.blocked


def test_without_a_pod_list_proc_alone_tells(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    old = install.install(LIB_V1, lib, TARGET, "0.1.0").library
    cur = install.install(LIB_V1_REBUILT, lib, TARGET, "0.2.0").library
    got = install.clean_up_libraries(lib, cur, _proc(tmp_path), oldest_container=None)
    assert got.removed == [old.name] and got.kept == []
