"""Every hooked function with hostile arguments, and every charging hook with its driver call failing.

``tests/hooksweep.c`` calls each function of ``hooks.h``'s table in one process with NULL
pointers, zeroed structures, NULL handles, zero, huge and overflowing sizes and counts: no call
may crash or trip a sanitizer, and none that fails may move the process's charge.  Then the
hooks that charge (allocations, contexts, code, limits, graphs, VMM handles) and those that
give a charge back run with valid arguments while the fake driver fails the call: the charge
must be what it was before, and the later successful free must give back exactly once.
"""

from __future__ import annotations

import random

import pytest

UUID_A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
UUID_B = "GPU-bbbbbbbb-0000-1111-2222-333333333333"
GIB = 1 << 30
MIB = 1 << 20

CAP = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "FAKE_WAIT_MS": "0"}


def sweep(lab, *args: str, **extra: str) -> list[str]:
    proc = lab.run_program([str(lab.build / "tests" / "hooksweep"), *args], timeout=120,
                           **CAP, **extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("done "), lines[-3:]
    return lines


SWEEPS = {
    "far": ([], {}),
    # near the cap (a 64 MiB context and 1000 MB allocated under 1 GiB) the hooks measure and
    # reserve before the driver's call, and refuse: those paths too
    "near_cap": (["--fill", "1000000000"], {}),
    # with a compute limit launches, copies and synchronisations take the throttle's paths; no
    # structure of 0xff there (its garbage stream handles reach the driver, as they would)
    "throttled": (["--fill", "1000000000", "--no-ones"], {"CUDA_DEVICE_SM_LIMIT": "30"}),
    # no context current (cuInit only): the hooks that look for the current context's device
    "no_context": (["--bare", "1"], {}),
    "no_context_throttled": (["--bare", "1", "--no-ones"], {"CUDA_DEVICE_SM_LIMIT": "30"}),
    # a second device: device 1 is a valid argument, whose charges count too
    "two_devices": (["--fill", "1000000000"], {"FAKE_CUDA_DEVICES": f"{UUID_A}=16g,{UUID_B}=16g"}),
}


@pytest.mark.parametrize("where", sorted(SWEEPS))
@pytest.mark.parametrize("fail", [False, True], ids=["hostile", "hostile_and_failing"])
def test_every_hook_survives_hostile_arguments_and_a_failure_charges_nothing(lab, fail, where):
    args, env = SWEEPS[where]
    lines = sweep(lab, *(["--fail"] if fail else []), *args, FAKE_CUDA_CTX_BYTES="64m", **env)
    calls, leaks, unbalanced = (int(v) for v in lines[-1].split()[1:])
    assert calls > 1000  # each of the ~250 hooks several times
    called = {ln.split()[1] for ln in lines if ln.startswith("call ")}
    assert {"cuImportExternalMemory", "cuDestroyExternalMemory", "cuMemAlloc_v2"} <= called
    assert leaks == 0, [ln for ln in lines if ln.startswith("LEAK")]
    # and every return path ended the in-flight operation it began (a raised count keeps the
    # reconcile from ever reading the driver clean)
    assert unbalanced == 0, [ln for ln in lines if ln.startswith("UNBALANCED")][:20]
    if fail:
        # the fake fails every call of the name: only hooks that answer before the driver
        # (or whose driver call has no failure point) may succeed, and none of them charges
        # (a primary context's reset gives back what the context held)
        for ln in lines:
            if ln.startswith("ret "):
                _, _name, _set, rc, before, after = ln.split()
                assert int(rc) != 0 or int(after) <= int(before), ln


def meminfo_free(res) -> list[int]:
    return [vals[0] for rc, vals in res.of("meminfo")]


CODE = {"FAKE_CUDA_MODULE_BYTES": "64m"}
# a context holds memory (the process is then in NVML's list before its green context)
GREEN = {"FAKE_CUDA_CTX_BYTES": "100m", "FAKE_CUDA_GREEN_BYTES": "50m"}

# name: (commands before, command that fails, FAKE_CUDA_FAIL, env)
CHARGING = {
    "alloc": ([], ["alloc", "100m"], "cuMemAlloc_v2:1", {}),
    "managed": ([], ["managed", "100m"], "cuMemAllocManaged:1", {}),
    "pitch": ([], ["pitch", "4096", "1024"], "cuMemAllocPitch_v2:1", {}),
    "async": ([], ["async", "100m"], "cuMemAllocAsync:1", {}),
    "pool": (["mkpool", "1", "0"], ["pool", "100m"], "cuMemAllocFromPoolAsync:1", {}),
    "vmm": ([], ["vmm", "100m", "0"], "cuMemCreate:1", {}),
    "vmap": (["vmm", "100m", "0"], ["vmap", "0"], "cuMemMap:1", {}),
    "vimport": (["vmm", "100m", "0", "vexport", "0"], ["vimport", "0"],
                "cuMemImportFromShareableHandle:1", {}),
    "vretain": (["vmm", "100m", "0", "vmap", "0"], ["vretain", "0"], "cuMemRetainAllocationHandle:1",
                {}),
    "array": ([], ["array", "1024", "1024"], "cuArrayCreate_v2:1", {}),
    "array3d": ([], ["array3d", "256", "256", "16"], "cuArray3DCreate_v2:1", {}),
    "mipmap": ([], ["mipmap", "1024", "1024", "4"], "cuMipmappedArrayCreate:1", {}),
    "ctxcreate": ([], ["ctxcreate", "0"], "cuCtxCreate:1", {"FAKE_CUDA_CTX_BYTES": "100m"}),
    "green": ([], ["green", "0"], "cuGreenCtxCreate:1", GREEN),
    "setlimit": ([], ["setlimit", "2", "64m"], "cuCtxSetLimit:1", {}),
    "modload": ([], ["modload"], "cuModuleLoadData:1", CODE),
    "libload": ([], ["libload"], "cuLibraryLoadData:1", CODE),
    "getfunc": (["modload"], ["getfunc"], "cuModuleGetFunction:1", CODE),
    "funcload": (["modload", "getfunc"], ["funcload"], "cuFuncLoad:1", CODE),
    "libmodule": (["libload"], ["libmodule"], "cuLibraryGetModule:1", CODE),
    "libglobal": (["libload"], ["libglobal"], "cuLibraryGetGlobal:1", CODE),
    "defpool": ([], ["defpool", "1", "1"], "cuMemGetDefaultMemPool:1", {}),
    "ginst": (["gnode", "300m", "0"], ["ginst", "flags"], "cuGraphInstantiate:1", {}),
    "ginstupload": (["gnode", "300m", "0"], ["ginst", "upload"], "cuGraphInstantiate:1", {}),
    # a VMM allocation's exported descriptor imported as external memory
    "eimport": (["vmm", "100m", "0", "vexport", "0"], ["eimport", "0"], "cuImportExternalMemory:1", {}),
}


@pytest.mark.parametrize("case", sorted(CHARGING))
def test_a_charging_hook_whose_driver_call_fails_leaves_the_charge_as_it_was(lab, case):
    before, cmd, fail, env = CHARGING[case]
    res = lab.run("init", "ctx", "0", *before, "meminfo", *cmd, "meminfo", **CAP,
                  FAKE_CUDA_FAIL=f"{fail}:999", **env)
    assert res.returncode == 0, res.stderr
    assert res.rc(cmd[0], len(res.of(cmd[0])) - 1) == 999, res.stdout
    assert len(set(meminfo_free(res))) == 1, res.stdout
    assert meminfo_free(res)[0] <= GIB


# name: (commands making it, command that gives it back, FAKE_CUDA_FAIL, env)
RELEASING = {
    "free": (["alloc", "100m"], ["free", "0"], "cuMemFree_v2:1", {}),
    "freeasync": (["async", "100m"], ["free", "0", "trimdefault", "0"], "cuMemFreeAsync:1", {}),
    "array": (["array", "1024", "1024"], ["free", "0"], "cuArrayDestroy:1", {}),
    "mipmap": (["mipmap", "1024", "1024", "4"], ["free", "0"], "cuMipmappedArrayDestroy:1", {}),
    "vmm": (["vmm", "100m", "0"], ["free", "0"], "cuMemRelease:1", {}),
    "vunmap": (["vmm", "100m", "0", "vmap", "0", "free", "0"], ["vunmap", "0"], "cuMemUnmap:1", {}),
    "ctxdestroy": (["ctxcreate", "0", "ctx", "0"], ["ctxdestroy", "0"], "cuCtxDestroy_v2:1",
                   {"FAKE_CUDA_CTX_BYTES": "100m"}),
    "greendestroy": (["green", "0"], ["greendestroy"], "cuGreenCtxDestroy:1", GREEN),
    # the external memory object keeps the VMM allocation's memory after its handle's release
    "eimport": (["vmm", "100m", "0", "vexport", "0", "eimport", "0", "free", "0"], ["free", "1"],
                "cuDestroyExternalMemory:1", {}),
}


@pytest.mark.parametrize("case", sorted(RELEASING))
def test_a_free_that_fails_keeps_the_charge_and_the_retry_returns_it_once(lab, case):
    make, give, fail, env = RELEASING[case]
    res = lab.run("init", "ctx", "0", "meminfo", *make, "meminfo", *give, "meminfo", *give,
                  "sync", "meminfo", *give, "sync", "meminfo", **CAP, FAKE_CUDA_FAIL=f"{fail}:999",
                  **env)
    assert res.returncode == 0, res.stderr
    rcs = [rc for rc, _ in res.of(give[0])][-3:]  # failed, done, refused (gone)
    assert rcs[0] == 999 and rcs[1] == 0 and rcs[2] != 0, res.stdout
    empty, made, failed, freed, again = meminfo_free(res)
    assert made < empty, res.stdout
    assert failed == made and freed == empty and again == empty, res.stdout
    assert lab.used() <= 2 * MIB


@pytest.mark.parametrize("near", [False, True], ids=["far", "near_cap"])
def test_every_free_on_every_kind_of_allocation_returns_the_charge_once(lab, near):
    # each kind of allocation (plain, managed, pitched, stream-ordered, a VMM handle, a VMM
    # mapping whose handle went, an array, a mipmapped array) given to every other kind's free
    # (refused, nothing returned), then to its own (returned), then to its own again (refused,
    # nothing returned twice)
    proc = lab.run_program([str(lab.build / "tests" / "hooksweep"), "--pairs",
                            *(["--fill", "850000000"] if near else [])],
                           timeout=120, FAKE_CUDA_CTX_BYTES="64m", **CAP)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, [ln for ln in lines if ln.startswith(("BAD", "made"))]
    assert lines[-1] == "pairs 0"
    assert sum(ln.startswith("freed ") for ln in lines) == 8


# ---- random sequences ----------------------------------------------------------------------

# what the fake driver can fail (FAKE_CUDA_FAIL), but cuDevicePrimaryCtxRelease: the fake's
# cuGreenCtxDestroy frees the green context before its release of the primary context fails,
# and returns that failure, which no driver does
SEQ_FAILABLE = [
    "cuMemAlloc_v2", "cuMemAllocManaged", "cuMemAllocPitch_v2", "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync", "cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease", "cuMemFree_v2",
    "cuMemFreeAsync", "cuArrayCreate_v2", "cuArrayDestroy", "cuMipmappedArrayCreate",
    "cuMipmappedArrayDestroy", "cuCtxCreate", "cuCtxDestroy_v2", "cuGreenCtxCreate",
    "cuGreenCtxDestroy", "cuCtxSetLimit", "cuMemPoolDestroy", "cuMemPoolGetAttribute",
    "cuDeviceGetMemPool", "cuGraphInstantiate", "cuGraphExecDestroy", "cuMemRetainAllocationHandle",
    "cuMemImportFromShareableHandle", "cuMemExportToShareableHandle", "cuEventRecord", "cuEventQuery",
    "cuCtxSynchronize", "cuModuleLoadData", "cuLibraryLoadData", "cuModuleGetFunction",
    "cuLibraryGetModule", "cuLibraryGetGlobal", "cuFuncLoad", "cuModuleUnload", "cuLibraryUnload",
    "cuStreamDestroy_v2", "cuLaunchKernel", "cuModuleGetLoadingMode", "cuImportExternalMemory",
    "cuDestroyExternalMemory",
]
SEQ_KNOBS = ("FAKE_CUDA_ADDR_REUSE", "FAKE_CUDA_HANDLE_REUSE", "FAKE_CUDA_POOL_PENDING",
             "FAKE_CUDA_SMALL_PAGES", "FAKE_CUDA_POOL_RELEASE")


def random_steps(rng: random.Random) -> tuple[list[list[str]], dict[str, str]]:
    """gsprobe commands: allocations of every kind, frees (right, wrong, twice), VMM maps,
    imports (as VMM handles and as external memory) and retains, contexts, green contexts, limits, pools, graphs, code loads and lookups,
    streams, resets; then everything freed and the primary context reset.  In steps (each a
    command or a few that go together, with their arguments), as test_multiprocess_fuzz.py
    cuts and spaces them."""
    steps = [["init"], ["ctx", "0"]]
    kinds: list[str] = []
    loaded = {"mod": False, "lib": False}  # the fake does not check a second unload
    simple = ["vretain", "vexport", "vmap", "vunmap", "free", "freesync"]
    plain = ["sync", "glaunch", "gdestroy", "gtrim", "pooldestroy", "greendestroy", "getfunc",
             "libkernel", "libglobal", "funcload", "launchfn"]
    for _ in range(rng.randint(5, 25)):
        size = rng.choice(["1m", "64m", "200m", "300m", "500m"])
        c = rng.choice(["alloc", "managed", "async", "pool", "pitch", "vmm", "array", "mipmap", "vimport",
                        "eimport", "ctxcreate", "ctxdestroy", "setlimit", "trim", "trimdefault", "gnode", "ginst",
                        "mkpool", "reset", "release", "modload", "modunload", "libload", "libunload",
                        "libmodule", "launchk", "sdestroy", "ssync", "slaunch", "sfree", "green", *simple,
                        *plain])
        if c in ("alloc", "managed", "async", "pool"):
            steps.append([c, size])
            kinds.append(c)
        elif c == "pitch":
            steps.append(["pitch", "16384", "8192"])
            kinds.append(c)
        elif c == "vmm":
            steps.append(["vmm", size, "0"])
            kinds.append(c)
        elif c == "array":
            steps.append(["array", "4096", "4096"])
            kinds.append(c)
        elif c == "mipmap":
            steps.append(["mipmap", "4096", "4096", "3"])
            kinds.append(c)
        elif c in simple or c in ("vimport", "eimport"):
            if kinds:
                steps.append([c, str(rng.randrange(len(kinds)))])
                if c in ("vimport", "eimport"):
                    kinds.append(c)
        elif c == "sfree":
            if kinds:
                steps.append([c, str(rng.randrange(len(kinds))), str(rng.randrange(3))])
        elif c == "green":
            steps.append([c, "0"])
        elif c in ("ctxcreate", "reset", "release"):
            steps.append([c, "0", "ctx", "0"])
        elif c == "ctxdestroy":
            steps.append([c, "0"])
        elif c == "setlimit":
            steps.append([c, rng.choice(["1", "2"]), rng.choice(["8m", "100m", "300m"])])
        elif c in ("trim", "trimdefault"):
            steps.append([c, "0"])
        elif c == "gnode":
            steps.append([c, size, "0"])
        elif c == "ginst":
            steps.append([c, rng.choice(["flags", "upload"])])
        elif c == "mkpool":
            steps.append([c, "1", "0"])
        elif c in ("modload", "libload"):
            steps.append([c])
            loaded["mod" if c == "modload" else "lib"] = True
        elif c == "libmodule":  # the module is the library's: not to be unloaded
            steps.append([c])
            loaded["mod"] = False
        elif c in ("modunload", "libunload"):
            key = "mod" if c == "modunload" else "lib"
            if loaded[key]:
                steps.append([c])
                loaded[key] = False
        elif c == "launchk":
            steps.append([c, str(rng.randrange(4))])
        elif c in ("sdestroy", "ssync"):
            steps.append([c, str(rng.randrange(3))])
        elif c == "slaunch":
            steps.append([c, str(rng.randrange(3)), "2"])
        else:
            steps.append([c])
        if rng.random() < 0.3:
            steps.append(["meminfo", "phys"])
    for i, kind in enumerate(kinds):
        steps.append((["vunmap", str(i)] if kind in ("vmm", "vimport") else []) + ["free", str(i)])
    steps.append(["modunload"] * loaded["mod"] + ["libunload"] * loaded["lib"])
    steps.append(["gdestroy", "pooldestroy", "greendestroy", "ctxdestroy", "0", "sync", "trimdefault", "0",
                  "gtrim", "reset", "0", "ctx", "0", "sync"])
    env = {k: "1" for k in SEQ_KNOBS if rng.random() < 0.3}
    if rng.random() < 0.7:
        env["FAKE_CUDA_FAIL"] = ",".join(
            f"{rng.choice(SEQ_FAILABLE)}:{rng.randint(1, 3)}:{rng.choice([2, 999])}"
            for _ in range(rng.randint(1, 3)))
    return [step for step in steps if step], env


def random_sequence(rng: random.Random) -> tuple[list[str], dict[str, str]]:
    """:func:`random_steps` as one command line."""
    steps, env = random_steps(rng)
    return [word for step in steps for word in step], env


def charged_and_held(res) -> tuple[int, int]:
    rc, vals = res.of("meminfo")[-1]
    assert rc == 0, res.stdout
    return GIB - vals[0], res.of("phys")[-1][1][0]


@pytest.mark.parametrize("block", range(4))
def test_random_sequences_end_with_the_charge_what_the_driver_holds(lab, block):
    # once everything is freed, unloaded and destroyed and the primary context reset, the charge
    # is the new context's, what the driver holds (after a sampler period where they differ:
    # memory a pool gives back at a synchronisation is uncharged by the sampler).  Found a second
    # destroy of a pool whose allocation was outstanding keeping its charge for good
    # (test_memory.py -k destroyed_again)
    seeds = range(block * 50, block * 50 + (50 if lab.variant == "release" else 12))
    env0 = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "FAKE_WAIT_MS": "0", "FAKE_CUDA_CTX_BYTES": "64m",
            "FAKE_CUDA_GREEN_BYTES": "16m", "FAKE_CUDA_MODULE_BYTES": "8m", "FAKE_CUDA_LAUNCH_BYTES": "4m"}
    for seed in seeds:
        cmds, env = random_sequence(random.Random(seed))
        res = lab.run(*cmds, "meminfo", "phys", "balanced", **env0, **env)
        assert res.returncode == 0, (seed, res.stderr[-2000:])
        # every hook of the sequence ended the in-flight operation it began
        assert res.of("balanced") == [(0, [0, 0])], (seed, env, " ".join(cmds))
        charged, held = charged_and_held(res)
        if charged != held:
            res = lab.run(*cmds, "sleep", "1500", "meminfo", "phys", **env0, **env)
            charged, held = charged_and_held(res)
        assert charged == held, (seed, env, " ".join(cmds), charged >> 20, held >> 20)
