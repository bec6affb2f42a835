"""Real GPU, a capped process in a PID namespace of its own, as in a container: which pids NVML
gives inside and outside it.

Drivers differ. Older ones list every GPU process by its host pid to every caller. Newer ones
(NVIDIA's open kernel modules, ``os_find_ns_pid``) give a caller the pids of its own namespace
and leave out every process it cannot see; R560 in a container also listed such a process with
0 bytes, and gave its utilisation samples host pids. The library matches its own entry in the
process list (the reconcile: memory no hook sees) and in the samples (the time-slice
correction) by one pid, and the agent places processes by host pid. This row records what the
driver under test does: the process list and the samples as seen from inside the namespace
(``nsenter``) and from outside, the pid the library matches its samples by, and whether
another process busy outside the namespace at the same time (another container's) shows in
the list and the samples read inside: the time-slice correction needs co-tenants' samples.
It needs root for
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


UNSHARE = ("--pid", "--fork", "--kill-child", "--mount-proc")
"""A PID namespace with its own /proc, as a container's; gpubench is its pid 1, and killing
unshare kills it and all inside."""


def test_a_process_in_a_pid_namespace_of_its_own(nvml: Nvml, gpubench: Path, lib: Path) -> None:
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    if unshare is None or nsenter is None:
        record("pid_namespace", "not measured: no unshare/nsenter (util-linux)", None)
        pytest.skip("no unshare/nsenter")
    tried = subprocess.run([unshare, *UNSHARE, "true"], check=False, capture_output=True,
                           text=True, timeout=20)
    if tried.returncode != 0:
        record("pid_namespace", f"not measured: unshare {' '.join(UNSHARE)} refused "
               f"({tried.stderr.strip()[-200:]})", None)
        pytest.skip("unshare --pid needs root")
    data: dict[str, Any] = {"steps": {}}
    try:
        _measure(nvml, gpubench, unshare, nsenter, data)
    except Exception as exc:  # the row says how far it got; the test fails as it would
        record("pid_namespace", f"not measured: {type(exc).__name__}: {exc}"[:300], None, **data)
        raise
    value, over = _verdict(data)
    # informational, unless the process in the namespace held more than the cap
    record("pid_namespace", value, False if over else None, **data)
    assert not over, data


def _measure(nvml: Nvml, gpubench: Path, unshare: str, nsenter: str,
             data: dict[str, Any]) -> None:
    """Fill ``data`` as far as the run gets."""
    steps = data["steps"]
    region = harness.new_region("pidns")
    # under a compute limit the sampler matches NVML's samples: it publishes the pid it uses
    server = Server(gpubench, harness.capped_env(region, sm=90), prefix=(unshare, *UNSHARE))
    tenant: Server | None = None
    try:
        data["ns_pid"] = server.pid
        data["pid"] = pid = _child_of(server.proc.pid)
        # another container's process, busy at the same time outside the namespace: whether
        # the namespace sees it is whether the time-slice correction can see co-tenants
        tenant = Server(gpubench, harness.plain_env())
        data["co_tenant_pid"] = tenant.pid
        steps["alloc 1 GiB"] = server.alloc(GIB)
        for busy in (server, tenant):
            busy.send("spin 1500")
        steps["spin 1.5 s"] = server.receive(30)
        steps["co-tenant spin 1.5 s"] = tenant.receive(30)
        time.sleep(0.6)  # a sampler tick after the last samples
        if pid is not None:
            inside = subprocess.run(
                [nsenter, "--target", str(pid), "--pid", "--", sys.executable, "-c", INSIDE],
                check=False, capture_output=True, text=True, timeout=harness.budget(60),
                env=harness.plain_env())
            lines = inside.stdout.strip().splitlines()
            data["inside"] = json.loads(lines[-1]) if inside.returncode == 0 and lines else {}
            data["inside_error"] = inside.stderr[-400:] if inside.returncode else ""
        listed, sampled = _outside(nvml)
        data["outside"] = {"listed": listed, "sampled": sampled}
        steps["info"] = server.ask("info")
    finally:
        server.kill()
        if tenant is not None:
            tenant.kill()
    from webhook.node.region import read_region
    got = read_region(region)
    slot = next((p for p in got.processes if p.pid == server.pid), None)
    data["library_pid"] = slot.host_pid if slot else 0
    data["region_used"] = got.devices[0].used_bytes if got.devices else 0


def _verdict(data: dict[str, Any]) -> tuple[str, bool]:
    """The row's value, and whether the process held more than the cap seen from outside."""
    ns_pid, pid, tenant = data["ns_pid"], data["pid"], data["co_tenant_pid"]
    seen, outside = data.get("inside", {}), data["outside"]

    def held(listed: object) -> str:
        if not isinstance(listed, dict):
            return ""
        used = next((listed[k] for k in (str(ns_pid), str(pid)) if k in listed), None)
        return "" if used is None else f" ({used / MIB:,.0f} MiB)"

    inner_samples = _kind(seen.get("sampled", "not read"), ns_pid, pid)
    used = data["library_pid"]
    parts = [f"inside: list by {_kind(seen.get('listed', 'not read'), ns_pid, pid)}"
             + held(seen.get("listed")),
             f"samples by {inner_samples}",
             f"outside: {_kind(outside['listed'], ns_pid, pid)}" + held(outside["listed"]),
             f"samples by {_kind(outside['sampled'], ns_pid, pid)}",
             "library used " + ("its namespace pid" if used == ns_pid else
                                "the outer pid" if used == pid else str(used or "none"))]
    cotenant = {what: _names(seen.get(what, "not read"), tenant) for what in ("listed", "sampled")}
    parts.append(f"co-tenant seen inside: list {cotenant['listed']}, samples {cotenant['sampled']}")
    if inner_samples == "outer pid" and used == ns_pid:
        parts.append("time-slice correction unmatched")
    if cotenant["sampled"] == "no" and tenant in outside["sampled"]:
        parts.append("time-slice correction blind to co-tenants")
    outer = outside["listed"].get(str(pid)) if pid else None
    return "; ".join(parts), outer is not None and outer > CAP_MIB * MIB
