"""Real GPU, one cap shared by the processes of a container (one region file): a second
process is refused what the first holds, gets it once the first is SIGKILLed or exits, and
processes racing for the slice never take more than the cap together."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.fills import watched
from gpu.harness import CAP_MIB, GIB, MIB, Server, record, region_used, retry_alloc
from gpu.nvmlwatch import Nvml, Poller

pytestmark = pytest.mark.gpu

OOM = "err 2 "  # CUDA_ERROR_OUT_OF_MEMORY


def _granted(answer: str) -> bool:
    return answer.startswith("ok")


def test_second_process_cannot_exceed_shared_cap(nvml: Nvml, gpubench: Path, lib: Path) -> None:
    env = harness.capped_env(harness.new_region("two"))
    ask = 6 * GIB
    steps: dict[str, Any] = {}
    servers: list[Server] = []
    with Poller(nvml, "two-processes") as poll:
        try:
            first = Server(gpubench, env, poll)
            servers.append(first)
            steps["first takes 6 GiB"] = first.alloc(ask)
            second = Server(gpubench, env, poll)
            servers.append(second)
            steps["second asks 6 GiB"] = second.alloc(ask)
            steps["second's cuMemGetInfo"] = second.ask("info")
            poll.phase = "after SIGKILL of first"
            first.kill()
            answer, took = retry_alloc(second, ask, within=5.0)
            steps["second after SIGKILL of first"], steps["reclaim_kill_s"] = answer, took
            if _granted(answer):
                second.ask(f"free {answer.split()[1]}")
            poll.phase = "third process"
            third = Server(gpubench, env, poll)
            servers.append(third)
            steps["third takes 6 GiB"] = third.alloc(ask)
            poll.phase = "after exit of third"
            steps["third exits holding it"] = third.quit()
            answer, took = retry_alloc(second, ask, within=5.0)
            steps["second after exit of third"], steps["reclaim_exit_s"] = answer, took
        finally:
            for server in servers:
                server.kill()
    outside = watched(poll)
    ok = (_granted(str(steps["first takes 6 GiB"]))
          and str(steps["second asks 6 GiB"]).startswith(OOM)
          and _granted(str(steps["second after SIGKILL of first"]))
          and _granted(str(steps["third takes 6 GiB"]))
          and _granted(str(steps["second after exit of third"]))
          and outside["max_mib"] <= CAP_MIB)
    second = str(steps["second asks 6 GiB"])
    refused = "granted (not refused)" if _granted(second) else second.split()[-1]
    record("two_procs",
           f"2nd: {refused}; after SIGKILL granted in {float(steps['reclaim_kill_s']):.2f} s, "
           f"after exit in {float(steps['reclaim_exit_s']):.2f} s; outside "
           f"{outside['max_mib']:,.0f} MiB", ok, steps=steps, outside=outside)
    assert ok, f"steps: {steps}; outside max {outside['max_mib']:,.0f} MiB"


def test_racing_processes_stay_under_shared_cap(nvml: Nvml, gpubench: Path, lib: Path) -> None:
    env = harness.capped_env(harness.new_region("race"))
    ask = 3 * GIB
    with Poller(nvml, "race-4x3GiB") as poll:
        servers: list[Server] = []
        try:
            poll.phase = "start"
            for _ in range(4):
                servers.append(Server(gpubench, env, poll))
            poll.phase = "racing"
            for server in servers:  # all four requests in flight at once
                server.send(f"alloc {ask}")
            answers = [server.receive() for server in servers]
            time.sleep(0.3)
            poll.sample()
        finally:
            for server in servers:
                server.kill()
    outside = watched(poll)
    granted = sum(_granted(a) for a in answers)
    refused_right = all(_granted(a) or a.startswith(OOM) for a in answers)
    ok = (outside["max_mib"] <= CAP_MIB and 1 <= granted and granted * ask <= CAP_MIB * MIB
          and refused_right)
    record("race", f"{granted}/4 granted 3 GiB; outside {outside['max_mib']:,.0f} MiB", ok,
           answers=answers, outside=outside)
    assert ok, f"answers {answers}; outside max {outside['max_mib']:,.0f} MiB"


def test_memory_shared_through_cuda_ipc_is_charged_once(nvml: Nvml, gpubench: Path,
                                                        lib: Path) -> None:
    """Programs share GPU memory between the processes of a container through CUDA IPC
    (torch.multiprocessing's CUDA tensors, producer/consumer pipelines): the importer maps the
    exporter's allocation, which the exporter's budget already holds. The library does not
    hook the IPC calls, but its reconcile charges whatever NVML says a process holds beyond its
    records; if the driver counts the mapping for the importer too, the container pays twice
    (and the agent's outside check, which sums NVML per process, sees it twice). Measured: NVML
    for the importer and the region's charge across the open, then whether the importer still
    gets what the cap has left."""
    region = harness.new_region("ipc")
    env = harness.capped_env(region)
    shared = 2 * GIB
    steps: dict[str, Any] = {}
    servers: list[Server] = []
    try:
        exporter = Server(gpubench, env)
        servers.append(exporter)
        importer = Server(gpubench, env)
        servers.append(importer)
        steps["export alloc"] = exporter.alloc(shared)
        assert _granted(steps["export alloc"]), steps
        handle = exporter.ask("ipcget 0")
        assert handle.startswith("ipc "), handle
        time.sleep(1.2)  # the samplers' reconciles (every 500 ms) settle both processes
        pids = {"exporter": exporter.proc.pid, "importer": importer.proc.pid}
        before = {k: nvml.pids_used({pid}) for k, pid in pids.items()}
        steps["region before"] = region_before = region_used(region)
        steps["import"] = importer.ask(f"ipcopen {handle.split()[1]}")
        assert _granted(steps["import"]), steps
        time.sleep(1.5)
        after = {k: nvml.pids_used({pid}) for k, pid in pids.items()}
        steps["region after"] = region_after = region_used(region)
        steps["importer view"] = importer.ask("info")
        # the mapping used, not only opened (lazily): the importer writes all of it
        steps["touch"] = importer.ask(f"touch {steps['import'].split()[1]} {shared}")
        time.sleep(1.5)
        touched = {k: nvml.pids_used({pid}) for k, pid in pids.items()}
        steps["region touched"] = region_touched = region_used(region)
        # what the cap has left by the exporter's charge alone, less a margin for noise
        left = CAP_MIB * MIB - region_before - 256 * MIB
        steps["importer asks what is left"] = importer.alloc(left)
        steps["close"] = importer.ask(f"free {steps['import'].split()[1]}")
    finally:
        for server in servers:
            server.kill()
    def growth(now: dict[str, int | None]) -> int | None:
        return None if before["importer"] is None or now["importer"] is None else \
            now["importer"] - before["importer"]

    grew, grew_touched = growth(after), growth(touched)
    charged = max(region_after, region_touched) - region_before
    # both must count it once, opened and written: the region (the library's budget) and
    # NVML's figure for the importer (the agent's outside check sums NVML per process), where
    # this namespace sees it
    ok = (charged < 64 * MIB and _granted(str(steps["importer asks what is left"]))
          and _granted(str(steps["touch"]))
          and all(g is None or g < 64 * MIB for g in (grew, grew_touched)))
    nvml_text = "not listed here" if grew is None else \
        f"{grew / MIB:+,.0f} MiB ({grew_touched / MIB:+,.0f} written)" \
        if grew_touched is not None else f"{grew / MIB:+,.0f} MiB"
    rest = "granted" if _granted(str(steps["importer asks what is left"])) else "refused"
    record("ipc_import", f"importer NVML {nvml_text}, region {charged / MIB:+,.0f} MiB for "
           f"2,048 MiB shared; rest of cap {rest}", ok, steps=steps, nvml_before=before,
           nvml_after=after, nvml_touched=touched)
    assert ok, steps


def test_the_agents_outside_check_sees_each_process(gpubench: Path, lib: Path) -> None:
    """The agent's outside memory check (webhook/node/audit.py) starts from NVML's per-process
    list as the agent reads it (Inventory.processes): each process of a container is listed
    under its pid with at least what it allocated. Where the pids NVML gives are not the ones
    this pid namespace knows, the row says so (the agent then needs hostPID)."""
    from webhook.node.inventory import Inventory
    env = harness.capped_env(harness.new_region("outside"))
    asks = (1 * GIB, 2 * GIB)
    inv = Inventory()
    servers: list[Server] = []
    try:
        inv.discover()
        for ask in asks:
            server = Server(gpubench, env)
            servers.append(server)
            assert _granted(server.alloc(ask)), "the allocation under the cap was refused"
        listed = {pid: used for g in inv.processes() for pid, used in (g.processes or {}).items()}
    finally:
        for server in servers:
            server.kill()
        inv.close()
    ours = [s.proc.pid for s in servers]
    seen = {pid: listed.get(pid) for pid in ours}
    record_data = {"ours": ours, "listed": {str(k): v for k, v in listed.items()}}
    if not any(pid in listed for pid in ours):
        # this machine runs the tests in a PID namespace of its own and the driver gives host
        # pids: what the agent meets on a node, where it reads the host's /proc instead
        record("outside_check", f"pids {ours} listed as {sorted(listed)} (another namespace)",
               None, **record_data)
        return
    ok = all(seen[pid] is not None and seen[pid] >= ask for pid, ask in zip(ours, asks))
    value = ", ".join(f"{(seen[p] or 0) / MIB:,.0f} MiB" for p in ours)
    record("outside_check", value, ok, **record_data)
    assert ok, value
