"""CUDA graphs' memory allocation nodes: charged when the graph maps them, not when captured.

The fake driver's graphs (``interposer/tests/fake/fakegraph.h``) map the sum of their
allocation nodes (times FAKE_CUDA_GRAPH_SHARE %) into a per-device graph pool at upload or
launch, keep it until cuDeviceGraphMemTrim, and report the pool through
cuDeviceGetGraphMemAttribute, as the real driver does. ``phys`` prints what the fake driver
really holds for the process: the charge must follow it.
"""

from __future__ import annotations

import pytest

GIB = 1 << 30
MIB = 1 << 20
OOM = 2
CAP = {"CUDA_DEVICE_MEMORY_LIMIT": "1g"}


def free_seen(res) -> list[int]:
    return [vals[0] for _, vals in res.of("meminfo")]


def phys(res) -> list[int]:
    return [vals[0] for _, vals in res.of("phys")]


def test_capturing_an_allocation_takes_no_budget(lab):
    # 2 GiB against a 1 GiB cap: capturing only records the node (refusing it here would break
    # graphs that never run, or run after other memory is freed)
    res = lab.run("init", "ctx", "0", "gcapture", "2g", "meminfo", "phys", **CAP)
    assert res.rc("gcapture") == 0
    assert free_seen(res) == [GIB]
    assert phys(res) == [0]


@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr"])
def test_a_graph_launch_charges_what_it_maps_and_a_trim_returns_it(lab, api):
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginst", "flags", "meminfo", "glaunch",
                  "meminfo", "phys", "glaunch", "meminfo", "gtrim", "meminfo", "phys", api=api, **CAP)
    assert [res.rc(c) for c in ("gcapture", "ginst", "glaunch", "gtrim")] == [0, 0, 0, 0]
    assert free_seen(res) == [GIB, GIB - 600 * MIB, GIB - 600 * MIB, GIB]  # a replay maps nothing
    assert phys(res) == [600 * MIB, 0]


def test_a_graph_that_does_not_fit_is_refused_before_it_maps_anything(lab):
    res = lab.run("init", "ctx", "0", "alloc", "600m", "gcapture", "600m", "ginst", "flags",
                  "glaunch", "meminfo", "phys", "free", "0", "glaunch", "meminfo", **CAP)
    assert [rc for rc, _ in res.of("glaunch")] == [OOM, 0]  # fits once the plain 600 MiB is freed
    assert free_seen(res) == [GIB - 600 * MIB, GIB - 600 * MIB]
    assert phys(res) == [600 * MIB]  # the refused launch mapped nothing


def test_the_charge_settles_to_what_the_pool_really_holds(lab):
    # two 400 MiB nodes whose lifetimes do not overlap share memory: 400 MiB mapped, not 800
    res = lab.run("init", "ctx", "0", "gnode", "400m", "0", "gnode", "400m", "0", "ginst", "flags",
                  "glaunch", "meminfo", "phys", **CAP, FAKE_CUDA_GRAPH_SHARE="50")
    assert res.rc("glaunch") == 0
    assert free_seen(res) == [GIB - 400 * MIB]
    assert phys(res) == [400 * MIB]


def test_a_graph_that_ran_is_replayed_near_the_cap(lab):
    # its 800 MiB of nodes map 400 MiB. With 500 MiB allocated after the first launch, the
    # nodes' sum would not fit (900 used + 800 - 400 held > 1024), but a graph that ran in a pool
    # no smaller than now maps nothing new: the replays go on
    res = lab.run("init", "ctx", "0", "gnode", "400m", "0", "gnode", "400m", "0", "ginst", "flags",
                  "glaunch", "alloc", "500m", "glaunch", "glaunch", "meminfo", **CAP,
                  FAKE_CUDA_GRAPH_SHARE="50")
    assert [rc for rc, _ in res.of("glaunch")] == [0, 0, 0]
    assert free_seen(res) == [GIB - 900 * MIB]


def test_a_replay_beside_other_graphs_live_allocations_is_reserved_again(lab):
    # another graph's allocation left alive in the pool takes the space this graph used: its
    # replay maps its 600 MiB again. The replay shortcut looked only at the pool's size and
    # let it map past the cap: 1450 MiB held under 1 GiB
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginst", "flags", "glaunch",
                  "gkeep", "500m", "alloc", "250m", "glaunch", "meminfo", "phys", **CAP)
    assert [rc for rc, _ in res.of("glaunch")] == [0, OOM]
    assert phys(res) == [850 * MIB]  # the kept 500 MiB lives in the pool; the replay mapped nothing
    assert free_seen(res) == [GIB - 850 * MIB]


def test_a_replay_after_a_trim_is_judged_by_what_it_needed(lab):
    # after a trim the replay maps again; it is judged by what its last run needed (400 MiB of
    # its 800 MiB of nodes), so it fits beside 500 MiB where the nodes' sum would not
    res = lab.run("init", "ctx", "0", "gnode", "400m", "0", "gnode", "400m", "0", "ginst", "flags",
                  "glaunch", "gtrim", "alloc", "500m", "glaunch", "meminfo", "phys", **CAP,
                  FAKE_CUDA_GRAPH_SHARE="50")
    assert [rc for rc, _ in res.of("glaunch")] == [0, 0]
    assert phys(res) == [900 * MIB]
    assert free_seen(res) == [GIB - 900 * MIB]


def test_a_graph_allocation_in_a_locality_domain_is_charged_to_its_device(lab):
    # an allocation node in locality domain 1 of device 1 (CUDA 13.4: its location's id the
    # bytes {device, domain}), launched from device 0's context.  Taken for no device's, it
    # was reckoned against device 0, whose graph pool never grew: device 1 held 600 MiB of it
    # uncharged
    held, go = lab.tmp / "held", lab.tmp / "go"
    proc = lab.start("init", "ctx", "0", "gnode", "600m", "1.1", "ginst", "flags", "glaunch", "alloc", "600m",
                     "touch", str(held), "waitfile", str(go), **CAP,
                     FAKE_CUDA_DEVICES=f"{lab.UUID_A}=16g,{lab.UUID_B}=16g")
    lab.wait_for(held)
    used = {d.uuid: d.used_bytes for d in lab.region().devices}
    go.touch()
    res = lab.finish(proc)
    assert res.rc("ginst") == 0 and res.rc("glaunch") == 0 and res.rc("alloc") == 0, res.stdout
    assert used == {lab.UUID_A: 600 * MIB, lab.UUID_B: 600 * MIB}


@pytest.mark.parametrize("inst", ["ginstf", "ginstpf"], ids=["with_flags", "with_params"])
def test_an_auto_free_graph_is_relaunched_near_the_cap(lab, inst):
    # its 600 MiB node is not freed in the graph: it lives on after the launch, and with
    # AUTO_FREE_ON_LAUNCH (flag 1) the next launch frees it first. Counted as alive beside the
    # relaunch (used + need - held = 600 + 600 - 600), the relaunch was refused under 1 GiB
    # although it maps nothing new
    res = lab.run("init", "ctx", "0", "gnode", "600m", "0", inst, "1", "glaunch", "glaunch",
                  "alloc", "300m", "glaunch", "meminfo", "phys", "alloc", "200m", **CAP,
                  FAKE_CUDA_GRAPH_UNFREED="1")
    assert res.rc(inst) == 0 and [rc for rc, _ in res.of("glaunch")] == [0, 0, 0]
    assert [rc for rc, _ in res.of("alloc")] == [0, OOM]
    assert free_seen(res) == [GIB - 900 * MIB]
    assert phys(res) == [900 * MIB]


def test_an_auto_free_graph_is_not_credited_what_the_program_freed_itself(lab):
    # after its launch the program frees the graph's allocation itself (cuMemFreeAsync by its
    # address), and another graph's 600 MiB lives in the pool: the relaunch's credit for what
    # its last launch left came off that other allocation, and it mapped 600 MiB more: 1.2 GiB
    # held under 1 GiB.  The credit holds only while no graph launch or foreign free came since
    res = lab.run("init", "ctx", "0", "gnode", "600m", "0", "ginstf", "1", "glaunch", "gfreelast",
                  "gkeep", "600m", "glaunch", "meminfo", "phys", **CAP, FAKE_CUDA_GRAPH_UNFREED="1")
    assert res.rc("gfreelast") == 0
    assert [rc for rc, _ in res.of("glaunch")] == [0, OOM]
    assert phys(res)[0] <= GIB


def test_allocations_in_child_graphs_count(lab):
    res = lab.run("init", "ctx", "0", "gnode", "300m", "0", "gchild", "ginst", "flags", "glaunch",
                  "meminfo", **CAP)
    assert res.rc("glaunch") == 0
    assert free_seen(res) == [GIB - 300 * MIB]


def test_allocations_in_child_graphs_nested_past_any_depth_count(lab):
    # the walk went 8 levels deep: a node wrapped 9 times was launched uncharged
    res = lab.run("init", "ctx", "0", "gnode", "2g", "0", *["gchild"] * 12, "ginst", "flags",
                  "glaunch", "meminfo", "phys", **CAP)
    assert res.rc("glaunch") == OOM
    assert free_seen(res) == [GIB] and phys(res) == [0]


@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr", "procaddr1"])
def test_cuda_10s_graph_instantiate_is_hooked_too(lab, api):
    # cuGraphInstantiate (CUDA 10.0) is still exported: reached by its name or cudaVersion 10.x
    over = lab.run("init", "ctx", "0", "gnode", "2g", "0", "ginst10", "glaunch", "meminfo",
                   "phys", api=api, **CAP)
    assert over.rc("ginst10") == 0 and over.rc("glaunch") == OOM
    assert free_seen(over) == [GIB] and phys(over) == [0]
    fits = lab.run("init", "ctx", "0", "gnode", "600m", "0", "ginst10", "glaunch", "meminfo",
                   api=api, **CAP)
    assert fits.rc("glaunch") == 0 and free_seen(fits) == [GIB - 600 * MIB]


def test_instantiate_with_upload_maps_and_charges_at_once(lab):
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginst", "upload", "meminfo", "phys",
                  **CAP)
    assert res.rc("ginst") == 0
    assert free_seen(res) == [GIB - 600 * MIB]
    assert phys(res) == [600 * MIB]


def test_instantiate_with_upload_over_the_cap_is_refused(lab):
    res = lab.run("init", "ctx", "0", "alloc", "600m", "gcapture", "600m", "ginst", "upload",
                  "meminfo", "phys", **CAP)
    assert res.rc("ginst") == OOM
    assert free_seen(res) == [GIB - 600 * MIB]
    assert phys(res) == [600 * MIB]


def test_cuGraphUpload_charges_like_a_launch(lab):
    res = lab.run("init", "ctx", "0", "gcapture", "300m", "ginst", "flags", "gupload", "meminfo",
                  "glaunch", "meminfo", **CAP)
    assert res.rc("gupload") == 0 and res.rc("glaunch") == 0
    assert free_seen(res) == [GIB - 300 * MIB, GIB - 300 * MIB]


def test_resetting_the_context_returns_graph_memory(lab):
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginst", "flags", "glaunch", "reset", "0",
                  "phys", **CAP)
    assert res.rc("reset") == 0
    assert phys(res) == [0]
    assert lab.used() == 0


def test_graph_memory_the_pool_keeps_past_the_last_context_stays_charged(lab):
    # a graph launched in a created context, then that context (the process's only one on the
    # device) destroyed: the device's graph pool still holds its 600 MiB (the fake's pool goes
    # with the primary context or a trim), but the charge went with the context without asking
    # the pool, and a 600 MiB allocation passed: 1200 MiB held under a 1 GiB cap. A trim, then,
    # returns it
    res = lab.run("init", "ctxcreate", "0", "gnode", "600m", "0", "ginst", "flags", "glaunch",
                  "ctxdestroy", "0", "ctx", "0", "meminfo", "phys", "alloc", "600m", "gtrim",
                  "meminfo", "phys", **CAP)
    assert [res.rc(c) for c in ("glaunch", "ctxdestroy", "gtrim")] == [0, 0, 0]
    assert phys(res)[0] == 600 * MIB
    assert res.rc("alloc") == OOM
    assert free_seen(res) == [GIB - 600 * MIB, GIB]
    assert phys(res)[1] == 0


def test_destroying_the_executable_keeps_the_pool_charged_until_trimmed(lab):
    res = lab.run("init", "ctx", "0", "gcapture", "200m", "ginst", "flags", "glaunch", "gdestroy",
                  "meminfo", "gtrim", "meminfo", **CAP)
    assert res.rc("gdestroy") == 0
    assert free_seen(res) == [GIB - 200 * MIB, GIB]


def test_an_executable_handle_reused_during_its_destroy_keeps_the_new_graph_charged(lab):
    # the driver hands the destroyed executable's handle to another thread's instantiation
    # while cuGraphExecDestroy is still inside; forgetting it after the driver's call forgot
    # the new graph, whose 900 MiB then launched unreserved: 1.2 GiB held under 1 GiB
    res = lab.run("init", "ctx", "0", "alloc", "300m", "gnode", "100m", "0", "ginst", "flags", "bggdestroy",
                  *lab.inside("cuGraphExecDestroyAfter", "gnew", "gnode", "900m", "0", "ginst", "flags", "gexec"),
                  "join", "glaunch", "meminfo", "phys", **CAP, FAKE_CUDA_HANDLE_REUSE="1",
                  **lab.held("cuGraphExecDestroyAfter"))
    assert res.values("gexec", 0) == res.values("gexec", 1)  # the handle came back
    assert res.rc("bggdestroy") == 0 and res.rc("glaunch") == OOM
    assert free_seen(res) == [GIB - 300 * MIB]
    assert phys(res) == [300 * MIB]


def test_more_than_1024_executables_with_allocation_nodes_are_all_charged(lab):
    # the table of executables was a fixed 1024: the 1025th went untracked, and its 2 GiB of
    # allocation nodes launched with nothing charged under a 1 GiB cap (free seen: all of it).
    # A graph with allocation nodes may have one instantiation at a time: 1025 graphs
    res = lab.run("init", "ctx", "0", *["gnew", "gnode", "1m", "0", "ginst", "flags"] * 1024, "gnew",
                  "gnode", "2g", "0", "ginst", "flags", "glaunch", "meminfo", "phys", **CAP)
    assert [rc for rc, _ in res.of("ginst")] == [0] * 1025
    assert res.rc("glaunch") == OOM
    assert free_seen(res) == [GIB]
    assert phys(res) == [0]


def test_a_graph_beside_uncharged_small_pages_stays_within_the_cap(lab):
    # a 4 KiB array takes a 2 MiB page (charged 4 KiB: the rest is under the reconcile's noise
    # threshold), then a graph's 922 MiB beside a 101 MiB context: its part fits the charge
    # (1,023 MiB), the process would hold 1,025.  It was admitted so: 1,025 MiB under 1,024
    res = lab.run("init", "ctx", "0", "alloc", "4k", "gnode", "922m", "0", "ginst", "flags", "glaunch",
                  "phys", **CAP, FAKE_CUDA_CTX_BYTES="101m", FAKE_CUDA_SMALL_PAGES="1")
    assert res.rc("glaunch") == OOM
    assert phys(res)[0] <= GIB


def test_an_executable_whose_destroy_fails_stays_charged_at_launch(lab):
    res = lab.run("init", "ctx", "0", "alloc", "300m", "gnode", "900m", "0", "ginst", "flags",
                  "gdestroy", "glaunch", "phys", **CAP, FAKE_CUDA_FAIL="cuGraphExecDestroy:1:999")
    assert res.rc("gdestroy") == 999 and res.rc("glaunch") == OOM
    assert phys(res) == [300 * MIB]


@pytest.mark.parametrize("nth", ["1", "2"], ids=["used", "reserved"])
def test_a_launch_that_cannot_read_the_graph_pool_reserves_the_sum_of_its_nodes(lab, nth):
    # the pool's used or reserved memory cannot be read before the launch: nothing was
    # reserved, and two 900 MiB nodes launched, 1.8 GiB held under 1 GiB
    fail = f"cuDeviceGetGraphMemAttribute:{nth}:999"
    over = lab.run("init", "ctx", "0", "gnode", "900m", "0", "gnode", "900m", "0", "ginst",
                   "flags", "glaunch", "meminfo", "phys", **CAP, FAKE_CUDA_FAIL=fail)
    assert over.rc("glaunch") == OOM
    assert free_seen(over) == [GIB] and phys(over) == [0]
    fits = lab.run("init", "ctx", "0", "gnode", "400m", "0", "ginst", "flags", "glaunch",
                   "meminfo", "phys", **CAP, FAKE_CUDA_FAIL=fail)
    assert fits.rc("glaunch") == 0
    assert free_seen(fits) == [GIB - 400 * MIB] and phys(fits) == [400 * MIB]


UNREADABLE = {  # a failing query of the walk over a graph's nodes: FAKE_CUDA_FAIL, the graph
    "count": ("cuGraphGetNodes:1:999", []),
    "list": ("cuGraphGetNodes:2:999", []),
    "type": ("cuGraphNodeGetType:1:999", []),
    "params": ("cuGraphMemAllocNodeGetParams:1:999", []),
    "child": ("cuGraphChildGraphNodeGetGraph:1:999", ["gchild"]),
}


@pytest.mark.parametrize("query", sorted(UNREADABLE))
def test_a_graph_whose_nodes_cannot_be_read_is_refused_at_instantiate(lab, query):
    # its allocations unknown, no launch of it could be reserved: the instantiate is refused
    # with the driver's error before anything is instantiated. It went through untracked, and
    # 2 GiB of nodes launched beside 300 MiB: 2.3 GiB held under 1 GiB
    fail, wrap = UNREADABLE[query]
    res = lab.run("init", "ctx", "0", "alloc", "300m", "gnode", "2g", "0", *wrap, "ginst", "flags",
                  "glaunch", "phys", "ginst", "upload", "meminfo", "phys", **CAP, FAKE_CUDA_FAIL=fail)
    assert res.of("ginst") == [(999, [0]), (OOM, [1])]  # read the second time, and over the cap
    assert res.rc("glaunch") != 0  # nothing to launch
    assert free_seen(res) == [GIB - 300 * MIB] and phys(res) == [300 * MIB, 300 * MIB]
    # once the nodes can be read the graph instantiates, and its launch is charged
    fits = lab.run("init", "ctx", "0", "gnode", "600m", "0", *wrap, "ginst", "upload", "ginst",
                   "flags", "glaunch", "meminfo", "phys", **CAP, FAKE_CUDA_FAIL=fail)
    assert fits.of("ginst") == [(999, [1]), (0, [0])] and fits.rc("glaunch") == 0
    assert free_seen(fits) == [GIB - 600 * MIB] and phys(fits) == [600 * MIB]


def test_graph_memory_is_not_counted_twice_by_the_near_cap_reconcile(lab):
    # 600 MiB of graph pool, then an allocation within the reconcile margin of the cap: NVML's
    # per-process figure includes the graph pool, which is already charged
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginst", "flags", "glaunch", "alloc",
                  "300m", "nvmlqueries", "meminfo", "phys", **CAP)
    assert res.rc("alloc") == 0
    assert res.values("nvmlqueries")[0] >= 1  # the reconcile did ask
    assert free_seen(res) == [GIB - 900 * MIB]
    assert phys(res) == [900 * MIB]


def test_a_graph_that_does_not_fit_is_refused_without_waiting_for_the_compute_budget(lab):
    # under a compute limit, a graph launch over the memory cap first waited for the budget
    # its predecessors ran up (here about 450 ms), then was refused anyway
    res = lab.run("init", "ctx", "0", "alloc", "600m", "gcapture", "600m", "ginst", "flags",
                  "launch", "20", "sync", "mark", "glaunch", "since", "meminfo", **CAP,
                  CUDA_DEVICE_SM_LIMIT="10", FAKE_CUDA_KERNEL_US="50000")
    assert res.rc("glaunch") == OOM
    assert res.of("since")[0][1][0] < 150
    assert free_seen(res) == [GIB - 600 * MIB]


def test_two_graphs_launched_at_once_do_not_both_count_on_the_pools_free_room(lab):
    # graph A (600 MiB, no free node) ran and the program freed its allocation: the pool holds
    # 600 MiB, none of it in use.  A thread relaunches A (held in the driver after its
    # reservation) while the main thread launches B (600 MiB).  Each took the pool's 600 free
    # MiB for its own: both ran, the pool grew to 1200 MiB under a 1 GiB cap
    go = "cuGraphLaunch:2"
    res = lab.run("init", "ctx", "0", "gnode", "600m", "0", "ginstf", "0", "gsave", "0", "glaunch",
                  "gfreelast", "gnew", "gnode", "600m", "0", "ginstf", "0", "gsave", "1", "guse", "0",
                  "bgglaunch", "1", *lab.inside(go, "guse", "1", "glaunch"), "join", "sync", "meminfo",
                  "phys", **CAP, FAKE_CUDA_GRAPH_UNFREED="1", **lab.held(go))
    assert res.rc("bgglaunch") == 0
    assert res.rc("glaunch", 1) == OOM  # B: A counts on the pool's room
    assert phys(res)[0] == 600 * MIB
    assert free_seen(res) == [GIB - 600 * MIB]


def test_a_trim_during_a_launch_keeps_the_room_it_counts_on_charged(lab):
    # a 600 MiB graph ran (the pool holds 600 MiB, charged).  A thread relaunches it, reserving
    # nothing (the pool has room for it), held in the driver; meanwhile the main thread trims the
    # graph pool and allocates 600 MiB.  The trim's settle took the charge to 0, the allocation
    # passed, and the relaunch mapped 600 MiB again: 1200 MiB held under a 1 GiB cap
    go = "cuGraphLaunch:2"
    res = lab.run("init", "ctx", "0", "gcapture", "600m", "ginstf", "0", "glaunch",
                  "bgglaunch", "1", *lab.inside(go, "gtrim", "alloc", "600m"), "join", "sync",
                  "gtrim", "meminfo", "phys", **CAP, **lab.held(go))
    assert res.rc("bgglaunch") == 0
    assert res.rc("alloc") == OOM
    assert phys(res)[0] <= GIB
    # settled to the pool once the launch is done: a trim then gives its room back
    assert free_seen(res) == [GIB - phys(res)[0]]
