"""Print the summary table of scripts/gpu-check.sh from the results file the GPU tests wrote,
beside HAMi-core's figures from issue 3, and write everything as JSON.

    python3 tests/gpu/summary.py RESULTS.jsonl [--json OUT.json]

Each row is one check. A row whose test recorded a measurement is PASS / FAIL (INFO when it
has no target); a row without one is SKIP (no GPU) or ERROR with the test's reason. Exit
status 1 when any row is FAIL or ERROR, else 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# (check id, what, target, HAMi-core as measured in issue 3, the test that measures it)
ROWS: list[tuple[str, str, str, str, str]] = [
    ("outside_usage", "1 usage seen from outside (NVML), max", "<= 10,240 MiB",
     "10,306 MiB at OOM", "test_outside_usage_never_exceeds_cap"),
    ("oom_torch", "1 over cap: torch OOM error, frees return", "OOM error; exact", "-",
     "test_torch_oom_is_catchable_and_frees_return_the_budget"),
    ("graph_memory", "1 CUDA graph allocations (launch, trim)", "charged; over cap refused",
     "-", "test_graph_allocations_are_charged_when_launched_and_refused_over_cap"),
    ("legacy_entry_points", "1 CUDA 2.x cuMemAlloc/cuMemGetInfo (2 GiB cap)",
     "charged; 3 GiB refused", "-", "test_cuda_2_entry_points_are_charged"),
    ("green_ctx", "1 green context (CUDA 12.4+): footprints, cap", "charged; outside <= cap",
     "-", "test_green_context_is_charged"),
    ("pool_async", "1 stream-ordered pool fill (2 GiB cap)",
     "outside <= cap; total >= cap - ctx - 64 MiB", "-",
     "test_pool_fill_by_stream_ordered_allocations_stays_under_cap"),
    ("pool_chunk", "1 pool growth, no library: reserved for held", "informational", "-",
     "test_pool_growth_steps_without_the_library"),
    ("array_sizes", "1 CUDA arrays: float4, BC1, BC7, NV12 charged", "real-2 MiB to 2x+2",
     "-", "test_arrays_are_charged_what_the_driver_takes"),
    ("launch_stack", "1 launch growing the stack near a 2 GiB cap", "OOM or charged; <= cap", "-",
     "test_a_launch_that_grows_the_stack_near_the_cap"),
    ("largest_torch", "2 largest allocation, PyTorch", "footprint <= ctx+64", "9.47 GiB",
     "test_largest_allocation_within_context_footprint_of_cap[torch]"),
    ("largest_torch_expandable", "2 largest allocation, PyTorch expandable segm.",
     "footprint <= ctx+64", "-",
     "test_largest_allocation_with_expandable_segments"),
    ("largest_cupy", "2 largest allocation, CuPy", "footprint <= ctx+64", "9.47 GiB",
     "test_largest_allocation_within_context_footprint_of_cap[cupy]"),
    ("largest_jax", "2 largest allocation, JAX (platform alloc.)", "footprint <= ctx+64",
     "9.47 GiB", "test_largest_allocation_within_context_footprint_of_cap[jax]"),
    ("jax_default", "2 JAX default env (BFC pool)", "pool inside cap", "-",
     "test_jax_default_environment_preallocates_inside_cap"),
    ("process_views", "3 in-process views (cuMemGetInfo, torch, NVML)", "total = cap",
     "-", "test_process_views_report_cap_and_usage"),
    ("memory_percent", "3 GPUSLICE_MEMORY_PERCENT=10", "10% of NVML total", "-",
     "test_memory_percent_resolves_against_real_total"),
    ("limits_file", "3 limits file vs 40 GiB in the env", "total = cap", "-",
     "test_the_limits_file_wins_over_a_lifted_environment"),
    ("smi_view", "3 in-container nvidia-smi total / used", "10,240 / usage",
     "10,240 MiB / usage", "test_nvidia_smi_in_container_shows_cap_and_usage"),
    ("two_procs", "4 two processes, one cap (6+6 GiB)", "2nd refused, then ok",
     "2nd refused", "test_second_process_cannot_exceed_shared_cap"),
    ("race", "4 four processes racing, 3 GiB each", "outside <= cap", "-",
     "test_racing_processes_stay_under_shared_cap"),
    ("outside_check", "4 agent's check: NVML per process (1+2 GiB)", "each pid, >= its alloc",
     "-", "test_the_agents_outside_check_sees_each_process"),
    ("ipc_import", "4 CUDA IPC: 2 GiB shared by 2 processes, written", "once: region, NVML", "-",
     "test_memory_shared_through_cuda_ipc_is_charged_once"),
    ("vmm_import", "4 VMM handle: 2 GiB shared by 2 processes", "region: once more", "-",
     "test_memory_shared_as_a_vmm_handle_is_charged_once_more"),
    ("managed_nvml", "4 managed memory: NVML per process, region", "region: once", "-",
     "test_managed_memory_as_nvml_counts_it_and_as_the_region_charges_it"),
    ("pid_namespace", "4 a process in a PID namespace: NVML's pids", "informational", "-",
     "test_a_process_in_a_pid_namespace_of_its_own"),
    ("sm_50", "5 bf16 matmul at SM limit 50%", "45-55%", "~100% (no limit)",
     "test_sm_limit_caps_matmul_throughput[50]"),
    ("sm_30", "5 bf16 matmul at SM limit 30%", "25-35%", "~100% (no limit)",
     "test_sm_limit_caps_matmul_throughput[30]"),
    ("sm_10", "5 bf16 matmul at SM limit 10%", "5-15%", "~100% (no limit)",
     "test_sm_limit_caps_matmul_throughput[10]"),
    ("sm_30_time", "5 same at 30%, time share (no clock comp.)", "informational", "-",
     "test_sm_limit_time_mode_for_comparison"),
    ("outside_compute", "5 agent's compute check: NVML share at 30%", "<= 40; unlimited > 40",
     "-", "test_sm_limit_caps_matmul_throughput[30]"),
    ("sm_30_capture_held", "5 same at 30%, a graph capture held open", "25-35%; not invalid.",
     "-", "test_sm_limit_holds_beside_a_capture_held_open"),
    ("sm_30_copies", "5 same at 30%, a 64 MiB H2D copy before each", "25-35%", "-",
     "test_sm_limit_excludes_copies_between_kernels"),
    ("sm_30_cotenant", "5 same at 30%, another tenant busy", "25-35%", "-",
     "test_sm_limit_beside_a_busy_tenant"),
    ("sm_30_cotenant_raw", "5 same, its time slices charged (correction off)", "informational",
     "-", "test_sm_limit_beside_a_busy_tenant"),
    ("sm_30_two_procs", "5 same, two processes of one container", "25-35% together", "-",
     "test_sm_limit_shared_by_processes[2]"),
    ("sm_30_four_procs", "5 same, four processes of one container", "25-35% together", "-",
     "test_sm_limit_shared_by_processes[4]"),
    ("memset_share", "5 memsets alone, no library: NVML's SM share", "informational", "-",
     "test_memsets_alone_as_nvml_sees_them"),
    ("launch_cost", "6 empty-kernel launch, lib vs none", "<= 1.05x", "-",
     "test_launch_cost_with_library_unlimited_within_5_percent"),
    ("torch_tiny", "6 torch tiny ops, lib vs none", "<= 1.05x", "-",
     "test_torch_tiny_ops_with_library_unlimited_within_5_percent"),
    ("alloc_free", "7 1 MiB cuMemAlloc+cuMemFree vs none", "<= +2 us", "+5 to +11 us",
     "test_alloc_free_pair_with_library_within_2us"),
    # not issue 3's: the node agent's NVML calls (webhook/node/inventory.py) on the real driver
    ("agent_inventory", "agent: GPUs found healthy, published, metrics", "healthy; smi's UUIDs",
     "-", "test_the_agent_discovers_the_gpus_healthy_as_nvidia_smi_lists_them"),
    ("agent_xid", "agent: XID event set registered", "every GPU, no wait", "-",
     "test_the_agent_registers_the_gpus_for_xid_events"),
]
BAR = ("outside_usage", "largest_torch", "largest_torch_expandable", "largest_cupy", "largest_jax",
       "smi_view", "two_procs", "sm_10", "sm_30", "sm_50", "torch_tiny", "launch_cost",
       "alloc_free")
"""The rows of issue 3's bar: printed again below the table, each figure in full (the table
cuts it to its column) with the command that measures that row alone, for the issue note."""
# jax[cuda12] installs jax-cuda12-plugin, jax[cuda13] jax-cuda13-plugin (jax's setup.py extras)
PACKAGES = ("torch", "cupy-cuda13x", "cupy-cuda12x", "jax", "jaxlib", "jax-cuda12-plugin",
            "jax-cuda13-plugin", "nvidia-ml-py", "pytest")


def load(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def build_rows(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = {ln["check"]: ln for ln in lines if ln.get("kind") == "check"}
    tests = [ln for ln in lines if ln.get("kind") == "test"]
    rows = []
    for check, what, target, hami, test in ROWS:
        outcome = next((t for t in reversed(tests) if t["nodeid"].endswith("::" + test)), None)
        row = {"check": check, "what": what, "target": target, "hami": hami, "test": test}
        if check in checks:
            rec = checks[check]
            status = {True: "PASS", False: "FAIL", None: "INFO"}[rec["ok"]]
            if status == "PASS" and outcome is not None and outcome["outcome"] == "failed":
                status = "FAIL"
            row.update(status=status, value=rec["value"], data=rec.get("data", {}))
        elif outcome is None:
            row.update(status="ERROR", value="not run (see the log)")
        elif outcome["outcome"] == "skipped" and "budget" not in outcome["message"]:
            row.update(status="SKIP", value=outcome["message"])
        else:
            row.update(status="ERROR", value=outcome["message"] or outcome["outcome"])
        rows.append(row)
    return rows


def rerun(rows: list[dict[str, Any]]) -> str | None:
    """The command that runs what this run did not reach (its time budget cut it, or the run
    was cut short from outside), for a second call on the same GPU; None when it reached all."""
    cut = [r for r in rows if r["status"] == "ERROR" and (
        r["value"] == "not run (see the log)"
        or "budget" in r["value"])]  # skipped for time, or a child the deadline cut short
    tests = {node: None for node in (node_id(row["test"]) for row in cut) if node is not None}
    if not tests:
        return None
    # a file of which nothing ran goes as the file: the command is the second device call's,
    # which takes at most 2,000 characters (every test by name: 2,700)
    by_file: dict[str, set[str]] = {}
    for row in ROWS:
        node = node_id(row[4])
        if node is not None:
            by_file.setdefault(node.split("::")[0], set()).add(node)
    here = Path(__file__).resolve().parent
    whole = {path for path, nodes in by_file.items() if nodes <= tests.keys()
             and set(re.findall(r"^def (test_\w+)\(", (here / Path(path).name).read_text(),
                                re.MULTILINE))
             == {n.split("::")[1].split("[")[0] for n in nodes}}
    tests = {(node.split("::")[0] if node.split("::")[0] in whole else node): None
             for node in tests}
    return (f"{len(cut)} rows not run or cut short; to run only them: "
            f'GPUCHECK_TESTS="{" ".join(tests)}" bash scripts/gpu-check.sh')


def node_id(test: str) -> str | None:
    """``tests/gpu/FILE::test[param]`` of a row's test, None when no file defines it; with its
    parameter: "[10]" matches no file, so the shell keeps it as it is."""
    name = test.split("[")[0]
    here = Path(__file__).resolve().parent
    found = next((path.name for path in sorted(here.glob("test_*.py"))
                  if f"def {name}(" in path.read_text()), None)
    return None if found is None else f"tests/gpu/{found}::{test}"


def bar(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row of the issue's bar: its status, the figure in full and the command that
    measures it alone."""
    out = []
    for row in rows:
        if row["check"] in BAR:
            node = node_id(row["test"])
            command = (f'GPUCHECK_TESTS="{node}" bash scripts/gpu-check.sh' if node
                       else "bash scripts/gpu-check.sh")
            if row["check"] == "outside_usage":  # the maximum over the run's capped children
                command = "bash scripts/gpu-check.sh (its maximum over every capped run before it)"
            out.append(f"bar {row['check']}: {row['status']} {' '.join(str(row['value']).split())}"
                       f"; command: {command}")
    return out


def timing(lines: list[dict[str, Any]], slowest: int = 6) -> str | None:
    """Where the time went: the tests' seconds (set-up included) and the slowest of them, to
    size the next run's budget and order; None when no test recorded its time."""
    timed = [t for t in lines if t.get("kind") == "test" and "seconds" in t]
    if not timed:
        return None
    top = sorted(timed, key=lambda t: -t["seconds"])[:slowest]
    names = ", ".join(f"{t['nodeid'].split('::')[-1]} {t['seconds']:.0f} s" for t in top)
    return f"time: {sum(t['seconds'] for t in timed):.0f} s in {len(timed)} tests; slowest: {names}"


def crashes(lines: list[dict[str, Any]], most: int = 3) -> list[str]:
    """One line per child killed by a fatal signal with the library's crash report (harness.
    crash_report): the child, the signal and its thread, and the first frames from where it
    died; children that died the same way are counted on one line."""
    seen: dict[str, int] = {}
    for ln in lines:
        if ln.get("kind") != "crash":
            continue
        report = ln.get("report", {})
        where = " < ".join(report.get("stack", [])[:4]) or "no frames"
        thread = str(report.get("signal", "?"))
        thread = thread.split(" in thread ", 1)[1] if " in thread " in thread else thread
        key = f"{str(report.get('signal', '?')).split(' ', 1)[0]} in thread {thread}: {where}"
        key = " ".join(w for w in key.split() if not w.isdigit())  # the tid differs per child
        seen[key] = seen.get(key, 0) + 1
    out = [f"crash ({n} child{'ren' if n > 1 else ''}): {k}" for k, n in seen.items()]
    return out[:most] + ([f"crash: {len(out) - most} more kinds (gpu-check.json)"]
                         if len(out) > most else [])


def versions(lines: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    found["python"] = sys.version.split()[0]
    for ln in lines:
        if ln.get("kind") == "env":
            found[ln["name"]] = ln["data"]
    return found


def _cut(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "~"


def render(rows: list[dict[str, Any]], found: dict[str, Any], took: str | None = None,
           notes: list[str] | None = None) -> str:
    widths = (5, 46, 64, 20, 18)
    head = ("", "check (issue 3 row)", "gpuslice, measured", "target", "HAMi-core (issue)")
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for r in rows:
        cells = (r["status"], r["what"], r["value"], r["target"], r["hami"])
        out.append("  ".join(_cut(c, w).ljust(w) for c, w in zip(cells, widths, strict=True))
                   .rstrip())
    gpu = found.get("gpu", {})
    if gpu:
        out.append(f"GPU: {gpu.get('name')} {gpu.get('total_mib')} MiB, driver "
                   f"{gpu.get('driver')}, {gpu.get('uuid')}")
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()
                                        if isinstance(v, str)))
    feet = [f"{r['check'].removeprefix('largest_')} {r['data']['context']['footprint_mib']:,.0f}"
            f" MiB (slice footprint {r['data']['footprint_mib']:,.0f})"
            for r in rows if r["check"].startswith("largest_") and "data" in r
            and "context" in r["data"]]
    if feet:
        out.append("context footprints without the library (NVML): " + "; ".join(feet))
    counts = {s: sum(r["status"] == s for r in rows) for s in
              ("PASS", "FAIL", "ERROR", "SKIP", "INFO")}
    out.extend(bar(rows))
    out.append("result: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    out.extend(notes or [])
    if took:
        out.append(took)
    again = rerun(rows)
    if again:
        out.append(again)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", type=Path, help="write rows, versions and raw records here")
    args = parser.parse_args()
    lines = load(args.results)
    rows = build_rows(lines)
    found = versions(lines)
    print(render(rows, found, timing(lines), crashes(lines)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "versions": found, "records": lines},
                                        indent=1, default=str))
    return 1 if any(r["status"] in ("FAIL", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
