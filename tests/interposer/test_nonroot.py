"""A non-root container: its processes share one budget once the agent has opened its state dir.

Kubelet creates a container's state dir (the webhook's ``subPathExpr``) with the mode of the
hostPath root, root-owned. Where that is 0755, a non-root process cannot create the region
file and each process falls back to a region of its own: a whole cap per process. The agent's
``share_state_dirs`` makes the root 1777 and opens up dirs made before it ran.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from webhook.node.cleanup import share_state_dirs
from webhook.node.region import read_region

NOBODY = 65534
HOST_ROOT = 100000
"""The host uid a user-namespaced pod's root is (the kubelet picks a multiple of 65536)."""
NSENTER = shutil.which("nsenter") or "nsenter"
CUDA_ERROR_OUT_OF_MEMORY = 2


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is the test user's alone)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as another user")
    base = Path(tempfile.mkdtemp(prefix="gpuslice-nonroot-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_non_root_processes_share_one_budget_once_the_agent_opened_the_state_dir(
        lab, shared_base):
    root = shared_base / "containers"
    container_dir = root / str(uuid.uuid4()) / "main"
    container_dir.mkdir(parents=True)
    for d in (root, container_dir.parent, container_dir):
        d.chmod(0o755)  # as kubelet made them under a 0755 root
    scratch = shared_base / "scratch"  # the fake driver's state, the ready mark
    scratch.mkdir()
    scratch.chmod(0o777)
    region = container_dir / "region"
    env = lab.env(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region), FAKE_CUDA_STATE=str(scratch / "fake"),
                  CUDA_DEVICE_MEMORY_LIMIT="1g", GPUSLICE_POD_UID="0b7f-uid")

    def start(*cmds: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(lab.command(*cmds), env=env, user=NOBODY, group=NOBODY,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lab.procs.append(proc)
        return proc

    # before the agent's pass: a region of its own would be a whole cap for each process, so a
    # webhook-managed process gets nothing, and says why
    alone = lab.finish(start("init", "ctx", "0", "alloc", "768m"))
    assert alone.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY
    assert not region.exists()
    assert (f"error: cannot use region {region} as uid {NOBODY} (Permission denied): no device memory "
            "is granted") in alone.stderr
    assert "node agent" in alone.stderr

    share_state_dirs(root)
    ready = scratch / "ready"
    keeper = start("init", "ctx", "0", "alloc", "768m", "touch", str(ready), "sleep", "30000")
    lab.wait_for(ready)
    second = lab.finish(start("init", "ctx", "0", "alloc", "512m", "alloc", "128m"))
    assert [second.rc("alloc", 0), second.rc("alloc", 1)] == [CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert "cannot use region" not in second.stderr
    assert region.stat().st_uid == NOBODY
    keeper.kill()
    keeper.wait(timeout=10)


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "directory"])
def test_what_a_tenant_plants_at_the_region_path_is_never_written_through(lab, plant):
    # The state dir is writable by every user of the container.  A root process that followed a
    # link planted there made the link's target world-writable and overwrote its start (found by
    # review, with /etc/passwd); and a region each process could not share gave each a whole cap.
    victim = lab.tmp / "victim"
    victim.write_bytes(b"root:x:0:0:precious\n")
    victim.chmod(0o600)
    region = lab.tmp / "state" / "region"
    region.parent.mkdir()
    if plant == "symlink":
        region.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, region)
    else:
        region.mkdir()
    managed = lab.run("init", "ctx", "0", "alloc", "64m", "meminfo", GPUSLICE_POD_UID="0b7f-uid",
                      CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region), CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert victim.read_bytes() == b"root:x:0:0:precious\n" and victim.stat().st_mode & 0o777 == 0o600
    assert managed.rc("alloc") == CUDA_ERROR_OUT_OF_MEMORY  # nothing granted, not a cap of its own
    assert managed.values("meminfo")[1] == 1
    why = {"symlink": "a symbolic link", "hardlink": "not a plain file", "directory": "Is a directory"}
    assert f"cannot use region {region} as uid {os.geteuid()} ({why[plant]})" in managed.stderr
    # outside Kubernetes (no webhook) the HAMi-core behaviour stays: a cap for the process alone
    plain = lab.run("init", "ctx", "0", "alloc", "64m", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region),
                    CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert plain.rc("alloc") == 0 and "caps apply to this process alone" in plain.stderr
    assert victim.read_bytes() == b"root:x:0:0:precious\n"


def test_a_region_file_the_process_did_not_create_keeps_its_mode(lab):
    # only the process that creates the region makes it 0666 (for every user of the container,
    # whatever the umask); one of this user's files found at the path was chmod'ed 0666 as well,
    # so a root program's region path named a root-owned 0600 file made it world-writable
    mine = lab.tmp / "mine"
    mine.write_bytes(b"")
    mine.chmod(0o600)
    res = lab.run("init", "ctx", "0", "alloc", "64m", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(mine),
                  CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert res.rc("alloc") == 0
    assert mine.stat().st_mode & 0o777 == 0o600
    assert "gpuslice" not in res.stderr  # used as the region all the same (this user's file)
    # a region the process creates is 0666 under any umask
    fresh = lab.tmp / "fresh"
    proc = lab.run_program(["sh", "-c", 'umask 077 && exec "$@"', "sh",
                            *lab.command("init", "ctx", "0", "alloc", "64m")],
                           CUDA_DEVICE_MEMORY_SHARED_CACHE=str(fresh), CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert proc.returncode == 0, proc.stderr
    assert fresh.stat().st_mode & 0o777 == 0o666


def test_a_process_opening_the_region_before_its_creator_made_it_0666_waits_for_that(lab, shared_base):
    # The creator makes the region file 0666 with an fchmod just after creating it; until then
    # its mode is 0666 less the creator's umask (0644 under root's 022).  A non-root process
    # opening the file in that moment was refused (EACCES) and, in a pod, granted no memory for
    # its whole life (outside one: a cap of its own beside the shared one).  The creator here
    # (root) is stopped before its fchmod (tests/next/slowchmod.c) until the other was refused
    state = shared_base / "state"
    state.mkdir()
    state.chmod(0o1777)  # as the agent's share_state_dirs leaves it
    region, held, refused, go = state / "region", state / "held", state / "refused", state / "go"
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsslowchmod.so"))
    env = lab.env(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(region), FAKE_CUDA_STATE=str(state / "fake"),
                  CUDA_DEVICE_MEMORY_LIMIT="1g", GPUSLICE_POD_UID="0b7f-uid",
                  LD_PRELOAD=":".join(preload), GS_TEST_CHMOD_PATH=str(region),
                  GS_TEST_CHMOD_HELD=str(held), GS_TEST_CHMOD_REFUSED=str(refused),
                  GS_TEST_CHMOD_GO=str(go))

    def start(*cmds: str, **kw: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(lab.command(*cmds), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)
        lab.procs.append(proc)
        return proc

    creator = start("init", "ctx", "0", "alloc", "512m", umask=0o022)
    lab.wait_for(held)
    other = start("init", "ctx", "0", "alloc", "256m", user=NOBODY, group=NOBODY)
    lab.wait_for(refused)
    go.touch()
    res = lab.finish(other)
    assert "cannot use region" not in res.stderr
    assert res.rc("alloc") == 0
    assert lab.finish(creator).rc("alloc") == 0
    assert region.stat().st_mode & 0o777 == 0o666


def test_a_set_user_id_program_ignores_its_callers_environment(release_lab, shared_base):
    # a set-user-ID root program run by nobody (AT_SECURE), the library preloaded through
    # /etc/ld.so.preload as in a container: its environment is the caller's.  The library loaded
    # the GPUSLICE_REAL_LIBCUDA the caller named (as root; here the fake driver), and made the
    # root-owned 0600 file named as CUDA_DEVICE_MEMORY_SHARED_CACHE 0666 and wrote the region
    # over it.  Now it reads no environment variable in such a process (the limits file only)
    lab = release_lab
    unshare = shutil.which("unshare")
    setpriv = shutil.which("setpriv")
    if not unshare or not setpriv:
        pytest.skip("needs unshare and setpriv")
    program = shared_base / "secure"
    shutil.copy(lab.build / "tests" / "secure", program)
    program.chmod(0o4755)
    victim = shared_base / "victim"
    victim.write_bytes(b"root's secret\n")
    victim.chmod(0o600)
    upper, work = lab.tmp / "etc-upper", lab.tmp / "etc-work"
    upper.mkdir()
    work.mkdir()
    (upper / "ld.so.preload").write_text(f"{lab.build / 'libgpuslice.so'}\n")
    script = ('mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc '
              '&& shift 2 && exec "$@"')
    prefix = [unshare, "--mount", "sh", "-c", script, "sh", str(upper), str(work)]
    if subprocess.run([*prefix, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount over /etc in a private mount namespace here")
    env = lab.env(LD_PRELOAD=None, GPUSLICE_REAL_LIBCUDA=str(lab.build / "fake" / "libcuda.so.1"),
                  CUDA_DEVICE_MEMORY_SHARED_CACHE=str(victim), CUDA_DEVICE_MEMORY_LIMIT="1g")
    proc = subprocess.run([*prefix, setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", str(program),
                           str(lab.build / "fake" / "libgsfakecb.so")],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    secure, rc, loaded = proc.stdout.split()[1:]
    assert secure == "1" and rc != "-1"  # AT_SECURE, and the library is there
    assert (rc, loaded) == ("801", "0")  # no driver of the caller's choosing: not supported
    assert victim.stat().st_mode & 0o777 == 0o600
    assert victim.read_bytes() == b"root's secret\n"


_CLONE_NEWUSER = 0x10000000
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, 0o2000000
_AT_FDCWD, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = -100, 0x1000, 4
_MOUNT_ATTR_IDMAP = 0x00100000
_SYS = {"x86_64": (428, 429, 442), "aarch64": (428, 429, 442)}  # open_tree, move_mount, mount_setattr


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _idmapped_bind(libc: ctypes.CDLL, source: Path, target: Path, userns: int) -> str | None:
    """Bind ``source`` at ``target`` through an idmapped mount with ``userns``'s mapping, as
    the container runtime mounts a user-namespaced pod's volumes; why not, or None."""
    open_tree, move_mount, mount_setattr = _SYS[os.uname().machine]
    fd = libc.syscall(open_tree, _AT_FDCWD, str(source).encode(),
                      _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    if fd < 0:
        return f"open_tree: {os.strerror(ctypes.get_errno())}"
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns)
        if libc.syscall(mount_setattr, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                        ctypes.sizeof(attr)) != 0:
            return f"mount_setattr: {os.strerror(ctypes.get_errno())}"
        if libc.syscall(move_mount, fd, b"", _AT_FDCWD, str(target).encode(),
                        _MOVE_MOUNT_F_EMPTY_PATH) != 0:
            return f"move_mount: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    return None


@pytest.mark.parametrize("idmapped", [True, False], ids=["idmapped", "plain"])
def test_a_user_namespaced_pods_processes_share_one_budget(release_lab, shared_base, idmapped):
    # spec.hostUsers: false (Kubernetes 1.30+ beta, on by default from 1.33): container uid 0 is
    # host uid 100000.  The kubelet (1.27+) has the runtime mount every volume, hostPath ones
    # included, through an idmapped mount with the pod's mapping: the state dir's root-owned
    # files are root's inside, and a file container root creates is host root's on disk.  Its
    # processes, root or not, share one region and the agent reads it; without the idmap (plain)
    # the agent's 1777 dirs let them too, the file then owned by the mapped uid.
    lab = release_lab
    if os.uname().machine not in _SYS:
        pytest.skip("syscall numbers known for x86_64 and aarch64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    root = shared_base / "containers"
    container_dir = root / str(uuid.uuid4()) / "main"
    container_dir.mkdir(parents=True)
    share_state_dirs(root)
    scratch = shared_base / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # the pod's user namespace, held open while the test runs
        os.close(read)
        os.write(write, b"1" if libc.unshare(_CLONE_NEWUSER) == 0 else b"0")
        time.sleep(120)
        os._exit(0)
    os.close(write)
    mounted = None
    try:
        if os.read(read, 1) != b"1":
            pytest.skip("cannot make a user namespace here")
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{holder}/{name}").write_text(f"0 {HOST_ROOT} 65536\n")
        state = container_dir
        if idmapped:
            state = shared_base / "mnt"
            state.mkdir()
            userns = os.open(f"/proc/{holder}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            try:
                why = _idmapped_bind(libc, container_dir, state, userns)
            finally:
                os.close(userns)
            if why:
                pytest.skip(f"no idmapped mount here ({why})")
            mounted = state
        env = lab.env(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(state / "region"),
                      FAKE_CUDA_STATE=str(scratch / "fake"), CUDA_DEVICE_MEMORY_LIMIT="1g",
                      GPUSLICE_POD_UID="0b7f-uid")

        def start(uid: int, *cmds: str) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                [NSENTER, "--user", f"--target={holder}", f"--setuid={uid}", f"--setgid={uid}",
                 *lab.command(*cmds)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            lab.procs.append(proc)
            return proc

        ready = scratch / "ready"
        keeper = start(0, "init", "ctx", "0", "alloc", "768m", "touch", str(ready), "sleep", "30000")
        lab.wait_for(ready)
        for uid in (0, 1000):  # container root, and a container user
            second = lab.finish(start(uid, "init", "ctx", "0", "alloc", "512m", "alloc", "128m"))
            assert [second.rc("alloc", 0), second.rc("alloc", 1)] == [CUDA_ERROR_OUT_OF_MEMORY, 0]
            assert "cannot use region" not in second.stderr
        on_disk = (container_dir / "region").stat()
        assert on_disk.st_uid == (0 if idmapped else HOST_ROOT)
        assert on_disk.st_mode & 0o777 == 0o666
        region = read_region(container_dir / "region")  # the agent's reader, as host root
        assert region.devices[0].limit_bytes == 1 << 30
        assert sum(p.used_bytes[0] for p in region.processes) >= 768 << 20
        keeper.kill()
        keeper.wait(timeout=10)
    finally:
        if mounted is not None:
            subprocess.run(["umount", "-l", str(mounted)], check=False)
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
