"""The GPU check's own tooling, without a GPU: the summary's rows and exit status, the
gpubench build with gcc alone, and the workload script's command line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu import gpubench, summary

HERE = Path(__file__).resolve().parent


def _write(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _row(rows: list[dict[str, object]], check: str) -> dict[str, object]:
    return next(r for r in rows if r["check"] == check)


def test_summary_rows_follow_measurements_and_test_outcomes() -> None:
    base = "tests/gpu/test_x.py::"
    lines = [
        {"kind": "check", "check": "outside_usage", "value": "10,100 MiB", "ok": True},
        {"kind": "check", "check": "smi_view", "value": "10,240 / 9,000", "ok": False},
        {"kind": "test", "nodeid": base + "test_second_process_cannot_exceed_shared_cap",
         "outcome": "failed", "message": "ChildError: gpubench serve exited"},
        {"kind": "test", "nodeid": base + "test_racing_processes_stay_under_shared_cap",
         "outcome": "skipped", "message": "needs a real GPU: NVML unavailable"},
        {"kind": "test", "nodeid": base + "test_sm_limit_caps_matmul_throughput[10]",
         "outcome": "skipped", "message": "time budget used up: not run"},
        {"kind": "test", "nodeid": base + "test_sm_limit_time_mode_for_comparison",
         "outcome": "failed", "message": "ChildError: matmul 5 timed out after 9s at the time budget's end: | x",
         "seconds": 9.4},
        {"kind": "test", "nodeid": base + "test_outside_usage_never_exceeds_cap",
         "outcome": "passed", "message": "", "seconds": 21.0},
        {"kind": "check", "check": "sm_50", "value": "50%", "ok": True},
    ]
    rows = summary.build_rows(lines)
    assert _row(rows, "outside_usage")["status"] == "PASS"
    assert _row(rows, "smi_view")["status"] == "FAIL"
    assert _row(rows, "two_procs")["status"] == "ERROR"
    assert _row(rows, "two_procs")["value"] == "ChildError: gpubench serve exited"
    assert _row(rows, "race")["status"] == "SKIP"
    assert _row(rows, "sm_10")["status"] == "ERROR"
    assert _row(rows, "alloc_free")["value"] == "not run (see the log)"
    # what the run did not reach, as one command: cut by the budget or never begun
    again = summary.rerun(rows)
    assert again is not None and again.endswith('" bash scripts/gpu-check.sh')
    ids = again.split('GPUCHECK_TESTS="')[1].split('"')[0].split()
    names = [i.split("::")[1] for i in ids if "::" in i]
    # the budget's skip, with its parameter (not every one); a child the deadline cut short; a
    # file of which nothing ran, as the file
    assert "tests/gpu/test_compute.py::test_sm_limit_caps_matmul_throughput[10]" in ids
    assert "tests/gpu/test_compute.py::test_sm_limit_caps_matmul_throughput" not in ids
    assert "tests/gpu/test_compute.py::test_sm_limit_time_mode_for_comparison" in ids
    assert "tests/gpu/test_overhead.py" in ids
    assert "tests/gpu/test_processes.py" not in ids  # two of its tests ran
    assert "test_second_process_cannot_exceed_shared_cap" not in names  # ran, and failed
    assert "test_racing_processes_stay_under_shared_cap" not in names  # skipped: no GPU
    assert "test_outside_usage_never_exceeds_cap" not in names  # measured
    assert len(ids) == len(set(ids)) and all((HERE.parents[1] / i.split("::")[0]).is_file()
                                             for i in ids)
    collected = subprocess.run(  # pytest takes them as they are printed, parameters and all
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *ids[:3], ids[-1]], cwd=HERE.parents[1], capture_output=True, text=True, check=False,
        timeout=60)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    # where the time went, for the next run's budget: the tests' seconds, the slowest first
    took = summary.timing(lines)
    assert took == ("time: 30 s in 2 tests; slowest: test_outside_usage_never_exceeds_cap 21 s, "
                    "test_sm_limit_time_mode_for_comparison 9 s")
    assert took in summary.render(rows, {}, took)
    assert summary.timing(lines[:3]) is None
    everything = [{"kind": "check", "check": row[0], "value": "v", "ok": True}
                  for row in summary.ROWS]
    assert summary.rerun(summary.build_rows(everything)) is None


def test_every_check_a_gpu_test_records_has_a_row() -> None:
    # a check without a row never shows, and its failure does not count in the exit status
    import re
    recorded = {name for path in HERE.glob("*.py")
                for name in re.findall(r'record\(\s*"([a-z0-9_]+)"', path.read_text())}
    rows = {row[0] for row in summary.ROWS}
    assert recorded - rows == set()
    assert recorded >= {"legacy_entry_points", "outside_usage", "alloc_free"}


def test_every_entry_of_the_run_order_names_a_gpu_test() -> None:
    # a renamed test would silently lose its place and run last, where the budget cuts first
    from gpu.conftest import ORDER

    for entry in ORDER:
        file, _, test = entry.partition("::")
        source = HERE / file
        assert source.is_file(), entry
        assert not test or f"def {test}(" in source.read_text(), entry


@pytest.mark.parametrize(("lines", "status"), [
    ([], 1),
    ([{"kind": "test", "nodeid": f"t.py::{row[4]}", "outcome": "skipped",
       "message": "needs a real GPU"} for row in summary.ROWS], 0),
    ([{"kind": "check", "check": row[0], "value": "v", "ok": True} for row in summary.ROWS], 0),
])
def test_summary_exit_status_is_zero_only_without_failures(
        tmp_path: Path, lines: list[dict[str, object]], status: int) -> None:
    results = _write(tmp_path / "results.jsonl", lines)
    out = tmp_path / "out" / "gpu-check.json"
    done = subprocess.run([sys.executable, str(HERE / "summary.py"), str(results), "--json",
                           str(out)], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stdout + done.stderr
    assert len(json.loads(out.read_text())["rows"]) == len(summary.ROWS)
    assert "HAMi-core" in done.stdout


def test_gpubench_builds_with_gcc_alone(tmp_path: Path) -> None:
    path, how = gpubench.build_gpubench(tmp_path / "gpubench")
    done = subprocess.run([str(path)], check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 64, how
    assert "usage: gpubench" in done.stderr


def test_workload_command_line_needs_no_framework() -> None:
    done = subprocess.run([sys.executable, str(HERE / "work.py"), "fill", "--help"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "chunk sizes in MiB" in done.stdout


IMAGE_ONLY = """
import importlib.abc, sys
# what the checks may import besides the standard library: pytest (and what it imports) and
# nvidia-ml-py, which the GPU machine's image has; not the webhook's packages
# (kubernetes-asyncio and pydantic are not on that image)
allowed = {"pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments",
           "pynvml", "gpu", "webhook"}
class Image(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
            return None
        raise ImportError(f"{name}: not a package the GPU checks may import")
sys.meta_path.insert(0, Image())
import pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.py")):
    __import__("gpu." + path.stem)
# and what they import when they run (nvmlwatch's and test_processes's imports in functions)
import webhook.node.compute, webhook.node.inventory, webhook.node.region
print("imported", len(list(pathlib.Path(sys.argv[1]).glob("*.py"))))
"""


def test_gpu_checks_import_only_what_the_gpu_machine_has() -> None:
    # the H200's image has PyTorch, CuPy, JAX, pytest and nvidia-ml-py, and nothing can be
    # installed there: a module of the checks that imported a package of the webhook's (say
    # through webhook.node) would cost every row at the one run a session gets
    root = HERE.parents[1]
    done = subprocess.run([sys.executable, "-c", IMAGE_ONLY, str(HERE)], capture_output=True,
                          text=True, check=False, cwd=root, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{root}:{root / 'tests'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("imported ")



def test_summary_prints_each_bar_figure_in_full_with_its_command() -> None:
    # the issue note takes the bar's figures from the summary as printed: the table cuts a
    # long figure (64 characters) and names no command, so each bar row has a line of its own
    long = ("2nd: CUDA_ERROR_OUT_OF_MEMORY; after SIGKILL granted in 0.00 s, region 6,144 MiB, "
            "outside 6,444 MiB")
    lines = [{"kind": "check", "check": row[0], "value": f"{row[0]} figure", "ok": True}
             for row in summary.ROWS]
    lines.append({"kind": "check", "check": "two_procs", "value": long, "ok": True})
    text = summary.render(summary.build_rows(lines), {})
    assert long in text
    for check in summary.BAR:
        test = next(row[4] for row in summary.ROWS if row[0] == check)
        node = next(f"tests/gpu/{p.name}::{test}" for p in sorted(HERE.glob("test_*.py"))
                    if f"def {test.split('[')[0]}(" in p.read_text())
        figure = long if check == "two_procs" else f"{check} figure"
        line = next((ln for ln in text.splitlines() if ln.startswith(f"bar {check}: ")), None)
        command = (f'GPUCHECK_TESTS="{node}" bash scripts/gpu-check.sh' if check != "outside_usage"
                   else "bash scripts/gpu-check.sh (its maximum over every capped run before it)")
        assert line == f"bar {check}: PASS {figure}; command: {command}", (check, line)
    assert set(summary.BAR) >= {"outside_usage", "largest_torch", "largest_cupy", "largest_jax",
                                "smi_view", "two_procs", "sm_10", "sm_30", "sm_50",
                                "torch_tiny", "launch_cost", "alloc_free"}


@pytest.mark.parametrize("measured", [0, 12])
def test_rerun_command_fits_a_device_call_and_runs_exactly_what_was_left(measured: int) -> None:
    # the second call on the device machine takes the printed command as its own, and a
    # command there is at most 2,000 characters: a test file of which nothing ran goes whole
    lines = [{"kind": "check", "check": row[0], "value": "v", "ok": True}
             for row in summary.ROWS[:measured]]
    again = summary.rerun(summary.build_rows(lines))
    assert again is not None
    assert len(again) <= 1000, (len(again), again)
    ids = again.split('GPUCHECK_TESTS="')[1].split('"')[0].split()
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=HERE.parents[1], capture_output=True, text=True, check=False, timeout=60)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    got = {ln for ln in collected.stdout.splitlines() if ln.startswith("tests/gpu/test_")}
    left = {summary.node_id(row[4]) for row in summary.ROWS[measured:]}
    assert got == left, (got ^ left)


def test_rerun_leaves_out_a_child_that_hung_for_its_own_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a child that hung for its whole timeout ran, and would hang again in the second call
    # (JAX's fill, probe and default pool: 75 s each); one the deadline cut short is left over
    from gpu import harness

    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    monkeypatch.setenv("GPUCHECK_DEADLINE", str(time.time() + 9))
    with pytest.raises(harness.ChildError) as cut:
        harness.run(sleeper, harness.plain_env(), 60)
    monkeypatch.setenv("GPUCHECK_DEADLINE", str(time.time() + 600))
    with pytest.raises(harness.ChildError) as hung:
        harness.run(sleeper, harness.plain_env(), 2)
    base = "tests/gpu/test_x.py::"
    lines = [{"kind": "check", "check": row[0], "value": "v", "ok": True}
             for row in summary.ROWS if row[0] not in {"largest_jax", "sm_10"}]
    lines += [{"kind": "test", "outcome": "failed", "message": f"ChildError: {exc.value}",
               "nodeid": base + test} for exc, test in (
                   (hung, "test_largest_allocation_within_context_footprint_of_cap[jax]"),
                   (cut, "test_sm_limit_caps_matmul_throughput[10]"))]
    again = summary.rerun(summary.build_rows(lines))
    assert again is not None and "test_sm_limit_caps_matmul_throughput[10]" in again, again
    assert "[jax]" not in again, (str(hung.value), again)


def test_children_start_without_the_machines_allocator_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # PyTorch 2.9 reads PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF
    # (c10/core/AllocatorConfig.cpp): one set on the machine would decide the allocator of
    # every PyTorch child, the expandable-segments variant's included
    from gpu import harness

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "CUPY_GPU_MEMORY_LIMIT"):
        monkeypatch.setenv(name, "x")
    for env in (harness.plain_env(), harness.capped_env(Path("/nonexistent/region"))):
        assert not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUPY_GPU_MEMORY_LIMIT"} & set(env)
    extra = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "PYTORCH_ALLOC_CONF" not in harness.plain_env(extra)
    assert harness.plain_env(extra)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
