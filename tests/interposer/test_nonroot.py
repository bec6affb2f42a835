"""A non-root container: its processes share one budget once the agent has opened its state dir.

Kubelet creates a container's state dir (the webhook's ``subPathExpr``) with the mode of the
hostPath root, root-owned. Where that is 0755, a non-root process cannot create the region
file and each process falls back to a region of its own: a whole cap per process. The agent's
``share_state_dirs`` makes the root 1777 and opens up dirs made before it ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from webhook.node.cleanup import share_state_dirs

NOBODY = 65534
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
