#!/usr/bin/env python3
"""Cost of the agent's outside memory check (webhook/node/audit.py) on a busy node.

A fake node (the agent tests' fake NVML, a /proc tree of cgroup and stat files) with P pods of
one GPU container each, K processes per container spread over 8 GPUs, all admitted by the real
webhook mutation and listed as the API server would. Times ``Auditor.check`` side by side:

* ``first``: a check that maps every container (reads the pod list once);
* ``steady``: the checks after it (cgroups and start times read again, no pod list);

and counts the pod lists. The check runs every ``agent.audit.interval`` (10 s) off every hot
path; what matters is that it stays a small fraction of a core and costs the API server
nothing in steady state.

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
from node.test_audit import as_models, cid, one_gpu, stat_line, systemd_cgroup

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
        pod = one_gpu(f"p{p}", 8192)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=80)
    ap.add_argument("--procs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    asyncio.run(bench(a.pods, a.procs, a.rounds))


if __name__ == "__main__":
    main()
