"""Real GPU, the node agent's NVML calls (webhook/node/inventory.py) as the agent makes them, in
the test process (no library preloaded), a second or two: what the fakes cannot show.

- ``agent_inventory``: a discovery finds every GPU ``nvidia-smi`` lists, each healthy, with
  ``nvidia-smi``'s UUID and total memory; the annotation entries parse with the extender's
  reader; a sample reads each GPU's memory and utilisation, the process lists read; where the
  webhook's packages are importable (not on the GPU machine's image: aiohttp, prometheus_client,
  kubernetes_asyncio), also the published resources and the agent's ``/metrics`` text.
- ``agent_xid``: every GPU is registered for critical XID events (or told unsupported, which is
  informational: nothing to judge), and a discovery reads the waiting events at once, the GPUs
  still healthy (no XID can be caused here: that an event names its GPU is not shown).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.harness import record
from gpu.nvmlwatch import Nvml

from webhook.node.inventory import Discovery, Inventory

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def _smi() -> tuple[list[dict[str, Any]] | None, str]:
    """The GPUs ``nvidia-smi`` lists (uuid, total MiB), or None and why not."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        done = subprocess.run([exe, "--query-gpu=uuid,memory.total",
                               "--format=csv,noheader,nounits"], check=False,
                              capture_output=True, text=True, timeout=harness.budget(20))
    except subprocess.TimeoutExpired:
        return None, "nvidia-smi timed out"
    if done.returncode != 0:
        return None, f"nvidia-smi failed ({done.returncode}): {done.stderr.strip()[-200:]}"
    listed = []
    for line in done.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[1].isdigit():
            return None, f"nvidia-smi printed {line!r}"
        listed.append({"uuid": fields[0], "memory_mib": int(fields[1])})
    return listed, ""


def _published(d: Discovery, inv: Inventory, tmp_path: Path) -> tuple[list[str], str]:
    """The problems of the published resources and of /metrics, and what was checked (the
    webhook's packages are not on the GPU machine's image: then neither is)."""
    try:
        from prometheus_client import generate_latest

        from webhook.node.config import AgentSettings
        from webhook.node.metrics import AgentCollector, AgentStatus, make_registry
        from webhook.node.publish import desired_state
    except ImportError as exc:
        return [], f"resources, /metrics not checked ({exc.name} missing)"
    problems = []
    want = desired_state(d, AgentSettings(node_name="gpu-check"))
    if want.resources.get("nvidia.com/gpu") != str(10 * len(d.gpus)):
        problems.append(f"resources {want.resources}")
    text = generate_latest(make_registry(AgentCollector(inv, tmp_path, AgentStatus()))).decode()
    for needed in ["gpuslice_nvml_available 1.0", "gpuslice_gpu_utilization_percent{",
                   *(f'uuid="{g.uuid}"' for g in d.gpus)]:
        if needed not in text:
            problems.append(f"/metrics lacks {needed}")
    return problems, "resources, /metrics checked"


def test_the_agent_discovers_the_gpus_healthy_as_nvidia_smi_lists_them(
        nvml: Nvml, tmp_path: Path) -> None:
    from webhook.placement.inventory import InventoryError, parse_inventory

    harness.budget(10)  # skipped when the run's time is up: the summary's command runs it
    listed, smi_why = _smi()
    inv = Inventory()
    try:
        started = time.monotonic()
        d = inv.discover()
        samples = inv.sample()
        lists = inv.processes()
        took = time.monotonic() - started
        problems: list[str] = []
        if not d.available:
            problems.append(f"NVML unavailable to the agent: {d.reason}")
        elif not d.gpus:
            problems.append("the driver is loaded but the agent found no GPU")
        problems += [f"GPU {g.index} {g.uuid}: {g.health}: {g.problem}"
                     for g in d.gpus if not g.healthy]
        problems += [f"GPU {g.index}: UUID {g.uuid!r}, product {g.product!r}, "
                     f"{g.memory_mib} MiB" for g in d.gpus
                     if not (g.uuid.startswith("GPU-") and g.product and g.memory_mib > 1024)]
        found = {g.uuid: g.memory_mib for g in d.gpus}
        if listed is not None:
            smi = {s["uuid"]: s["memory_mib"] for s in listed}
            if set(smi) != set(found):
                problems.append(f"UUIDs {sorted(found)}, nvidia-smi's {sorted(smi)}")
            problems += [f"{u}: {found[u]:,} MiB, nvidia-smi's {smi[u]:,}"
                         for u in set(smi) & set(found) if abs(found[u] - smi[u]) > 1]
        try:
            annotation = json.dumps([g.to_json() for g in d.gpus], separators=(",", ":"))
            parsed = [g.uuid for g in parse_inventory(annotation)]
            if parsed != [g.uuid for g in d.gpus]:
                problems.append(f"the extender read {parsed}")
        except InventoryError as exc:
            problems.append(f"the extender's reader: {exc}")
        problems += [f"sample of {s.gpu.uuid}: total {s.memory_total_bytes}, used "
                     f"{s.memory_used_bytes}, utilisation {s.utilization_percent}"
                     for s in samples
                     if s.memory_total_bytes is None or s.memory_used_bytes is None
                     or s.memory_total_bytes < s.gpu.memory_mib * MIB
                     or s.utilization_percent is None]
        if len(samples) != len(d.gpus):
            problems.append(f"{len(samples)} samples of {len(d.gpus)} GPUs")
        problems += [f"process list of {p.gpu.uuid} unreadable" for p in lists
                     if p.processes is None]
        more, also = _published(d, inv, tmp_path) if d.gpus else ([], "")
        problems += more
    finally:
        inv.close()
    ok = not problems
    n = len(d.gpus)
    mem = ", ".join(sorted({f"{g.memory_mib:,}" for g in d.gpus})) or "-"
    smi_says = ("= nvidia-smi" if listed is not None and ok else
                "vs nvidia-smi" if listed is not None else f"({smi_why}: not compared)")
    value = (f"{sum(g.healthy for g in d.gpus)}/{n} GPU{'s' * (n != 1)} healthy, UUIDs+MiB "
             f"{smi_says} ({mem} MiB); extender reads it; {also or 'nothing published'} "
             f"({took:.2f} s)")
    if problems:
        value = f"{'; '.join(problems)[:300]} | {value}"
    record("agent_inventory", value, ok, driver=d.driver_version, reason=d.reason,
           gpus=[g.to_json() | {"problem": g.problem} for g in d.gpus],
           nvidia_smi=listed if listed is not None else smi_why,
           samples=[{"uuid": s.gpu.uuid, "used": s.memory_used_bytes,
                     "total": s.memory_total_bytes, "util": s.utilization_percent}
                    for s in samples],
           processes={p.gpu.uuid: p.processes for p in lists}, published=also,
           seconds=round(took, 3), problems=problems)
    assert ok, "; ".join(problems)


def test_the_agent_registers_the_gpus_for_xid_events(
        nvml: Nvml, caplog: pytest.LogCaptureFixture) -> None:
    harness.budget(10)
    caplog.set_level(logging.DEBUG, logger="webhook.node.inventory")
    inv = Inventory()
    try:
        first = inv.discover()
        made = inv._events is not None
        watched = sorted(set(inv._watched.values()))
        unwatched = sorted(inv._unwatched)
        no_events = inv._no_events
        started = time.monotonic()
        again = inv.discover()  # reads the events waiting, without waiting for one
        read_s = time.monotonic() - started
        wait_error = inv._wait_error
    finally:
        inv.close()
    told = [f"{r.getMessage()} ({getattr(r, 'error', '')})" for r in caplog.records
            if r.name == "webhook.node.inventory" and "XID" in r.getMessage()]
    uuids = sorted(g.uuid for g in first.gpus)
    problems = []
    if not first.gpus:
        problems.append(f"no GPU discovered ({first.reason or 'none listed'})")
    if set(watched) | set(unwatched) != set(uuids) and not no_events:
        problems.append(f"neither registered nor told unsupported: "
                        f"{sorted(set(uuids) - set(watched) - set(unwatched))}; {told}")
    if wait_error:
        problems.append(f"reading the events failed: {wait_error}")
    if read_s >= 5:
        problems.append(f"the discovery that read the events took {read_s:.1f} s")
    problems += [f"GPU {g.uuid} {g.health} after the read: {g.problem}"
                 for g in again.gpus if not g.healthy]
    if problems:
        ok: bool | None = False
        value = "; ".join(problems)
    elif watched == uuids:
        ok = True
        value = (f"{len(watched)}/{len(uuids)} registered; events read at once "
                 f"({read_s:.2f} s), still healthy")
    else:  # the driver, or some GPUs, report no XID events: nothing to judge
        ok = None
        why = "; ".join(told)[:200] or "no reason logged"
        value = (f"unsupported: {'no event set' if no_events else f'{len(unwatched)} GPUs'}; "
                 f"{len(watched)}/{len(uuids)} registered ({why})")
    record("agent_xid", value, ok, event_set=made, no_events=no_events, watched=watched,
           unwatched=unwatched, read_s=round(read_s, 3), wait_error=wait_error, logged=told,
           problems=problems)
    assert ok is not False, value
