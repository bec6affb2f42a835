"""State dirs: opened to every container user; garbage collection of departed pods only, after a
grace period, UID-named dirs only."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from webhook.node.cleanup import remove_stale, share_state_dirs, stale_pod_dirs

NOW = 1_700_000_000.0
GRACE = 600.0


def _pod_dir(root: Path, age: float, containers: tuple[str, ...] = ("main",)) -> str:
    uid = str(uuid.uuid4())
    d = root / uid
    for c in containers:
        (d / c).mkdir(parents=True)
        (d / c / "region").write_bytes(b"\0" * 64)
        os.utime(d / c, (NOW - age, NOW - age))
    os.utime(d, (NOW - age, NOW - age))
    return uid


def test_dirs_of_departed_pods_are_removed_after_the_grace_period(tmp_path: Path) -> None:
    gone = _pod_dir(tmp_path, age=3600)
    live = _pod_dir(tmp_path, age=3600)
    assert remove_stale(tmp_path, {live}, GRACE, NOW) == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live]


def test_a_young_dir_of_a_pod_the_api_does_not_list_yet_is_kept(tmp_path: Path) -> None:
    young = _pod_dir(tmp_path, age=30)
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW) == []
    assert (tmp_path / young).is_dir()


def test_a_container_started_recently_keeps_an_old_pod_dir(tmp_path: Path) -> None:
    uid = _pod_dir(tmp_path, age=3600)
    (tmp_path / uid / "sidecar").mkdir()
    os.utime(tmp_path / uid / "sidecar", (NOW - 10, NOW - 10))
    os.utime(tmp_path / uid, (NOW - 3600, NOW - 3600))
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW) == []


def test_names_that_are_not_pod_uids_and_symlinks_are_never_touched(tmp_path: Path) -> None:
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    target = tmp_path.parent / "elsewhere"
    target.mkdir(exist_ok=True)
    link = tmp_path / str(uuid.uuid4())
    os.symlink(target, link)
    for p in (tmp_path / "lost+found", tmp_path / "notes.txt"):
        os.utime(p, (NOW - 9999, NOW - 9999))
    assert remove_stale(tmp_path, set(), GRACE, NOW) == []
    assert (tmp_path / "lost+found").exists() and link.is_symlink() and target.exists()


def test_a_missing_state_dir_removes_nothing(tmp_path: Path) -> None:
    assert remove_stale(tmp_path / "absent", set(), GRACE, NOW) == []


def _mode(path: Path) -> int:
    return path.lstat().st_mode & 0o7777


def test_state_dirs_are_opened_to_every_container_user(tmp_path: Path) -> None:
    # kubelet made a pod's dirs with the root's mode before the agent ran (0755: root only)
    root = tmp_path / "containers"
    root.mkdir(mode=0o755)
    uid = _pod_dir(root, age=0, containers=("main", "sidecar"))
    for d in (root, root / uid, root / uid / "main", root / uid / "sidecar"):
        d.chmod(0o755)
    region = root / uid / "main" / "region"
    region.chmod(0o600)
    before = os.stat(root / uid).st_mtime
    changed = share_state_dirs(root)
    assert changed == [".", uid, f"{uid}/main", f"{uid}/sidecar"]
    assert _mode(root) == 0o1777
    assert [_mode(root / uid / c) for c in ("", "main", "sidecar")] == [0o1777] * 3
    assert _mode(region) == 0o600  # files are the library's (it makes regions 0666)
    assert os.stat(root / uid).st_mtime == before  # the garbage collector's clock is untouched
    assert share_state_dirs(root) == []  # nothing left to do next round


def test_a_missing_state_root_is_created_shared(tmp_path: Path) -> None:
    root = tmp_path / "var" / "lib" / "gpuslice" / "containers"
    assert share_state_dirs(root) == ["."]
    assert _mode(root) == 0o1777


def test_opening_up_never_follows_symlinks_or_touches_other_names(tmp_path: Path) -> None:
    root = tmp_path / "containers"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    outside.chmod(0o700)
    (root / str(uuid.uuid4())).symlink_to(outside)
    pod = root / str(uuid.uuid4())
    pod.mkdir()
    (pod / "main").symlink_to(outside)
    (root / "not-a-uid").mkdir(mode=0o700)
    (root / "not-a-uid").chmod(0o700)
    changed = share_state_dirs(root)
    assert _mode(outside) == 0o700 and _mode(root / "not-a-uid") == 0o700
    assert changed == [".", pod.name]


def test_a_symlinked_state_root_is_resolved_once(tmp_path: Path) -> None:
    # an admin may keep the state on another disk; it failed every round with ENOTDIR (review)
    real = tmp_path / "disk" / "containers"
    real.mkdir(parents=True, mode=0o755)
    uid = _pod_dir(real, age=0)
    link = tmp_path / "containers"
    link.symlink_to(real)
    assert share_state_dirs(link) == [".", uid, f"{uid}/main"]
    assert _mode(real) == 0o1777 and _mode(real / uid / "main") == 0o1777


def test_a_tree_deeper_than_pythons_recursion_is_removed_and_keeps_no_other_dir(
        tmp_path: Path) -> None:
    # a tenant's `mkdir d; cd d` loop: shutil.rmtree recursed per level and stopped the round
    deep = _pod_dir(tmp_path, age=3600)
    later = _pod_dir(tmp_path, age=3600)
    fd = os.open(tmp_path / deep / "main", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):
            os.mkdir("d", dir_fd=fd)
            (Path(f"/proc/self/fd/{fd}") / "d" / "f").write_bytes(b"x")
            down = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = down
    finally:
        os.close(fd)
    for uid in (deep, later):
        os.utime(tmp_path / uid, (NOW - 3600, NOW - 3600))
        os.utime(tmp_path / uid / "main", (NOW - 3600, NOW - 3600))
    assert remove_stale(tmp_path, set(), GRACE, NOW) == sorted([deep, later])
    assert list(tmp_path.iterdir()) == []


def test_links_inside_a_departed_pods_dir_are_removed_not_followed(tmp_path: Path) -> None:
    outside = tmp_path.parent / f"outside-{uuid.uuid4()}"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "file").write_text("host data")
    root = tmp_path / "state"
    root.mkdir()
    uid = _pod_dir(root, age=3600)
    (root / uid / "main" / "to-dir").symlink_to(outside / "keep")
    (root / uid / "main" / "to-file").symlink_to(outside / "keep" / "file")
    os.mkfifo(root / uid / "main" / "fifo")
    os.utime(root / uid / "main", (NOW - 3600, NOW - 3600))
    assert remove_stale(root, set(), GRACE, NOW) == [uid]
    assert (outside / "keep" / "file").read_text() == "host data"


def test_a_mtime_set_in_the_future_does_not_keep_a_dir_forever(tmp_path: Path) -> None:
    # `touch -d 2100-01-01 /var/run/gpuslice` from inside the container: ctime stays the
    # time of the change, which no one can set
    uid = _pod_dir(tmp_path, age=0)
    future = 4_102_444_800.0  # 2100-01-01
    os.utime(tmp_path / uid, (future, future))
    os.utime(tmp_path / uid / "main", (future, future))
    a_year_on = os.stat(tmp_path / uid).st_ctime + 365 * 86400
    assert remove_stale(tmp_path, set(), GRACE, a_year_on) == [uid]


def test_a_pod_dir_swapped_for_a_link_midway_never_redirects_the_chmod(
        tmp_path: Path, monkeypatch) -> None:
    # The root is 1777: any user of the host can make a pod-UID-named dir there and keep
    # swapping it with a symbolic link (to /proc/1/root/etc from the agent's hostPID view). A
    # pass that checked the entry and then used its path again opened up the link target's
    # sub-dirs (the host's /etc/cron.d, /etc/profile.d...) to every user. Here the swaps come
    # at the worst moments: the pod dir a dir when listed and when opened by its own name, a
    # link at every other step.
    from webhook.node import cleanup
    root = tmp_path / "containers"
    root.mkdir()
    target = tmp_path / "host-etc"
    (target / "cron.d").mkdir(parents=True)
    (target / "cron.d").chmod(0o755)
    uid = str(uuid.uuid4())
    pod, real, link = root / uid, tmp_path / "real", tmp_path / "link"
    (pod / "cron.d").mkdir(parents=True)
    link.symlink_to(target)
    state = {"listed": False, "now": "dir"}

    def be(what: str) -> None:
        if state["now"] != what:
            os.rename(pod, real if what == "link" else link)
            os.rename(link if what == "link" else real, pod)
            state["now"] = what

    real_open, real_scandir = os.open, os.scandir

    def attacked_open(path, flags, mode=0o777, *, dir_fd=None):
        if state["listed"]:
            itself = str(path) == str(pod) or (dir_fd is not None and str(path) == uid)
            be("dir" if itself else "link")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def attacked_scandir(path="."):
        if state["listed"]:
            be("link")
        state["listed"] = True
        return real_scandir(path)

    monkeypatch.setattr(cleanup.os, "open", attacked_open)
    monkeypatch.setattr(cleanup.os, "scandir", attacked_scandir)
    try:
        share_state_dirs(root)
    finally:
        monkeypatch.undo()
    assert _mode(target / "cron.d") == 0o755
    be("dir")
    assert _mode(pod / "cron.d") == 0o1777  # the pod's own container dir, through its fd


def test_a_dir_moved_out_of_a_tree_being_removed_leads_nowhere_else(
        tmp_path: Path, monkeypatch) -> None:
    # The root is 1777: a user of the host may own a pod-UID-named tree there. Moving one of
    # its sub-dirs into a live pod's container dir while the agent is inside it made the way
    # back up (``..``) lead into that container dir: its region went, and so on upwards.
    from webhook.node import cleanup
    root = tmp_path / "state"
    root.mkdir()
    victim = _pod_dir(root, age=0)
    region = root / victim / "main" / "region"
    departed = _pod_dir(root, age=3600)
    (root / departed / "main" / "d1" / "d2").mkdir(parents=True)
    os.utime(root / departed / "main", (NOW - 3600, NOW - 3600))
    real_open = os.open

    def moved_once_entered(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if str(path) == "d2" and dir_fd is not None:  # the agent is in d2 now: move it
            os.rename(root / departed / "main" / "d1" / "d2", root / victim / "main" / "d2")
        return fd

    monkeypatch.setattr(cleanup.os, "open", moved_once_entered)
    try:
        assert remove_stale(root, {victim}, GRACE, NOW) == []  # not removed this time
    finally:
        monkeypatch.undo()
    assert region.read_bytes() == b"\0" * 64
    assert (root / victim / "main" / "d2").is_dir()  # (the mover's; not the agent's to remove)
    assert remove_stale(root, {victim}, GRACE, NOW) == [departed]  # the next round
    assert region.exists()


# ---- edges a mutation run of webhook/node/cleanup.py found untested ------------------------------

def test_a_dir_exactly_the_grace_period_old_is_stale(tmp_path: Path) -> None:
    uid = _pod_dir(tmp_path, age=GRACE)
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW) == [tmp_path / uid]
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW - 1) == []


def test_a_link_named_as_a_pod_is_not_taken_for_a_stale_pod_dir(tmp_path: Path) -> None:
    target = tmp_path.parent / "elsewhere-old"
    target.mkdir()
    os.utime(target, (NOW - 9999, NOW - 9999))
    link = tmp_path / str(uuid.uuid4())
    os.symlink(target, link)
    os.utime(link, (NOW - 9999, NOW - 9999), follow_symlinks=False)  # the link itself old too
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW) == []


def test_a_link_to_something_changed_lately_does_not_keep_an_old_pod_dir(tmp_path: Path) -> None:
    # the dir's age is its own and its entries' (never a link's target, which a tenant could
    # keep fresh, and with it the pod dir, for ever)
    uid = _pod_dir(tmp_path, age=3600)
    fresh = tmp_path.parent / "fresh"
    fresh.mkdir()
    os.utime(fresh, (NOW, NOW))
    os.symlink(fresh, tmp_path / uid / "link")
    os.utime(tmp_path / uid / "link", (NOW - 3600, NOW - 3600), follow_symlinks=False)
    os.utime(tmp_path / uid, (NOW - 3600, NOW - 3600))
    assert stale_pod_dirs(tmp_path, set(), GRACE, NOW) == [tmp_path / uid]
    assert remove_stale(tmp_path, set(), GRACE, NOW) == [uid]
    assert fresh.is_dir()


def test_a_link_among_a_pods_container_dirs_neither_stops_nor_redirects_the_opening_up(
        tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    uid = _pod_dir(tmp_path, age=10, containers=("b-main",))
    elsewhere = tmp_path.parent / "elsewhere-dir"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o755)
    os.symlink(elsewhere, tmp_path / uid / "a-link")  # listed before the container dir
    os.symlink(elsewhere, tmp_path / str(uuid.uuid4()))  # and one beside the pod dirs
    os.chmod(tmp_path / uid / "b-main", 0o755)
    share_state_dirs(tmp_path)
    assert _mode(tmp_path / uid / "b-main") == 0o1777
    assert _mode(elsewhere) == 0o755
    assert "cannot open up" not in caplog.text  # passed by, not tried and refused


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_opening_up_and_removing_leave_no_descriptor_open(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from webhook.node import cleanup
    before = _open_fds()
    uid = _pod_dir(tmp_path, age=3600, containers=("a", "b"))
    d = tmp_path / uid / "a"
    for i in range(5):
        d = d / f"n{i}"
        d.mkdir()
    os.chmod(tmp_path / uid, 0o755)
    os.chmod(tmp_path, 0o755)
    assert share_state_dirs(tmp_path) == [".", uid, f"{uid}/a", f"{uid}/b"]
    assert share_state_dirs(tmp_path) == []
    assert _open_fds() == before
    os.utime(tmp_path / uid, (NOW - 3600, NOW - 3600))
    for c in ("a", "b"):
        os.utime(tmp_path / uid / c, (NOW - 3600, NOW - 3600))
    assert remove_stale(tmp_path, set(), GRACE, NOW) == [uid]
    assert _open_fds() == before
    # a mode that cannot be set: the error reaches the caller, and the descriptor is closed
    os.chmod(tmp_path, 0o755)

    def refused(fd: int, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(cleanup.os, "fchmod", refused)
    try:
        share_state_dirs(tmp_path)
    except PermissionError:
        pass
    else:
        raise AssertionError("a refused chmod of the root passed unnoticed")
    assert _open_fds() == before
