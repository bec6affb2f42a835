"""One budget per container: several processes, races, SIGKILL at bad moments, fork."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from webhook.node import region as mirror
from webhook.node.region import DeviceSlot, ProcessUsage, Region, encode_region

from .conftest import Lab, Result, parse

MIB = 1 << 20
GIB = 1 << 30
OOM = 2


def test_second_process_cannot_exceed_shared_cap(lab):
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="10g")
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", "5g", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert [rc for rc, _ in res.of("alloc")] == [OOM, 0]
    (lab.tmp / "go").touch()
    assert lab.finish(holder).rc("alloc") == 0


def test_many_processes_race_for_the_last_gib_and_exactly_one_wins(lab):
    n = 6
    holder = lab.start("init", "ctx", "0", "alloc", "9g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="10g")
    lab.wait_for(lab.tmp / "held")
    go = lab.tmp / "go"
    racers = [lab.start("init", "ctx", "0", "touch", str(lab.tmp / f"ready{i}"), "waitfile",
                        str(go), "alloc", "1g", "touch", str(lab.tmp / f"done{i}"), "waitfile",
                        str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="10g")
              for i in range(n)]
    for i in range(n):
        lab.wait_for(lab.tmp / f"ready{i}")
    go.touch()
    for i in range(n):
        lab.wait_for(lab.tmp / f"done{i}")
    assert lab.used() == 10 * GIB
    (lab.tmp / "end").touch()
    outcomes = [lab.finish(p).rc("alloc") for p in racers]
    assert sorted(outcomes) == [0] + [OOM] * (n - 1)
    lab.finish(holder)
    assert lab.used() == 0


def test_a_storm_of_processes_fills_the_cap_exactly_and_never_past_it(lab):
    # Started at once, every process attaches, makes a 20 MiB context and asks for 64 MiB
    # under a cap that holds all contexts and half the allocations; each holds what it got.
    n, ctx, size = 24, 20 * MIB, 64 * MIB
    cap = n * ctx + n // 2 * size
    storm = [lab.start("init", "ctx", "0", "alloc", "64m", "touch", str(lab.tmp / f"done{i}"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT=str(cap),
                       FAKE_CUDA_CTX_BYTES="20m")
             for i in range(n)]
    for i in range(n):
        lab.wait_for(lab.tmp / f"done{i}", timeout=60)
    used = lab.used()
    (lab.tmp / "end").touch()
    results = [lab.finish(p) for p in storm]
    contexts = sum(r.rc("ctx") == 0 for r in results)
    allocations = sum(r.rc("alloc") == 0 for r in results)
    assert used == contexts * ctx + allocations * size <= cap
    # usage only grew during the storm: whatever was refused did not fit at the end either
    if allocations < n:
        assert cap - used < size
    if contexts < n:
        assert cap - used < ctx
    assert lab.used() == 0 and lab.region().processes == ()


def start_keeper(lab, **env: str) -> subprocess.Popen[str]:
    """A process holding 1 GiB under a 4 GiB cap until ``end`` appears."""
    keeper = lab.start("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "kept"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="4g", **env)
    lab.wait_for(lab.tmp / "kept")
    return keeper


def kill_a_holder(lab, mark: str, **env: str) -> None:
    """A process that attaches after the keeper, takes 2 GiB and is SIGKILLed holding them."""
    victim = lab.start("init", "ctx", "0", "alloc", "2g", "touch", str(lab.tmp / mark),
                       "waitfile", str(lab.tmp / "never"), CUDA_DEVICE_MEMORY_LIMIT="4g", **env)
    lab.wait_for(lab.tmp / mark)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)


@pytest.mark.parametrize(("make", "inside", "before"), [
    (("ctx", "0"), "cuDevicePrimaryCtxRetain", ()),
    (("ctxcreate", "0"), "cuCtxCreate", ()),
    (("green", "0"), "cuGreenCtxCreate", ("ctx", "0")),
], ids=["primary", "created", "green"])
def test_a_context_whose_footprint_no_longer_fits_once_made_is_undone(lab, make, inside, before):
    # Nothing is reserved for a container's first context (no footprint measured yet) nor for
    # a green one: while it is being made, another process fills the cap.  Its footprint was
    # forced past the cap (found by review: 128 MiB over with 8 processes); now the context
    # is destroyed and the call answers CUDA_ERROR_OUT_OF_MEMORY, the caller's memory as it was.
    ctx = 20 * MIB
    mark = lab.tmp / "inside"
    slow = lab.start("init", *before, *make, "phys", "touch", str(lab.tmp / "made"), "waitfile",
                     str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_CTX_BYTES="20m",
                     FAKE_CUDA_SLEEP=f"{inside}:1500", FAKE_CUDA_SLEEP_MARK=str(mark))
    lab.wait_for(mark)
    held = lab.used()  # the green context's primary context, made before
    fill = GIB - held - ctx
    filler = lab.start("init", "ctx", "0", "alloc", str(fill), "touch", str(lab.tmp / "full"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="1g",
                       FAKE_CUDA_CTX_BYTES="20m")
    lab.wait_for(lab.tmp / "full")
    assert lab.used() == GIB
    lab.wait_for(lab.tmp / "made")
    assert lab.used() == GIB
    (lab.tmp / "end").touch()
    res, full = lab.finish(slow), lab.finish(filler)
    assert full.rc("alloc") == 0
    assert res.rc(make[0]) == OOM
    assert res.values("phys") == [held]  # the context went with its refusal
    assert "does not fit in what is left of the cap" in res.stderr
    assert lab.used() == 0


def test_processes_growing_pools_of_their_own_at_once_stay_within_the_cap(lab):
    # two processes each allocate 8 MiB from a pool of their own (a created one, a device's
    # default one), each growing it by a 32 MiB chunk; while both are inside the driver a third
    # fills the cap. Only the 8 MiB were reserved before the driver's call: the third's
    # 1008 MiB passed, 1072 MiB held under a 1 GiB cap seen from outside (24 MiB per pool)
    pools = [("mkpool", "1", "0", "pool", "8m"), ("async", "8m")]
    marks = [lab.tmp / f"grown{i}" for i in range(len(pools))]
    growers = [lab.start("init", "ctx", "0", *cmds, "touch", str(lab.tmp / f"done{i}"),
                         "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="1g",
                         FAKE_CUDA_SLEEP_MARK=str(mark),
                         FAKE_CUDA_SLEEP="cuMemAllocFromPoolAsyncAfter:2000,cuMemAllocAsyncAfter:2000")
               for i, (cmds, mark) in enumerate(zip(pools, marks, strict=True))]
    for mark in marks:
        lab.wait_for(mark)
    filler = lab.start("init", "ctx", "0", "alloc", "1008m", "touch", str(lab.tmp / "full"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="1g")
    lab.wait_for(lab.tmp / "full")
    outside = lab.run("nvml", "0", LD_PRELOAD=None).values("nvml")[1]
    for i in range(len(pools)):
        lab.wait_for(lab.tmp / f"done{i}")
    (lab.tmp / "end").touch()
    grown = [lab.finish(proc) for proc in growers]
    assert outside == 64 * MIB
    assert lab.finish(filler).rc("alloc") == OOM
    assert grown[0].rc("pool") == 0 and grown[1].rc("async") == 0
    assert lab.used() == 0


def test_processes_of_threads_racing_on_pools_at_the_cap_never_pass_it(lab):
    # tests/poolrace.c: 3 processes of 4 threads allocate from the default pool and a pool of
    # their own, free, trim and synchronise (the pools giving back) at random near a 1 GiB cap,
    # with the driver's pool calls widened by 1 ms. Seen from outside the device's usage
    # peaked 60-92 MiB over the cap, for up to 6 ms, when only requests were reserved before
    # the driver's call, each pool's growth by a whole chunk noticed after it; and once
    # everything is freed each process's charge is what the driver holds for it (its context)
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "FAKE_CUDA_CTX_BYTES": "20m",
           "FAKE_CUDA_POOL_RELEASE": "1",
           "FAKE_CUDA_SLEEP": "cuMemAllocAsyncAfter:1,cuMemAllocFromPoolAsyncAfter:1,"
                              "cuMemFreeAsyncAfter:1"}
    program = str(lab.build / "tests" / "poolrace")
    done = lab.tmp / "done"
    monitor = subprocess.Popen([program, "monitor", str(done)], stdout=subprocess.PIPE, text=True,
                               env=lab.env(LD_PRELOAD=None, CAP_BYTES=str(GIB), **env))
    racers = [subprocess.Popen([program, "300", "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=lab.env(**env))
              for _ in range(3)]
    lab.procs += [monitor, *racers]
    outs = [racer.communicate(timeout=120) for racer in racers]
    done.touch()
    peak, longest = (int(v) for v in monitor.communicate(timeout=30)[0].split()[1:])
    for racer, (out, err) in zip(racers, outs, strict=True):
        lab.check_sanitizers(err)
        assert racer.returncode == 0, err
        _, errors, charged, held = out.split()
        assert (int(errors), int(charged), int(held)) == (0, 20 * MIB, 20 * MIB), err
    assert peak <= GIB, f"{(peak - GIB) / MIB:.0f} MiB over the cap for up to {longest} us"


def test_a_cap_smaller_than_one_context_says_what_to_raise(lab):
    # 256 MiB against a 600 MiB context (PyTorch's takes 524 MiB on an H200): CUDA cannot start,
    # first from the measurement, then, for the next process, from the container's estimate
    for _ in range(2):
        res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="256m",
                      FAKE_CUDA_CTX_BYTES="600m")
        assert res.rc("ctx") == OOM
        errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        assert errors == [ln for ln in errors if "a CUDA context needs 600 MiB on this device, more "
                          "than the container's whole cap of 256 MiB" in ln and "nvidia.com/gpumem" in ln]
        assert len(errors) == 1, res.stderr
        assert lab.used() == 0


def test_a_dead_process_beside_a_live_one_is_reclaimed_before_a_refusal_and_a_view(lab):
    # a process attaching beside a live one stops checking there; the dead after it are
    # reclaimed where they matter
    keeper = start_keeper(lab)
    kill_a_holder(lab, "held")
    assert lab.used() == 3 * GIB
    view = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert view.values("meminfo") == [3 * GIB, 4 * GIB]
    assert lab.used() == GIB
    kill_a_holder(lab, "held2")
    res = lab.run("init", "ctx", "0", "alloc", "2600m", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.rc("alloc") == 0
    (lab.tmp / "end").touch()
    lab.finish(keeper)
    assert lab.used() == 0


def test_a_killed_processs_memory_leaves_the_containers_figures_while_the_others_run(lab):
    # nobody attaches, allocates or looks: the sampler of a live process sweeps (one sweep per
    # container every 2 s, whichever process claims it), so the region the agent reads for its
    # metrics drops the dead process's memory.  (The sampler runs once NVML lists the process,
    # here from its 100 MiB context, as a real context's.)
    ctx = 100 * MIB
    keeper = start_keeper(lab, FAKE_CUDA_CTX_BYTES="100m")
    kill_a_holder(lab, "held", FAKE_CUDA_CTX_BYTES="100m")
    deadline = time.monotonic() + 8
    while lab.used() != GIB + ctx and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab.used() == GIB + ctx
    assert [p.pid for p in lab.region().processes] == [keeper.pid]
    (lab.tmp / "end").touch()
    lab.finish(keeper)


def test_a_process_attaching_sweeps_the_dead_when_the_containers_sweep_is_due(lab):
    # no sampler runs here (NVML never lists these processes: their contexts take nothing), so
    # only an attach, a refusal or a view can notice the dead; an attach stops checking at the
    # first live process, then sweeps if nobody of the container did in the last 2 s
    keeper = start_keeper(lab)
    kill_a_holder(lab, "held")
    swept = time.monotonic()  # the victim's attach swept before (it found the keeper)
    time.sleep(max(0.0, swept + 2.2 - time.monotonic()))
    assert lab.used() == 3 * GIB
    lab.run("init", "ctx", "0", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert lab.used() == GIB
    assert [p.pid for p in lab.region().processes] == [keeper.pid]
    (lab.tmp / "end").touch()
    lab.finish(keeper)


def test_a_process_killed_mid_allocation_returns_its_usage(lab):
    mark = lab.tmp / "inside"
    victim = lab.start("init", "ctx", "0", "alloc", "2g", "alloc", "7g",
                       CUDA_DEVICE_MEMORY_LIMIT="10g", FAKE_CUDA_SLEEP="cuMemAlloc_v2:60000",
                       FAKE_CUDA_SLEEP_MARK=str(mark))
    lab.wait_for(mark)  # inside the driver call, with its reservation made
    assert lab.used() >= 2 * GIB
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    res = lab.run("init", "ctx", "0", "alloc", "10g", CUDA_DEVICE_MEMORY_LIMIT="10g")
    assert res.rc("alloc") == 0  # the dead process's reservation was reclaimed
    assert lab.used() == 0


def test_a_process_killed_holding_the_lock_blocks_nobody(lab):
    lab.run("init", "ctx", "0", CUDA_DEVICE_MEMORY_LIMIT="4g")  # create the region
    ready = lab.tmp / "locked"
    holder = subprocess.Popen([str(lab.build / "tests" / "lockhold"), str(lab.region_path),
                               str(ready)])
    lab.procs.append(holder)
    lab.wait_for(ready)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    res = lab.run("init", "ctx", "0", "alloc", "4g", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g",
                  timeout=30)
    assert "died holding the region lock" in res.stderr
    assert res.rc("alloc") == 0
    assert res.values("meminfo") == [0, 4 * GIB]


def test_a_half_done_update_by_a_killed_lock_holder_is_repaired(lab):
    keeper = lab.start("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g")
    lab.wait_for(lab.tmp / "held")
    ready = lab.tmp / "locked"
    holder = subprocess.Popen([str(lab.build / "tests" / "lockhold"), str(lab.region_path),
                               str(ready), "torn"])
    lab.procs.append(holder)
    lab.wait_for(ready)
    assert lab.used() == 2 * GIB  # 1 GiB real + 1 GiB written by the half-done update
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    res = lab.run("init", "ctx", "0", "alloc", "3g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.rc("alloc") == 0  # 1 GiB (keeper) + 3 GiB: the phantom gigabyte is gone
    assert "died holding the region lock" in res.stderr
    (lab.tmp / "go").touch()
    assert lab.finish(keeper).values("meminfo") == [3 * GIB, 4 * GIB]


def test_exit_from_a_signal_handler_inside_the_lock_blocks_nobody(release_lab):
    # exit() from a handler that interrupted the region's lock ran the exit destructor on the
    # thread holding it: the process waited on itself, and every process of the container on
    # it (the review's run hung at its 9th attempt).  Each attempt here fires at another moment
    # of an allocate-free loop that takes the lock twice per round.
    lab = release_lab
    lab.run("init", "ctx", "0", CUDA_DEVICE_MEMORY_LIMIT="4g")
    for attempt in range(40):
        proc = subprocess.Popen([str(lab.build / "tests" / "exitsignal"), str(3000 + 797 * attempt)],
                                env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="4g"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lab.procs.append(proc)
        _, err = proc.communicate(timeout=10)  # TimeoutExpired: it hung
        assert proc.returncode == 0, err
    res = lab.run("init", "ctx", "0", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="4g", timeout=20)
    assert res.rc("alloc") == 0


def test_a_full_stderr_pipe_blocks_only_its_own_process(release_lab):
    # The first process to lock after a holder was killed repairs the region and says so.  Its
    # stderr is a pipe nobody reads, full: the line used to be written under the lock, so that
    # process blocked holding it, and every other process of the container behind it.
    lab = release_lab
    lab.run("init", "ctx", "0", CUDA_DEVICE_MEMORY_LIMIT="4g")
    ready = lab.tmp / "locked"
    holder = subprocess.Popen([str(lab.build / "tests" / "lockhold"), str(lab.region_path), str(ready)])
    lab.procs.append(holder)
    lab.wait_for(ready)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    stuck = subprocess.Popen(lab.command("init", "ctx", "0", "alloc", "1g"),
                             env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="4g"), stdout=subprocess.PIPE,
                             stderr=w, text=True)
    lab.procs.append(stuck)
    os.close(w)
    try:
        time.sleep(1.0)
        assert stuck.poll() is None  # blocked writing the repair's line
        res = lab.run("init", "ctx", "0", "alloc", "1g", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="4g",
                      timeout=20)
        assert res.rc("alloc") == 0
        drained = b""
        while b"died holding the region lock" not in drained:
            chunk = os.read(r, 1 << 16)
            assert chunk, drained[-300:]
            drained += chunk
        assert stuck.wait(timeout=20) == 0
    finally:
        os.close(r)


def test_a_line_logged_to_a_stderr_nobody_reads_any_more_does_not_kill_the_process(release_lab):
    # The program never writes to stderr itself; the library's line (here: a bad limit value) went
    # to a pipe whose reader had gone, and SIGPIPE killed a program that would have run fine
    lab = release_lab
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(lab.command("init", "ctx", "0", "alloc", "1g", "meminfo"),
                              env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="abc"), stdout=subprocess.PIPE,
                              stderr=w, text=True, timeout=60, check=False)
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.returncode
    res = Result(proc.returncode, proc.stdout, "", parse(proc.stdout))
    assert res.rc("alloc") == 0
    assert res.values("meminfo")[1] == 16 * GIB  # the bad value is ignored: no cap, as before


def test_a_child_made_without_the_fork_handlers_leaves_the_parents_usage(release_lab):
    # A child of _Fork() (or clone, or vfork) runs no fork handlers: it still took its parent's
    # process slot for its own, and its exit returned the parent's usage, so another process got
    # 4 GiB beside the parent's 1 GiB under a 4 GiB cap
    lab = release_lab
    go = lab.tmp / "go"
    parent = subprocess.Popen([str(lab.build / "tests" / "rawfork"), str(go)],
                              env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="4g"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    lab.procs.append(parent)
    assert parent.stdout is not None
    assert parent.stdout.readline().split() == ["alloc", "0"]
    assert parent.stdout.readline().split() == ["child", "0"]
    assert lab.used() == GIB
    res = lab.run("init", "ctx", "0", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.rc("alloc") == OOM
    go.touch()
    assert parent.wait(timeout=20) == 0
    assert lab.used() == 0


def test_a_vfork_child_that_calls_exit_leaves_its_parent_able_to_register(lab):
    # a vfork() child's exit() runs the library's destructor in its parent's memory: its "this
    # process exits" flag became the parent's, which could then never register, and every
    # allocation of its own was refused (1 GiB under a 4 GiB cap, nothing else held)
    res = lab.run("vforkexit", "init", "ctx", "0", "alloc", "1g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.of("vforkexit") == [(0, [])]
    assert res.rc("alloc") == 0
    # (glibc's exit() in the child also marked every library's destructors as run: the parent's
    # exit returned nothing, and its slot is reclaimed as a dead process's)
    assert lab.run("init", "ctx", "0", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="4g").rc("alloc") == 0


def test_a_vfork_child_that_calls_exit_leaves_its_parent_a_sampler(lab):
    # the child's exit() also stopped the parent's sampler thread for good: a killed process's
    # 2 GiB stayed in the container's figures (no sweep) beside the keeper, its only live process
    ctx = 100 * MIB
    keeper = lab.start("init", "ctx", "0", "alloc", "1g", "vforkexit", "touch", str(lab.tmp / "kept"),
                       "waitfile", str(lab.tmp / "end"), CUDA_DEVICE_MEMORY_LIMIT="4g",
                       FAKE_CUDA_CTX_BYTES="100m")
    lab.wait_for(lab.tmp / "kept")
    kill_a_holder(lab, "held", FAKE_CUDA_CTX_BYTES="100m")
    deadline = time.monotonic() + 8
    while lab.used() != GIB + ctx and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab.used() == GIB + ctx
    (lab.tmp / "end").touch()
    assert lab.finish(keeper).of("vforkexit") == [(0, [])]


def test_a_process_that_exits_returns_its_usage(lab):
    lab.run("init", "ctx", "0", "alloc", "3g", "alloc", "1g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert lab.used() == 0
    assert lab.region().processes == ()


def test_a_process_whose_driver_tears_down_slowly_at_exit_leaves_nothing_behind(lab):
    # A real driver destroys its contexts after the library has returned the process's usage,
    # while the sampler thread (running here for the compute limit) still wakes every 500 ms
    # and NVML still lists the process's memory.  Taking that for growth outside the hooks
    # left a live-looking slot charging 1 GiB after the process was gone.
    lab.run("init", "ctx", "0", "alloc", "1g", CUDA_DEVICE_MEMORY_LIMIT="4g",
            CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_SLEEP="exit:1200")
    assert lab.region().processes == ()
    assert lab.used() == 0


def test_a_process_that_exits_without_cleanup_is_reclaimed(lab):
    lab.run("init", "ctx", "0", "alloc", "3g", "exit", "0", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert lab.used() == 3 * GIB  # _exit skipped the library's destructor
    res = lab.run("init", "ctx", "0", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.rc("alloc") == 0


def test_usage_recorded_by_an_earlier_container_incarnation_is_reclaimed(lab):
    # a live pid (ours) recorded under another pid namespace: a previous container's process
    lab.region_path.write_bytes(encode_region(Region(
        pod_uid="u", pod_name="p", namespace="n", container="c",
        devices=(DeviceSlot(index=0, uuid=lab.UUID_A, limit_bytes=4 * GIB, used_bytes=3 * GIB,
                            sm_limit=0, busy_ns=0),),
        processes=(ProcessUsage(pid=os.getpid(), used_bytes=(3 * GIB,)),))))
    res = lab.run("init", "ctx", "0", "alloc", "4g", CUDA_DEVICE_MEMORY_LIMIT="4g")
    assert res.rc("alloc") == 0


def test_fork_child_charges_its_own_usage_and_parent_keeps_its_own(lab):
    res = lab.run("init", "ctx", "0", "alloc", "1g", "fork", "alloc", "2g", "touch",
                  str(lab.tmp / "x"), CUDA_DEVICE_MEMORY_LIMIT="4g")
    # child: allocates 2 GiB, exits (returning them); parent: then also allocates 2 GiB
    assert [rc for rc, _ in res.of("alloc")] == [0, 0, 0]
    assert res.of("fork") == [(0, [])]
    assert lab.used() == 0


def test_fork_child_usage_is_separate_from_the_parents(lab):
    child_ready, parent_go = lab.tmp / "child", lab.tmp / "parent"
    proc = lab.start("init", "ctx", "0", "alloc", "1g", "fork", "alloc", "2g", "touch",
                     str(child_ready), "waitfile", str(parent_go), CUDA_DEVICE_MEMORY_LIMIT="4g")
    lab.wait_for(child_ready)
    region = lab.region()
    usage = sorted(p.used_bytes[0] for p in region.processes)
    assert usage == [GIB, 2 * GIB]  # two processes, each with its own usage
    parent_go.touch()
    lab.finish(proc)


def test_a_fork_after_cuda_clears_only_the_stream_entries_in_use(release_lab):
    # the child's fork handler cleared the whole 485 KiB stream table of the throttle, faulting
    # it in: 528 KiB of RssAnon more in the child than in its parent; now the entries ever
    # taken (here one: the legacy stream)
    res = release_lab.run("init", "ctx", "0", "launch", "3", "sync", "rssanon", "fork", "rssanon",
                          "childexit", CUDA_DEVICE_SM_LIMIT="50")
    (parent, _), (child, is_child) = [vals for _, vals in res.of("rssanon")][:2]
    assert is_child == 1 and res.of("fork") == [(0, [])]
    assert child - parent < 200, (parent, child)


def test_a_child_forked_while_another_thread_holds_the_pools_lock_can_use_pools(lab):
    # a thread of the parent frees a pool allocation, and the pools' lock is held across the
    # driver's pool attribute query (the fake sleeps in the fifth one, the free's); the main
    # thread forks meanwhile.  The child has the lock as it was, held by a thread it does not
    # have: its fork handler makes it anew, or the child's first pool allocation waits for ever
    mark = lab.tmp / "held"
    res = lab.run("init", "ctx", "0", "mkpool", "1", "0", "pool", "1m", "bgfreesync", "0", "0",
                  "waitfile", str(mark), "fork", "pool", "1m", "childexit", "join", timeout=30,
                  FAKE_CUDA_SLEEP="cuMemPoolGetAttribute:1500:5", FAKE_CUDA_SLEEP_MARK=str(mark))
    assert res.returncode == 0, res.stderr
    assert res.of("waitfile") == [(0, [])], res.stdout
    assert res.of("fork") == [(0, [])] and res.of("bgfreesync") == [(0, [])], res.stdout
    assert [rc for rc, _ in res.of("pool")] == [0, 0, 0]  # the parent's, the child's, the parent's again


def test_a_forked_child_does_not_wait_for_a_settle_of_its_parents_other_thread(lab):
    # a thread of the parent destroys a context with a 1 s kernel in flight: under a compute limit
    # the throttle synchronises it first, counted so that a global capture begun meanwhile waits
    # for it; the main thread forks during that wait.  The settling thread is not in the child,
    # and the child's first global capture waited for it for ever (a review's find); now the
    # child's fork handler starts the capture bookkeeping over
    res = lab.run("init", "ctxcreate", "0", "launch", "1", "bgctxdestroy", "0", "0", "sleep", "300",
                  "fork", "ctx", "0", "capture", "1", "childexit", "join", timeout=30,
                  CUDA_DEVICE_SM_LIMIT="50", FAKE_CUDA_KERNEL_US="1000000")
    assert res.returncode == 0, res.stderr
    lines = [line.split()[0] for line in res.stdout.splitlines()]
    # the child's capture, then the parent's wait for the child, then the parent's own capture
    assert lines[lines.index("sleep") + 1:] == ["ctx", "capture", "fork", "ctx", "capture", "bgctxdestroy"]
    assert [rc for rc, _ in res.of("capture")] == [0, 0], res.stdout
    assert res.of("fork") == [(0, [])] and res.of("bgctxdestroy") == [(0, [])], res.stdout


def test_a_forked_child_that_exits_does_not_return_the_parents_usage(lab):
    proc = lab.start("init", "ctx", "0", "alloc", "1g", "fork", "childexit", "touch",
                     str(lab.tmp / "after"), "waitfile", str(lab.tmp / "go"),
                     CUDA_DEVICE_MEMORY_LIMIT="4g")
    lab.wait_for(lab.tmp / "after")  # the child has exited normally (destructors ran)
    assert lab.used() == GIB
    assert [p.used_bytes[0] for p in lab.region().processes] == [GIB]
    (lab.tmp / "go").touch()
    assert lab.finish(proc).of("fork") == [(0, [])]


def test_a_killed_process_not_yet_reaped_returns_its_usage(lab):
    # a zombie (SIGKILLed, its parent has not waited yet: the OOM killer, a shell that never
    # reaps) holds no memory; it was counted alive before and kept its 6 GiB
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(lab.tmp / "held")
    os.kill(holder.pid, signal.SIGKILL)
    for _ in range(200):  # until the kernel has made it a zombie (not reaped: no wait yet)
        with open(f"/proc/{holder.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    res = lab.run("init", "ctx", "0", "alloc", "6g", CUDA_DEVICE_MEMORY_LIMIT="8g")
    holder.wait()
    assert res.rc("alloc") == 0


def test_a_process_whose_main_thread_ended_keeps_its_charge(lab):
    # main() ends with pthread_exit while a worker thread holds 700 MiB: the process lives,
    # but /proc shows its leader as a zombie, and it was taken for dead: another process's
    # 700 MiB passed the 1 GiB cap (1400 MiB from outside)
    ready, stop = lab.tmp / "ready", lab.tmp / "stop"
    proc = subprocess.Popen([str(lab.build / "tests" / "mainexit"), "700", str(ready), str(stop)],
                            env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="1g"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lab.procs.append(proc)
    lab.wait_for(ready)
    for _ in range(200):  # until only the worker runs
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    res = lab.run("init", "ctx", "0", "alloc", "700m", CUDA_DEVICE_MEMORY_LIMIT="1g")
    used = lab.used()
    stop.touch()
    out, err = proc.communicate(timeout=30)
    lab.check_sanitizers(err)
    assert res.rc("alloc") == OOM and used == 700 * MIB
    assert "free 0" in out


def test_a_process_that_execs_returns_what_its_old_image_held(lab):
    # exec replaces the program in the same process (same pid and start time): the old image's
    # slot stayed charged before, next to the new one's
    res = lab.run("init", "ctx", "0", "alloc", "4g", "reexec", "init", "ctx", "0", "meminfo",
                  CUDA_DEVICE_MEMORY_LIMIT="8g")
    assert res.values("meminfo") == [8 * GIB, 8 * GIB]


def test_a_process_that_execs_a_program_without_cuda_returns_what_its_old_image_held(lab):
    # exec keeps the pid and start time, so the old image's slot looked alive, holding its
    # 4 GiB until the new program (no CUDA: it never looks at the region) ended; another
    # process's 6 GiB was refused under an 8 GiB cap with nothing held.  The slot's token went
    # with the exec
    res, _ = beside_a_holder(lab, "reexec", "8g", "6g")
    assert res.rc("alloc") == 0


def beside_a_holder(lab: Lab, step: str, limit: str, ask: str, **env: str) -> tuple[Result, int]:
    """A process allocates 4 GiB, runs gsprobe's command `step` and waits; meanwhile another
    asks for `ask`.  Returns the other's result and the region's usage just after it."""
    held, go = lab.tmp / "held", lab.tmp / "go"
    proc = lab.start("init", "ctx", "0", "alloc", "4g", step, "touch", str(held), "waitfile", str(go),
                     CUDA_DEVICE_MEMORY_LIMIT=limit, **env)
    lab.wait_for(held)
    res = lab.run("init", "ctx", "0", "alloc", ask, CUDA_DEVICE_MEMORY_LIMIT=limit, **env)
    used = lab.used()
    go.touch()
    lab.finish(proc)
    return res, used


@pytest.mark.parametrize("fs", ["local", "btrfs"])
def test_a_process_that_closes_its_descriptors_keeps_its_slot(lab, fs):
    # closefrom(3) (or a dup2 onto the token's number) lets the token's lock go while the
    # process lives and holds its memory: another process took that for an exec, reclaimed its
    # 4 GiB and got 4 GiB more under a 6 GiB cap.  The process still maps the region file, which
    # an exec would not leave.  On btrfs stat(2) gives a file's subvolume device and
    # /proc/PID/maps its superblock's: the mapping, looked for under the former, was never found
    # there, and the same 4 GiB were reclaimed (8 GiB held under the 6 GiB cap on a real btrfs)
    env = like_btrfs(lab) if fs == "btrfs" else {}
    res, used = beside_a_holder(lab, "closefds", "6g", "4g", **env)
    assert res.rc("alloc") == OOM
    assert used == 4 * GIB


def test_a_sweep_leaves_a_slot_its_process_registered_in_again_since_it_was_found_dead(lab):
    # Between an exec and the new image's registration, a process's slot looks dead: the same
    # pid and start time, its token gone with the exec, the region not mapped.  A sweep checks
    # the slots without the region's lock and reclaims the dead under it if their identity is
    # unchanged; the new image, a CUDA program, registers in the same slot with the same
    # identity, and a sweep that took the lock only after that reclaimed the live process's
    # usage.  Under the lock it checks that the token is still not held.  The sweeper here stops
    # just after reading the process's /proc maps (tests/next/pausemaps.c) until the new image
    # has registered and allocated
    t = lab.tmp
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgspausemaps.so"))
    # its cuMemGetInfo sweeps (at most every 250 ms per process: 300 ms after its attach)
    sweeper = lab.start("init", "ctx", "0", "alloc", "1m", "touch", str(t / "attached"),
                        "waitfile", str(t / "execd"), "sleep", "300", "meminfo", "touch",
                        str(t / "swept"), "waitfile", str(t / "end"), CUDA_DEVICE_MEMORY_LIMIT="8g",
                        LD_PRELOAD=":".join(preload), GS_TEST_PAUSED=str(t / "paused"),
                        GS_TEST_RESUME=str(t / "resume"))
    lab.wait_for(t / "attached")
    proc = lab.start("init", "ctx", "0", "alloc", "1g", "reexec", "touch", str(t / "execd"),
                     "waitfile", str(t / "go"), "init", "ctx", "0", "alloc", "2g", "touch",
                     str(t / "registered"), "waitfile", str(t / "end"), CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(t / "paused")  # the sweep found the process dead, without the lock
    (t / "go").touch()
    lab.wait_for(t / "registered")  # in the same slot, its token taken
    (t / "resume").touch()
    lab.wait_for(t / "swept")
    region = lab.region()
    (t / "end").touch()
    assert [rc for rc, _ in lab.finish(proc).of("alloc")] == [0, 0]
    lab.finish(sweeper)
    assert {p.pid: p.used_bytes[0] for p in region.processes} == {sweeper.pid: MIB, proc.pid: 2 * GIB}
    assert region.devices[0].used_bytes == 2 * GIB + MIB


def test_a_fork_child_at_the_cap_takes_its_parent_for_alive(lab):
    # the child's refused reservation checks the container's processes for the dead: its
    # parent's token is held through the parent's own descriptor, which the child closed
    res = lab.run("init", "ctx", "0", "alloc", "3g", "fork", "alloc", "2g", "meminfo",
                  CUDA_DEVICE_MEMORY_LIMIT="4g")
    # the child runs the rest, then the parent
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM, OOM]
    assert [vals for _, vals in res.of("meminfo")] == [[GIB, 4 * GIB]] * 2
    assert res.of("fork") == [(0, [])]


def live_tokens(lab: Lab) -> dict[int, int]:
    """``{pid: token}`` of the region's live process slots."""
    return {p.pid: p.token for p in lab.region().processes}


def like_btrfs(lab: Lab) -> dict[str, str]:
    """The environment that makes the lab's files report another device to stat(2) than
    /proc/PID/maps names, as on btrfs (tests/next/btrfslike.c, preloaded before the library)."""
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsbtrfslike.so"))
    return {"LD_PRELOAD": ":".join(preload), "GS_TEST_BTRFS_DIR": str(lab.tmp)}


def on_nfs(lab: Lab) -> dict[str, str]:
    """The environment that makes the region file look and lock as on NFS
    (tests/next/nfslike.c, preloaded before the library)."""
    preload = lab.base["LD_PRELOAD"].split(":")  # [sanitizer runtime,] the library
    preload.insert(len(preload) - 1, str(lab.build / "tests" / "libgsnfslike.so"))
    return {"LD_PRELOAD": ":".join(preload), "GS_TEST_NFS_PATH": str(lab.region_path)}


@pytest.mark.parametrize("fs", ["local", "nfs"])
def test_liveness_tokens_are_taken_only_on_local_file_systems(lab, fs):
    # NFS emulates flock(2) with a byte-range lock on the whole file, which a token (a lock on
    # one byte) blocks: each process's attach waited for the token holder's whole life.  There
    # no token is taken, and a live process is still told from a dead one by /proc
    env = on_nfs(lab) if fs == "nfs" else {}
    held, held2, go = lab.tmp / "held", lab.tmp / "held2", lab.tmp / "go"
    holder = lab.start("init", "ctx", "0", "alloc", "4g", "touch", str(held), "waitfile", str(go),
                       CUDA_DEVICE_MEMORY_LIMIT="6g", **env)
    lab.wait_for(held)
    other = lab.start("init", "ctx", "0", "alloc", "1g", "alloc", "4g", "touch", str(held2),
                      "waitfile", str(go), CUDA_DEVICE_MEMORY_LIMIT="6g", **env)
    # attached beside the holder, not behind its token (the holder gives up waiting after 10 s)
    lab.wait_for(held2, timeout=8)
    assert holder.poll() is None
    tokens = live_tokens(lab)
    go.touch()
    res = lab.finish(other)
    lab.finish(holder)
    if fs == "nfs":
        assert tokens == {holder.pid: 0, other.pid: 0}
    else:
        assert tokens == {holder.pid: holder.pid, other.pid: other.pid}
    # the holder is alive (its 4 GiB not reclaimed for the other's refused 4 GiB)
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]


def test_a_killed_process_on_nfs_returns_its_usage(lab):
    # without tokens (NFS) a dead holder is still told by its pid
    env = on_nfs(lab)
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g", **env)
    lab.wait_for(lab.tmp / "held")
    tokens = live_tokens(lab)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    res = lab.run("init", "ctx", "0", "alloc", "6g", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="8g",
                  timeout=30, **env)
    assert tokens == {holder.pid: 0}
    assert res.rc("alloc") == 0
    assert res.values("meminfo") == [2 * GIB, 8 * GIB]


def test_a_failed_huge_allocation_on_an_uncapped_device_leaves_the_usage_right(lab):
    holder = lab.start("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"))
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", str(2**64 - 1))
    used = lab.used()
    (lab.tmp / "go").touch()
    lab.finish(holder)
    assert res.rc("alloc") == OOM
    assert used == GIB  # a reservation the sum cannot hold is refused; it wrapped to 0 before


def age_region(lab: Lab, version: int) -> None:
    """Rewrite the region as an older library's file of that version."""
    lab.run("init", CUDA_DEVICE_MEMORY_LIMIT="8g")  # a valid region, to age
    stale = bytearray(lab.region_path.read_bytes())
    if version == 1:
        size = mirror.PROCS_OFFSET + mirror.MAX_PROCS * mirror.PROC_V1.size
        stale = stale[:size]
        stale[12:16] = size.to_bytes(4, "little")
    stale[8:12] = version.to_bytes(4, "little")
    lab.region_path.unlink()
    lab.region_path.write_bytes(bytes(stale))


@pytest.mark.parametrize("version", [0, 1])
def test_a_region_file_from_an_older_library_is_replaced_not_given_up(lab, version):
    # a version-0 region (an older layout): processes fell back to private regions, so every
    # process got the whole cap; now the file is started afresh and shared.  Version 1 is the
    # layout before process slots held a host pid and measured time: a smaller file
    age_region(lab, version)
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", "6g", CUDA_DEVICE_MEMORY_LIMIT="8g")
    (lab.tmp / "go").touch()
    lab.finish(holder)
    assert res.rc("alloc") == OOM


def newer_region(lab: Lab, pidns: int) -> bytes:
    """Rewrite the region as a newer library's file (version 3, process slots 32 bytes longer)
    with one live process registered from pid namespace ``pidns``; return its bytes."""
    lab.run("init", CUDA_DEVICE_MEMORY_LIMIT="8g")  # a valid region, its slots free
    old = lab.region_path.read_bytes()
    stride = mirror.PROC.size + 32
    newer = bytearray(old[:mirror.PROCS_OFFSET] + bytes(mirror.MAX_PROCS * stride))
    newer[8:16] = (3).to_bytes(4, "little") + len(newer).to_bytes(4, "little")
    newer[mirror.PROCS_OFFSET:mirror.PROCS_OFFSET + 16] = (
        os.getpid().to_bytes(4, "little") + mirror.PROC_LIVE.to_bytes(4, "little")
        + pidns.to_bytes(8, "little"))
    lab.region_path.unlink()
    lab.region_path.write_bytes(bytes(newer))
    return bytes(newer)


POD = {"GPUSLICE_POD_UID": "u-1"}  # a pod's process: without the shared region it gets nothing


def test_a_newer_librarys_region_left_by_an_earlier_run_of_the_container_is_replaced(lab):
    # A container started under a newer library (region version 3) and restarted after the
    # node's library was rolled back: the new run's processes got no memory for the pod's life
    # ("has version 3 ...: no device memory is granted"); its processes are an earlier pid
    # namespace's, gone, so the file is started afresh and shared
    newer_region(lab, pidns=os.stat("/proc/self/ns/pid").st_ino + 1)
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    lab.wait_for(lab.tmp / "held")
    res = lab.run("init", "ctx", "0", "alloc", "1g", "alloc", "2g", CUDA_DEVICE_MEMORY_LIMIT="8g",
                  **POD)
    (lab.tmp / "go").touch()
    first = lab.finish(holder)
    assert first.rc("alloc") == 0, first.stderr
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]  # one budget: 7 GiB of 8 held
    assert "newer library (version 3)" in first.stderr and "replaced" in first.stderr
    assert lab.region().processes == ()


def test_a_newer_librarys_region_a_process_of_this_run_uses_is_left_alone(lab):
    # a process of this container registered in it (a tenant's LD_PRELOAD of a newer library):
    # replaced, its budget and this process's would be two
    newer = newer_region(lab, pidns=os.stat("/proc/self/ns/pid").st_ino)
    res = lab.run("init", "ctx", "0", "alloc", "1g", CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    assert res.rc("alloc") == OOM
    assert "has version 3" in res.stderr
    assert lab.region_path.read_bytes() == newer


def test_an_older_librarys_region_a_process_of_this_run_uses_is_not_replaced_under_it(lab):
    # The library dir a pod mounts holds every installed version, so a process of a container
    # started before an upgrade can preload the new one (LD_PRELOAD) beside the old library's
    # processes: it replaced their region and got a budget of its own, 12 GiB under 8 GiB. Here
    # the holder's region is marked version 1 in place, as a live old library's would be.
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    lab.wait_for(lab.tmp / "held")
    inode = lab.region_path.stat().st_ino
    with open(lab.region_path, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    res = lab.run("init", "ctx", "0", "alloc", "6g", CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    assert lab.region_path.stat().st_ino == inode
    (lab.tmp / "go").touch()
    lab.finish(holder)
    assert res.rc("alloc") == OOM
    assert "has version 1" in res.stderr and "uses it" in res.stderr


def test_an_older_librarys_region_whose_process_of_this_run_was_killed_is_replaced(lab):
    # As above, but the old library's process was SIGKILLed: its slot stays marked live, and no
    # process of its version is left to sweep it. The region was kept as "in use", and every new
    # process of the container was granted no memory for the pod's life.
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    lab.wait_for(lab.tmp / "held")
    with open(lab.region_path, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    holder.kill()
    holder.wait(timeout=10)
    res = lab.run("init", "ctx", "0", "alloc", "6g", CUDA_DEVICE_MEMORY_LIMIT="8g", **POD)
    assert res.rc("alloc") == 0, res.stderr
    assert "older library (version 1): replaced" in res.stderr


def wait_for_lock_waiters(path: Path, count: int, timeout: float = 20) -> None:
    """Until ``count`` processes wait for a flock on ``path``'s inode (/proc/locks' "->" lines:
    blocked requests), rather than a sleep that bets they got there."""
    inode = str(os.stat(path).st_ino)
    deadline = time.monotonic() + timeout
    while True:
        lines = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
        waiting = sum(1 for f in lines if f[1:3] == ["->", "FLOCK"] and
                      any(x.count(":") == 2 and x.rsplit(":", 1)[1] == inode for x in f))
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"{waiting} of {count} processes wait for {path}'s lock"
        time.sleep(0.005)


def test_two_processes_replacing_an_older_librarys_region_at_once_share_the_new_one(release_lab):
    # Both open the old file and wait for its lock (held here, as by a process of the old
    # library starting); the first replaces the file, and the second, holding the old inode,
    # replaced the first one's new file in turn: each got a whole cap, 12 GiB under 8 GiB
    lab = release_lab
    age_region(lab, 1)
    fd = os.open(lab.region_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # (contexts with a footprint, as real ones: a context NVML does not list lets the library
    # take the other process, appearing meanwhile, for itself)
    procs = [lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / f"held{i}"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g",
                       FAKE_CUDA_CTX_BYTES="100m") for i in range(2)]
    wait_for_lock_waiters(lab.region_path, 2)  # both wait for the old file's lock
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    for i in range(2):
        lab.wait_for(lab.tmp / f"held{i}")
    (lab.tmp / "go").touch()
    assert sorted(lab.finish(p).rc("alloc") for p in procs) == [0, OOM]


@pytest.fixture
def btrfs(tmp_path):
    """A small btrfs, loop-mounted (root and btrfs-progs only)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.btrfs"):
        pytest.skip("needs root and mkfs.btrfs")
    image, mount = tmp_path / "btrfs.img", tmp_path / "btrfs"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(160 << 20)
    for argv in (["mkfs.btrfs", "-q", str(image)], ["mount", "-o", "loop", str(image), str(mount)]):
        if subprocess.run(argv, check=False, capture_output=True).returncode != 0:
            pytest.skip("cannot make and loop-mount a btrfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_a_region_on_a_full_btrfs_kills_no_process(lab, btrfs):
    # btrfs copies on write: a store into a region page written back since needs new blocks,
    # allocated by posix_fallocate or not, and on a full file system the next process of the
    # container died of SIGBUS at its first store (exit -7); so would every running one at its
    # next.  The region file is made without copy on write there
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": str(btrfs / "region"), "CUDA_DEVICE_MEMORY_LIMIT": "4g"}
    assert lab.run("init", "ctx", "0", "alloc", "1g", **env).rc("alloc") == 0
    os.sync()
    fd = os.open(btrfs / "fill", os.O_WRONLY | os.O_CREAT)
    for size in (1 << 20, 4096):  # until the file system is full
        try:
            while os.write(fd, bytes(size)):
                pass
        except OSError:
            pass
    os.close(fd)
    os.sync()
    for _ in range(2):
        res = lab.run("init", "ctx", "0", "alloc", "1g", **env)
        assert res.returncode == 0 and res.rc("alloc") == 0, res
        os.sync()


def test_a_process_that_cannot_read_the_boot_id_resets_nothing(release_lab):
    # The boot id tells a region left from an earlier boot.  Unreadable, it read as zeros, which
    # matched no region's: the region was reset under a live process holding 6 GiB, and the
    # newcomer got 6 GiB more under an 8 GiB cap
    lab = release_lab
    if subprocess.run(["unshare", "-m", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -m) to hide the boot id")
    holder = lab.start("init", "ctx", "0", "alloc", "6g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(lab.tmp / "held")
    hidden = ("mount --bind /dev/null /proc/sys/kernel/random/boot_id && exec "
              + " ".join(lab.command("init", "ctx", "0", "alloc", "6g", "meminfo")))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", hidden], check=False, capture_output=True,
                          text=True, timeout=60, env=lab.env(CUDA_DEVICE_MEMORY_LIMIT="8g"))
    res = Result(proc.returncode, proc.stdout, proc.stderr, parse(proc.stdout))
    (lab.tmp / "go").touch()
    lab.finish(holder)
    assert "earlier boot" not in proc.stderr
    assert res.rc("alloc") == OOM
    assert res.values("meminfo") == [2 * GIB, 8 * GIB]


@pytest.mark.parametrize("boot", ["earlier", "this"])
def test_a_region_from_an_earlier_boot_is_reset_and_takes_this_boots_id(lab, boot):
    # A region file on a path that outlives a reboot still lists the earlier boot's processes,
    # and the new boot reuses their pids: a slot whose pid, pid namespace and start time match a
    # live process of this boot (a sleep here) looks alive for good, its 6 GiB with it.  The
    # boot id in the region tells: from an earlier boot the region is reset, and takes this
    # boot's id (no test read it back: a reset that left it zero passed, found by mutation
    # testing).  The same region of this boot keeps the slot
    this_boot = uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        start = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        data = bytearray(encode_region(Region(
            pod_uid="u", pod_name="p", namespace="n", container="c",
            devices=(DeviceSlot(index=0, uuid=lab.UUID_A, limit_bytes=8 * GIB, used_bytes=6 * GIB, sm_limit=0,
                                busy_ns=0),),
            processes=(ProcessUsage(pid=sleeper.pid, used_bytes=(6 * GIB,), pidns=os.stat("/proc/self/ns/pid").st_ino,
                                    start_time=start),))))
        at, size = mirror.field_layout(mirror.HEADER_FIELDS)["boot_id"]
        data[at:at + size] = this_boot if boot == "this" else bytes(reversed(this_boot))
        lab.region_path.write_bytes(data)
        res = lab.run("init", "ctx", "0", "alloc", "6g", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="8g",
                      LIBCUDA_LOG_LEVEL="3")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert lab.region_path.read_bytes()[at:at + size] == this_boot
    if boot == "this":
        assert res.rc("alloc") == OOM and "earlier boot" not in res.stderr
        assert res.values("meminfo") == [2 * GIB, 8 * GIB]
    else:
        assert "is from an earlier boot: reset" in res.stderr
        assert res.rc("alloc") == 0
        assert res.values("meminfo") == [2 * GIB, 8 * GIB]


def test_a_process_whose_slot_was_reclaimed_never_writes_into_someone_elses(lab):
    # another process took this one for dead and reset the region (a pid namespace it cannot
    # see into does that); a new process then registered in the same slot.  The first one's
    # free and exit must not touch the newcomer's usage (they decremented it before)
    holder = lab.start("init", "ctx", "0", "alloc", "1g", "touch", str(lab.tmp / "held"),
                       "waitfile", str(lab.tmp / "go"), "free", "0",
                       CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(lab.tmp / "held")
    lab.region_path.write_bytes(encode_region(Region(
        pod_uid="u", pod_name="p", namespace="n", container="c", devices=(), processes=())))
    newcomer = lab.start("init", "ctx", "0", "alloc", "2g", "touch", str(lab.tmp / "held2"),
                         "waitfile", str(lab.tmp / "go2"), CUDA_DEVICE_MEMORY_LIMIT="8g")
    lab.wait_for(lab.tmp / "held2")
    (lab.tmp / "go").touch()
    assert lab.finish(holder).rc("free") == 0
    region = lab.region()
    (lab.tmp / "go2").touch()
    lab.finish(newcomer)
    assert [p.used_bytes[0] for p in region.processes] == [2 * GIB]
    assert region.devices[0].used_bytes == 2 * GIB
