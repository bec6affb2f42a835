"""CUDA_DEVICE_SM_LIMIT: the container gets its share of GPU time, measured on fake kernels.

The fake driver runs each kernel for FAKE_CUDA_KERNEL_US of real time on its stream's timeline;
the probe launches as fast as it can for a while and reports how much kernel time ran. Without
the library a launch loop keeps the fake GPU 100% busy.
"""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("kind", ["ex", "coop", "graph"])
def test_every_launch_api_is_throttled(release_lab, kind):
    got = share(release_lab, 1.5, kind, CUDA_DEVICE_SM_LIMIT="30", FAKE_CUDA_KERNEL_US="1000")
    assert abs(got - 30) <= TOLERANCE, f"{kind}: measured {got:.1f}%"


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
