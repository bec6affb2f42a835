"""``scripts/gpu-check.sh`` end to end on the fake driver: the GPU check is the one thing that
runs on the scarce H200 time, once per session at best, so its own plumbing (the build, the
harness's children and deadline, gpubench, the NVML watches, the agent's outside checks, the
summary and the files under ``$OUT``) is rehearsed here on every CI run, every row of it, in two
runs of the script:

- the memory, view, process, stream-ordered pool, array and cost rows: their workloads are gpubench
  (the C driver-API tool) and the fills of PyTorch, CuPy and JAX, played here by ``tests/gpu/rehearsal``'s
  stand-ins, which take memory through the driver API as those frameworks' allocators do
  (PyTorch's expandable segments through ``cuMemCreate`` pages); ``nvidia-smi`` is a stand-in
  that reads NVML as the real one does;
- the compute rows (``test_compute.py``, ``test_cotenant.py``), whose workload is a PyTorch
  matmul: the stand-in's ``torch.mm`` launches the fake GPU's kernels through the library's
  hooks, and its ``copy_`` from host memory (``sm_30_copies``) queues the fake's async copy;
- with them, the node agent's rows (``test_agent.py``: its NVML calls through the real pynvml,
  which loads the fake NVML as the driver's; its utilisation query answers with the compute
  run's power model on, and its event set takes the agent's XID registration).

The stand-ins refuse to load without ``GPUCHECK_REHEARSAL=1``. The fake's figures are not the
bar's: the functional rows' verdicts are asserted (a cap, a refusal, a view, a capture that
ended), the timing rows only measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpu import summary

from .conftest import BUILD, ROOT, UUID_A

REHEARSAL = ROOT / "tests" / "gpu" / "rehearsal"
STANDINS = {"PYTHONPATH": str(REHEARSAL), "GPUCHECK_REHEARSAL": "1"}
"""The stand-in frameworks on the children's path, and the switch that lets them load."""
TESTS = ["tests/gpu/test_memory.py", "tests/gpu/test_views.py", "tests/gpu/test_processes.py",
         "tests/gpu/test_usage.py", "tests/gpu/test_overhead.py", "tests/gpu/test_vmm.py",
         "tests/gpu/test_pidns.py", "tests/gpu/test_pool.py", "tests/gpu/test_arrays.py",
         "tests/gpu/test_stack.py", "tests/gpu/test_managed.py"]
"""Every test but the compute rows'."""
FUNCTIONAL = {"outside_usage", "oom_torch", "graph_memory", "legacy_entry_points", "green_ctx",
              "largest_torch", "largest_torch_expandable", "largest_cupy", "largest_jax",
              "jax_default", "process_views", "memory_percent", "limits_file", "smi_view",
              "two_procs", "race", "outside_check", "ipc_import", "vmm_import", "pool_async",
              "array_sizes", "launch_stack", "managed_nvml"}
"""Rows whose verdict the fake decides as a GPU would (caps, refusals, views, NVML per process;
the fake's IPC import takes no memory of its own, which is what ipc_import asks of the real
driver). The launch and alloc+free costs are the fake's own (a 250 ns fake launch, a 2 µs fake
allocation): measured, not judged here."""


COMPUTE = {"sm_50", "sm_30", "sm_10", "sm_30_time", "outside_compute", "sm_30_capture_held",
           "torch_tiny", "sm_30_copies", "sm_30_cotenant", "sm_30_cotenant_raw",
           "sm_30_two_procs", "sm_30_four_procs", "memset_share"}
"""The rows of test_compute.py, test_cotenant.py and test_memset.py."""
AGENT = {"agent_inventory", "agent_xid"}
"""The node agent's rows (test_agent.py), run with the compute rows: the agent samples each
GPU's utilisation, which the fake gives only with its power model on."""
COMPUTE_TESTS = ["tests/gpu/test_compute.py", "tests/gpu/test_cotenant.py",
                 "tests/gpu/test_memset.py", "tests/gpu/test_agent.py"]


def run_script(tmp_path: Path, tests: list[str], smi: bool = True,
               **fake: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/gpu-check.sh on the fake driver with ``$OUT`` at ``tmp_path / "out"``
    (``smi``: with the stand-in nvidia-smi on the path)."""
    out = tmp_path / "out"
    keep = ("PATH", "HOME", "LANG")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update({
        "OUT": str(out), "PYTHON": str(ROOT / ".venv" / "bin" / "python"),
        "LD_LIBRARY_PATH": str(BUILD / "fake"),  # the fake libcuda.so.1, libnvidia-ml.so.1
        "FAKE_CUDA_STATE": str(tmp_path / "fakestate"),  # NVML's per-process view
        "FAKE_CUDA_DEVICES": f"{UUID_A}=16g",
        # a context holds memory, so NVML lists each process; the green context's row takes
        # a primary context under 256 MiB for one that was not charged (the H200's: 524 MiB)
        "FAKE_CUDA_CTX_BYTES": "300m",
        # the default (285 s) holds the compute run about twice over on 2 idle cores; a loaded
        # CI machine gets more before rows are skipped for time
        "GPUCHECK_BUDGET_S": "420",
        "GPUCHECK_TESTS": " ".join(tests), "TMPDIR": str(tmp_path), **STANDINS, **fake,
    })
    # its nvidia-smi; GPUCHECK_REHEARSAL_PATH: folders before it (tools that fail, say)
    env["PATH"] = ":".join(filter(None, [fake.get("GPUCHECK_REHEARSAL_PATH", ""),
                                         str(REHEARSAL / "bin") if smi else "",
                                         env.get("PATH", "/usr/bin:/bin")]))
    if not Path(env["PYTHON"]).is_file():
        env["PYTHON"] = "python3"
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, cwd="/",
                          check=False, capture_output=True, text=True, timeout=480)


def gpu_check(tmp_path: Path, tests: list[str], **fake: str) -> tuple[str, dict[str, Any]]:
    """Run scripts/gpu-check.sh on the fake driver; its log and the rows of gpu-check.json."""
    out = tmp_path / "out"
    done = run_script(tmp_path, tests, **fake)
    log = done.stdout + done.stderr
    # the rows of the tests not asked for show ERROR ("not run"), so the status is 1
    assert done.returncode == 1, log
    assert "interposer/build/libgpuslice.so" in log  # built (or found up to date) and listed
    assert "driver 580.00.00-fake" in log  # the summary names the GPU NVML found
    report = json.loads((out / "gpu-check.json").read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert len(rows) == len(summary.ROWS)
    # every measurement went to $OUT as it was made, for a run cut off by the device's limit
    measured = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {m["check"] for m in measured if m.get("kind") == "check"} >= {
        c for c, r in rows.items() if r["status"] != "ERROR"}
    assert (out / "gpu-check.log").stat().st_size > 0
    # where the time went (the tests' seconds, the slowest named), for the next run's budget
    took = re.search(r"^time: [0-9]+ s in [0-9]+ tests; slowest: test_", log, re.MULTILINE)
    assert took, log[-2000:]
    # the summary names what the run did not reach, as the command that runs only that: here
    # the other run's files, and every one of them
    again = re.search(r'rows not run or cut short; to run only them: GPUCHECK_TESTS="([^"]+)" bash', log)
    assert again is not None, log[-2000:]
    assert {i.split("::")[0] for i in again.group(1).split()} == (
        set(COMPUTE_TESTS) if tests == TESTS else set(TESTS))
    # each bar row once more below the table, its figure in full and the command that
    # measures it alone, for the issue note
    for check in summary.BAR:
        row = rows[check]
        assert re.search(f"^bar {check}: {row['status']} {re.escape(' '.join(row['value'].split()))}"
                         '; command: (GPUCHECK_TESTS="tests/gpu/test_[a-z_]+.py::test_[a-z0-9_\\[\\]]+" '
                         r"bash scripts/gpu-check.sh$|bash scripts/gpu-check.sh \(its maximum)",
                         log, re.MULTILINE), (check, log[-3000:])
    return log, {"rows": rows, "versions": report["versions"], "measured": measured}


@pytest.mark.slow
def test_gpu_check_runs_its_memory_rows_on_the_fake_driver(built: Path, tmp_path: Path) -> None:
    log, report = gpu_check(
        tmp_path, TESTS,
        # launch_stack's kernel: 16 KiB a thread (gpubench_stack only; every other function
        # none), the stack reserved for 262,144 threads (an H100's 270,336, near enough): its
        # launch grows 4 GiB, past the 2 GiB cap
        FAKE_CUDA_FUNC_LOCAL="16k", FAKE_CUDA_FUNC_LOCAL_NAME="gpubench_stack",
        FAKE_CUDA_STACK_THREADS="262144")
    rows = report["rows"]
    for check in FUNCTIONAL:
        assert rows[check]["status"] == "PASS", (check, rows[check], log[-3000:])
    for check, says in (("launch_cost", "x call"), ("alloc_free", " us plain)")):
        assert rows[check]["status"] in {"PASS", "FAIL"}, rows[check]  # measured, not judged
        assert says in rows[check]["value"], rows[check]
    assert set(rows) - FUNCTIONAL - {"launch_cost", "alloc_free", "pid_namespace",
                                     "pool_chunk"} == COMPUTE | AGENT
    # the fake lists each live process by the pid it knows itself by: in a PID namespace (root
    # here) its namespace's, which the library used too; and as kill() finds no process of
    # that number inside, it leaves the co-tenant outside out of the inside list, as the open
    # kernel modules do (it gives no samples unless asked)
    assert rows["pid_namespace"]["status"] == "INFO", rows["pid_namespace"]
    assert rows["pid_namespace"]["value"].startswith(
        ("inside: list by namespace pid (1,324 MiB); ", "not measured: unshare --pid refused")), \
        rows["pid_namespace"]
    assert rows["pid_namespace"]["value"].endswith(
        ("library used its namespace pid; co-tenant seen inside: list no, samples no", ")")), \
        rows["pid_namespace"]
    for check in COMPUTE | AGENT:  # not asked for in this run
        assert rows[check]["status"] == "ERROR", rows[check]
        assert rows[check]["value"] == "not run (see the log)"
    # what each row saw, where the fake knows the answer: a context of 300 MiB (the fills get
    # the cap less that, within the pools' rounding), two pids each with context + allocation,
    # an import that takes nothing, an outside watch that saw each row's held peak
    for variant in ("torch", "torch_expandable", "cupy", "jax"):
        data = next(m["data"] for m in report["measured"] if m.get("check") == f"largest_{variant}")
        assert data["context"]["footprint_mib"] == 300, (variant, data["context"])
        assert 300 <= data["footprint_mib"] <= 320, (variant, data)
        assert 10240 - 64 <= data["outside"]["max_mib"] <= 10240, (variant, data["outside"])
    assert rows["jax_default"]["value"].startswith("pool limit 7,680 MiB")  # 75 % of the cap
    assert rows["outside_check"]["value"] == "1,324 MiB, 2,348 MiB"
    assert rows["ipc_import"]["value"].startswith("importer NVML +0 MiB (+0 written), region +0 MiB")
    # the fake's NVML counts an imported VMM handle for the importer (the stricter model)
    assert rows["vmm_import"]["value"] == ("importer NVML +2,048 MiB, region +2,048 MiB for "
                                           "2,048 MiB shared, +0 after the unmap"), rows["vmm_import"]
    # the fake's NVML counts managed memory as the process's, resident at once
    assert rows["managed_nvml"]["value"] == ("NVML per process +1,024 MiB untouched, +1,024 touched "
                                             "(device +1,024); region +1,024 MiB for 1,024 managed, "
                                             "+0 after the free"), rows["managed_nvml"]
    assert rows["graph_memory"]["value"].endswith("outside 2,348")  # 2 GiB + the context
    assert rows["smi_view"]["value"].startswith("10,240 / 4,396 MiB (usage 4,396)")
    # the stream-ordered pool rows: the fake grows a pool by whole 32 MiB chunks, so gpubench's
    # poolgrow must measure them (1, 2, 10, 50 and 150 MiB held), and its release threshold 0
    # give them back at the synchronisation after the frees; poolfill reaches a 2 GiB cap less
    # the 300 MiB context to the chunk (27 x 64 MiB; each smaller size needs a chunk more)
    assert rows["pool_chunk"]["status"] == "INFO", rows["pool_chunk"]
    assert rows["pool_chunk"]["value"] == ("32/32/32/64/160 MiB for 1/2/10/50/150 held (as 32 MiB "
                                           "chunks); freed+synced 0, trimmed 0"), rows["pool_chunk"]
    grew = next(m["data"] for m in report["measured"] if m.get("check") == "pool_chunk")
    assert grew["growth_steps_mib"] == [32, 0, 0, 32, 96] and grew["as_chunk_model"], grew
    assert grew["result"]["freed_mib"] == 160, grew  # given back at the synchronisation
    assert rows["pool_async"]["value"] == ("1,728 MiB (>= 1,684; context 300, pool 1,728), "
                                           "outside 2,028"), rows["pool_async"]
    filled = next(m["data"] for m in report["measured"] if m.get("check") == "pool_async")
    assert filled["result"]["counts"] == [27, 0, 0, 0], filled["result"]
    assert filled["result"]["used_after"] == 300 == filled["result"]["used_before"], filled
    # the arrays' sizes: the fake takes for each format what the library charges (its sizing
    # model is the library's), the NV12 frame's 11.9 MiB charged as 12 (whole 2 MiB pages)
    assert rows["array_sizes"]["value"] == (
        "charged/real MiB: FLOAT_X4 256.0/256.0 (1.00x), BC1_UNORM 8.0/8.0 (1.00x), "
        "BC7_UNORM 16.0/16.0 (1.00x), NV12 12.0/11.9 (1.01x)"), rows["array_sizes"]
    arrays = next(m["data"] for m in report["measured"] if m.get("check") == "array_sizes")
    assert [(f["name"], f["real_bytes"]) for f in arrays["formats"]] == [
        ("FLOAT_X4", 4096 * 4096 * 16), ("BC1_UNORM", 1024 * 1024 * 8),
        ("BC7_UNORM", 1024 * 1024 * 16), ("NV12", 3840 * 2160 * 3 // 2)], arrays["formats"]
    # a launch that grows the stack near the cap: the fake grows 16 KiB x 262,144 threads =
    # 4 GiB without the library; with it, filled to 212 MiB below a 2 GiB cap (context 300 MiB),
    # the launch is refused before the driver, and the kernel with no local memory still runs
    assert rows["launch_stack"]["value"] == (
        "CUDA_ERROR_OUT_OF_MEMORY at 1,836/2,048 MiB; 16 KiB/thread x 262,144: no library "
        "granted, +4,096 MiB (stack 0 -> 16,384 B); small kernel rc 0; outside 1,836"), \
        rows["launch_stack"]
    # the script's own nvidia-smi query (the stand-in, no library: the whole fake GPU)
    assert f"Fake GPU 0, {UUID_A}, 580.00.00-fake, 16384 MiB, 0 MiB" in log
    assert report["versions"]["gpubench"]["build"]  # how gpubench was built, for the record


@pytest.mark.slow
def test_gpu_check_runs_its_compute_rows_on_the_fake_driver(built: Path, tmp_path: Path) -> None:
    log, report = gpu_check(
        tmp_path, COMPUTE_TESTS,
        FAKE_CUDA_KERNEL_US="2000",  # a matmul's kernel
        FAKE_CUDA_COPY_US="2000",  # sm_30_copies's copy before each: as long as the kernel
        FAKE_CUDA_MEMSET_US="2000",  # memset_share's memsets
        FAKE_GPU_SHARED="1",  # the processes share one GPU that time-slices them
        FAKE_NVML_POWER_LIMIT_MW="700000")  # NVML's utilisation, per process too
    rows = report["rows"]
    for check in COMPUTE:  # measured: a figure, not "not run" or a child's error
        assert rows[check]["status"] in {"PASS", "FAIL", "INFO"}, (check, rows[check], log[-3000:])
    assert rows["sm_30_capture_held"]["value"].endswith("capture ended")  # not invalidated
    # the agent's sampler beside each run read a share for both, with the raw streams kept
    assert re.fullmatch(r"NVML [0-9.]+% at 30% \(throttle's own [0-9.]+%\); unlimited [0-9.]+%",
                        rows["outside_compute"]["value"]), rows["outside_compute"]
    assert re.search(r"; charging [0-9]+/1000 of the measured GPU time$",
                     rows["sm_30_cotenant"]["value"]), rows["sm_30_cotenant"]
    # and the raw per-process queries that are to settle NVML's semantics on the GPU
    watched = next(m for m in report["measured"] if m.get("check") == "outside_compute")
    for run in ("limited", "plain"):
        probes = watched["data"][run]["probes"]
        assert probes and all(isinstance(p["all"], dict) and isinstance(p["last_2s"], dict)
                              for p in probes), probes
        assert any(v["n"] >= 1 for p in probes for v in p["all"].values()), probes
    # the stand-in's copy_ queued the fake's copy (which holds the stream 2 ms: timed alone,
    # one takes that long, however loaded the machine); the share it gives is measured only
    copies = rows["sm_30_copies"]["value"]
    found = re.fullmatch(r"[0-9.]+%; GPU time [0-9.]+%, x[0-9.]+; NVML [0-9.]+%; "
                         r"copy ([0-9.]+)/mm [0-9.]+ ms", copies)
    assert found and float(found.group(1)) >= 1.9, rows["sm_30_copies"]
    # memsets alone, without the library, while the agent's sampler watches: the fake's NVML
    # gives their time to the process as SM time (the question the row asks of the driver)
    assert re.fullmatch(r"[0-9,]+ GB/s of 1 GiB memsets alone; NVML's share of SM time: "
                        r"([0-9]+ %|not judged)", rows["memset_share"]["value"]), rows["memset_share"]
    assert rows["sm_30_two_procs"]["value"].count("+") == 1
    assert rows["sm_30_four_procs"]["value"].count("+") == 3
    # the agent's NVML calls through the real pynvml on the fake NVML: the GPU found healthy as
    # the stand-in nvidia-smi lists it, read as the extender and /metrics read it, and
    # registered for XID events (none waiting: the read answers at once)
    assert rows["agent_inventory"]["status"] == "PASS", (rows["agent_inventory"], log[-3000:])
    assert rows["agent_inventory"]["value"].startswith(
        "1/1 GPU healthy, UUIDs+MiB = nvidia-smi (16,384 MiB); extender reads it; resources, "
        "/metrics checked"), rows["agent_inventory"]
    assert rows["agent_xid"]["status"] == "PASS", rows["agent_xid"]
    assert rows["agent_xid"]["value"].startswith("1/1 registered; events read at once"), \
        rows["agent_xid"]
    for check in set(rows) - COMPUTE - AGENT:  # the other run's rows, not asked for here
        assert rows[check]["status"] == "ERROR", rows[check]


@pytest.mark.slow
def test_gpu_check_does_not_check_a_library_its_failed_build_left(built: Path,
                                                                  tmp_path: Path) -> None:
    # a failed build leaves the library of an earlier one in place (a warm device machine keeps
    # interposer/build between calls): its figures would be taken for the code's
    tools = tmp_path / "failing"
    tools.mkdir()
    for name in ("make", "gcc", "cc"):
        (tools / name).write_text("#!/bin/sh\necho \"$0: refused\" >&2\nexit 1\n")
        (tools / name).chmod(0o755)
    assert (BUILD / "libgpuslice.so").is_file()  # the earlier build's
    test = "tests/gpu/test_memory.py::test_largest_allocation_within_context_footprint_of_cap[torch]"
    done = run_script(tmp_path, [test], GPUCHECK_REHEARSAL_PATH=str(tools))
    log = done.stdout + done.stderr
    assert "build FAILED" in log, log[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "out" / "gpu-check.json")
                                              .read_text())["rows"]}
    assert rows["largest_torch"]["status"] == "ERROR", (rows["largest_torch"], log[-3000:])
    assert "build failed" in rows["largest_torch"]["value"], rows["largest_torch"]
    assert done.returncode == 1


@pytest.mark.slow
def test_gpu_check_without_nvidia_smi_runs_the_rest(built: Path, tmp_path: Path) -> None:
    # the checks read NVML through pynvml: without nvidia-smi only its row has nothing to run,
    # and the log must not say that every check is skipped
    tests = ["tests/gpu/test_views.py::test_nvidia_smi_in_container_shows_cap_and_usage",
             "tests/gpu/test_views.py::test_process_views_report_cap_and_usage"]
    done = run_script(tmp_path, tests, smi=False)
    log = done.stdout + done.stderr
    assert "every check will be skipped" not in log, log[:3000]
    assert "nvidia-smi not found" in log, log[:3000]
    rows = {r["check"]: r for r in json.loads((tmp_path / "out" / "gpu-check.json")
                                              .read_text())["rows"]}
    assert rows["smi_view"]["status"] == "ERROR", rows["smi_view"]
    assert "nvidia-smi not found" in rows["smi_view"]["value"], rows["smi_view"]
    assert rows["process_views"]["status"] == "PASS", (rows["process_views"], log[-3000:])
