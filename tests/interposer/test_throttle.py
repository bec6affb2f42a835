"""CUDA_DEVICE_SM_LIMIT: the container gets its share of GPU time, measured on fake kernels.

The fake driver runs each kernel for FAKE_CUDA_KERNEL_US of real time on its stream's timeline;
the probe launches as fast as it can for a while and reports how much kernel time ran. Without
the library a launch loop keeps the fake GPU 100% busy.
"""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from webhook.node.region import DeviceSlot, Region, encode_region

GIB = 1 << 30
CUDA_ERROR_INVALID_CONTEXT = 201

TOLERANCE = 5.0  # percentage points


def share(lab, seconds: float, kind: str = "kernel", api: str = "direct", **env: str) -> float:
    res = lab.run("init", "ctx", "0", "bench", str(seconds), kind, api=api, **env)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0, res.stdout + res.stderr
    return 100.0 * kernel_ns / wall_ns


@pytest.mark.parametrize(("limit", "kernel_us"), [(30, 50000), (30, 2000), (30, 20), (10, 20),
                                                  (50, 2000)])
def test_sm_limit_holds_the_share_for_huge_and_tiny_kernels(release_lab, limit, kernel_us):
    got = share(release_lab, 2.0, CUDA_DEVICE_SM_LIMIT=str(limit),
                FAKE_CUDA_KERNEL_US=str(kernel_us))
    assert abs(got - limit) <= TOLERANCE, f"limit {limit}%, measured {got:.1f}%"


@pytest.mark.parametrize(("limit", "kernel_us"), [(50, 200000), (30, 300000)])
def test_kernels_longer_than_the_idle_credit_each_waited_for_get_the_share(release_lab, limit, kernel_us):
    # a launch, then a synchronisation (a benchmark timing one huge matmul at a time): each
    # kernel is measured when it ends, and the clock first caught up with that moment less the
    # 50 ms idle credit, as if the GPU had been idle while the kernel ran: each kernel's own
    # time beyond 50 ms went free.  200 ms kernels at 50 % got 36.3 %, 300 ms ones at 30 %
    # 24.0 %; now the credit ends where the kernel began: 50.8 % and 30.5 %
    res = release_lab.run("init", "ctx", "0", "bench", "3", "sync", CUDA_DEVICE_SM_LIMIT=str(limit),
                          FAKE_CUDA_KERNEL_US=str(kernel_us))
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches >= 2, res.stdout + res.stderr
    # from the first launch to the last one's: the last kernel's debt is not waited off
    got = 100.0 * (kernel_ns - kernel_us * 1000) / (wall_ns - kernel_us * 1000)
    assert abs(got - limit) <= TOLERANCE, f"limit {limit}%, {kernel_us} us kernels: {got:.1f}%"


def test_kernels_longer_than_the_queue_wait_do_not_run_ahead_of_the_budget(release_lab):
    # 500 ms kernels launched back to back under 50 %: each launch past the 50 ms queue wait
    # paid in advance only what the kernel ahead had run so far, and queued behind all of it, so
    # the queue grew by doubling: three or four kernels ran back to back, then as long idle (the
    # average held, but the GPU was 99.9 % busy over 1.5 s windows).  Once a launch's cost is
    # known the queued work is paid in advance in full: 66.6 %, one kernel a second.  The first
    # kernels, of unknown cost, still run ahead (skipped: the first 3.5 s)
    res = release_lab.run("init", "ctx", "0", "peak", "8", "1500", "3500", CUDA_DEVICE_SM_LIMIT="50",
                          FAKE_CUDA_KERNEL_US="500000")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 4, res.stdout + res.stderr
    # at most the share of the window and one kernel: (0.75 s + 0.5 s) / 1.5 s
    assert worst <= 850, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 50% limit"


@pytest.mark.parametrize("kind", ["cpeak", "dpeak", "fpeak"])
def test_a_graph_loop_whose_trip_count_grows_does_not_run_ahead_of_the_budget(release_lab, kind):
    # one graph launched back to back under 30 %, with a WHILE node (CUDA 12.4's conditional
    # nodes), or made for device launch (its kernel relaunches it from the GPU, and the host
    # launch completes with the last relaunch), or a plain graph whose kernel launches such a
    # device graph (fpeak): for a second its loop ran once a launch (1 ms),
    # then 200 times (200 ms), the trip count set by its kernels, which the host never sees.
    # The stream's queue held 20 ms of work by the 1 ms estimate learnt so far: twenty launches,
    # 4 s of work, admitted at once, and the GPU was 100.0 % busy over 1.5 s windows.  Such
    # graphs (every graph while one made for device launch lives) now queue 1 ms of estimated
    # work: 37.4-37.8 %
    res = release_lab.run("init", "ctx", "0", kind, "5", "1500", "1000", "1000", "200",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10, res.stdout + res.stderr
    # at most the share of the window and one 200 ms launch: (0.45 s + 0.2 s) / 1.5 s
    assert worst <= 450, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"


@pytest.mark.parametrize("kind", ["cpeak", "dpeak", "fpeak"])
def test_graph_loops_are_paced_under_asan(asan_lab, kind):
    res = asan_lab.run("init", "ctx", "0", kind, "1.5", "500", "0", "500", "50",
                       CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, _) = res.of("peak")[0]
    assert rc == 0 and launches > 0, res.stdout + res.stderr


GRAPH_CHANGES = [("update", "procaddr"), ("update1", "dlsym"), ("kernel", "direct"), ("kernel1", "procaddr"),
                 ("node", "dlsym"), ("child", "direct"), ("enable", "procaddr"), ("new", "direct")]


@pytest.mark.parametrize(("how", "api"), GRAPH_CHANGES)
def test_a_graph_changed_in_place_does_not_run_ahead_of_the_budget(release_lab, how, api):
    # one graph launched back to back under 30 %: for a second a launch runs 1 ms, then the
    # program changes it so that a launch runs 100 ms (cuGraphExecUpdate[_v2] from a graph of
    # the same shape with a larger grid, a kernel node's grid set through
    # cuGraphExecKernelNodeSetParams[_v2] or cuGraphExecNodeSetParams, a larger child graph set,
    # a disabled node enabled, or a new executable instantiated).  The stream's queue held 20 ms
    # of work by the 1 ms estimate: twenty launches, 2 s of work, admitted at once, and the GPU
    # was 86.7 % busy over 1.5 s windows under a 30 % limit (every kind of change alike).  A
    # changed or new executable's launch now waits for its stream's queue, and the stream's
    # next launches for that launch's measurement: 33.3 % (29.8 % from the change to the end)
    res = release_lab.run("init", "ctx", "0", "gpeak", "5", "1500", "1000", "1000", "100", how, api=api,
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10, res.stdout + res.stderr
    # at most the share of the window and one 100 ms launch: (0.45 s + 0.1 s) / 1.5 s
    assert worst <= 400, f"{how}: the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"


@pytest.mark.parametrize("api", ["direct", "ptsz"])
@pytest.mark.parametrize("how", ["bigfn", "bigrid"])
def test_a_stream_that_goes_on_to_a_longer_kernel_does_not_run_ahead_of_the_budget(release_lab, how, api):
    # a second of a 1 ms kernel, then a 100 ms kernel, launched back to back on one stream under
    # 30 %, and 86.7 % of the GPU over 1.5 s windows, 2 s of work at once:
    # - bigfn: another function's (a loop of big matmuls after elementwise work).  The stream's
    #   own estimate was what its last launches cost, 1 ms, and its queue took twenty of the
    #   100 ms kernels by it.  Each function's cost is now learnt on its own (the first launch of
    #   one runs alone and is measured): 33.3 %
    # - bigrid: the same function's at a grid of 100, not 1 (the fake's FAKE_GRID_FN runs one
    #   kernel per block), as an elementwise kernel whose grid follows its tensor's size goes
    #   on to large tensors.  Its one figure was the small grid's.  Sizes are now told apart,
    #   and a grid 100 times any measured is a leap, measured alone first: 33.3 %
    res = release_lab.run("init", "ctx", "0", "gpeak", "5", "1500", "1000", "1000", "100", how, api=api,
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10, res.stdout + res.stderr
    assert worst <= 400, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"
    assert abs(res.values("after")[0] / 10 - 30) <= TOLERANCE, res.stdout


@pytest.mark.parametrize("how", ["bigrid1", "bigrid2"])
def test_a_kernel_whose_time_grows_faster_than_its_grid_does_not_run_ahead_of_the_budget(release_lab, how):
    # a kernel whose time is in the square of its grid (attention over a sequence its grid
    # follows) for a second, then at a grid of 50 (250 ms), 50.0 % of the GPU over 1.5 s windows
    # under 30 % either way before:
    # - bigrid2: at grids 1 and 2 in turn (0.1 and 0.4 ms).  In proportion to grid 2, each was
    #   counted at 10 ms and the queue took them two at a time.  Estimated in the square, as the
    #   two points grew, 33.3 % (and grid 50, 25 times grid 2, is now a leap as below)
    # - bigrid1: at grid 1 alone (short prompts, then a long one).  Nothing measured showed the
    #   growth: counted at 5 ms, four at a time.  A grid past 4x the largest measured is a leap,
    #   measured alone first: 33.3 % (bigrid2's 25x leap is now caught so too)
    res = release_lab.run("init", "ctx", "0", "gpeak", "5", "1500", "1000", "1000", "50", how,
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="100")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10, res.stdout + res.stderr
    assert worst <= 400, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"
    assert abs(res.values("after")[0] / 10 - 30) <= TOLERANCE, res.stdout


@pytest.mark.parametrize("unload", ["cuModuleUnload", "cuLibraryUnload"])
def test_a_kernel_loaded_again_at_its_old_handle_does_not_run_ahead_of_the_budget(release_lab, unload):
    # a second of kernel "k" at 1 ms; then its module is unloaded and loaded again, recompiled to
    # run 100 ms (a JIT's new version of a kernel), and the driver gives "k" its old handle
    # (FAKE_CUDA_HANDLE_REUSE: the allocator hands back the freed module's memory).  The handle's
    # cost, 1 ms, was the old code's, and the queue took twenty of the new kernels by it: 100 %
    # of the GPU over 1.5 s windows under 30 %.  An unload forgets every cost (any handle may come
    # back as another's); the next launches wait for their queues once: 33.3 %
    res = release_lab.run("init", "ctx", "0", "gpeak", "5", "1500", "1000", "1000", "100",
                          "reload" if unload == "cuModuleUnload" else "relib",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000", FAKE_CUDA_HANDLE_REUSE="1")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10 and res.of("reused") == [(0, [1])], res.stdout + res.stderr
    assert worst <= 400, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"
    assert abs(res.values("after")[0] / 10 - 30) <= TOLERANCE, res.stdout


@pytest.mark.parametrize(("kind", "kernel_us"), [("alt:100000", "5"), ("sizes:20", "2")])
def test_a_kernel_launched_at_many_grids_gets_the_share(release_lab, kind, kernel_us):
    # one function at changing grids, its kernels short enough that a launch waiting for its
    # stream's queue costs the share:
    # - alt: a kernel whose time is the same at a grid of 1 and of 100000 (a grid the GPU never
    #   fills), the two in turn.  Estimated in proportion to the last size measured alone, each
    #   large launch waited for the queue: 16.8 % under 30 %.  Two sizes are kept, and a size
    #   between them is estimated on their chord: 30 %
    # - sizes: FAKE_GRID_FN, whose time grows with its grid, at grids 1..20 in turn (tensors of
    #   changing shapes).  Taken for unknown, each size between two measured waited for the
    #   queue: 11.0 %.  Estimated from them: 30 %
    res = release_lab.run("init", "ctx", "0", "bench", "1", kind, "bench", "3", kind,
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US=kernel_us)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[1]
    assert rc == 0 and launches > 100, res.stdout + res.stderr
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"{kind}: {got:.1f}%"


def costsim(built, *cmds: str) -> list[int]:
    """``tests/costsim.c``: costs.c alone, fed scripted measurements; each ``est``'s figure."""
    out = subprocess.run([str(built / "tests" / "costsim"), *cmds], capture_output=True, text=True,
                         check=True).stdout
    return [int(line.split()[3]) for line in out.splitlines()]


F = "0x7f0012345600"  # a function's handle


def test_one_sizes_cost_is_its_figure_below_and_in_proportion_above(built):
    # measured only at a grid of 100 threads: as much at fewer (the GPU was not filled, or
    # the time is a launch's own), in proportion at more, up to a leap (4x); a size the driver
    # refuses (0) as 1
    assert costsim(built, "learn", F, "100", "1000", "est", F, "100", "est", F, "1", "est", F, "0",
                   "est", F, "250", "est", F, "400") == [1000, 1000, 1000, 2500, 4000]


def test_a_leap_past_the_largest_size_measured_is_unknown_until_measured(built):
    # past 4x the largest size measured nothing tells how the time grows (attention at a 50x
    # longer sequence takes 2500x): unknown, so the launch is measured alone first; once it is,
    # the next leap counts from it.  Sizes the driver may saturate to (2^64 - 1 threads) make
    # no overflow either way
    assert costsim(built, "learn", F, "1", "1000", "learn", F, "100", "100000", "est", F, "401", "est", F, "400",
                   "learn", F, "401", "401000", "est", F, "401", "est", F, "1604", "est", F, "1605",
                   "est", F, "200") == [0, 400000, 401000, 1604000, 0, 200000]
    assert costsim(built, "learn", F, str(2**63), "1000", "est", F, str(2**64 - 1), "est", F, "5",
                   "learn", F, "1", "1", "est", F, str(2**63 - 1)) == [1999, 1000, 999]
    # the largest point moved down to a size between (measured above the chord) moves to one
    # nearer it than the smallest: no size measured before becomes a leap
    moved = costsim(built, "learn", F, "1", "1000", "learn", F, "1000", "1000000", "learn", F, "600", "900000",
                    "est", F, "1000", "est", F, "2400", "est", F, "2401")
    assert moved[0] > 0 and moved[1] > 0 and moved[2] == 0, moved


def test_two_sizes_estimate_on_their_chord(built):
    # 5 us at 1 thread, 100 us at 1000: on the chord between (above a time that grows in
    # proportion or less), the smaller's figure below, in proportion to the larger above
    est = costsim(built, "learn", F, "1", "5000", "learn", F, "1000", "100000",
                  "est", F, "1", "est", F, "500", "est", F, "1000", "est", F, "4000", "learn", F, "0", "1",
                  "est", F, "1")
    assert est[:4] == [5000, 5000 + 95000 * 499 // 999, 100000, 400000], est
    # measured again at a measured size: a quarter of the running average (one at 0 threads is at 1)
    assert est[4] == (5000 * 3 + 1) // 4, est


def test_a_larger_size_is_never_estimated_below_a_smaller(built):
    # noise: the larger size measured quicker than the smaller; the larger is taken at the
    # smaller's figure, flat between, and in proportion from it above
    assert costsim(built, "learn", F, "10", "9000", "learn", F, "1000", "3000",
                   "est", F, "500", "est", F, "1000", "est", F, "2000") == [9000, 9000, 18000]


def test_sizes_that_grew_faster_than_in_proportion_are_estimated_in_the_square_above(built):
    # 1 us a thread at 100 threads, 2 us at 200 (attention over a sequence its grid follows):
    # 4x the time at 2x the size is estimated at 4x again above, not 2x (on the chord between);
    # a thread at the larger costing less than half as much again (1.25x) stays in proportion;
    # capped as in proportion (10 and 40 ms at 100 and 200 threads: 640 ms at 800)
    assert costsim(built, "learn", F, "100", "100000", "learn", F, "200", "400000",
                   "est", F, "400", "est", F, "150", "est", F, "800") == [1600000, 250000, 6400000]
    assert costsim(built, "learn", F, "100", "10000000", "learn", F, "200", "40000000",
                   "est", F, "800") == [100 * 10**6]
    assert costsim(built, "learn", F, "100", "100000", "learn", F, "200", "250000",
                   "est", F, "400") == [500000]


def test_a_size_between_moves_the_nearer_point_only_if_the_chord_was_low(built):
    base = ["learn", F, "100", "1000", "learn", F, "1000", "10000"]
    # at or under the chord (a kernel that grows less than in proportion): nothing moves
    assert costsim(built, *base, "learn", F, "400", "1500", "est", F, "400", "est", F, "100",
                   "est", F, "1000") == [4000, 1000, 10000]
    # over it (grown costlier since, or faster than in proportion): the nearer point is moved
    # there; above it, the two points having grown faster than in proportion, in the square
    assert costsim(built, *base, "learn", F, "800", "20000", "est", F, "800", "est", F, "1000",
                   "est", F, "100") == [20000, 31250, 1000]
    assert costsim(built, *base, "learn", F, "200", "9000", "est", F, "200", "est", F, "100") == [9000, 9000]


def test_an_estimate_in_proportion_is_capped(built):
    # past the largest size measured, at most 100 ms or that size's figure (any estimate past the
    # queue's 20 ms queues nothing behind it; what a launch waiting behind pays in advance is
    # not inflated by a grid the GPU runs in far less than in proportion)
    assert costsim(built, "learn", F, "10", "30000000", "est", F, "20", "est", F, "40") == [60 * 10**6, 100 * 10**6]
    assert costsim(built, "learn", F, "1", "1000000", "learn", F, "10", "300000000", "est", F, "40") == [300 * 10**6]


def test_a_forgotten_cost_is_unknown_and_others_stay(built):
    other = "0x7f0012345700"
    assert costsim(built, "learn", F, "1", "1000", "learn", other, "1", "2000", "forget", F,
                   "est", F, "1", "est", other, "1", "learn", F, "1", "3000", "est", F, "1") == [0, 2000, 3000]


def test_an_unload_forgets_every_cost(built):
    # which handles were the unloaded code's is not known, and any may come back as another's:
    # all are unknown, and learnt again from the next measurement (not averaged with the old)
    other = "0x7f0012345700"
    assert costsim(built, "learn", F, "1", "1000", "learn", other, "1", "2000", "unload", "est", F, "1",
                   "est", other, "1", "learn", F, "1", "3000", "est", F, "1", "est", other, "1") == [0, 0, 3000, 0]


def test_the_least_recently_used_cost_gives_room(built):
    # 300000 other functions learnt after ours (the table holds 65536, four to a set): ours,
    # never used since, is gone; used between each thousand of them, it stays (the same number
    # would have pushed it out of its set with first in, first out)
    assert costsim(built, "learn", F, "1", "1000", "fill", "300000", "est", F, "1") == [0]
    keep = [cmd for _ in range(300) for cmd in ("est", F, "1", "fill", "1000")]
    assert costsim(built, "learn", F, "1", "1000", *keep, "est", F, "1")[-1] == 1000


@pytest.mark.parametrize(("functions", "kernel_us"), [(16, 200), (3000, 200), (3000, 20), (9000, 20)])
def test_many_kernels_in_turn_get_the_share(release_lab, functions, kernel_us):
    # a model's step launches hundreds or thousands of kernels (an XLA step thousands of fused
    # ones): each one's cost is learnt once (its first launch waits for the stream's queue) and
    # kept, so after the first round they pipeline as one kernel's launches do.  With 8192
    # entries, 9000 kernels of 20 us in turn got 12.4 %: each launch of an evicted one waited
    # for the queue again, every round.  The first round (a warm-up: 3000 of 20 us took ~0.35 s)
    # is left out
    res = release_lab.run("init", "ctx", "0", "bench", "1.5", f"fns:{functions}", "bench", "3",
                          f"fns:{functions}", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US=str(kernel_us))
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[1]
    assert rc == 0 and launches > functions, res.stdout + res.stderr
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"{functions} kernels of {kernel_us} us in turn: {got:.1f}%"


@pytest.mark.parametrize("grid", ["100", "5"])
def test_a_changed_graphs_launches_still_get_the_share(release_lab, grid):
    # once the changed graph's first launch is measured, its stream's estimate is that launch's
    # time (not joined to the old 1 ms at a quarter's weight), and its launches queue by it:
    # 100 ms or 5 ms launches get the share from the change on
    res = release_lab.run("init", "ctx", "0", "gpeak", "5", "1500", "1000", "300", grid, "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, worst) = res.of("peak")[0]
    assert rc == 0 and launches > 10, res.stdout + res.stderr
    got = res.values("after")[0] / 10
    assert abs(got - 30) <= TOLERANCE, f"{grid} ms launches got {got:.1f}% after the change"
    assert worst <= 400, f"the GPU was {worst / 10:.1f}% busy over 1.5 s under a 30% limit"


@pytest.mark.parametrize("how", ["update", "update1", "kernel", "kernel1", "node", "child", "enable",
                                 "memcpy", "memset", "host"])
@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr"])
def test_each_way_to_change_an_executable_graph_makes_its_cost_unknown(lab, how, api):
    res = lab.run("init", "ctx", "0", "gset", how, "4", api=api, CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="100", LIBCUDA_LOG_LEVEL="3")
    assert res.rc("gset") == 0, res.stdout + res.stderr
    changed = res.stderr.count("changed: its next launches wait for their stream's queue")
    # "enable" disables its second node before the first launch, then enables it
    assert changed == (2 if how == "enable" else 1), res.stderr[-2000:]


@pytest.mark.parametrize("how", ["update", "kernel", "enable"])
def test_without_a_compute_limit_graph_changes_are_passed_through(lab, how):
    res = lab.run("init", "ctx", "0", "gset", how, "4", FAKE_CUDA_KERNEL_US="100", LIBCUDA_LOG_LEVEL="3")
    assert res.rc("gset") == 0, res.stdout + res.stderr
    assert "changed: its next launches" not in res.stderr


def test_a_failed_graph_update_changes_nothing(lab):
    # the driver refuses the update (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE): its answer, and the
    # executable's launches keep their measured cost
    res = lab.run("init", "ctx", "0", "gset", "update", "4", CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="100", LIBCUDA_LOG_LEVEL="3",
                  FAKE_CUDA_FAIL="cuGraphExecUpdate:0:910")
    assert res.rc("gset") == 910
    assert "changed: its next launches" not in res.stderr


@pytest.mark.parametrize("kernel_us", [20, 1000])
def test_graph_loops_of_a_steady_trip_count_get_the_share(release_lab, kernel_us):
    # the shorter queue of such graphs must not starve them: tiny loops still pipeline
    seconds = 3
    res = release_lab.run("init", "ctx", "0", "cpeak", str(seconds), "1500", "0", "100000", "1",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US=str(kernel_us))
    rc, (launches, _) = res.of("peak")[0]
    assert rc == 0, res.stdout + res.stderr
    got = 100.0 * launches * kernel_us / 1e6 / seconds
    assert abs(got - 30) <= TOLERANCE, f"limit 30%, {kernel_us} us loops got {got:.1f}%"


@pytest.mark.parametrize(("kind", "env", "us"), [("copy", "FAKE_CUDA_COPY_US", 2000),
                                                 ("hostfn", "FAKE_CUDA_HOSTFN_US", 2000),
                                                 ("copyattr", "FAKE_CUDA_COPY_US", 2000),
                                                 ("copy3dattr", "FAKE_CUDA_COPY_US", 2000),
                                                 ("hostfn2", "FAKE_CUDA_HOSTFN_US", 2000),
                                                 ("waitcopy", "FAKE_CUDA_COPY_US", 4000),
                                                 ("prefetch", "FAKE_CUDA_COPY_US", 2000),
                                                 ("prefetchbatch", "FAKE_CUDA_COPY_US", 2000),
                                                 ("decompress", "FAKE_CUDA_COPY_US", 2000)])
@pytest.mark.parametrize("api", ["direct", "procaddr", "ptsz"])
def test_copies_host_functions_and_waits_between_kernels_are_not_charged_as_kernel_time(
        release_lab, kind, env, us, api):
    # before each 2 ms kernel its stream does other work: a 2 ms async copy, a 2 ms host
    # function, or a wait for a 4 ms copy on another stream (JAX's copy streams; a shorter one
    # overlaps the kernels queued ahead).  An interval ran from one event of the stream to the
    # next, and the throttle keeps up to 20 ms queued, so that work was charged as kernel time:
    # the kernels got 16.8 % of the GPU at a 30 % limit in each case (a 2 ms managed-memory
    # prefetch too, single or CUDA 13.0's batch, a 2 ms batch on the decompression engine, and
    # CUDA 13.2's copies with attributes and cuLaunchHostFunc_v2, hooked since 2026-12-06); now
    # 30.7 %.  The hooks of those calls mark the stream, and its next launch ends the gap with an
    # event of its own
    got = share(release_lab, 2.0, kind, api=api, CUDA_DEVICE_SM_LIMIT="30",
                FAKE_CUDA_KERNEL_US="2000", **{env: str(us)})
    assert abs(got - 30) <= TOLERANCE, f"{kind}: measured {got:.1f}%"


def test_a_memset_before_a_copy_is_still_charged(release_lab):
    # a 2 ms memset (kernel time: it may run as a kernel) then a copy before each 2 ms kernel:
    # the copy's gap took the memset with it, charged nothing (a review's find: 61.5 % of the
    # GPU at a 30 % limit); now a memset keeps the next launch from ending a gap: 33.6 % (one
    # interval in ten or so starts on an idle stream, after its memset: uncharged, as always, and
    # more often on a busy machine, hence the wider bound)
    got = share(release_lab, 2.0, "memsetcopy", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                FAKE_CUDA_MEMSET_US="2000")
    assert abs(got - 30) <= 2 * TOLERANCE, f"measured {got:.1f}%"


@pytest.mark.parametrize("api", ["direct", "procaddr", "ptsz"])
def test_a_memset_without_a_stream_before_a_copy_is_still_charged(release_lab, api):
    # cuMemsetD8 and its kin take no stream: for device memory they are asynchronous with
    # respect to the host all the same, queued on the legacy stream (the per-thread one for the
    # _ptds variants), and were not hooked, so a 2 ms one before a copy fell into the copy's
    # gap as the async memsets did: 61.5 % of the GPU at a 30 % limit (direct, cuGetProcAddress
    # and _ptds alike).  Now they keep the next launch from ending a gap: 33.6 %, as the async ones
    got = share(release_lab, 2.0, "smemsetcopy", api=api, CUDA_DEVICE_SM_LIMIT="30",
                FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_MEMSET_US="2000")
    assert abs(got - 30) <= 2 * TOLERANCE, f"{api}: measured {got:.1f}%"


def test_work_between_kernels_is_told_apart_under_the_sanitizers_too(lab):
    # the same path (the mark, the gap's event, its measurement) in the ASan/UBSan build
    got = share(lab, 1.0, "copy", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                FAKE_CUDA_COPY_US="2000")
    assert abs(got - 30) <= 2 * TOLERANCE, f"measured {got:.1f}%"


def test_threads_racing_on_one_stream_cannot_hide_a_kernel_in_a_gap(release_lab):
    # two threads launch 2 ms kernels on one stream, one of them with an async copy before each;
    # each launch sits 3 ms inside the driver after queueing its kernel.  A gap's event recorded
    # meanwhile by the other thread came after that kernel, which fell into the gap, charged
    # nothing (40.5-40.7 % at a 30 % limit before the fix); now a launch between its begin and its
    # end's record leaves the stream's interval as it is: 30.8-31.0 %
    res = release_lab.run("init", "ctx", "0", "mbenchone", "2", "2", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_SLEEP="cuLaunchKernelAfter:3")
    rc, (launches, kernel_ns, wall_ns) = res.of("mbenchone")[0]
    assert rc == 0 and launches > 0, res.stdout + res.stderr
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


def test_without_a_limit_work_between_kernels_takes_the_streams_time(release_lab):
    # the control: the copies do hold the stream, half its time here
    got = share(release_lab, 1.0, "copy", FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_COPY_US="2000")
    assert abs(got - 50) <= TOLERANCE, f"measured {got:.1f}%"


@pytest.mark.parametrize("kind", ["ex", "coop", "graph", "multi"])
def test_every_launch_api_is_throttled(release_lab, kind):
    got = share(release_lab, 1.5, kind, CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    assert abs(got - 30) <= TOLERANCE, f"{kind}: measured {got:.1f}%"


def test_a_multi_device_cooperative_launch_is_throttled_on_each_device(release_lab):
    # cuLaunchCooperativeKernelMultiDevice (deprecated, still exported) was not hooked: its
    # kernels ran at 100 % under a 30 % limit.  Two devices, each limited to 30 %: the fake
    # counts both devices' kernel time, so 60 % of one device's wall time.  One call needs
    # both budgets, so it errs on the strict side: 26-31 % per device (throttled one inside
    # the other, the first stream's intervals spanned the second's waits: 17 %)
    got = share(release_lab, 1.5, "multi2", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                FAKE_CUDA_DEVICES="GPU-aaaaaaaa-0000-1111-2222-333333333333=16g,"
                                  "GPU-bbbbbbbb-0000-1111-2222-333333333333=16g")
    assert 2 * (30 - 2 * TOLERANCE) <= got <= 2 * (30 + TOLERANCE), f"two devices: measured {got:.1f}%"


@pytest.mark.parametrize("green", [False, True], ids=["primary-current", "green-current"])
def test_a_launch_on_a_primary_context_stream_from_a_green_context_is_throttled(release_lab, green):
    # with a green context current, a context-less kernel on a stream of the primary context:
    # keyed by the primary context for memory, the green context looked like the stream's own,
    # so the throttle did not switch to it, its events could not be recorded there, and the
    # launches ran at 100 % under 30 % (review helper-38)
    pre = ["green", "0", "greencur", "capcur"] if green else []
    res = release_lab.run("init", "ctx", "0", *pre, "xbench", "1.5", "0", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000")
    rc, (_launches, kernel_ns, wall_ns, _home) = res.of("xbench")[0]
    assert rc == 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


def test_launches_in_a_green_context_are_throttled(release_lab):
    # a green context's CUcontext is measured as its device's primary context
    res = release_lab.run("init", "ctx", "0", "green", "0", "greencur", "bench", "1.5", "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    rc, (_launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and res.rc("greencur") == 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


@pytest.mark.parametrize("limit", [None, "30"])
def test_a_multi_device_launch_the_driver_refuses_returns_its_error(lab, limit):
    # no list, a NULL stream, more entries than devices: the driver's CUDA_ERROR_INVALID_VALUE,
    # with or without a limit, and nothing else happens
    res = lab.run("init", "ctx", "0", "multibad", "launch", CUDA_DEVICE_SM_LIMIT=limit)
    assert res.of("multibad") == [(1, [1, 1])]
    assert res.rc("launch") == 0


@pytest.mark.parametrize("api", ["direct", "dlsym", "procaddr"])
@pytest.mark.parametrize("kind", ["launch1", "grid", "gridasync"])
def test_the_cuda_2_launches_are_throttled(release_lab, kind, api):
    # cuLaunch, cuLaunchGrid, cuLaunchGridAsync: cuda.h no longer declares them, the driver
    # still exports them (and cuGetProcAddress hands them out at cudaVersion 2000); unhooked,
    # they ran at 100 % under a 30 % limit
    got = share(release_lab, 1.5, kind, api=api, CUDA_DEVICE_SM_LIMIT="30",
                FAKE_CUDA_KERNEL_US="1000")
    assert abs(got - 30) <= TOLERANCE, f"{kind} via {api}: measured {got:.1f}%"


def test_per_thread_default_stream_launches_are_throttled(release_lab):
    got = share(release_lab, 1.5, api="ptsz", CUDA_DEVICE_SM_LIMIT="30",
                FAKE_CUDA_KERNEL_US="1000")
    assert abs(got - 30) <= TOLERANCE


def test_sm_limit_holds_under_asan(asan_lab):
    got = share(asan_lab, 1.5, CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000")
    assert abs(got - 30) <= TOLERANCE


def test_processes_of_a_container_share_one_compute_budget(release_lab):
    lab = release_lab
    env = {"CUDA_DEVICE_SM_LIMIT": "30", "FAKE_CUDA_KERNEL_US": "1000"}
    lab.run("init", **env)  # create the region with the limit
    procs = [lab.start("init", "ctx", "0", "bench", "2", "kernel", **env) for _ in range(2)]
    total = 0.0
    for proc in procs:
        _rc, (_launches, kernel_ns, wall_ns) = lab.finish(proc).of("bench")[0]
        total += 100.0 * kernel_ns / wall_ns
    assert abs(total - 30) <= TOLERANCE, f"two processes together: {total:.1f}%"


# ---- ranks that synchronise across devices ----------------------------------------------------
#
# Tensor- or data-parallel ranks, one per GPU of the container, end each step in a collective
# (the fake's: its kernel spins until every rank's has started, as NCCL's do).  Paced one device
# at a time, the spin of a rank whose peer waits for its budget is charged as the GPU time it is;
# the rank then waits (100/C - 1) times as long while the peer's next collective spins: under 50 %
# the waits grow without end (25 steps in 38 s at 40 %, then a collective never met).  A launch
# now waits for the furthest-ahead clock of the container's devices under the same limit.

def multi_gpu(n: int) -> str:
    return ",".join(f"GPU-{c * 8}-0000-1111-2222-333333333333=16g" for c in "abcdefgh"[:n])


def run_ranks(lab, ranks: int, limit: str, steps: int, **env: str) -> list:
    env = {"CUDA_DEVICE_SM_LIMIT": limit, "FAKE_CUDA_DEVICES": multi_gpu(ranks),
           "FAKE_CUDA_RANKS": str(ranks), "FAKE_CUDA_COLLECTIVE_WAIT_MS": "3000", **env}
    lab.run("init", **env)
    procs = [lab.start("init", "ctx", str(r), "tp", str(steps), "4",
                       FAKE_CUDA_KERNEL_US=str(1000 + 200 * r // (ranks - 1)), **env)
             for r in range(ranks)]
    return [lab.finish(p, timeout=120).of("tp")[0] for p in procs]


@pytest.mark.parametrize(("ranks", "limit", "steps"), [(2, "40", 150), (2, "20", 80), (4, "40", 100)])
def test_tensor_parallel_ranks_under_a_limit_keep_stepping(release_lab, ranks, limit, steps):
    # 4 kernels of 1.0 to 1.2 ms per rank and step: at best a step takes 4 x 1.2 ms / C.  Quiet,
    # they take 1.0-1.05 times that; on a loaded machine up to 3 times (a rank that misses its
    # peer's latest charge goes ahead once), never a stall
    ideal_s = steps * 4 * 1.2e-3 * 100 / int(limit)
    for rank, (rc, (done, busy_ns, wall_ns)) in enumerate(run_ranks(release_lab, ranks, limit, steps)):
        assert rc == 0 and done == steps, f"rank {rank}: {done} of {steps} steps, rc {rc}"
        assert wall_ns / 1e9 <= 3 * ideal_s, f"rank {rank}: {wall_ns / 1e9:.2f} s for {ideal_s:.2f}"
        share = 100.0 * busy_ns / wall_ns  # its device's time, spins included
        assert share <= int(limit) + TOLERANCE, f"rank {rank}: {share:.1f}% at {limit}%"


def test_tensor_parallel_ranks_under_different_limits_keep_stepping(release_lab):
    # devices under different limits (CUDA_DEVICE_SM_LIMIT_<i>) wait for each other too: ganged
    # only under equal limits, 40 % and 35 % did 16 steps in 7.7 s, then never met (review)
    ideal_s = 100 * 4 * 1.2e-3 * 100 / 35
    results = run_ranks(release_lab, 2, "40", 100, CUDA_DEVICE_SM_LIMIT_0="40", CUDA_DEVICE_SM_LIMIT_1="35")
    for rank, (rc, (done, _busy, wall_ns)) in enumerate(results):
        assert rc == 0 and done == 100, f"rank {rank}: {done} of 100 steps, rc {rc}"
        assert wall_ns / 1e9 <= 3 * ideal_s, f"rank {rank}: {wall_ns / 1e9:.2f} s for {ideal_s:.2f}"


def test_a_debt_left_by_processes_that_went_is_paid_by_the_next(release_lab):
    # the region goes idle between the processes; its device's clock used to be zeroed then, so
    # three processes in turn, each ending with a 1 s kernel at 20 %, ran back to back: 100 %
    lab = release_lab
    env = {"CUDA_DEVICE_SM_LIMIT": "20", "FAKE_CUDA_KERNEL_US": "1000000"}
    start = time.monotonic()
    for _ in range(3):
        res = lab.run("init", "ctx", "0", "launch", "1", "sync", **env)
        assert res.rc("launch") == 0 and res.rc("sync") == 0
    took = time.monotonic() - start
    # the second and third wait off the 4 s each kernel before them owes
    assert took >= 8.5, f"3 x 1 s kernels at 20 % in {took:.2f} s"


def test_a_bad_gang_value_is_reported_and_the_ranks_still_wait_together(release_lab):
    for rc, (done, _busy, _wall) in run_ranks(release_lab, 2, "40", 60, GPUSLICE_SM_LIMIT_GANG="maybe"):
        assert rc == 0 and done == 60
    res = release_lab.run("init", CUDA_DEVICE_SM_LIMIT="40", GPUSLICE_SM_LIMIT_GANG="maybe")
    assert "ignoring GPUSLICE_SM_LIMIT_GANG value 'maybe' (expected on or off)" in res.stderr


def test_ranks_paced_one_device_at_a_time_stall(release_lab):
    # GPUSLICE_SM_LIMIT_GANG=off: the old pacing, kept as a switch for containers whose devices
    # run unrelated work; with ranks that synchronise it stalls, which this shows
    results = run_ranks(release_lab, 2, "40", 150, GPUSLICE_SM_LIMIT_GANG="off",
                        FAKE_CUDA_COLLECTIVE_WAIT_MS="1500")
    assert any(rc == 702 or done < 150 for rc, (done, _, _) in results), results


@pytest.mark.parametrize("gang", ["on", "off"])
def test_unrelated_work_on_two_devices_gets_the_limit_on_each(release_lab, gang):
    # the gang does not cost unrelated processes their share: 20 ms kernels on one device, 50 us
    # ones on the other, each at about 30 %
    lab = release_lab
    env = {"CUDA_DEVICE_SM_LIMIT": "30", "FAKE_CUDA_DEVICES": multi_gpu(2), "GPUSLICE_SM_LIMIT_GANG": gang}
    lab.run("init", **env)
    procs = [lab.start("init", "ctx", str(d), "bench", "3", "own", FAKE_CUDA_KERNEL_US=us, **env)
             for d, us in ((0, "20000"), (1, "50"))]
    for d, proc in enumerate(procs):
        _rc, (_n, kernel_ns, wall_ns) = lab.finish(proc).of("bench")[0]
        got = 100.0 * kernel_ns / wall_ns
        assert abs(got - 30) <= TOLERANCE, f"device {d}, gang {gang}: {got:.1f}%"


def test_a_device_whose_processes_went_no_longer_holds_the_others(release_lab):
    # a process on device 1 ends after a 1 s kernel at 20 %, leaving its clock 4 s ahead: that
    # debt is the device's, and held device 0's unrelated process for it (4.6 % over 6 s) until
    # the sampler saw no live process on device 1 any more
    lab = release_lab
    env = {"CUDA_DEVICE_SM_LIMIT": "20", "FAKE_CUDA_DEVICES": multi_gpu(2)}
    lab.run("init", **env)
    steady = lab.start("init", "ctx", "0", "touch", str(lab.tmp / "steady"), "bench", "6", "own",
                       FAKE_CUDA_KERNEL_US="1000", **env)
    lab.wait_for(lab.tmp / "steady")  # launching on device 0 before device 1's process starts
    res = lab.run("init", "ctx", "1", "bench", "0.001", "kernel", FAKE_CUDA_KERNEL_US="1000000", **env)
    assert res.rc("bench") == 0
    _rc, (_n, kernel_ns, wall_ns) = lab.finish(steady).of("bench")[0]
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 20) <= TOLERANCE, f"device 0 beside device 1's leftover debt: {got:.1f}%"


def test_without_a_limit_launches_are_not_slowed(release_lab):
    got = share(release_lab, 0.5, FAKE_CUDA_KERNEL_US="20")
    assert got > 95
    assert release_lab.region().devices[0].busy_ns == 0  # nothing measured on the fast path


def test_sm_limit_100_means_no_throttling(release_lab):
    assert share(release_lab, 0.5, CUDA_DEVICE_SM_LIMIT="100", FAKE_CUDA_KERNEL_US="20") > 95


def test_measured_gpu_time_is_recorded_for_the_agent(release_lab):
    lab = release_lab
    share(lab, 1.0, CUDA_DEVICE_SM_LIMIT="50", FAKE_CUDA_KERNEL_US="1000")
    busy = lab.region().devices[0].busy_ns
    assert 0.4e9 <= busy <= 0.6e9  # about half of one second


def test_launches_on_a_capturing_stream_pass_straight_through(release_lab):
    res = release_lab.run("init", "ctx", "0", "capture", "200", CUDA_DEVICE_SM_LIMIT="10",
                          FAKE_CUDA_KERNEL_US="10000")
    rc, (elapsed_ns,) = res.of("capture")[0]
    assert rc == 0
    # 200 kernels of 10 ms at 10% would take 20 s if paced; captured, nothing waits
    assert elapsed_ns < 1e9


# ---- clock compensation (GPUSLICE_SM_LIMIT_MODE=throughput, the default) --------------------
#
# The fake NVML plays a GPU with a 700 W limit whose board power is idle + utilisation x the
# kernels' full-duty draw. With 1360 W of dynamic draw at 30% duty (the H200's bf16 matmul at
# boost clock, about), full duty would need 2.3x the power headroom, so the clock under full
# load would be cbrt(2.3) ~ 1.31x lower: GPU time is charged that many times over.

H200ISH = {"FAKE_NVML_POWER_LIMIT_MW": "700000", "FAKE_NVML_IDLE_MW": "100000",
           "FAKE_NVML_DYNAMIC_MW": "1360000"}


def expected_scale(power_mw: float, limit_mw: float, idle_mw: float, util: float) -> float:
    """The model of clockcomp.c, written independently: cube root of full-duty power over headroom."""
    ratio = (power_mw - idle_mw) * 100 / util / (limit_mw - idle_mw)
    return min(max(ratio, 1.0) ** (1 / 3), 1.75)


def settled_bench(lab, limit: int, **env: str) -> tuple[int, int, int]:
    """(launches, kernel ns, wall ns) over 2 s, after 2.5 s for the clock estimate to settle."""
    env.setdefault("FAKE_CUDA_KERNEL_US", "2000")
    res = lab.run("init", "ctx", "0", "bench", "2.5", "kernel", "bench", "2", "kernel",
                  CUDA_DEVICE_SM_LIMIT=str(limit), **env)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[1]
    assert rc == 0 and launches > 0, res.stdout + res.stderr
    return launches, kernel_ns, wall_ns


def steady_share(lab, limit: int, **env: str) -> tuple[float, int]:
    """Share of wall time once the estimate has settled, and the scale."""
    _launches, kernel_ns, wall_ns = settled_bench(lab, limit, **env)
    return 100.0 * kernel_ns / wall_ns, lab.region().devices[0].sm_scale_milli


def test_boosted_kernels_are_charged_at_the_full_load_clock(release_lab):
    got, scale = steady_share(release_lab, 30, **H200ISH)
    # The steady state: the share is 30 / s, and s follows from the power at that share. Idle
    # power was not seen (busy from the start), so the library assumes limit / 8.
    want = 1.0
    for _ in range(50):
        util = 30 / want
        want = expected_scale(100_000 + util / 100 * 1_360_000, 700_000, 87_500, util)
    # the fake's utilisation windows are coarse (the throttle paces in 20 ms batches): +-0.07
    assert abs(scale / 1000 - want) <= 0.07, f"scale {scale}, model {want:.3f}"
    assert abs(got - 30 / want) <= 2.0, f"time share {got:.1f}%, want {30 / want:.1f}%"


def test_work_that_fits_the_power_limit_at_full_duty_gets_its_plain_time_share(release_lab):
    got, scale = steady_share(release_lab, 30, **{**H200ISH, "FAKE_NVML_DYNAMIC_MW": "500000"})
    assert scale == 1000
    assert abs(got - 30) <= TOLERANCE


def test_time_mode_turns_the_compensation_off(release_lab):
    got, scale = steady_share(release_lab, 30, GPUSLICE_SM_LIMIT_MODE="time", **H200ISH)
    assert scale == 0
    assert abs(got - 30) <= TOLERANCE


def test_managed_containers_ignore_time_mode(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "2.5", "kernel", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="2000", GPUSLICE_POD_UID="uid-1",
                          GPUSLICE_SM_LIMIT_MODE="time", **H200ISH)
    assert "ignoring GPUSLICE_SM_LIMIT_MODE=time" in res.stderr
    assert release_lab.region().devices[0].sm_scale_milli > 1200


def test_a_bad_mode_is_reported_and_the_default_applies(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "2.5", "kernel", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="2000", GPUSLICE_SM_LIMIT_MODE="fast", **H200ISH)
    assert "ignoring GPUSLICE_SM_LIMIT_MODE value 'fast'" in res.stderr
    assert release_lab.region().devices[0].sm_scale_milli > 1200


@pytest.mark.parametrize(("power", "util", "want"), [
    (508_000, 30, None),   # boosted at 30% duty
    (700_000, 50, None),   # at the limit at half duty: full duty would need twice the headroom
    (700_000, 100, 1000),  # fully busy at the limit: already the full-load clock
    (300_000, 90, 1000),   # memory-bound: full duty stays under the limit
    (700_000, 5, 1750),    # implausible: clamped
    (600_000, 3, 0),       # too little utilisation to say anything: no estimate
])
def test_scale_from_fixed_readings(release_lab, power, util, want):
    release_lab.run("init", "ctx", "0", "sleep", "1800", CUDA_DEVICE_SM_LIMIT="30",
                    FAKE_NVML_POWER_LIMIT_MW="700000", FAKE_NVML_POWER_MW=str(power),
                    FAKE_NVML_UTIL=str(util))
    if want is None:
        want = round(1000 * expected_scale(power, 700_000, 87_500, util))
    assert abs(release_lab.region().devices[0].sm_scale_milli - want) <= 2


def test_idle_power_is_learned_from_idle_samples(release_lab):
    release_lab.run("init", "ctx", "0", "sleep", "1700", CUDA_DEVICE_SM_LIMIT="30",
                    FAKE_NVML_POWER_LIMIT_MW="700000", FAKE_NVML_IDLE_MW="90000")
    dev = release_lab.region().devices[0]
    assert dev.idle_power_mw == 90_000
    assert dev.sm_scale_milli == 0  # nothing ran: no estimate


def test_without_power_readings_the_plain_time_share_applies(release_lab):
    got, scale = steady_share(release_lab, 30)  # the fake NVML reports no power by default
    assert scale == 0
    assert abs(got - 30) <= TOLERANCE


def test_clock_compensation_under_asan(asan_lab):
    got, scale = steady_share(asan_lab, 30, **H200ISH)
    assert 1250 <= scale <= 1450
    assert 19 <= got <= 26


# ---- the closed loop: throughput against a GPU whose clock follows its power limit ----------
#
# With FAKE_GPU_EXPONENT set, the fake GPU runs at 1980 MHz unless its kernels, at the
# utilisation of the last 50 ms, would draw more than the 700 W limit (100 W idle + u x 1433 W x
# (f / 1980)^exponent); then at the clock where they fit. Kernels take 2 ms at 1980 MHz and
# proportionally longer below (memory-bound ones: 2 ms at any clock). Fully busy, this GPU runs
# at 1481 MHz (exponent 3): the H200's bf16 matmul, roughly (1515 MHz at full load, ~1950-1980
# when throttled). Throughput = kernels completed per second, against the full-load figure
# computed from the same model.

CLOCKED = {"FAKE_NVML_POWER_LIMIT_MW": "700000", "FAKE_NVML_IDLE_MW": "100000",
           "FAKE_NVML_DYNAMIC_MW": "1433000", "FAKE_CUDA_KERNEL_US": "2000"}


def full_load_rate(exponent: float = 3.0, dynamic_mw: float = 1_433_000,
                   memory_bound: bool = False) -> float:
    """Kernels per second with the GPU fully busy, from the fake's model."""
    if memory_bound:
        return 500.0
    return 500.0 * min(1.0, (600_000 / dynamic_mw) ** (1 / exponent))


def throughput_share(lab, limit: int, exponent: float = 3.0, memory_bound: bool = False,
                     **env: str) -> float:
    """% of the full-load throughput once the estimate has settled."""
    env = {**CLOCKED, "FAKE_GPU_EXPONENT": str(exponent), **env}
    if memory_bound:
        env["FAKE_GPU_MEMBOUND"] = "1"
    launches, _kernel_ns, wall_ns = settled_bench(lab, limit, **env)
    rate = launches / (wall_ns / 1e9)
    return 100.0 * rate / full_load_rate(exponent, float(env["FAKE_NVML_DYNAMIC_MW"]), memory_bound)


@pytest.mark.parametrize("limit", [10, 30, 50])
def test_compensated_limit_gives_its_share_of_full_load_throughput(release_lab, limit):
    got = throughput_share(release_lab, limit)
    assert abs(got - limit) <= 3, f"limit {limit}%: {got:.1f}% of the full-load throughput"


def test_plain_time_share_overdelivers_on_an_idle_gpu(release_lab):
    # what GPUSLICE_SM_LIMIT_MODE=time (and HAMi-like time slicing) gives: the boost clock's worth
    got = throughput_share(release_lab, 30, GPUSLICE_SM_LIMIT_MODE="time")
    assert got >= 36, f"{got:.1f}%"


@pytest.mark.parametrize("exponent", [2.5, 3.5])
def test_compensation_holds_when_power_does_not_follow_the_cube_law(release_lab, exponent):
    # the library assumes power ~ clock^3; a GPU that follows ^2.5 or ^3.5 still gets 30 +- 3
    got = throughput_share(release_lab, 30, exponent)
    assert abs(got - 30) <= 3, f"exponent {exponent}: {got:.1f}%"


def test_memory_bound_work_under_the_power_limit_gets_its_share(release_lab):
    got = throughput_share(release_lab, 30, memory_bound=True, FAKE_NVML_DYNAMIC_MW="500000")
    assert abs(got - 30) <= 3, f"{got:.1f}%"


def test_memory_bound_work_over_the_power_limit_is_under_delivered(release_lab):
    # A known limit of the model (interposer/README.md): kernels that would exceed the power
    # limit at full duty but whose time does not depend on the clock are charged for a boost
    # that does not speed them up: ~22% instead of 30.
    got = throughput_share(release_lab, 30, memory_bound=True)
    assert 18 <= got <= 26, f"{got:.1f}%"


# ---- robustness of the measurement ----------------------------------------------------------

def test_a_launch_waits_for_a_kernel_of_unknown_cost_only_so_long(lab):
    # the second launch waits for the first kernel to learn its cost, but at most 50 ms: a kernel
    # that waits for the host (a stream wait on a flag set after the next launch) must not
    # deadlock the program; before, the second launch returned only when the 2 s kernel ended
    start = time.monotonic()
    res = lab.run("init", "ctx", "0", "launch", "2", CUDA_DEVICE_SM_LIMIT="50",
                  FAKE_CUDA_KERNEL_US="2000000")
    assert res.rc("launch") == 0
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("sync", ["sync", "ctxsync13", "ctxsyncnull"])
def test_the_last_work_of_a_process_is_charged_at_its_synchronisation(release_lab, sync):
    # one 100 ms kernel per process, then a synchronisation and exit: each is charged (before,
    # work was measured only at the next launch, which never came: such processes ran unlimited).
    # ctxsync13 / ctxsyncnull: CUDA 13.0's cuCtxSynchronize_v2 (what cuGetProcAddress gives for
    # "cuCtxSynchronize" at 13000), with the current context or NULL; unhooked, 0 ms was charged
    lab = release_lab
    for _ in range(4):
        res = lab.run("init", "ctx", "0", "launch", "1", sync, CUDA_DEVICE_SM_LIMIT="50",
                      FAKE_CUDA_KERNEL_US="100000")
        assert (res.rc("launch"), res.rc(sync)) == (0, 0)
    busy_ms = lab.region().devices[0].busy_ns / 1e6
    assert 380 <= busy_ms <= 420, f"{busy_ms:.0f} ms of GPU time charged for 400 ms"


def test_a_failed_event_record_does_not_charge_idle_time(lab):
    # the third record (the start of the second launch's interval) fails: before, the interval
    # ran from the first launch's end event and charged the second of idle time between them
    res = lab.run("init", "ctx", "0", "launch", "1", "sleep", "1000", "launch", "1", "sync",
                  "launch", "1", "sync", CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_FAIL="cuEventRecord:3:999")
    assert [rc for rc, _ in res.of("launch")] == [0, 0, 0]
    busy_ms = lab.region().devices[0].busy_ns / 1e6
    assert busy_ms < 50, f"{busy_ms:.0f} ms charged for two 10 us kernels"


def test_no_gap_after_a_failed_record_hides_the_kernel_it_would_have_ended(lab):
    # three 500 ms kernels on one stream, a copy before the third; the second's end event fails
    # to record (the 4th record).  Its kernel is charged to the next interval, but the copy's gap
    # ended there and it fell in (1000 ms charged for 1500, a review's find); now no gap is
    # ended until a launch's end is recorded again
    lab.run("init", "ctx", "0", "launch", "1", "launch", "1", "copies", "1", "launch", "1", "sync",
            CUDA_DEVICE_SM_LIMIT="99", FAKE_CUDA_KERNEL_US="500000", FAKE_CUDA_FAIL="cuEventRecord:4:999")
    busy_ms = lab.region().devices[0].busy_ns / 1e6
    assert abs(busy_ms - 1500) < 50, f"{busy_ms:.0f} ms charged for three 500 ms kernels"


def test_failing_event_queries_leak_no_events(lab):
    res = lab.run("init", "ctx", "0", "launch", "2000", "events", CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="1", FAKE_CUDA_FAIL="cuEventQuery:0:999")
    assert res.rc("launch") == 0
    assert res.values("events")[0] <= 3 * 64, res.values("events")


def test_a_full_event_ring_makes_its_newest_event_cover_more_launches(release_lab):
    # 10 s kernels: each launch waits 50 ms for the queue, so the host runs ahead of the GPU and
    # the 64-event ring is full after about 3.2 s; the launches after that re-record its newest
    # event (no event leaks, no launch refused)
    res = release_lab.run("init", "ctx", "0", "launch", "70", "events", CUDA_DEVICE_SM_LIMIT="99",
                          FAKE_CUDA_KERNEL_US="10000000", LIBCUDA_LOG_LEVEL="3")
    assert res.rc("launch") == 0
    assert "the newest event now covers" in res.stderr
    assert res.values("events")[0] <= 64 + 2 + 66


def test_a_global_capture_that_fails_to_begin_leaves_the_throttle_on(release_lab):
    # a global capture is counted before the driver is called (event queries stop in every
    # thread); a refused begin must take the count back, or every later launch passes
    # unmeasured (100 % with the decrement removed)
    res = release_lab.run("init", "ctx", "0", "capture", "1", "bench", "1.5", "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                          FAKE_CUDA_FAIL="cuStreamBeginCapture_v2:1:999")
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0
    assert abs(100.0 * kernel_ns / wall_ns - 30) <= TOLERANCE


def test_a_launch_from_inside_a_global_capture_begin_does_not_deadlock(lab):
    # a profiler's API callback may launch (or synchronise) inside cuStreamBeginCapture: the
    # begin held the throttle's lock across the driver call, and the launch waited for it in
    # the same thread forever
    res = lab.run("init", "ctx", "0", "capture", "1", "bench", "1", "kernel", timeout=30,
                  CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                  FAKE_CUDA_CAPTURE_REENTER="1")
    assert res.rc("capture") == 0
    assert res.rc("bench") == 0


@pytest.mark.parametrize("callback", ["cuEventRecord:sync", "cuEventQuery:sync",
                                      "cuEventRecord:launch", "cuEventQuery:launch"])
def test_a_driver_callback_inside_the_throttles_event_calls_does_not_deadlock(lab, callback):
    # a profiler's API callback on the events the throttle records and queries under its lock
    # that synchronises or launches: the nested hook waited for that lock in the same thread.
    # It passes through now, unmeasured (the sampler charges nested launches from NVML: see
    # test_launches_from_a_driver_callback_inside_the_throttles_event_calls_are_charged)
    res = lab.run("init", "ctx", "0", "bench", "1", "kernel", timeout=30, CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="1000", FAKE_CUDA_API_CALLBACK=callback)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0
    assert re.search(r"fake: api callbacks [1-9]", res.stderr), res.stderr
    if callback.endswith("sync"):  # no work of its own: the share holds
        # on the strict side by about 2 points (each event record waits for the GPU inside
        # the callback): 27-28 % alone, 24.4-26.8 % while the 2-core machine was busier
        share = 100.0 * kernel_ns / wall_ns
        assert 30 - 2 * TOLERANCE <= share <= 30 + TOLERANCE


@pytest.mark.parametrize("callback", ["cuEventRecord:launch", "cuEventQuery:launch", "cuEventRecord:launchown",
                                      "cuEventQuery:launchown"])
def test_launches_from_a_driver_callback_inside_the_throttles_event_calls_are_charged(release_lab, callback):
    # a launch from a profiler's API callback (CUPTI, say) on the events the throttle records and
    # queries under its lock cannot wait for that lock: it passed through unmeasured and unpaid,
    # so a tenant subscribing such a callback ran kernels of its own for free inside the
    # throttle's event queries: 37.1 % (legacy stream) and 44.8 % (a stream of its own) of the
    # fake GPU under a 30 % limit, 62-136 % with the kernels running concurrently.  It is now
    # charged from NVML's per-process figure beyond what the events measured, as a launch a
    # capture keeps from being measured.  The callbacks on the event queries had a tail: the
    # queue wait polled the head's event every 0.1 ms, each poll queued a callback's kernel
    # behind which the program's own waited, so one launch's wait queued up to 500 of them
    # (1,400 callback kernels for 29 of the program's own in 4 s), paid only at the sampler's
    # next look: 24-25 % mostly, but up to 47.6 % where such a flood came at the end of the
    # run.  The wait now polls every 10 ms once its queries set off a callback's launch: 3.1
    # callback kernels per launch of the program's, 330 of its own, 32.3-33.4 % over 20 runs
    # beside two busy helpers (the first half second runs before the sampler's first look);
    # the callbacks on the event records (kernels inside measured intervals) still 30 %
    res = release_lab.run("init", "ctx", "0", "bench", "4", "kernel", timeout=30, CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000", FAKE_CUDA_SERIAL="1",
                          FAKE_CUDA_API_CALLBACK=callback)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0
    callbacks = re.search(r"fake: api callbacks ([1-9]\d*)", res.stderr)
    assert callbacks, res.stderr
    assert int(callbacks[1]) <= 8 * launches, f"{callback}: {callbacks[1]} callback kernels for {launches}"
    got = 100.0 * kernel_ns / wall_ns
    assert 30 - 3 * TOLERANCE <= got <= 30 + TOLERANCE, f"{callback}: measured {got:.1f}%"


def test_a_context_a_callback_makes_inside_the_throttles_event_calls_is_booked_afterwards(lab):
    # the callback makes and destroys a context: forgetting it in the throttle took the
    # throttle's lock that the thread held (hung).  Context calls from a callback under a lock
    # of ours pass straight through and are booked, in order, once the lock is released
    res = lab.run("init", "ctx", "0", "bench", "1", "kernel", "meminfo", "phys", timeout=30,
                  CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                  FAKE_CUDA_API_CALLBACK="cuEventQuery:ctx", FAKE_CUDA_CTX_BYTES="10m")
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0
    assert "fake: api callback cuEventQuery ctx 0" in res.stderr
    assert abs(100.0 * kernel_ns / wall_ns - 30) <= TOLERANCE
    free, total = res.values("meminfo")
    assert total - free == res.values("phys")[0] == 10 * (1 << 20)


def test_a_primary_context_a_callback_retains_inside_the_throttles_event_calls_is_charged(lab):
    # retained from a callback under the throttle's lock, it passed through unbooked: once the
    # created context (whose memory the reconcile had counted) went, 100 MiB were held and 0
    # charged, for good (a later retain finds it active and charges nothing)
    res = lab.run("init", "ctxcreate", "0", "bench", "0.5", "kernel", "meminfo", "phys",
                  "ctxdestroy", "0", "ctx", "0", "meminfo", "phys", timeout=30,
                  CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_CTX_BYTES="100m",
                  CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                  FAKE_CUDA_API_CALLBACK="cuEventQuery:retain")
    assert "fake: api callback cuEventQuery retain 0" in res.stderr
    for k in range(2):
        free, total = res.values("meminfo", k)
        assert total - free == res.values("phys", k)[0], res.stdout
    assert res.values("phys", 1)[0] == 100 * (1 << 20)


def test_a_callback_syncing_inside_a_limit_change_and_one_retaining_inside_a_launch_do_not_deadlock(
        lab):
    # thread B changes a limit (holding the context lock) and its callback synchronises (it
    # waited for the throttle's lock); thread A launches (holding the throttle's lock) and its
    # callback retains the primary context (it waited for the context lock): hung.  A hook
    # reached from a callback under a lock of ours never waits for the context lock now
    res = lab.run("init", "ctx", "0", "bgsetlimit", "8m", "50", "sleep", "100", "bench", "1",
                  "kernel", "join", timeout=30, CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="1000",
                  FAKE_CUDA_API_CALLBACK="cuCtxSetLimit:sync,cuEventQuery:retain",
                  FAKE_CUDA_SLEEP="cuCtxSetLimit:300")
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[0]
    assert rc == 0 and launches > 0 and res.rc("bgsetlimit") == 0
    assert abs(100.0 * kernel_ns / wall_ns - 30) <= TOLERANCE


def test_a_callback_allocating_inside_the_throttles_event_calls_and_a_release_do_not_deadlock(lab):
    # a thread launching graphs, whose callback allocates near the cap inside the throttle's
    # event queries (it held the throttle's lock and waited for the context lock to
    # reconcile), while the main thread releases the primary context (it held the context lock
    # and waited for the throttle's to forget the context): hung.  The reconcile is skipped
    # under the throttle's lock, and the release forgets after the context lock
    res = lab.run("init", "ctx", "0", "alloc", "800m", "gcapture", "4m", "ginst", "flags",
                  "glaunch", "bgglaunch", "100", "sleep", "100", "release", "0", "join",
                  timeout=30, CUDA_DEVICE_MEMORY_LIMIT="1g", FAKE_CUDA_CTX_BYTES="100m",
                  CUDA_DEVICE_SM_LIMIT="10", FAKE_CUDA_KERNEL_US="5000",
                  FAKE_CUDA_API_CALLBACK="cuEventQuery:alloc", FAKE_CUDA_API_CALLBACK_BYTES="10m",
                  FAKE_CUDA_SLEEP="cuDevicePrimaryCtxRelease:600")
    assert res.rc("release") == 0
    assert res.rc("bgglaunch") in (0, CUDA_ERROR_INVALID_CONTEXT)  # its context went meanwhile
    assert "fake: api callback cuEventQuery alloc 0" in res.stderr


@pytest.mark.parametrize("how", ["captureother", "recaptureother"])
@pytest.mark.parametrize("sm_limit", ["30", None], ids=["limited", "no-limit"])
def test_a_global_capture_in_one_thread_is_not_invalidated_by_launches_in_another(lab, sm_limit, how):
    # in global capture mode the driver forbids event queries in every thread, and one would
    # invalidate the capture (PyTorch's CUDA graphs capture in global mode): while a capture is
    # on, other threads' launches pass through unmeasured.  CUDA 13.3's recapture into an
    # existing graph too: unhooked, it went uncounted and the capture was invalidated
    # (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, 901, at its end)
    res = lab.run("init", "ctx", "0", how, "50", CUDA_DEVICE_SM_LIMIT=sm_limit,
                  FAKE_CUDA_CAPTURE_STRICT="1")
    assert res.of(how) == [(0, [0, 0])], res.stdout


def test_a_global_capture_begun_while_a_context_is_settled_before_its_destroy_waits(lab):
    # a context's destroy first synchronises it (its work measured while its events can be
    # read), outside the throttle's lock; a global capture another thread began during that
    # synchronisation was invalidated by it (as the driver does; here the fake, strict).  The
    # begin now waits until no context is being synchronised so
    mark = lab.tmp / "syncing"
    res = lab.run("init", "ctx", "0", "ctxcreate", "0", "launch", "1", "bgcapture", str(mark), "600",
                  "ctxdestroy", "0", "join", CUDA_DEVICE_SM_LIMIT="50", FAKE_CUDA_KERNEL_US="200000",
                  FAKE_CUDA_SLEEP="cuCtxSynchronize:400", FAKE_CUDA_SLEEP_MARK=str(mark),
                  FAKE_CUDA_CAPTURE_STRICT="1", FAKE_CUDA_CAPTURE_SYNC="1", timeout=60)
    assert res.rc("ctxdestroy") == 0, res.stdout + res.stderr
    begin, (end, waited_ms) = res.of("bgcapture")[0]
    assert (begin, end) == (0, 0)  # 901: invalidated
    assert waited_ms >= 300  # it began once the 400 ms synchronisation had ended


@pytest.mark.parametrize("destroy", [["ctxcreate", "0", "launch", "1", "ctxdestroy", "0"],
                                     ["launch", "1", "reset", "0"]], ids=["destroy", "primary-reset"])
def test_a_global_capture_a_callback_begins_inside_the_settle_before_a_destroy_does_not_hang(lab, destroy):
    # a context's destroy (or a primary reset) first synchronises it, counted as a settle that a
    # global capture's begin waits for; a profiler's callback inside that very synchronisation
    # that began a global capture waited for its own thread's settle for ever (hung)
    res = lab.run("init", "ctx", "0", *destroy, timeout=30, CUDA_DEVICE_SM_LIMIT="30",
                  FAKE_CUDA_KERNEL_US="100000", FAKE_CUDA_API_CALLBACK="cuCtxSynchronize:capture")
    assert res.rc(destroy[-2]) == 0, res.stdout + res.stderr
    assert "fake: api callback cuCtxSynchronize capture 0" in res.stderr


# ---- launches a capture keeps from being measured ---------------------------------------------
#
# While a capture that forbids event queries is on (global mode in any thread, thread-local mode
# in the launching one), launches cannot be measured.  They still wait for the budget, pay the
# last measured launch's GPU time in advance, and the sampler charges what NVML's per-process
# utilisation finds them running beyond that (slices.c).  Before, a program that began a global
# capture on a stream of its own and never ended it ran at 100 % under a 30 % limit.


def ran_share(res) -> float:
    """Kernel time the fake GPU ran (not merely queued) between the first and last "ran", in %."""
    (_, (ran0, t0)), (_, (ran1, t1)) = res.of("ran")[0], res.of("ran")[-1]
    return 100.0 * (ran1 - ran0) / (t1 - t0)


@pytest.mark.parametrize(("mode", "before"), [("0", ["bench", "1", "own"]), ("0", []), ("1", ["bench", "1", "own"])],
                         ids=["global", "global-no-history", "thread-local"])
def test_a_capture_held_open_does_not_lift_the_limit(release_lab, mode, before):
    # 2 ms kernels on a stream of its own, a capture held open on another stream all along.  With
    # no launch measured before, the first launches pay nothing in advance and fill the driver's
    # queue (2 s on the fake): the share is taken after it
    warm = ["bench", "2", "own"] if not before else []
    res = release_lab.run("init", "ctx", "0", *before, "hold", mode, *warm, "ran", "bench", "4", "own", "ran",
                          "unhold", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1")
    assert res.rc("hold") == 0 and res.rc("unhold") == 0  # the capture was not invalidated
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"capture mode {mode}: {got:.1f}%"


@pytest.mark.parametrize("mode", ["0", "1"], ids=["global", "thread-local"])
def test_a_capture_whose_stream_is_destroyed_forbids_queries_no_longer(release_lab, mode):
    # a capture never ended, its stream destroyed (an error path), then 2 ms kernels with no
    # NVML figure to charge unmeasured launches by: the capture stayed counted for good, every
    # launch went unmeasured and unpaced
    res = release_lab.run("init", "ctx", "0", "hold", mode, "holdgone", "bench", "1", "own", "ran", "bench", "4",
                          "own", "ran", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_PROC_UTIL="off")
    assert res.rc("hold") == 0 and res.rc("holdgone") == 0
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"capture mode {mode}: {got:.1f}%"


@pytest.mark.parametrize("mode", ["0", "1"], ids=["global", "thread-local"])
def test_a_capture_whose_context_is_destroyed_forbids_queries_no_longer(release_lab, mode):
    # the same with the stream's context destroyed (its streams, and their captures, with it),
    # then the primary context's launches
    res = release_lab.run("init", "ctxcreate", "0", "hold", mode, "ctxdestroy", "0", "ctx", "0", "bench", "1",
                          "own", "ran", "bench", "4", "own", "ran", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_PROC_UTIL="off")
    assert res.rc("hold") == 0 and res.rc("ctxdestroy") == 0
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"capture mode {mode}: {got:.1f}%"


@pytest.mark.parametrize("mode", ["0", "1", "2"], ids=["global", "thread-local", "relaxed"])
def test_a_capture_into_the_programs_graph_is_counted_as_any_other(release_lab, mode):
    # cuStreamBeginCaptureToGraph (CUDA 12.3+) held open in a green context, then begun again on
    # the same stream once ended: never invalidated, and the launches beside it held to the
    # limit (a regression check: found sound)
    res = release_lab.run("init", "ctx", "0", "green", "0", "greencur", "bench", "1", "own", "holdg", mode, "ran",
                          "bench", "3", "own", "ran", "unhold", "holdg", mode, "unhold",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_CAPTURE_STRICT="1")
    assert [rc for rc, _ in res.of("holdg") + res.of("unhold")] == [0, 0, 0, 0]
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"capture mode {mode}: {got:.1f}%"


@pytest.mark.parametrize("mode", ["0", "1"], ids=["global", "thread-local"])
def test_a_capture_begun_beside_64_others_held_open_is_not_invalidated(lab, mode):
    # 64 relaxed captures held open on streams of their own (they forbid no query), then one that
    # does: the table of captures held 64, so the 65th went uncounted, the throttle queried its
    # events meanwhile and the driver invalidated the capture (its end 901)
    res = lab.run("init", "ctx", "0", "holds", "64", "2", "hold", mode, "bench", "0.3", "own", "unhold",
                  "unholds", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                  FAKE_CUDA_CAPTURE_STRICT="1")
    assert res.of("holds") == [(0, [64])] and res.rc("hold") == 0
    assert res.rc("unhold") == 0  # the capture was not invalidated
    assert res.rc("unholds") == 0


def test_a_capture_held_open_beside_another_process_gets_its_share(release_lab):
    # the events would count the co-tenant's slices; NVML's per-process figure does not
    res = release_lab.run("init", "ctx", "0", "bench", "3", "own", "hold", "0", "ran", "bench", "4", "own", "ran",
                          "unhold", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                          FAKE_CUDA_CAPTURE_STRICT="1", **COTENANT)
    assert res.rc("unhold") == 0
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"beside a co-tenant: {got:.1f}%"


def test_launches_under_a_capture_are_paced_by_the_advance_without_nvml(release_lab):
    # no per-process figure (NVML without the call): the advance payment alone, at the last
    # measured launch's GPU time, paces them (with no launch measured before, only the device's
    # utilisation would, below)
    res = release_lab.run("init", "ctx", "0", "bench", "1", "own", "hold", "0", "ran", "bench", "4", "own",
                          "ran", "unhold", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_PROC_UTIL="off")
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"without NVML's figure: {got:.1f}%"


# NVML's per-process query answering NOT_FOUND for good, or failing from the start: before, the
# device's utilisation never stood in (only a 2 s silence, and the next one), 99.9 % of the GPU
NVML_SILENT = {"off": {"FAKE_NVML_PROC_UTIL": "off"}, "mps": {"FAKE_NVML_PROC_UTIL": "mps"},
               "not_found": {"FAKE_NVML_PROC_PERIOD_MS": "100000000"},
               "failing": {"FAKE_NVML_PROC_FAIL_AFTER_MS": "1"}}


@pytest.mark.parametrize("nvml", sorted(NVML_SILENT))
def test_graphs_under_a_capture_cannot_outrun_a_one_kernel_advance_without_nvmls_figure(release_lab, nvml):
    # the dodge: learn a one-kernel estimate (2 ms), open a thread-local capture on a stream of
    # its own, then launch graphs of 4 kernels: each pays the 2 ms advance, and with no
    # per-process figure for the process (NVML without the call; or MPS, where every kernel is
    # the server's) nothing settled the rest: 99.9 % of the GPU under a 30 % limit.  Now the
    # device's utilisation stands in for the process's share: 29-35 % over the first 5 s, however
    # the run lines up with the sampler's ticks (the charge lags the work by a tick; with NVML's
    # own figure 23-29 %).  31-42 % while the fake NVML read 0 % at its first utilisation query:
    # the capture's first tick, whose advances were then all given back
    res = release_lab.run("init", "ctx", "0", "bench", "1", "own", "hold", "1", "ran", "bench", "5", "graph",
                          "ran", "unhold", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_UTIL_RATES="1", **NVML_SILENT[nvml])
    assert res.rc("unhold") == 0
    got = ran_share(res)
    assert 30 - TOLERANCE <= got <= 30 + 2 * TOLERANCE, f"{nvml}: {got:.1f}%"


@pytest.mark.parametrize("nvml", ["off", "mps"])
def test_launches_under_a_capture_with_no_launch_measured_before_are_paced_without_nvmls_figure(
        release_lab, nvml):
    # no launch measured before the capture: no advance at all, so without a per-process figure
    # nothing paced them (86 % at 30 % in a review); the device's utilisation stands in: 38 %
    # over 5 s, the first tick's work running ahead of the charge
    res = release_lab.run("init", "ctx", "0", "hold", "1", "ran", "bench", "5", "graph", "ran", "unhold",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_PROC_UTIL=nvml, FAKE_NVML_UTIL_RATES="1")
    assert res.rc("unhold") == 0
    got = ran_share(res)
    assert 30 - TOLERANCE <= got <= 30 + 2 * TOLERANCE, f"{nvml}: {got:.1f}%"


def test_launches_under_a_capture_with_no_launch_measured_before_are_paced_while_the_sampler_runs_late(
        release_lab):
    # as above (NVML without the per-process call), each utilisation query taking 5 ms: the
    # sampler's rounds come ~10 ms later over two, as on a loaded machine (43.1 % seen at load
    # ~9).  The launch that first waits for the charge stamps the last unmeasured launch ~5 ms
    # after a round; the round whose span starts 1 s later is fresh by ~7 ms on time, not
    # fresh once the rounds are late, and the device's figure is dropped a round early: 42.8 %
    # for 35.0 % (3 ms late: 34.8 %).  The tail is 1.25 s now (slices.c): 35.0, 34.8 and
    # 34.3 % with the rounds 0, 5 and 20 ms late
    res = release_lab.run("init", "ctx", "0", "hold", "1", "ran", "bench", "5", "graph", "ran", "unhold",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000", FAKE_CUDA_CAPTURE_STRICT="1",
                          FAKE_NVML_PROC_UTIL="off", FAKE_NVML_UTIL_RATES="1", FAKE_NVML_UTIL_SLEEP_MS="5")
    assert res.rc("unhold") == 0
    got = ran_share(res)
    assert 30 - TOLERANCE <= got <= 30 + 2 * TOLERANCE, f"rounds late: {got:.1f}%"


def test_launches_under_a_capture_are_charged_with_the_time_slice_correction_off(release_lab):
    res = release_lab.run("init", "ctx", "0", "hold", "0", "bench", "2", "own", "ran", "bench", "4", "own", "ran",
                          "unhold", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="2000",
                          FAKE_CUDA_CAPTURE_STRICT="1", GPUSLICE_SM_TIMESLICE_CORRECTION="off",
                          GPUSLICE_SM_LIMIT_MODE="time")
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"correction off: {got:.1f}%"


@pytest.mark.parametrize(("streams", "seconds", "limit"), [(1, 2, 30), (4, 2, 30), (2, 6, 30)])
def test_streams_whose_kernels_wait_for_each_other_are_charged_their_union(release_lab, streams,
                                                                           seconds, limit):
    # FAKE_CUDA_SERIAL: the process's kernels run one at a time, so a kernel queued on one stream
    # waits for the others' and its interval includes that wait; charged per stream, N streams
    # got 30/N% or less (measured before: 30.8, 20.1, 11.3% for 1, 2, 4 streams).  The 6 s run
    # outlives the timeline's 5 s reference event, which is then re-based on a newer one.
    # Four such streams ran a little under their share (23.7-31.0 % seen, 24.9 % once in CI):
    # a launch that gives up its queue wait pays an advance, which was given back only after
    # it had been waited off, and partly lost; a wait for the budget now measures the streams
    # holding one (`-k given_back_late`), and four streams hold the limit as one does.
    res = release_lab.run("init", "ctx", "0", "mbench", str(seconds), str(streams),
                          CUDA_DEVICE_SM_LIMIT=str(limit), FAKE_CUDA_SERIAL="1",
                          FAKE_CUDA_KERNEL_US="2000", LIBCUDA_LOG_LEVEL="3")
    rc, (launches, kernel_ns, wall_ns) = res.of("mbench")[0]
    assert rc == 0 and launches > 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - limit) <= TOLERANCE, f"{streams} streams: {got:.1f}%"
    assert ("timeline re-based" in res.stderr) == (seconds > 5)


def test_many_streams_waiting_for_each_other_are_not_held_back_by_advances_given_back_late(release_lab):
    # 16 threads, each on a stream of its own, kernels run one at a time: a stream's kernel
    # waits behind the others', so its interval (and the per-launch estimate taken from it) is
    # 20-50 ms for a 2 ms kernel.  A launch that gives up its queue wait pays the queued work's
    # estimate in advance (70-260 ms of clock each), given back once the work is measured; but
    # the threads waiting for the budget measured nothing until the clock had passed, so the
    # advances were waited off first and then given back below the idle credit, lost: 8.9-11.4 %
    # under a 30 % limit.  A wait for the budget now measures the streams holding an advance
    # every 10 ms: 31.2 %
    res = release_lab.run("init", "ctx", "0", "mbench", "3", "16", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_SERIAL="1", FAKE_CUDA_KERNEL_US="2000")
    rc, (launches, kernel_ns, wall_ns) = res.of("mbench")[0]
    assert rc == 0 and launches > 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"16 streams: {got:.1f}%"


def test_the_17th_context_with_work_gets_a_timeline_of_its_own(release_lab):
    # 16 green contexts with a kernel each (measured as contexts of their own, each with a
    # timeline), then a 17th whose 2 streams' kernels wait for each other: the table of 16
    # timelines left it none, so each stream was charged its own intervals, not their union:
    # 17.7-22.4 % under 30 %
    res = release_lab.run("init", "ctx", "0", "greens", "16", "0", "greenswork", "sleep", "300", "greens", "1", "0",
                          "greencur", "capcur", "mbench", "2", "2", CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_SERIAL="1",
                          FAKE_CUDA_KERNEL_US="2000")
    assert res.of("greens") == [(0, [16]), (0, [1])] and res.rc("greenswork") == 0
    rc, (launches, kernel_ns, wall_ns) = res.of("mbench")[0]
    assert rc == 0 and launches > 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"the 17th context: {got:.1f}%"


# ---- beside another process: its time slices are not ours ----------------------------------
#
# FAKE_GPU_COTENANT_SLICE_US: another process keeps the fake GPU busy and the GPU time-slices
# between the two (2 ms each, as without MPS), so an interval between two of our events also
# holds the other's slices.  Measured as is, the limit gives half the share; the library
# charges only the share NVML's per-process utilisation gives the process (slices.c).  The
# share is kernel time / wall time of this process once the correction has settled.

COTENANT = {"FAKE_GPU_COTENANT_SLICE_US": "2000"}


def test_after_a_capture_beside_another_process_its_time_is_not_charged(release_lab):
    # NVML's per-process figure works here: a span with no sample of ours is one this process
    # did not run, and the device's utilisation (the co-tenant's time) must not stand in for it
    # (the dodge's fallback is only for processes NVML never had a figure for).  A capture held
    # for 1 s of launches, then 2 s idle, then 2 s of launches beside the busy co-tenant
    res = release_lab.run("init", "ctx", "0", "bench", "2", "own", "hold", "0", "bench", "1", "own", "unhold",
                          "sleep", "2000", "ran", "bench", "2", "own", "ran", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000", FAKE_CUDA_CAPTURE_STRICT="1", FAKE_NVML_UTIL_RATES="1",
                          **COTENANT)
    assert res.rc("unhold") == 0
    got = ran_share(res)
    assert abs(got - 30) <= TOLERANCE, f"after the capture: {got:.1f}%"


def settled_share(lab, limit: int, runs: tuple[str, ...] = ("2", "2"), **env: str) -> float:
    """Share (%) over the last of several back-to-back benches."""
    env.setdefault("FAKE_CUDA_KERNEL_US", "1000")
    cmds = [part for seconds in runs for part in ("bench", seconds, "kernel")]
    res = lab.run("init", "ctx", "0", *cmds, CUDA_DEVICE_SM_LIMIT=str(limit), **env)
    rc, (launches, kernel_ns, wall_ns) = res.of("bench")[-1]
    assert rc == 0 and launches > 0, res.stdout + res.stderr
    return 100.0 * kernel_ns / wall_ns


@pytest.mark.parametrize(("limit", "kernel_us"), [(30, 1000), (10, 5000), (50, 300)])
def test_beside_a_busy_process_the_container_gets_its_share(release_lab, limit, kernel_us):
    got = settled_share(release_lab, limit, FAKE_CUDA_KERNEL_US=str(kernel_us), **COTENANT)
    assert abs(got - limit) <= TOLERANCE, f"limit {limit}%: {got:.1f}% beside a busy process"


@pytest.mark.parametrize("frame", ["55888", "1048576"], ids=["nvml-580", "1MiB"])
def test_the_sampler_thread_has_room_for_nvmls_stack(lab, frame):
    # On an H200 (driver 580.159.04) every process under a compute limit died of SIGSEGV within
    # a second: the sampler thread, whose stack was 64 KiB (the static TLS of the process's
    # libraries taken out of it), asks NVML for per-process utilisation, and NVML keeps that
    # control call's 55,888 bytes of parameters on the caller's stack.  The fake takes as much
    # (FAKE_NVML_STACK_BYTES), and a driver taking 1 MiB must fit too
    got = settled_share(lab, 30, FAKE_NVML_STACK_BYTES=frame, **COTENANT)
    assert abs(got - 30) <= TOLERANCE, f"{got:.1f}% beside a busy process"


@pytest.mark.parametrize("mode", ["nvml", "off"])
def test_the_agent_sees_the_container_own_gpu_time(release_lab, mode):
    # the region's busy time (the agent's busy-seconds and measured-share metrics) is the
    # container's own GPU time: uncorrected it would be twice what its kernels ran
    res = release_lab.run("init", "ctx", "0", "bench", "4", "kernel", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000", GPUSLICE_SM_TIMESLICE_CORRECTION=mode,
                          **COTENANT)
    _rc, (_launches, kernel_ns, _wall_ns) = res.of("bench")[0]
    ratio = release_lab.region().devices[0].busy_ns / kernel_ns
    # corrected from ~1 s on (the first ticks learn): ~1.2; uncorrected: ~2
    assert (ratio <= 1.35) if mode == "nvml" else (ratio >= 1.7), f"busy / kernel time {ratio:.2f}"


def test_charging_the_other_process_slices_halves_the_share(release_lab):
    # what the events measure uncorrected (and what the library did before): ~15% for 30
    got = settled_share(release_lab, 30, GPUSLICE_SM_TIMESLICE_CORRECTION="off", **COTENANT)
    assert 12 <= got <= 19, f"{got:.1f}%"


@pytest.mark.parametrize("driver", ["off", "mps", "device"])
def test_per_process_figures_that_are_no_split_of_time_change_nothing(release_lab, driver):
    # off: NVML cannot say; mps: every kernel is the server's, none is ours; device: each
    # process reported at the device's utilisation (the shares overlap, so they are not slices)
    got = settled_share(release_lab, 30, FAKE_NVML_PROC_UTIL=driver, **COTENANT)
    assert 12 <= got <= 19, f"{driver}: {got:.1f}%"


def test_short_bursts_beside_a_busy_process_are_not_over_delivered(release_lab):
    # one burst's coarse figures (NVML truncates to whole percents) once set a factor of 1/3
    # that the next burst ran with: 16.6, 45.1, 34.1, 32.8% for four 0.6 s bursts
    cmds = []
    for _ in range(3):
        cmds += ["bench", "0.6", "kernel", "sleep", "900"]
    res = release_lab.run("init", "ctx", "0", *cmds, "bench", "0.6", "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000", **COTENANT)
    shares = [100.0 * k / w for _rc, (_n, k, w) in res.of("bench")]
    # alone, such bursts get ~32.5% (the idle credit); nothing may go past that by much
    assert max(shares) <= 36, shares


@pytest.mark.parametrize(("knob", "value"), [("FAKE_NVML_PROC_PERIOD_MS", "1000"),
                                             ("FAKE_NVML_PROC_ROOM", "100")])
def test_drivers_that_sample_slowly_or_want_room_for_100(release_lab, knob, value):
    # a 1 s sample period: every other tick finds nothing new (NVML_ERROR_NOT_FOUND), which once
    # reset the correction each time (19.7%); some drivers always ask for room for 100 samples
    got = settled_share(release_lab, 30, ("3", "3"), **{knob: value}, **COTENANT)
    assert abs(got - 30) <= TOLERANCE, f"{knob}={value}: {got:.1f}%"


def test_garbage_rows_among_the_samples_are_left_out(release_lab):
    # a driver listing rows of garbage among its samples (nvtop issue #110: utilisations in the
    # tens of thousands, timestamps decades old, rows of zeros; FAKE_NVML_PROC_GARBAGE): they
    # are no process's share, nor the newest sample seen
    res = release_lab.run("init", "ctx", "0", "bench", "2", "kernel", "bench", "2", "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                          FAKE_NVML_PROC_GARBAGE="1", LIBCUDA_LOG_LEVEL="4", **COTENANT)
    _rc, (_launches, kernel_ns, wall_ns) = res.of("bench")[-1]
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"{got:.1f}% beside a busy process"
    assert "(1 ran)" in res.stderr and "(2 ran)" not in res.stderr, res.stderr[-2000:]


def test_a_driver_under_reporting_our_share_cannot_take_more_than_half_off(release_lab):
    # NVML reporting 80% of our true share: beside one busy process an interval holds at most
    # one of its slices per slice of ours, so at most half is removed (without that: 38%)
    got = settled_share(release_lab, 30, FAKE_NVML_PROC_BIAS="80", **COTENANT)
    assert got <= 30 + TOLERANCE, f"{got:.1f}%"


def test_the_correction_ends_when_the_other_process_leaves(release_lab):
    # it leaves 2.5 s into the run; after a transition second the plain limit holds again
    got = settled_share(release_lab, 30, ("2.5", "1", "2"), FAKE_GPU_COTENANT_MS="2500",
                        **COTENANT)
    assert abs(got - 30) <= TOLERANCE, f"{got:.1f}% after the other process left"


@pytest.mark.parametrize("others", [5, 7])
def test_beside_many_busy_processes_the_container_gets_its_share(release_lab, others):
    # n busy processes taking turns: a fixed floor of 1/4 on the factor charged (1 + n) / 4
    # times too much, 6.5-7.7% and 4.7-5.0% at a 10% limit.  Now 9.2-9.4% (6 runs each before
    # and after the container-level correction); one CI run measured 7.3% over a 3 s window
    # on a loaded machine, so the settled window is 5 s
    got = settled_share(release_lab, 10, ("2", "5"), FAKE_GPU_COTENANTS=str(others), **COTENANT)
    assert abs(got - 10) <= 2.5, f"{got:.1f}% beside {others} busy processes"


def test_a_factor_is_dropped_when_nvml_stops_answering(release_lab):
    # the per-process query fails from 1.6 s on while the other process leaves at 2.5 s: the
    # factor learnt beside it stayed for good (60% at a 30% limit, alone)
    res = release_lab.run("init", "ctx", "0", "bench", "2.5", "kernel", "bench", "1", "kernel",
                          "bench", "4", "kernel", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000", FAKE_GPU_COTENANT_MS="2500",
                          FAKE_NVML_PROC_FAIL_AFTER_MS="1600", LIBCUDA_LOG_LEVEL="3", **COTENANT)
    _rc, (_launches, kernel_ns, wall_ns) = res.of("bench")[-1]
    got = 100.0 * kernel_ns / wall_ns
    assert got <= 30 + TOLERANCE, f"{got:.1f}% alone after NVML stopped answering"
    assert "time-slice factor 1000/1000" in res.stderr


def test_alone_on_the_gpu_nothing_is_corrected(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "1.5", "kernel", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_KERNEL_US="1000", LIBCUDA_LOG_LEVEL="3")
    assert "time-slice factor" not in res.stderr
    assert "device slot 0: ours" not in res.stderr  # no other process: nothing to learn


def test_in_a_container_pid_namespace_the_host_pid_is_used(release_lab):
    # NVML's pids are the host's; ours is learnt when the context appears in its process list
    got = settled_share(release_lab, 30, FAKE_NVML_PID_OFFSET="100000", FAKE_CUDA_CTX_BYTES="64m",
                        **COTENANT)
    assert abs(got - 30) <= TOLERANCE, f"{got:.1f}%"


def test_an_unknown_host_pid_corrects_nothing(release_lab):
    # another pid namespace and no memory in NVML's list to learn ours from: getpid() matches
    # no sample, so nothing is learnt
    got = settled_share(release_lab, 30, FAKE_NVML_PID_OFFSET="100000", **COTENANT)
    assert 12 <= got <= 19, f"{got:.1f}%"


def test_a_cotenant_sample_under_a_pid_equal_to_ours_is_not_taken_for_ours(release_lab):
    # host pids in NVML's lists, ours unknown (the context holds no memory it lists), and another
    # tenant listed under our getpid() before our first context, running 2% of the time beside
    # a busy one: the reconcile no longer took getpid() for ours, but the sampler still matched
    # it to that tenant's samples, and learnt from 2% that most of our measured time was
    # others' (the container got twice its limit)
    other, env = release_lab.cotenant_under_our_pid()
    got = settled_share(release_lab, 30, **{**env, "FAKE_CUDA_CTX_BYTES": "0"}, FAKE_GPU_COTENANT_SELF_PCT="2",
                        **COTENANT)
    other.kill()
    release_lab.finish(other)
    assert 12 <= got <= 19, f"{got:.1f}%"  # uncorrected, as with no pid (test above)


def test_the_correction_holds_in_time_mode_and_under_asan(asan_lab):
    got = settled_share(asan_lab, 30, GPUSLICE_SM_LIMIT_MODE="time", **COTENANT)
    assert abs(got - 30) <= TOLERANCE, f"{got:.1f}%"


def test_a_bad_correction_value_is_reported_and_the_correction_stays_on(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "2", "kernel", "bench", "2", "kernel",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000",
                          GPUSLICE_SM_TIMESLICE_CORRECTION="maybe", **COTENANT)
    assert "ignoring GPUSLICE_SM_TIMESLICE_CORRECTION value 'maybe'" in res.stderr
    _rc, (_launches, kernel_ns, wall_ns) = res.of("bench")[-1]
    assert abs(100.0 * kernel_ns / wall_ns - 30) <= TOLERANCE


# FAKE_GPU_SHARED: the processes of the test share one fake GPU that runs one kernel at a time,
# in the order they were queued (the state file holds its timeline), and the fake NVML reports
# each process's share.  Processes of one container wake for the same budget and launch
# together, so each one's intervals also hold the other's kernels.

def shared_gpu_total(lab, processes: int, settle: str = "2", **env: str) -> float:
    """Sum of the processes' shares over 4 s once the correction has settled."""
    env = {"CUDA_DEVICE_SM_LIMIT": "30", "FAKE_CUDA_KERNEL_US": "1000", "FAKE_GPU_SHARED": "1",
           **env}
    lab.run("init", **env)  # the region, with the limit
    procs = [lab.start("init", "ctx", "0", "bench", settle, "kernel", "bench", "4", "kernel", **env)
             for _ in range(processes)]
    total = 0.0
    for proc in procs:
        rc, (launches, kernel_ns, wall_ns) = lab.finish(proc).of("bench")[1]
        assert rc == 0 and launches > 0
        total += 100.0 * kernel_ns / wall_ns
    return total


@pytest.mark.parametrize(("processes", "tolerance"), [(2, TOLERANCE), (3, 7.0)])
def test_processes_of_a_container_on_one_gpu_do_not_charge_each_other(release_lab, processes,
                                                                       tolerance):
    # three processes and their samplers on a 2-core machine make each one's figures noisier
    # (22-31% seen across runs); uncorrected they get 16%
    got = shared_gpu_total(release_lab, processes)
    assert abs(got - 30) <= tolerance, f"{processes} processes together: {got:.1f}%"


def test_many_processes_of_a_container_on_one_gpu_learn_the_correction_together(release_lab):
    # six processes: each one's share of the GPU is a few whole percents, and alone each one
    # learnt from too few ticks (most under the 5 % measured threshold) or too coarse figures:
    # 12-20 % together.  Learnt from the container's summed shares and measurements (each
    # process publishes its host pid and its measured time in the region), the factor takes
    # about 6 s to settle (the GPU gets busier as it falls); settled, 29.1-30.4 % seen.  With
    # the CPUs busy (six processes and a CPU hog on 2 cores) 6 s failed 2 runs in 6 at
    # 19.7-22.8 %, the library of before the limits file too; 9 s passed 6 in 6
    got = shared_gpu_total(release_lab, 6, settle="9")
    assert abs(got - 30) <= 7.0, f"6 processes together: {got:.1f}%"


def slicesim(built, scenario: str) -> list[int]:
    """``tests/slicesim.c``: slices.c alone, fed scripted figures tick by tick; the factors."""
    out = subprocess.run([str(built / "tests" / "slicesim"), scenario], capture_output=True,
                         text=True, check=True).stdout
    return [int(line.split()[3]) for line in out.splitlines()]


@pytest.mark.parametrize("scenario", ["apart", "lag", "jitter", "rejoin"])
def test_processes_of_a_container_that_never_overlap_are_not_corrected(built, scenario):
    # two processes of one container whose kernels never overlap: each measures what it ran,
    # and NVML agrees (apart); or NVML's samples come a tick after the time they cover (lag:
    # a member that had measured without a sample counted as ~0 and its late sample as another
    # tenant's: factor 630, the container charged 63 % of its time); or NVML's two figures
    # move opposite ways by 5 points (jitter: each member clipped to its measurement per tick,
    # 942); or the other process registers again in another slot (rejoin)
    factors = slicesim(built, scenario)
    assert min(factors[5:]) == 1000, factors
    assert min(factors) >= 880, factors


def test_a_crowd_of_processes_of_a_container_learns_one_factor(built):
    # six processes each measuring 15 % where they ran 4-6 %: 1/3, rounded up to the strict
    # side by the half percent NVML's truncation is taken to have lost
    factors = slicesim(built, "crowd")
    assert all(333 <= f <= 380 for f in factors[4:]), factors


def test_a_process_of_the_container_with_an_unknown_host_pid_counts_uncorrected(built):
    # its samples carry a pid we cannot tell from another tenant's: real = measured for it
    # (15 of 15), ours 5.5 of 15 (rounded back): (15 + 5.5) / 30
    factors = slicesim(built, "unknown")
    assert factors[4:] == [683] * (len(factors) - 4), factors


def slicesim_lines(built, scenario: str) -> list[dict[str, int]]:
    out = subprocess.run([str(built / "tests" / "slicesim"), scenario], capture_output=True,
                         text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        rows.append({parts[i]: int(parts[i + 1]) for i in range(2, len(parts), 2)})
    return rows


MS = 1000  # slicesim prints microseconds


def test_unmeasured_launches_are_charged_what_nvml_finds_beyond_the_measured_time(built):
    # ticks 4-6: nothing measured, NVML 100 % of 500 ms; 7-9: 20 % measured, NVML 50 % (+0.5
    # for its truncation); the 1.25 s after the last such launch (NVML lags, and half a round
    # for a late sampler) only the half point; then nothing.  The span charged starts where the
    # tick's samples began
    rows = slicesim_lines(built, "unmeasured")
    charged = [r["charged_us"] for r in rows]
    assert charged[:4] == [0] * 4
    assert charged[4:7] == [500 * MS] * 3
    assert charged[7:10] == [152500] * 3
    assert all(c <= 2500 for c in charged[10:14]) and charged[14:] == [0] * 2, charged
    assert all(r["since_ms_ago"] == 500 for r in rows if r["charged_us"])


def test_unmeasured_launches_beside_another_process_are_charged_their_real_share(built):
    # the events measure twice what runs (the co-tenant's slices): the learnt factor (about
    # 1/2) applies to what they measured, not to NVML's share, and nothing is learnt meanwhile
    rows = slicesim_lines(built, "unmeasured-cotenant")
    factors = [r["factor"] for r in rows]
    assert factors[3] < 600 and factors[4:10] == [factors[3]] * 6, factors
    assert [r["charged_us"] for r in rows[4:7]] == [252500] * 3
    measured_charged = 0.4 * 500 * MS * factors[3] / 1000
    assert all(abs(r["charged_us"] - (252500 - measured_charged)) <= 1 for r in rows[7:10])


def test_what_unmeasured_launches_paid_in_advance_is_settled_against_nvml(built):
    # 300 ms paid in advance per tick: NVML's 100 % charges 200 more; its 20 % (tick 5) and
    # 50 % beside 20 % measured (ticks 7-9) give back what did not run
    # Advances paid before the first tick (5 s) ran before any span: none of them is given back
    # (they were, as the first span's, and restarts after a silence did it again: review helper-53)
    rows = slicesim_lines(built, "unmeasured-prepaid")
    assert [r["refunded_us"] for r in rows[:4]] == [0] * 4
    assert [(r["charged_us"], r["refunded_us"]) for r in rows[4:10]] == [
        (200 * MS, 0), (0, 197500), (200 * MS, 0), (0, 147500), (0, 147500), (0, 147500)]


def test_queued_unmeasured_work_is_charged_until_it_drains(built):
    # the last unmeasured launch is at tick 9, but its queued work runs (NVML 70 %, 30 measured)
    # to tick 13: charged while it shows, not only for the second after the launch
    rows = slicesim_lines(built, "unmeasured-queued")
    assert [r["charged_us"] for r in rows[10:14]] == [202500] * 4
    assert rows[14]["charged_us"] <= 2500 and rows[15]["charged_us"] == 0


def register_again(lab) -> None:
    """A process under a compute limit taken for dead by another, which reset the region: it
    registers again at its next charge, its sampler running."""
    held, go, again = lab.tmp / "held", lab.tmp / "go", lab.tmp / "again"
    holder = lab.start("init", "ctx", "0", "bench", "1", "kernel", "touch", str(held),
                       "waitfile", str(go), "alloc", "1m", "touch", str(again), "sleep", "300",
                       CUDA_DEVICE_SM_LIMIT="30", CUDA_DEVICE_MEMORY_LIMIT="8g",
                       FAKE_CUDA_KERNEL_US="1000")
    lab.wait_for(held)
    before = [p for p in lab.region().processes if p.pid == holder.pid]
    lab.region_path.write_bytes(encode_region(Region(
        pod_uid="u", pod_name="p", namespace="n", container="c", processes=(),
        devices=(DeviceSlot(index=0, uuid=lab.UUID_A, limit_bytes=8 * GIB, used_bytes=0,
                            sm_limit=30, busy_ns=0),))))
    (go).touch()
    lab.wait_for(again)
    after = [p for p in lab.region().processes if p.pid == holder.pid]
    lab.finish(holder)
    assert len(before) == len(after) == 1
    assert before[0].host_pid == holder.pid  # no pid namespace here: its own pid
    assert before[0].measured_ns[0] > 0.2e9  # 1 s at 30 %, less the first launches
    assert after[0].measured_ns[0] >= before[0].measured_ns[0]


def test_a_process_registering_again_publishes_what_it_measured_so_far(release_lab):
    # another process took this one for dead and reset the region; registering again at its
    # next charge, it writes the GPU time it measured in its life, not 0 (its next debit would
    # otherwise show that whole life to the others as one tick's time)
    register_again(release_lab)


def test_a_process_registering_again_races_its_sampler_on_nothing(tsan_lab):
    # the pid the process registered with was written plainly as it registered again, and read
    # without the lock by the sampler's sweep (region.c's me_unlocked): ThreadSanitizer reported
    # the race in 4 runs of 4
    register_again(tsan_lab)


def test_uncorrected_processes_of_a_container_charge_each_other(release_lab):
    # measured before the correction: 19.7% for two processes, 16.0% for three
    got = shared_gpu_total(release_lab, 3, GPUSLICE_SM_TIMESLICE_CORRECTION="off")
    assert got <= 22, f"{got:.1f}%"


TWO_GPUS = {"FAKE_CUDA_DEVICES": "GPU-aaaaaaaa-0000-1111-2222-333333333333=16g,"
                                 "GPU-bbbbbbbb-0000-1111-2222-333333333333=16g"}


@pytest.mark.parametrize("limits", [{"CUDA_DEVICE_SM_LIMIT_1": "30"}, {"CUDA_DEVICE_SM_LIMIT": "30"}],
                         ids=["only_its_device", "every_device"])
def test_a_context_less_kernel_on_another_contexts_stream_is_throttled_in_that_context(lab, limits):
    # a CUkernel runs in its stream's context: launched on device 1's stream while device 0's
    # context was current, it was charged to device 0 (no limit there) or, its events made in
    # the wrong context, not measured at all: 100 % of device 1 either way
    res = lab.run("init", "ctx", "0", "xbench", "1.5", "1", **TWO_GPUS, **limits,
                  FAKE_CUDA_KERNEL_US="1000")
    rc, (launches, kernel_ns, wall_ns, home_kept) = res.of("xbench")[0]
    assert rc == 0 and launches > 0
    assert home_kept == 1  # the caller's context is current again
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


def test_a_failed_switch_to_the_streams_context_leaves_one_launch_unmeasured(lab):
    # the 6th cuCtxSetCurrent of the process (the probe made three, the first launch two) fails
    # as the library returns to the stream's context after the first launch: its end event was
    # then made in the caller's context, the driver would not record it, and it went back to
    # the stream's spare events, so no later launch was measured either: 100 %
    res = lab.run("init", "ctx", "0", "xbench", "1.5", "1", **TWO_GPUS, CUDA_DEVICE_SM_LIMIT_1="30",
                  FAKE_CUDA_KERNEL_US="1000", FAKE_CUDA_FAIL="cuCtxSetCurrent:6:201")
    rc, (launches, kernel_ns, wall_ns, home_kept) = res.of("xbench")[0]
    assert rc == 0 and launches > 0 and home_kept == 1
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


@pytest.mark.parametrize("begin", ["v2", "v1"])
def test_a_launch_waiting_for_budget_does_not_invalidate_a_global_capture(release_lab, begin):
    # another thread's launch that passed the capture check before a global-mode capture began
    # (PyTorch's default for CUDA graphs) then woke from its budget wait and queried its
    # events: the driver invalidated the capture, 16 of 20 at a 10 % limit.  CUDA 10.0's
    # cuStreamBeginCapture (always global) was not hooked at all: every query went ahead
    program = str(release_lab.build / "tests" / "capturerace")
    proc = release_lab.run_program([program, "20", "30", begin],
                                   CUDA_DEVICE_SM_LIMIT="10", FAKE_CUDA_CAPTURE_STRICT="1",
                                   FAKE_CUDA_KERNEL_US="10000")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["captures", "20", "invalidated", "0", "launcherrors", "0"], \
        proc.stdout + proc.stderr


def test_kernels_longer_than_the_queue_wait_are_paced(release_lab):
    # 400 ms kernels, far longer than the 50 ms a launch waits for its stream's queue: each
    # launch gave up waiting with the kernels before it still unmeasured, so unpaid, and all
    # six (2.4 s of GPU time) were admitted within 300 ms, then ran back to back at 100 %
    # (10 kernels of 500 ms: admitted in 451 ms).  Paced at 30 %, the sixth starts once the
    # five before it are paid for: after about 6.7 s (less the burst allowance)
    res = release_lab.run("init", "ctx", "0", "mark", "launch", "6", "since", "sync", "since",
                          CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="400000")
    admitted = res.values("since", 0)[0]
    assert res.rc("launch") == 0 and res.rc("sync") == 0
    assert admitted >= 4500, admitted


def test_several_contexts_of_one_process_on_one_device_get_the_share(release_lab):
    # three threads, each in a context of its own (cuCtxCreate) beside the primary one: the
    # contexts take turns on the GPU, so each one's intervals held the others' kernels, and
    # the time-slice correction acted only beside another process: 14.8 % at a 30 % limit
    # (two: 20-27 %; four: 13 %, now about 24 %, in the weak list).  Three threads launching on
    # a 2-core machine read 25.0 % once in CI (25.4, 29.6, 26.3 % in three runs after): allowed 7
    # points, as for three processes
    res = release_lab.run("init", "ctx", "0", "mbenchctx", "8", "3", CUDA_DEVICE_SM_LIMIT="30",
                          FAKE_CUDA_SERIAL="1", FAKE_CUDA_KERNEL_US="2000", FAKE_NVML_UTIL_RATES="1")
    rc, (launches, kernel_ns, wall_ns) = res.of("mbenchctx")[0]
    assert rc == 0 and launches > 0
    got = 100.0 * kernel_ns / wall_ns
    assert abs(got - 30) <= 7.0, f"measured {got:.1f}%"


def launchprobe(lab, mode: str, seconds: float, n: int, **env: str) -> float:
    proc = lab.run_program([str(lab.build / "tests" / "launchprobe"), mode, str(seconds), str(n)],
                           timeout=120, **env)
    match = re.fullmatch(rf"{mode} rc=(\d+) launches=(\d+) share=([\d.]+)%\n", proc.stdout)
    assert proc.returncode == 0 and match, proc.stdout + proc.stderr
    assert match[1] == "0" and int(match[2]) > 0, proc.stdout
    return float(match[3])


def test_a_timeline_reference_held_behind_a_stream_wait_does_not_blur_the_timeline(release_lab):
    # a context's timeline places every event at its float milliseconds after a reference event,
    # renewed every 5 s; a renewal recorded after a launch held by a stream wait (or a kernel
    # that runs for hours) never completed, and no other was taken: the old reference aged,
    # and hours later its float milliseconds (a quarter of a millisecond apart at an hour) could
    # not tell 20 us intervals apart, so most were charged nothing.  The fake's event skew plays
    # the hour (the kernels after the wait are an hour after the first reference).  Before:
    # 100.0 % of the fake GPU under a 30 % limit; a reference that has not completed 5 s after
    # its record is now replaced by a new one (30.5 %)
    got = launchprobe(release_lab, "stale", 3, 1, CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="20",
                      FAKE_WAIT_MS="600000", FAKE_CUDA_EVENT_SKEW="10000:3600000")
    assert abs(got - 30) <= TOLERANCE, f"measured {got:.1f}%"


def test_a_long_interval_over_many_small_kernels_of_another_stream_is_charged(release_lab):
    # stream A runs graphs of 1000 kernels of 0.1 ms (100 ms each), a thread launches one
    # 0.1 ms kernel every 500 us on stream B: B's many short segments filled the context's
    # timeline, which merged its two oldest and so counted the gaps between them as charged;
    # A's intervals, spanning them, were charged almost nothing: 97-108 % under 30 %.  The
    # oldest segment is now dropped (charged again if reached back over: the strict side)
    got = launchprobe(release_lab, "segs", 3, 1000, CUDA_DEVICE_SM_LIMIT="30",
                      FAKE_CUDA_KERNEL_US="100", GAP_US="500")
    assert got <= 30 + 2 * TOLERANCE, f"measured {got:.1f}%"


def test_launches_beyond_the_streams_the_throttle_tracks_are_paced(release_lab):
    # 256 streams (every entry the throttle keeps) each hold one kernel behind a stream wait
    # on the host (2 s): an entry with work in flight is never recycled, so launches on one
    # more stream found none, went unmeasured and unpaid: 100 % under 30 %.  They are now paced
    # as the launches a capture keeps from being measured (paid in advance, settled against
    # NVML's per-process figures): 34 %
    got = launchprobe(release_lab, "holders", 1.5, 256, CUDA_DEVICE_SM_LIMIT="30",
                      FAKE_CUDA_KERNEL_US="2000", FAKE_WAIT_MS="2000")
    assert got <= 30 + 2 * TOLERANCE, f"measured {got:.1f}%"


def test_a_launch_behind_a_host_held_stream_is_not_held_for_the_hosts_time(release_lab):
    # a kernel of unknown cost waits behind a stream wait on a flag the host sets only after its
    # next launch; 3 s of host work, then that launch.  Past its 50 ms queue wait it paid in
    # advance what the head could have run since its interval's start was recorded, 3 s, though
    # the GPU had not reached that start: held 3 s times 100/30, 10.2 s, and the container's
    # budget on the device with it.  Nothing has run before the start is reached: held 50 ms
    proc = release_lab.run_program([str(release_lab.build / "tests" / "launchprobe"), "hostheld", "1", "3000"],
                                   timeout=120, CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="40000",
                                   FAKE_WAIT_MS="30000")
    match = re.fullmatch(r"hostheld rc=(\d+) launches=(\d+) share=([\d.]+)% held_ms=(\d+)\n", proc.stdout)
    assert proc.returncode == 0 and match, proc.stdout + proc.stderr
    assert match[1] == "0" and int(match[2]) > 0
    assert int(match[4]) < 1000, f"the launch was held {match[4]} ms"
    assert float(match[3]) <= 30 + 2 * TOLERANCE, f"measured {match[3]}% after it"


def test_work_running_when_its_context_is_destroyed_is_charged(release_lab):
    # create a context, launch, wait for the GPU without a hooked synchronisation (cuCtxDestroy
    # waits for it on a GPU), destroy: the context's pending events were thrown away after the
    # driver's destroy, nothing was charged, 94.9 % under 30 %.  The context's streams are now
    # waited for and measured before the destroy: 30.5 %
    got = launchprobe(release_lab, "ctxloop", 3, 1, CUDA_DEVICE_SM_LIMIT="30",
                      FAKE_CUDA_KERNEL_US="2000")
    assert got <= 30 + 2 * TOLERANCE, f"measured {got:.1f}%"


LAST_REFERENCE = {  # a second reference, a 300 ms kernel, the other goes; then the last goes
    "release": (["ctx", "0", "ctx", "0", "launch", "1", "mark", "release", "0"], ["release", "0"]),
    "release7": (["legacy", "1", "ctx", "0", "ctx", "0", "launch", "1", "mark", "release", "0"],
                 ["release", "0"]),
    "green": (["ctx", "0", "green", "0", "launch", "1", "mark", "release", "0"], ["greendestroy"]),
    "in_green": (["ctx", "0", "green", "0", "greencur", "launch", "1", "mark", "release", "0"],
                 ["greendestroy"]),
    "detach": (["ctxcreate", "0", "attach", "launch", "1", "mark", "detach", "0"], ["detach", "0"]),
}


@pytest.mark.parametrize("case", LAST_REFERENCE)
def test_work_running_when_a_context_loses_its_last_reference_is_charged(release_lab, case):
    # the primary context released to zero (cuDevicePrimaryCtxRelease_v2 or 7.0's), or by the
    # destroy of a green context holding it; a green context's own work at its destroy; a
    # created context's last cuCtxDetach: the driver destroys the context and its events, and
    # the work still running in it was charged from host time at the release, 0 ms of 300.
    # It is now waited for and measured first, as before cuCtxDestroy; a release the
    # references counted through the hooks say is not the last does not wait
    first, last = LAST_REFERENCE[case]
    res = release_lab.run("init", *first, "since", *last, "since", CUDA_DEVICE_SM_LIMIT="50",
                          FAKE_CUDA_KERNEL_US="300000")
    assert res.rc("launch") == 0 and {rc for rc, _ in res.of(last[0]) + res.of(first[-2])} == {0}
    waited = [vals[0] for _, vals in res.of("since")]
    assert waited[0] < 150, waited  # the other reference did not wait
    busy_ms = release_lab.region().devices[0].busy_ns / 1e6
    assert 280 <= busy_ms <= 330, f"{busy_ms:.0f} ms of GPU time charged for 300 ms ({waited} ms waited)"


@pytest.mark.parametrize("stays_active", [None, "1"], ids=["released", "stays-active"])
def test_work_running_when_the_primary_context_is_reset_is_charged(release_lab, stays_active):
    # cuDevicePrimaryCtxReset destroys the context's events with everything else (whether or
    # not the driver keeps the emptied context active): a 300 ms kernel still running in it is
    # waited for and measured first, as before a destroy or a last release; without that wait
    # it was charged from host time at the reset, 0 ms of 300
    res = release_lab.run("init", "ctx", "0", "launch", "1", "mark", "reset", "0", "since",
                          CUDA_DEVICE_SM_LIMIT="50", FAKE_CUDA_KERNEL_US="300000",
                          FAKE_CUDA_RESET_ACTIVE=stays_active)
    assert res.rc("launch") == 0 and res.rc("reset") == 0
    busy_ms = release_lab.region().devices[0].busy_ns / 1e6
    assert 280 <= busy_ms <= 330, f"{busy_ms:.0f} ms of GPU time charged for 300 ms ({res.values('since')} ms waited)"


def test_work_running_when_a_process_exits_is_charged(release_lab):
    # a child per job: one 500 ms kernel, a wait without a hooked synchronisation, exit.
    # Nothing charged the kernel (busy_ns stayed 0): 99.7 % under 30 %.  The exit destructor
    # now charges each context's unmeasured time since its streams' intervals began: 31.7 %
    got = launchprobe(release_lab, "exitloop", 4, 1, CUDA_DEVICE_SM_LIMIT="30",
                      FAKE_CUDA_KERNEL_US="500000")
    assert got <= 30 + 2 * TOLERANCE, f"measured {got:.1f}%"
    assert release_lab.region().devices[0].busy_ns >= 0.5e9


def test_host_work_after_the_last_unread_kernel_is_not_all_charged_at_exit(release_lab):
    # one 10 ms kernel waited for without a hooked synchronisation, then 5 s of host work and
    # exit: the exit's host-time charge ran from the kernel's start to the exit, 5 s of debt the
    # container's next launches would wait 17 s for at 30 %; it is bounded at 2 s
    launchprobe(release_lab, "exitloop", 0.001, 1, CUDA_DEVICE_SM_LIMIT="30",
                FAKE_CUDA_KERNEL_US="10000", TAIL_MS="5000")
    busy = release_lab.region().devices[0].busy_ns
    assert 0.01e9 <= busy <= 2.1e9, busy


def test_a_context_less_kernel_launched_with_no_current_context_is_throttled(release_lab):
    # a context-less kernel (a CUkernel) launched from a thread with no current context runs in
    # its stream's context (the fake's FAKE_STREAM_CTX_LAUNCH): with no current context the
    # throttle found no slot and let it through unmeasured, 100 % under 30 %.  It is now
    # measured in the stream's context (cuStreamGetCtx), none current again afterwards: 30-31 %
    got = launchprobe(release_lab, "noctx", 1.5, 0, CUDA_DEVICE_SM_LIMIT="30",
                      FAKE_CUDA_KERNEL_US="2000", FAKE_STREAM_CTX_LAUNCH="1")
    assert got <= 30 + 2 * TOLERANCE, f"measured {got:.1f}%"


# ---- a destroyed stream's handle given to a new one -------------------------------------------

def test_a_new_stream_with_a_destroyed_streams_handle_is_not_charged_its_idle_time(lab):
    # a stream is destroyed while a 1 s host function holds it, a kernel queued behind; the driver
    # gives its handle to the next stream, whose five 1 ms kernels run 100 ms apart meanwhile.
    # Their events queued in the old stream's entry behind its unfinished ones, so the new stream
    # never looked idle: each kernel's interval ran from the last one's end, the 100 ms between
    # them charged as kernel time
    steps = []
    for _ in range(5):
        steps += ["slaunch", "0", "1", "sleep", "100"]
    res = lab.run("init", "ctx", "0", "slaunch", "0", "1", "shostfn", "0", "slaunch", "0", "1", "sdestroy", "0",
                  *steps, "sleep", "1000", "sync", CUDA_DEVICE_SM_LIMIT="99", FAKE_CUDA_KERNEL_US="1000",
                  FAKE_CUDA_HOSTFN_US="1000000", FAKE_CUDA_HANDLE_REUSE="1")
    assert [rc for rc, _ in res.of("slaunch")] == [0] * 7, res.stdout + res.stderr
    assert res.rc("sdestroy") == 0 and res.rc("sync") == 0
    busy_ms = lab.region().devices[0].busy_ns / 1e6
    assert busy_ms < 50, f"{busy_ms:.0f} ms charged for seven 1 ms kernels"
