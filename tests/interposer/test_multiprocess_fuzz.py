"""Several processes of one container at once, each running a random command sequence.

Per seed, 2-4 ``gsprobe`` processes share one region (one container, a 1 GiB cap) and the fake
driver's state file (so its NVML lists every process's memory, as a GPU's does).  Each runs
its own :func:`test_hook_sweep.random_steps` sequence (allocations of every kind, frees,
pools, VMM, arrays, contexts, green contexts, limits, graphs, code loads, resets, failing
driver calls; through exported symbols, ``dlsym`` or ``cuGetProcAddress``; with the fake's
primary reset that keeps the context active and its lowered limits freed, or not), spaced by
short sleeps, and either runs it to its end, stops part way
(returning from ``main``: the library's destructor gives everything back) or ``_exit``s part
way (no destructor: liveness must reclaim it); some are SIGKILLed by the test at a random
moment.  Checked:

1. while they run (the test samples the fake driver's state file every few milliseconds),
   the memory the container's live processes hold on the device never passes the cap by more
   than the contexts being made at that moment (README "Memory": nothing is reserved for a
   container's first context nor for a green context, whose footprint is measured once made
   and the context destroyed if it does not fit; the sample allows each process's context
   footprint while one of its commands that makes a context may be in flight) and, for a
   process that has returned from ``main``, what it holds between the library's destructor
   (which gives its charge back) and its death.  The knobs behind the transient and lasting
   exceptions of README "Not done / weak" are left off: ``FAKE_CUDA_POOL_PENDING`` (an undone
   pool allocation's memory kept past the cap while its free is outstanding),
   ``FAKE_CUDA_LAUNCH_BYTES`` and ``FAKE_CUDA_MODULE_BYTES`` (code loaded lazily, past the cap
   by its size; a load near the cap held past it for the call and one NVML reading), and the
   pool chunk stays the 32 MiB the library reserves;
2. once every process has ended, a new process's attach reclaims the dead ones (SIGKILLed or
   ``_exit``ed): it sees the whole cap but its own context, and after it the region holds no
   usage and no process slot (a process that returned from ``main`` has left its slot at
   once);
3. no process crashed (exit status 0, or the SIGKILL the test sent) and no sanitizer spoke.

``GPUSLICE_MP_FUZZ_SEEDS`` runs more: ``500`` (seeds 0-499) or ``1000-1500``.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import GIB, MIB, Lab
from .test_hook_sweep import random_steps

CAP = GIB
CTX, GREEN = 64 * MIB, 16 * MIB
ENV = {"CUDA_DEVICE_MEMORY_LIMIT": str(CAP), "FAKE_WAIT_MS": "0", "FAKE_CUDA_CTX_BYTES": "64m",
       "FAKE_CUDA_GREEN_BYTES": "16m"}

# gsprobe's commands that random_steps uses, with how many arguments each takes
ARITY = {
    "init": 0, "ctx": 1, "release": 1, "reset": 1, "ctxcreate": 1, "ctxdestroy": 1, "alloc": 1,
    "managed": 1, "async": 1, "pool": 1, "pitch": 2, "vmm": 2, "array": 2, "mipmap": 3,
    "vimport": 1, "eimport": 1, "vretain": 1, "vexport": 1, "vmap": 1, "vunmap": 1, "free": 1,
    "freesync": 1, "sfree": 2, "green": 1, "setlimit": 2, "trim": 1, "trimdefault": 1,
    "gnode": 2, "ginst": 1, "mkpool": 2, "modload": 0, "modunload": 0, "libload": 0,
    "libunload": 0, "libmodule": 0, "launchk": 1, "sdestroy": 1, "ssync": 1, "slaunch": 2,
    "sync": 0, "glaunch": 0, "gdestroy": 0, "gtrim": 0, "pooldestroy": 0, "greendestroy": 0,
    "getfunc": 0, "libkernel": 0, "libglobal": 0, "funcload": 0, "launchfn": 0, "meminfo": 0,
    "phys": 0, "sleep": 1, "waitfile": 1, "touch": 1, "exit": 1,
}
# what a command that makes a context may hold before the library has charged it
MAKES_CONTEXT = {"ctx": CTX, "ctxcreate": CTX, "green": CTX + GREEN}

# fakestate.h's struct fake_phys: 256 process entries {pid, pad, used[20], kernel_ns}
FAKE_PROC = struct.Struct("<ii20QQ")
FAKE_PROCS = 256


def command_names(words: list[str]) -> list[str]:
    names, i = [], 0
    while i < len(words):
        names.append(words[i])
        i += 1 + ARITY[words[i]]
    assert i == len(words), words
    return names


@dataclass
class Member:
    """One process of the container: its commands, environment and how it ends."""

    words: list[str]
    env: dict[str, str]
    api: str  # how gsprobe reaches the driver (--api)
    ending: str  # "full", "return" (main returns part way) or "_exit" (part way, no destructor)
    kill_at: float | None  # seconds after the start, or never
    names: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    out: bytes = b""
    printed: int = 0  # lines printed at the last look
    killed: bool = False
    returncode: int | None = None

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (f"[{self.ending}, kill at {self.kill_at}] {env} gsprobe --api {self.api} "
                f"{' '.join(self.words)}")


def plan(seed: int, go: Path) -> list[Member]:
    rng = random.Random(seed)
    members = []
    for _ in range(rng.randint(2, 4)):
        steps, env = random_steps(rng)
        env.pop("FAKE_CUDA_POOL_PENDING", None)  # a documented lasting exception (above)
        for knob in ("FAKE_CUDA_RESET_ACTIVE", "FAKE_CUDA_LIMIT_SHRINK"):  # driver variants
            if rng.random() < 0.3:
                env[knob] = "1"
        api = rng.choice(["direct", "direct", "dlsym", "procaddr", "ptsz"])
        ending = rng.choices(["full", "return", "_exit"], [0.7, 0.15, 0.15])[0]
        if ending != "full":
            steps = steps[:rng.randrange(2, len(steps))]
            if ending == "_exit":
                steps.append(["exit", "0"])
        words = ["waitfile", str(go)]
        for step in steps:
            pause = rng.random()  # mostly short, now and then past the sampler's 500 ms tick
            if pause < 0.02:
                words += ["sleep", str(rng.randint(200, 700))]
            elif pause < 0.25:
                words += ["sleep", str(rng.randint(1, 25))]
            words += step
        kill_at = rng.uniform(0.0, 0.4) if rng.random() < 0.3 else None
        members.append(Member(words, env, api, ending, kill_at, command_names(words)))
    return members


def held_by_live(state: Path, members: list[Member]) -> dict[int, int]:
    """What the fake driver holds on device 0 for each of the members still alive (a zombie's
    memory is gone, as a dead process's on a GPU)."""
    try:
        data = state.read_bytes()
    except FileNotFoundError:
        return {}
    pids = {m.proc.pid for m in members if m.proc is not None}
    held: dict[int, int] = {}
    for i in range(min(FAKE_PROCS, len(data) // FAKE_PROC.size)):
        entry = FAKE_PROC.unpack_from(data, i * FAKE_PROC.size)
        pid, used0 = entry[0], entry[2]
        if pid in pids and alive(pid):
            held[pid] = held.get(pid, 0) + used0
    return held


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def drain(member: Member) -> None:
    assert member.proc is not None and member.proc.stdout is not None
    try:
        while chunk := os.read(member.proc.stdout.fileno(), 65536):
            member.out += chunk
    except BlockingIOError:
        pass


def run_seed(base: Path, variant: str, seed: int) -> None:
    lab = Lab(base / f"seed{seed}", variant)
    lab.tmp.mkdir(parents=True)
    go = lab.tmp / "go"
    members = plan(seed, go)
    state = Path(lab.base["FAKE_CUDA_STATE"])
    try:
        for i, m in enumerate(members):
            with open(lab.tmp / f"err{i}", "wb") as err:
                m.proc = subprocess.Popen(lab.command(*m.words, api=m.api), env=lab.env(**ENV, **m.env),
                                          stdout=subprocess.PIPE, stderr=err)
            assert m.proc.stdout is not None
            os.set_blocking(m.proc.stdout.fileno(), False)
            lab.procs.append(m.proc)  # type: ignore[arg-type]
        go.touch()
        start, over = time.monotonic(), []
        while any(m.returncode is None for m in members):
            assert time.monotonic() - start < 120, [m.describe() for m in members]
            held = held_by_live(state, members)
            allowed = 0
            for m in members:
                assert m.proc is not None
                before = m.printed
                drain(m)
                m.printed = m.out.count(b"\n")
                if m.proc.pid not in held:
                    continue
                if m.printed >= len(m.names):  # returned from main: its exit gives back early
                    allowed += held[m.proc.pid]
                else:  # a command in flight when the state was read made a context
                    allowed += max((MAKES_CONTEXT.get(n, 0) for n in m.names[before:m.printed + 1]),
                                   default=0)
            total = sum(held.values())
            if total > CAP + allowed:  # confirmed by a second reading: one read of the file
                # while processes write it can see one's free after another's allocation in
                # the same bytes (a 4 MiB excess once in 200 seeds, not seen again)
                total = min(total, sum(held_by_live(state, members).values()))
            if total > CAP + allowed:
                over.append((round(time.monotonic() - start, 4), total >> 20, allowed >> 20,
                             {pid: b >> 20 for pid, b in held.items()}))
            now = time.monotonic() - start
            for m in members:
                assert m.proc is not None
                if m.kill_at is not None and not m.killed and now >= m.kill_at and m.proc.poll() is None:
                    m.proc.send_signal(signal.SIGKILL)
                    m.killed = True
                if m.returncode is None and m.proc.poll() is not None:
                    drain(m)
                    m.returncode = m.proc.returncode
            time.sleep(0.002)
        context = f"seed {seed}:\n" + "\n".join(
            f"  pid {m.proc.pid if m.proc else '-'} rc {m.returncode}: {m.describe()}"
            for m in members)
        for i, m in enumerate(members):
            stderr = (lab.tmp / f"err{i}").read_text(errors="replace")
            lab.check_sanitizers(stderr)
            ok = {0, -signal.SIGKILL} if m.killed else {0}
            assert m.returncode in ok, (context, i, stderr[-3000:])
            if not m.killed:  # every command ran, in order, each printing its line
                lines = [ln.split()[0] for ln in m.out.decode().splitlines() if ln.strip()]
                assert lines == [n for n in m.names if n != "exit"], (context, i)
        assert not over, (context, over[:20])
        # a process that returned from main has left its slot; the others are reclaimed
        # (no region yet where every process was killed before its first CUDA call)
        left = {p.pid for p in lab.region().processes} if lab.region_path.exists() else set()
        ended = {m.proc.pid for m in members if m.proc and not m.killed and m.ending != "_exit"}
        assert not left & ended, (context, left, ended)
        sweeper = lab.run("init", "ctx", "0", "meminfo", **ENV)
        assert sweeper.returncode == 0, sweeper.stderr
        free, total = sweeper.values("meminfo")
        assert total == CAP and free == CAP - CTX, (context, free >> 20, lab.region())
        region = lab.region()
        assert region.devices[0].used_bytes == 0 and region.processes == (), (context, region)
    finally:
        lab.cleanup()


def seeds_from_env() -> list[int]:
    spec = os.environ.get("GPUSLICE_MP_FUZZ_SEEDS", "")
    if not spec:
        return []
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last))) if last else list(range(int(first)))


@pytest.mark.parametrize("seed", range(3))
def test_processes_of_one_container_running_random_sequences_at_once(lab, tmp_path, seed):
    run_seed(tmp_path, lab.variant, seed if lab.variant == "release" else 100 + seed)


@pytest.mark.skipif(not seeds_from_env(), reason="GPUSLICE_MP_FUZZ_SEEDS not set")
def test_many_seeds(release_lab, tmp_path):
    failures = []
    for seed in seeds_from_env():
        try:
            run_seed(tmp_path, "release", seed)
        except AssertionError as e:
            failures.append(f"{seed}: {str(e)[:3000]}")
    assert not failures, "\n\n".join(failures)
