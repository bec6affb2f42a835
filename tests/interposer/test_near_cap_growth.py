"""Growth no allocation hook charges exactly, near the cap: small allocations and code loads.

The fake driver here serves allocations of at most 1 MiB from 2 MiB pages the process's small
allocations share (``FAKE_CUDA_SMALL_PAGES=1``: its figure grows by a whole page when one needs
a new page, while the library charges the allocation at 512-byte granularity) and takes
``FAKE_CUDA_MODULE_BYTES`` at each module or library load. On an H200 (driver 580, 10 GiB cap)
a JAX fill (XLA's platform allocator: a cuMemAlloc per array, chunks of 256, 64, 16, 4 and
1 MiB until each is refused, a new executable compiled for each size, and 1-byte allocations)
was seen from outside at 10,242 MiB, 2 MiB over the cap. Near the cap the library now admits a
small allocation only if the headroom covers a whole page, and a code load only if it covers
one 2 MiB chunk; far from it nothing changes.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest

MIB = 1 << 20
GIB = 1 << 30
OOM = 2
CAP = GIB
ENV = {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "FAKE_CUDA_CTX_BYTES": "100m",
       "FAKE_CUDA_SMALL_PAGES": "1", "FAKE_CUDA_MODULE_BYTES": "2m"}


def compile_then(size: str) -> tuple[str, ...]:
    """XLA's pattern: an executable compiled (loaded, its function looked up) for a new size,
    then arrays of that size until one is refused."""
    return ("modload", "getfunc", "fill", size)


# A JAX-like fill of the cap, then 1-byte arrays until refused.
JAX = ("init", "ctx", "0", *compile_then("256m"), *compile_then("64m"), *compile_then("16m"),
       *compile_then("4m"), *compile_then("1m"), *compile_then("1"))

# The fake driver's shared state: per process, pid (int32), pad, used[8] (uint64), kernel_ns.
PROC = struct.Struct("<ii8QQ")


def physical(state, pid: int) -> int:
    """What the fake driver (and so its NVML) holds for `pid` on device 0; 0 if not listed."""
    try:
        data = state.read_bytes()
    except FileNotFoundError:
        return 0
    for off in range(0, min(len(data), 256 * PROC.size) - PROC.size + 1, PROC.size):
        fields = PROC.unpack_from(data, off)
        if fields[0] == pid:
            return fields[2]
    return 0


def watched(lab, *cmds: str, api: str = "direct", **env: str):
    """Run the probe while a watcher samples its per-process figure from outside; returns the
    result, the largest figure seen, the figure and the region's charge once it has done
    ``cmds`` (it holds its memory until then)."""
    proc = lab.start(*cmds, "phys", "touch", str(lab.tmp / "held"), "waitfile",
                     str(lab.tmp / "go"), api=api, **env)
    state = lab.tmp / "fakestate"
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], physical(state, proc.pid))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        lab.wait_for(lab.tmp / "held")
    finally:
        done.set()
        watcher.join()
    final = physical(state, proc.pid)
    peak[0] = max(peak[0], final)
    region = lab.used()
    (lab.tmp / "go").touch()
    return lab.finish(proc), peak[0], final, region


def granted(res, size_nth: int) -> int:
    return res.of("fill")[size_nth][1][0]


@pytest.mark.parametrize("ctx", ["100m", "101m"], ids=["even-ctx", "odd-ctx"])
def test_a_jax_like_fill_stays_within_the_cap_seen_from_outside(lab, ctx):
    res, peak, final, region = watched(lab, *JAX, **{**ENV, "FAKE_CUDA_CTX_BYTES": ctx})
    assert res.returncode == 0, res.stdout + res.stderr
    # every size was filled until refused, the 1-byte arrays too
    assert [rc for rc, _ in res.of("fill")] == [OOM] * 6, res.stdout
    # before, the last two loads went through at the cap: seen from outside the process held
    # 1,028 MiB under the 1,024 MiB cap (the region said 1,028); with a 101 MiB context, 1,027
    # (a 1 MiB array alone in its page too), while the region said 1,025
    assert peak <= CAP, (peak, final, region, res.stdout)
    assert final <= CAP
    assert region <= CAP
    # and small allocations still fill to within a page of the cap
    assert final > CAP - 2 * MIB, (final, region)


def test_small_allocations_fill_to_within_a_page_of_the_cap(lab):
    # no code loads: 1 MiB chunks, two to a page, then 4 KiB ones, after a 101 MiB context.
    # Before, the last 1 MiB array took a page of its own: 1,025 MiB seen from outside while the
    # region said 1,024
    res, peak, final, region = watched(lab, "init", "ctx", "0", "fill", "256m", "fill", "1m",
                                       "fill", "4k", **{**ENV, "FAKE_CUDA_CTX_BYTES": "101m"})
    assert [rc for rc, _ in res.of("fill")] == [OOM] * 3, res.stdout
    assert peak <= CAP, (peak, final, region)
    # 1,023 MiB seen from outside (153 arrays of 1 MiB, in 77 pages); the region misses only
    # the half page the process holds uncharged
    assert CAP - 2 * MIB < final <= CAP, (final, region)
    assert final - 2 * MIB < region <= final


@pytest.mark.parametrize("big", [["alloc", "922m"], ["vmm", "922m", "0"], ["pitch", "922m", "1"]],
                         ids=["alloc", "vmm", "pitch"])
def test_a_large_allocation_beside_uncharged_small_pages_stays_within_the_cap(lab, big):
    # a 4 KiB array takes a 2 MiB page (charged 4 KiB: the rest is under the reconcile's
    # noise threshold), then 922 MiB beside a 101 MiB context: the charge fits (1,023 MiB),
    # the process would hold 1,025.  The near-cap admission counted what the process holds
    # uncharged for small allocations and loads only: 1,025 MiB held under the 1,024 MiB cap
    res = lab.run("init", "ctx", "0", "alloc", "4k", big[0], *big[1:], "phys",
                  **{**ENV, "FAKE_CUDA_CTX_BYTES": "101m"})
    assert res.rc(big[0], 1 if big[0] == "alloc" else 0) == OOM, res.stdout
    assert res.values("phys")[0] <= CAP


@pytest.mark.parametrize("rows", [["235521", "4087"], ["1", "944128"]], ids=["near", "far_estimate"])
def test_a_pitch_wider_than_reserved_beside_uncharged_small_pages_stays_within_the_cap(lab, rows):
    # as above, with a driver whose pitch is 1 KiB-aligned: reserved at 512-byte alignment, the
    # rows take 920 MiB (235,521 bytes by 4,087: near the cap, it fits on top of the 4 KiB
    # array's page), or 461 MiB (1 byte by 944,128: far from the cap); the driver's pitch takes
    # 922 MiB, and the difference was reserved against the cap alone, not on top of what the
    # process holds uncharged: 1,025 MiB held under the 1,024 MiB cap
    res = lab.run("init", "ctx", "0", "alloc", "4k", "pitch", *rows, "phys",
                  **{**ENV, "FAKE_CUDA_CTX_BYTES": "101m", "FAKE_CUDA_PITCH_ALIGN": "1024"})
    assert res.rc("pitch") == OOM, res.stdout
    assert res.values("phys")[0] <= CAP
    # with room for it, the same pitch is admitted at the driver's figure
    res = lab.run("init", "ctx", "0", "alloc", "4k", "pitch", *rows, "phys",
                  **{**ENV, "FAKE_CUDA_CTX_BYTES": "99m", "FAKE_CUDA_PITCH_ALIGN": "1024"})
    assert res.rc("pitch") == 0, res.stdout
    assert 99 * MIB + 921 * MIB < res.values("phys")[0] <= CAP


@pytest.mark.parametrize(("cmd", "env"), [("async", {}), ("pool", {}),
                                          ("async", {"FAKE_CUDA_FAIL": "cuDeviceGetMemPool:0:999"})],
                         ids=["async", "from_pool", "pool_unknown"])
def test_a_pool_growing_beside_uncharged_small_pages_stays_within_the_cap(lab, cmd, env):
    # as above for a stream-ordered pool, which grows by whole 32 MiB chunks: a 4 KiB array's
    # 2 MiB page (charged 4 KiB) beside a 127 MiB context, then an 896 MiB allocation from a
    # pool (the stream's device's current one, a pool of the program's, or one the library
    # cannot ask for, charged as a plain allocation): its chunks fit the charge (1,023 MiB),
    # the process would hold 1,025.  Its growth was reserved against the cap alone: 1,025 MiB
    # held under the 1,024 MiB cap
    res = lab.run("init", "ctx", "0", "alloc", "4k", cmd, "896m", "phys",
                  **{**ENV, "FAKE_CUDA_CTX_BYTES": "127m", **env})
    assert res.rc(cmd) == OOM, res.stdout
    assert res.values("phys")[0] <= CAP


def test_a_load_past_the_headroom_is_refused_and_the_program_goes_on(lab):
    # 100 MiB context + 922 MiB: 2 MiB left, then a 1 MiB array takes a page of its own (1 MiB
    # left in the library's view, none in the driver's): a 2 MiB load cannot fit.  Before, it
    # went through: 1,026 MiB held under the 1,024 MiB cap
    for name in ("modload", "libload"):
        res = lab.run("init", "ctx", "0", "alloc", "922m", "alloc", "1m", name, "phys",
                      "free", "0", "alloc", "1k", name, "phys", **ENV)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.rc("alloc", 1) == 0
        assert res.rc(name, 0) == OOM, res.stdout
        phys = [vals[0] for _, vals in res.of("phys")]
        assert phys[0] == 100 * MIB + 922 * MIB + 2 * MIB  # nothing taken by the refused load
        # the program goes on: once room is made, it allocates and the same load is admitted
        assert res.rc("free") == 0
        assert res.rc("alloc", 2) == 0
        assert res.rc(name, 1) == 0, res.stdout
        assert phys[1] == 100 * MIB + 2 * MIB + 2 * MIB


def test_a_function_lookup_past_the_headroom_is_refused(lab):
    res = lab.run("init", "ctx", "0", "modload", "alloc", "920m", "alloc", "1m", "getfunc",
                  "phys", **{**ENV, "FAKE_CUDA_MODULE_BYTES": "2m"})
    assert res.rc("modload") == 0
    assert res.rc("getfunc") == OOM, res.stdout


def test_far_from_the_cap_nothing_changes(lab):
    # small allocations and loads far from the cap make no NVML query (the fast path), and
    # are charged what they were before: 512-byte granularity, code after the load
    res = lab.run("init", "ctx", "0", "nvmlqueries", *(["alloc", "1k"] * 20), "alloc", "1",
                  "nvmlqueries", "modload", "getfunc", "meminfo", **ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(rc == 0 for rc, _ in res.of("alloc"))
    assert res.rc("modload") == 0 and res.rc("getfunc") == 0
    before, after = (vals[0] for _, vals in res.of("nvmlqueries"))
    assert after == before
    free, total = res.values("meminfo")
    # the context and 21 allocations of 512 B and 1 KiB; the module's 2 MiB is left to the
    # sampler far from the cap
    assert total - free == 100 * MIB + 20 * 1024 + 512


def test_a_repeated_lookup_passes_straight_through_even_at_the_cap(lab):
    # launchers that ask for a kernel's function before every launch (TVM-FFI's cubin launcher
    # calls cuKernelGetFunction each time): only a function's first lookup in a context can
    # load its code.  Admitted like a first one, each repeat made an NVML query within 256 MiB
    # of the cap and was refused within a chunk of it (every launch failing), and woke the
    # sampler far from it
    res = lab.run("init", "ctx", "0", "modload", "getfunc", "libload", "libkernel",
                  "alloc", "918m", "alloc", "1m", "nvmlqueries", *(["getfunc", "libkernel"] * 20),
                  "nvmlqueries", **{**ENV, "FAKE_CUDA_MODULE_BYTES": "2m"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert [rc for rc, _ in res.of("getfunc")] == [0] * 21
    assert [rc for rc, _ in res.of("libkernel")] == [0] * 21
    before, after = (vals[0] for _, vals in res.of("nvmlqueries"))
    assert after == before, f"{after - before} NVML queries for 40 repeated lookups"


@pytest.mark.parametrize("load,unload,lookup", [("modload", "modunload", "getfunc"),
                                                ("libload", "libunload", "libkernel")])
def test_a_lookup_in_a_module_loaded_again_at_an_unloaded_ones_handle_is_admitted(lab, load, unload, lookup):
    # the driver hands a new module (or library) an unloaded one's handle (its object's
    # address); unloads are not hooked, so the lookups seen stayed in the table and the new
    # module's first lookup passed as a repeat: at the cap (the same figures as
    # test_a_function_lookup_past_the_headroom_is_refused) it got 0, not OOM, and loaded its
    # code unadmitted.  Now each load gives the handle a new generation the lookup keys hold
    res = lab.run("init", "ctx", "0", load, lookup, unload, load, "alloc", "920m", "alloc", "1m",
                  lookup, **{**ENV, "FAKE_CUDA_HANDLE_REUSE": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc(unload) == 0 and [rc for rc, _ in res.of(load)] == [0, 0]
    assert res.rc("alloc", 1) == 0
    assert [rc for rc, _ in res.of(lookup)] == [0, OOM], res.stdout


@pytest.mark.parametrize("api", ["direct", "procaddr"])
@pytest.mark.parametrize("load,lookup", [("modload", "getfunc"), ("libload", "libkernel")])
def test_a_function_loaded_with_cufuncload_past_the_headroom_is_refused(lab, load, lookup, api):
    # cuFuncLoad (CUDA 12.4) finalizes a lazily loaded function's loading: its code is loaded
    # then, as at its first launch.  Looked up far from the cap (nothing loaded yet), then
    # loaded within a chunk of it: 100 MiB context + 2 MiB module + 920 MiB + a 1 MiB array's
    # page leave no room for a 2 MiB function.  Before, it was not hooked: 1,026 MiB held under
    # the 1,024 MiB cap.  (The fake's kernel's function is the kernel's handle: the load is not
    # taken for a repeat of cuKernelGetFunction.)
    res = lab.run("init", "ctx", "0", load, lookup, "alloc", "920m", "alloc", "1m",
                  "funcload", "phys", "funcload", "free", "0", "funcload", "phys", "funcload",
                  api=api, **{**ENV, "FAKE_CUDA_LAUNCH_BYTES": "2m"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc(lookup) == 0 and res.rc("alloc", 1) == 0
    phys = [vals[0] for _, vals in res.of("phys")]
    # refused, nothing loaded; again at once (not taken for a repeat of a load that failed)
    assert [rc for rc, _ in res.of("funcload")][:2] == [OOM, OOM], res.stdout
    assert phys[0] == 100 * MIB + 2 * MIB + 920 * MIB + 2 * MIB <= CAP
    # the program goes on: once room is made the function loads, and loading it again (no
    # effect, the driver says) passes straight through
    assert [rc for rc, _ in res.of("funcload")][2:] == [0, 0], res.stdout
    assert phys[1] == 100 * MIB + 2 * MIB + 2 * MIB + 2 * MIB


def test_cufuncload_of_a_function_of_a_module_loaded_again_at_an_unloaded_ones_handle_is_admitted(lab):
    # the reloaded module gets the unloaded one's handle, and its function the old function's:
    # its cuFuncLoad must not pass as a repeat of the old function's
    res = lab.run("init", "ctx", "0", "modload", "getfunc", "funcload", "modunload", "modload", "getfunc",
                  "alloc", "918m", "alloc", "1m", "funcload",
                  **{**ENV, "FAKE_CUDA_HANDLE_REUSE": "1", "FAKE_CUDA_LAUNCH_BYTES": "2m"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert [rc for rc, _ in res.of("getfunc")] == [0, 0] and res.rc("alloc", 1) == 0
    assert [rc for rc, _ in res.of("funcload")] == [0, OOM], res.stdout


@pytest.mark.parametrize("gone,again", [(["reset", "0"], ["ctx", "0"]), (["release", "0"], ["ctx", "0"]),
                                        (["ctxdestroy", "0"], ["ctxcreate", "0"])],
                         ids=["reset", "release", "destroyed"])
@pytest.mark.parametrize("need", ["libmodule", "libglobal"])
def test_a_library_needed_in_a_new_context_past_the_headroom_is_refused(lab, need, gone, again):
    # a library is loaded in a context when it is needed there: cuLibraryGetModule and
    # cuLibraryGetGlobal return the current context's module or global, so in a context made
    # after the load (the primary context retained again after a reset or its last release, a
    # created context at a destroyed one's handle) they load the library's code and globals.
    # 100 MiB context + 922 MiB + a 1 MiB array's page leave no room for the 2 MiB library.
    # Before, neither was hooked: 1,026 MiB held under the 1,024 MiB cap
    first = ["ctxcreate", "0"] if again[0] == "ctxcreate" else ["ctx", "0"]
    res = lab.run("init", *first, "libload", need, *gone, *again, "alloc", "922m", "alloc", "1m",
                  need, "phys", need, "free", "0", need, "phys", need, **ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc("alloc", 1) == 0
    rcs = [rc for rc, _ in res.of(need)]
    phys = [vals[0] for _, vals in res.of("phys")]
    assert rcs[:3] == [0, OOM, OOM], res.stdout
    assert phys[0] == 100 * MIB + 922 * MIB + 2 * MIB <= CAP
    # once room is made it is loaded, and asked for again it passes straight through
    assert rcs[3:] == [0, 0], res.stdout
    assert phys[1] == 100 * MIB + 2 * MIB + 2 * MIB


TWO_GPUS = {"FAKE_CUDA_DEVICES": "GPU-aaaaaaaa-0000-1111-2222-333333333333=16g,"
                                 "GPU-bbbbbbbb-0000-1111-2222-333333333333=16g"}


def test_an_eager_library_load_past_another_devices_headroom_is_refused(lab):
    # CUDA_MODULE_LOADING=EAGER: cuLibraryLoad* loads the library in every context at once,
    # each device's.  Device 1 is filled to its cap (100 MiB context + 922 MiB + a 1 MiB
    # array's page), then the library is loaded from device 0's context.  Before, only the
    # current device was admitted: device 1 held 1,026 MiB under its 1,024 MiB cap
    res = lab.run("init", "ctx", "1", "alloc", "922m", "alloc", "1m", "ctx", "0", "libload", "physd", "1",
                  "ctx", "1", "free", "0", "ctx", "0", "libload", "physd", "0", "physd", "1",
                  **{**ENV, **TWO_GPUS, "CUDA_MODULE_LOADING": "EAGER"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc("alloc", 1) == 0
    physd = [vals[0] for _, vals in res.of("physd")]
    assert [rc for rc, _ in res.of("libload")] == [OOM, 0], res.stdout
    assert physd[0] == 100 * MIB + 922 * MIB + 2 * MIB <= CAP
    # once room is made on device 1 it loads, in both devices' contexts
    assert physd[1:] == [100 * MIB + 2 * MIB, 100 * MIB + 2 * MIB + 2 * MIB]


def test_a_lazy_library_load_is_not_refused_for_another_devices_cap(lab):
    # lazily (the default) the library is loaded in a context only when needed there: a load
    # from device 0's context takes nothing on device 1, which is at its cap
    res = lab.run("init", "ctx", "1", "alloc", "922m", "alloc", "1m", "ctx", "0", "libload", "physd", "1",
                  **{**ENV, **TWO_GPUS})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc("libload") == 0, res.stdout
    assert res.values("physd")[0] == 100 * MIB + 922 * MIB + 2 * MIB


def test_a_lookup_in_a_reloaded_librarys_module_is_admitted(lab):
    # cuLibraryGetModule's module of a library loaded again at an unloaded one's handle may be
    # the old module's handle: a function's first lookup in it must not pass as a repeat of
    # one in the unloaded library's module (at the cap: 0, not OOM, its code loaded unadmitted)
    res = lab.run("init", "ctx", "0", "libload", "libmodule", "getfunc", "libunload", "libload", "libmodule",
                  "alloc", "920m", "alloc", "1m", "getfunc", **{**ENV, "FAKE_CUDA_HANDLE_REUSE": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert [rc for rc, _ in res.of("libload")] == [0, 0] and res.rc("libunload") == 0
    assert [rc for rc, _ in res.of("libmodule")] == [0, 0] and res.rc("alloc", 1) == 0
    assert [rc for rc, _ in res.of("getfunc")] == [0, OOM], res.stdout


# ---- loads whose code does not fit: undone ----------------------------------------------------
# A load is admitted near the cap against one 2 MiB chunk; what it really takes is known only
# once the driver has loaded it.  An 8 MiB module or library passed the cap by the rest: after
# 1,018 MiB (a 100 MiB context and 918 MiB), 1,026 MiB held under the 1,024 MiB cap (a fuzz run,
# test_hook_sweep.py's seed 3717, held 1,028).  Now a load the measurement after it finds past the
# cap is unloaded again and refused with CUDA_ERROR_OUT_OF_MEMORY, and its charge goes with it.

LOADS = {"modload": "modunload", "libload": "libunload"}
CODE8 = {**ENV, "FAKE_CUDA_SMALL_PAGES": None, "FAKE_CUDA_MODULE_BYTES": "8m"}


def charged(res, nth: int = 0) -> int:
    """The container's charge on device 0 as the capped view gives it (``meminfo``)."""
    free, total = res.values("meminfo", nth)
    return total - free


@pytest.mark.parametrize("api", ["direct", "procaddr"])
@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_load_that_overshoots_the_cap_is_undone_and_the_program_goes_on(lab, load, api):
    res = lab.run("init", "ctx", "0", "alloc", "918m", load, "meminfo", "phys", "alloc", "4m", "meminfo", "phys",
                  "free", "0", "free", "1", "alloc", "916m", load, "meminfo", "phys", "alloc", "1k",
                  api=api, **CODE8)
    assert res.returncode == 0, res.stdout + res.stderr
    phys = [vals[0] for _, vals in res.of("phys")]
    # refused, nothing left loaded, and nothing charged for it: before, 0 and 1,026 MiB held
    assert res.rc(load, 0) == OOM, res.stdout
    assert phys[0] == 100 * MIB + 918 * MIB <= CAP
    assert charged(res, 0) == phys[0]
    # the program goes on: what fits is still granted, to the last byte
    assert res.rc("alloc", 1) == 0
    assert phys[1] == charged(res, 1) == 1022 * MIB
    # and a load that fits the cap exactly stands (the 916 MiB allocation's room made)
    assert [rc for rc, _ in res.of("free")] == [0, 0]
    assert res.rc(load, 1) == 0, res.stdout
    assert phys[2] == charged(res, 2) == CAP
    assert res.rc("alloc", 3) == OOM


def paused(lab, before: list[str], after: list[str], **env: str | None):
    """Run the probe's ``before`` commands, read the region while it holds what they left, then
    its ``after`` commands; returns the result and the container's charge at the pause."""
    proc = lab.start(*before, "touch", str(lab.tmp / "paused"), "waitfile", str(lab.tmp / "go"), *after, **env)
    lab.wait_for(lab.tmp / "paused")
    region = lab.used()
    (lab.tmp / "go").touch()
    return lab.finish(proc), region


@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_load_that_overshoots_and_cannot_be_unloaded_stands_charged_what_the_driver_holds(lab, load):
    # the driver refuses the unload that would undo the load (its first unload call): the load
    # stands, the program keeps a handle it can unload, and the charge is what the driver holds
    # (past the cap: the next allocation is refused).  Unloaded by the program, the next load
    # that overshoots is undone (before, it stood too: 1,026 MiB held)
    unload = LOADS[load]
    res, region = paused(lab, ["init", "ctx", "0", "alloc", "918m", load, "phys"],
                         ["alloc", "1k", unload, load, "meminfo", "phys"],
                         **{**CODE8, "FAKE_CUDA_FAIL": f"cu{'Module' if load == 'modload' else 'Library'}Unload:1"})
    assert res.returncode == 0, res.stdout + res.stderr
    rcs = [rc for rc, _ in res.of(load)]
    phys = [vals[0] for _, vals in res.of("phys")]
    assert rcs[0] == 0 and phys[0] == 1026 * MIB
    assert region == phys[0], (region >> 20, phys[0] >> 20)
    assert res.rc("alloc", 1) == OOM
    assert res.rc(unload) == 0
    assert rcs[1] == OOM, res.stdout
    assert phys[1] == charged(res) == 1018 * MIB
    assert "could not be unloaded" in res.stderr


@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_load_that_overshoots_beside_an_allocation_in_the_driver_is_undone(lab, load):
    # another thread's 10 MiB is reserved and inside the driver (not taken yet) while 8 MiB are
    # loaded: a reading then sees the load's growth less those 10 MiB, nothing to charge, and the
    # load stood; once the allocation was made the process held 1,026 MiB under the 1,024 MiB cap.
    # The judgement takes its reading again once nothing is in flight (at most 100 ms)
    point = "cuMemAlloc_v2:2"  # the thread's allocation, the process's second
    res = lab.run("init", "ctx", "0", "alloc", "908m", "bgalloc", "10m", "0", "waitfile", str(lab.tmp / f"in-{point}"),
                  load, "meminfo", "phys", "join", "meminfo", "phys", **{**CODE8, **lab.held(point, ms=30)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc("bgalloc") == 0 and res.rc(load) == OOM, res.stdout
    phys = [vals[0] for _, vals in res.of("phys")]
    assert phys[1] == charged(res, 1) == 1018 * MIB


@pytest.mark.parametrize("load", sorted(LOADS))
def test_a_load_that_overshoots_while_another_process_allocates_is_undone(lab, load):
    # the container's other process takes the room (322 MiB beside 700) while this one's load is
    # inside the driver, begun 324 MiB from the cap (far: nothing reserved); the 8 MiB load then
    # took the container to 1,030 MiB under its 1,024 MiB cap
    point = "cuModuleLoadData" if load == "modload" else "cuLibraryLoadData"
    other = lab.start("init", "ctx", "0", "touch", str(lab.tmp / "other"), *lab.inside(point, "alloc", "322m"),
                      "waitfile", str(lab.tmp / "judged"), "phys", **CODE8)
    lab.wait_for(lab.tmp / "other")
    res = lab.run("init", "ctx", "0", "alloc", "500m", load, "meminfo", "phys", "touch", str(lab.tmp / "judged"),
                  **{**CODE8, **lab.held(point)})
    theirs = lab.finish(other)
    assert res.returncode == 0 and theirs.returncode == 0, res.stdout + res.stderr + theirs.stderr
    assert theirs.rc("alloc") == 0 and res.rc(load) == OOM, res.stdout
    ours = res.values("phys")[0]
    assert ours == 600 * MIB and ours + theirs.values("phys")[0] == 1022 * MIB
    assert charged(res) == 1022 * MIB


def test_an_eager_library_load_that_overshoots_another_devices_cap_is_undone(lab):
    # CUDA_MODULE_LOADING=EAGER: the library goes into every context at once.  Device 1 holds
    # 1,018 MiB (admitted: a chunk is left), the library's 8 MiB take it to 1,026 MiB under its
    # 1,024 MiB cap.  Undone, it leaves both devices; once room is made it loads in both
    res = lab.run("init", "ctx", "1", "alloc", "918m", "ctx", "0", "libload", "physd", "0", "physd", "1",
                  "ctx", "1", "meminfo", "alloc", "4m", "free", "1", "free", "0", "ctx", "0", "libload",
                  "physd", "0", "physd", "1", **{**CODE8, **TWO_GPUS, "CUDA_MODULE_LOADING": "EAGER"})
    assert res.returncode == 0, res.stdout + res.stderr
    physd = [vals[0] for _, vals in res.of("physd")]
    assert [rc for rc, _ in res.of("libload")] == [OOM, 0], res.stdout
    assert physd[:2] == [100 * MIB, 1018 * MIB]
    assert charged(res) == 1018 * MIB  # device 1's
    assert res.rc("alloc", 1) == 0
    assert physd[2:] == [108 * MIB, 108 * MIB]


# A kernel's local memory: the driver grows the context's stack at a launch that needs more per
# thread than the stack limit, for every thread the device runs at once, and keeps it (cuda.h on
# CU_LIMIT_STACK_SIZE).  On the fake, 262,144 threads: each KiB per thread is 256 MiB (264 MiB on
# an H100 or H200, 132 SMs x 2048 threads).  FAKE_CUDA_FUNC_LOCAL is every function's local size
# but the probe's default kernel's (``launch``: none).
STACK = {**ENV, "FAKE_CUDA_SMALL_PAGES": "0", "FAKE_CUDA_STACK_THREADS": "262144"}
LAUNCH_PATHS = [("direct", "plain"), ("direct", "ex"), ("direct", "coop"), ("direct", "grid"),
                ("procaddr", "plain"), ("procaddr", "ex"), ("procaddr", "coop"),
                ("ptsz", "plain"), ("ptsz", "ex"), ("ptsz", "coop")]


@pytest.mark.parametrize(("api", "how"), LAUNCH_PATHS, ids=[f"{a}-{h}" for a, h in LAUNCH_PATHS])
def test_a_launch_whose_stack_growth_does_not_fit_is_refused_and_the_program_goes_on(lab, api, how):
    # 100 MiB context + 700 MiB, 224 MiB left: a kernel needing 1 KiB per thread would make the
    # driver take 256 MiB more at its launch.  Before, it went through and was charged after the
    # fact: 1,056 MiB held under the 1,024 MiB cap
    res = lab.run("init", "ctx", "0", "alloc", "700m", "lmlaunch", how, "1", "phys", "getlimit", "0",
                  "launch", "1", "alloc", "100m", "phys", api=api, **{**STACK, "FAKE_CUDA_FUNC_LOCAL": "1k"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.rc("lmlaunch") == OOM, res.stdout
    phys = [vals[0] for _, vals in res.of("phys")]
    assert phys[0] == 800 * MIB  # nothing grew
    assert res.values("getlimit") == [0]
    # the program goes on: a launch that needs no more stack, a smaller allocation
    assert res.rc("launch") == 0
    assert res.rc("alloc", 1) == 0
    assert phys[1] == 900 * MIB


@pytest.mark.parametrize(("api", "how"), LAUNCH_PATHS, ids=[f"{a}-{h}" for a, h in LAUNCH_PATHS])
def test_a_launch_whose_stack_growth_fits_is_granted_charged_and_asked_once(lab, api, how):
    # 512 B per thread: 128 MiB, which fits the 224 MiB left; charged before the launch (through
    # cuCtxSetLimit's reservation), and the function's local size asked of the driver once: the
    # second launch makes no driver call of the judgement (before: none asked, the growth left
    # to the reconcile)
    res, peak, final, region = watched(lab, "init", "ctx", "0", "alloc", "700m", "lmlaunch", how, "1",
                                       "lmcalls", "lmlaunch", how, "1", "lmcalls", "getlimit", "0",
                                       api=api, **{**STACK, "FAKE_CUDA_FUNC_LOCAL": "512"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert [rc for rc, _ in res.of("lmlaunch")] == [0, 0], res.stdout
    first, second = (vals for _, vals in res.of("lmcalls"))
    assert first[1] == 1  # one local-size query
    assert second == first  # nothing asked again
    assert res.values("getlimit") == [512]
    assert final == peak == 928 * MIB
    assert region == final  # charged what the driver holds


def test_a_context_less_kernels_local_size_is_asked_with_cukernelgetattribute(lab):
    # a CUkernel passed as a CUfunction (cuLaunchKernel accepts one): where cuFuncGetAttribute
    # refuses the handle, cuKernelGetAttribute on the current device tells
    res = lab.run("init", "ctx", "0", "alloc", "700m", "lmlaunch", "plain", "1", "lmcalls", "phys",
                  **{**STACK, "FAKE_CUDA_FUNC_LOCAL": "1k", "FAKE_CUDA_FAIL": "cuFuncGetAttribute:0:400"})
    assert res.rc("lmlaunch") == OOM, res.stdout
    assert res.values("lmcalls")[1] == 2  # cuFuncGetAttribute refused, cuKernelGetAttribute answered
    assert res.values("phys") == [800 * MIB]


def test_far_from_the_cap_a_launchs_stack_growth_makes_no_driver_call_and_is_charged_after(lab):
    # 200 MiB held: no judgement (the launch hook stays a tail call), the driver grows the stack
    # by itself (256 MiB) and the sampler charges it
    proc = lab.start("init", "ctx", "0", "alloc", "100m", "lmcalls", "lmlaunch", "plain", "1", "lmcalls",
                     "phys", "touch", str(lab.tmp / "held"), "waitfile", str(lab.tmp / "go"),
                     **{**STACK, "FAKE_CUDA_FUNC_LOCAL": "1k"})
    try:
        lab.wait_for(lab.tmp / "held")
        deadline = time.monotonic() + 5
        while lab.used() != 456 * MIB and time.monotonic() < deadline:
            time.sleep(0.01)
        charged = lab.used()
    finally:
        (lab.tmp / "go").touch()
    res = lab.finish(proc)
    assert res.rc("lmlaunch") == 0, res.stdout
    before, after = (vals for _, vals in res.of("lmcalls"))
    assert after == before == [0, 0]
    assert res.values("phys") == [456 * MIB]
    assert charged == 456 * MIB
