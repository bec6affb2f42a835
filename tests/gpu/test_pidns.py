"""Real GPU, a capped process in a PID namespace of its own, as in a container: which pids NVML
gives inside and outside it.

Drivers differ. Older ones list every GPU process by its host pid to every caller. Newer ones
(NVIDIA's open kernel modules, ``os_find_ns_pid``) give a caller the pids of its own namespace
and leave out every process it cannot see; R560 in a container also listed such a process with
0 bytes, and gave its utilisation samples host pids. The library matches its own entry in the
process list (the reconcile: memory no hook sees) and in the samples (the time-slice
correction) by one pid, and the agent places processes by host pid. This row records what the
driver under test does: the process list and the samples as seen from inside the namespace
(``nsenter``) and from outside, the pid the library matched, and whether another process
busy outside the namespace at the same time (another container's) shows in the list and the
samples read inside: the time-slice correction needs co-tenants' samples. It needs root for
``unshare --pid``; the row says so where it cannot run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import CAP_MIB, GIB, MIB, Server, record
from gpu.nvmlwatch import Nvml

pytestmark = pytest.mark.gpu

INSIDE = """
import json, os, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
out = {"self": os.getpid()}
try:
    out["listed"] = {str(p.pid): p.usedGpuMemory
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
except pynvml.NVMLError as exc:
    out["listed"] = f"{type(exc).__name__}: {exc}"
try:
    out["sampled"] = sorted({s.pid for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)})
except pynvml.NVMLError_NotFound:
    out["sampled"] = []
except pynvml.NVMLError as exc:
    out["sampled"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
"""NVML's process list and samples as a process of the namespace reads them (no library)."""


def _child_of(parent: int) -> int | None:
    """The pid (here) of ``parent``'s child: gpubench, which unshare forked into the namespace."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(parent):
            return int(status.parent.name)
    return None


def _kind(pids: object, ns_pid: int, pid: int | None) -> str:
    """Whose pid a list names gpubench by: its namespace's, the one we know, or neither."""
    if not isinstance(pids, dict | list):
        return str(pids)  # the query's error
    names = {str(p) for p in pids}
    if str(ns_pid) in names and ns_pid != pid:
        return "namespace pid"
    if pid is not None and str(pid) in names:
        return "outer pid"
    return "not listed"


def _names(pids: object, pid: int) -> str:
    """Whether a list read inside the namespace names ``pid`` (a process outside it)."""
    if not isinstance(pids, dict | list):
        return str(pids)  # the query's error
    return "yes" if str(pid) in {str(p) for p in pids} else "no"


def _outside(nvml: Nvml) -> tuple[dict[str, int | None], list[int]]:
    import pynvml
    listed = {str(p.pid): p.usedGpuMemory
              for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml.handle)}
    try:
        sampled = sorted({s.pid for s in pynvml.nvmlDeviceGetProcessUtilization(nvml.handle, 0)})
    except pynvml.NVMLError:
        sampled = []
    return listed, sampled


def test_a_process_in_a_pid_namespace_of_its_own(nvml: Nvml, gpubench: Path, lib: Path) -> None:
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    if unshare is None or nsenter is None:
        record("pid_namespace", "not measured: no unshare/nsenter (util-linux)", None)
        pytest.skip("no unshare/nsenter")
    tried = subprocess.run([unshare, "--pid", "--fork", "true"], check=False,
                           capture_output=True, text=True, timeout=20)
    if tried.returncode != 0:
        record("pid_namespace", f"not measured: unshare --pid refused ({tried.stderr.strip()})",
               None)
        pytest.skip("unshare --pid needs root")
    region = harness.new_region("pidns")
    # under a compute limit the sampler matches NVML's samples: it publishes the pid it uses
    env = harness.capped_env(region, sm=90)
    steps: dict[str, Any] = {}
    server = Server(gpubench, env, prefix=(unshare, "--pid", "--fork", "--kill-child"))
    tenant: Server | None = None
    try:
        pid = _child_of(server.proc.pid)
        # another container's process, busy at the same time outside the namespace: whether
        # the namespace sees it is whether the time-slice correction can see co-tenants
        tenant = Server(gpubench, harness.plain_env())
        steps["alloc 1 GiB"] = server.alloc(GIB)
        for busy in (server, tenant):
            busy.send("spin 1500")
        steps["spin 1.5 s"] = server.receive(30)
        steps["co-tenant spin 1.5 s"] = tenant.receive(30)
        time.sleep(0.6)  # a sampler tick after the last samples
        inside = subprocess.run(
            [nsenter, "--target", str(pid), "--pid", "--", sys.executable, "-c", INSIDE],
            check=False, capture_output=True, text=True, timeout=60,
            env=harness.plain_env()) if pid else None
        listed, sampled = _outside(nvml)
        steps["info"] = server.ask("info")
    finally:
        server.kill()
        if tenant is not None:
            tenant.kill()
    from webhook.node.region import read_region
    got = read_region(region)
    slot = next((p for p in got.processes if p.pid == server.pid), None)
    seen = json.loads(inside.stdout.strip().splitlines()[-1]) if inside and \
        inside.returncode == 0 and inside.stdout.strip() else {}
    inner_mem = seen.get("listed", {}).get(str(server.pid)) if isinstance(
        seen.get("listed"), dict) else None
    outer_mem = listed.get(str(pid)) if pid else None
    matched = slot.host_pid if slot else 0
    data = {"ns_pid": server.pid, "pid": pid, "co_tenant_pid": tenant.pid, "inside": seen,
            "inside_error": inside.stderr[-400:] if inside and inside.returncode else "",
            "outside": {"listed": listed, "sampled": sampled}, "library_pid": matched,
            "region_used": got.devices[0].used_bytes, "steps": steps}
    inner_samples = _kind(seen.get("sampled", "not read"), server.pid, pid)
    parts = [f"inside: list by {_kind(seen.get('listed', 'not read'), server.pid, pid)}"
             + ("" if inner_mem is None else f" ({inner_mem / MIB:,.0f} MiB)"),
             f"samples by {inner_samples}",
             f"outside: {_kind(listed, server.pid, pid)}"
             + ("" if outer_mem is None else f" ({outer_mem / MIB:,.0f} MiB)"),
             f"samples by {_kind(sampled, server.pid, pid)}",
             f"library matched {'its namespace pid' if matched == server.pid else matched or 'none'}"]
    cotenant = {what: _names(seen.get(what, "not read"), tenant.pid) for what in ("listed", "sampled")}
    parts.append(f"co-tenant seen inside: list {cotenant['listed']}, samples {cotenant['sampled']}")
    if inner_samples == "outer pid" and matched == server.pid:
        parts.append("time-slice correction unmatched")
    if cotenant["sampled"] == "no" and tenant.pid in sampled:
        parts.append("time-slice correction blind to co-tenants")
    # informational, unless the process in the namespace held more than the cap
    over = outer_mem is not None and outer_mem > CAP_MIB * MIB
    record("pid_namespace", "; ".join(parts), False if over else None, **data)
    assert not over, data
