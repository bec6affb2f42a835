#!/usr/bin/env python3
"""Cost of the agent's outside checks (webhook/node/audit.py, compute.py) on a busy node.

A fake node (the agent tests' fake NVML, a /proc tree of cgroup and stat files) with P pods of
one GPU container each, K processes per container spread over 8 GPUs, all admitted by the real
webhook mutation and listed as the API server would. Times ``Auditor.check`` side by side:

* ``first``: a check that maps every container (reads the pod list once);
* ``steady``: the checks after it (cgroups and start times read again, no pod list);

* ``poll``: one poll of the outside compute check's sampler, every process sampled busy (each
  one's start time read as it is sampled, its place kept from the last poll), and every other
  poll without the places kept (cgroup and start time read for each);
* ``steady+compute``: the steady check with the compute check on (a 60 s window of polls);

and counts the pod lists. The check runs every ``agent.audit.interval`` (10 s) and the poll
every second, off every hot path; what matters is that they stay a small fraction of a core and
cost the API server nothing in steady state.

Usage: ``.venv/bin/python scripts/bench_audit.py [--pods 80] [--procs 5] [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from node.fakenvml import GIB, FakeDevice, FakeNvml
from node.test_audit import as_models, cid, gpu_pod, stat_line, systemd_cgroup

from webhook.node.audit import Auditor
from webhook.node.inventory import Inventory


async def bench(pods: int, procs: int, rounds: int) -> None:
    proc = Path(tempfile.mkdtemp(prefix="bench-audit-")) / "proc"
    proc.mkdir()
    nvml = FakeNvml([FakeDevice(f"GPU-{i:08d}-0000-0000-0000-000000000000", total=80 * GIB)
                     for i in range(8)])
    listed = []
    pid = 1000
    for p in range(pods):
        pod = gpu_pod(f"p{p}", {"a": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192",
                                      "nvidia.com/gpucores": "30"}})
        listed.append(pod)
        for _ in range(procs):
            (proc / str(pid)).mkdir()
            (proc / str(pid) / "cgroup").write_text(
                systemd_cgroup(pod["metadata"]["uid"], cid(f"p{p}/a")))
            (proc / str(pid) / "stat").write_text(stat_line(pid, 1))
            nvml.devices[p % 8].processes[pid] = GIB
            pid += 1
    models = await as_models(*listed)
    lists = 0

    async def list_pods():  # type: ignore[no-untyped-def]
        nonlocal lists
        lists += 1
        return models

    inv = Inventory(nvml)
    inv.discover()
    auditor = Auditor(inv, proc, list_pods=list_pods)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        report = await auditor.check()
        times.append(time.perf_counter() - t)
    steady = statistics.median(times[1:])
    print(f"{pods * procs} GPU processes, {pods} containers, 8 GPUs, {rounds} checks")
    print(f"  first  {times[0] * 1e3:7.1f} ms (maps every container: {lists} pod list)")
    print(f"  steady {steady * 1e3:7.1f} ms median, {min(times[1:]) * 1e3:.1f}-"
          f"{max(times[1:]) * 1e3:.1f} ms; first/steady {times[0] / steady:.2f}x; "
          f"pod lists after the first: {lists - 1}")
    print(f"  at one check per 10 s: {steady / 10 * 100:.2f} % of a core; "
          f"{len(report.holdings)} containers judged")

    # the compute check: every process busy, a sample each per second
    clock = [0.0]
    auditor = Auditor(inv, proc, list_pods=list_pods, compute_window=60,
                      clock=lambda: clock[0])
    assert auditor.compute is not None
    stamp = 1
    polls, cold = [], []
    for i in range(61):
        clock[0] += 1.0
        stamp += 1_000_000
        for dev in nvml.devices:
            dev.samples = [(p, stamp, 5) for p in dev.processes]
            dev.device_samples = [(stamp, min(100, 5 * len(dev.processes)))]
        if i % 2:  # every other poll without the places of the last one (each pid read twice)
            auditor._placed.clear()
        t = time.perf_counter()
        auditor.compute.poll()
        (cold if i % 2 else polls).append(time.perf_counter() - t)
    checks = []
    for _ in range(rounds):
        t = time.perf_counter()
        report = await auditor.check()
        checks.append(time.perf_counter() - t)
    poll = statistics.median(polls[1:])
    both = statistics.median(checks[1:])
    judged = sum(1 for c in report.loads if c.judged)
    print(f"  poll   {poll * 1e3:7.1f} ms median, {min(polls[1:]) * 1e3:.1f}-"
          f"{max(polls[1:]) * 1e3:.1f} ms; at one poll per second: {poll * 100:.2f} % of a core")
    uncached = statistics.median(cold)
    print(f"  poll without the places kept {uncached * 1e3:7.1f} ms median; "
          f"without/with {uncached / poll:.2f}x")
    print(f"  steady+compute {both * 1e3:7.1f} ms median; steady+compute/steady "
          f"{both / steady:.2f}x; {judged} containers' compute judged")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=80)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    asyncio.run(bench(a.pods, a.procs, a.rounds))


if __name__ == "__main__":
    main()
