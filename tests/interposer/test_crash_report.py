"""GPUSLICE_CRASH_REPORT=1 (interposer/src/crash.c): a process that dies of a fatal signal
writes the signal, the thread and its native stack first, for the GPU check, where no debugger
runs; the program's own handler still runs after it and the process still dies of the signal.

The crash the GPU check last hit is made here too: NVML's per-process utilisation query, asked
from the library's sampler thread under a compute limit, taking more stack than the thread has
(FAKE_NVML_STACK_BYTES past the thread's 8 MiB), so the report must come from an alternate
signal stack.  The GPU check's harness turns the report into the summary's ``crash`` line
(tests/gpu/harness.py crash_report, tests/gpu/summary.py crashes)."""

from __future__ import annotations

import json
import signal

import pytest
from gpu import harness, summary

OVERFLOW = {"CUDA_DEVICE_SM_LIMIT": "30", "FAKE_NVML_STACK_BYTES": str(16 << 20)}


def report_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "] crash: " in ln]


def test_a_crash_on_the_samplers_overflowed_stack_is_reported_with_its_frames(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "2", "kernel", GPUSLICE_CRASH_REPORT="1",
                          **OVERFLOW)
    assert res.returncode == -signal.SIGSEGV, res.stderr
    head = report_lines(res.stderr)
    assert head and head[0].split("] crash: ")[1].startswith("SIGSEGV (code "), res.stderr
    assert "in thread" in head[0] and "'gpuslice'" in head[0], head  # the library's thread
    assert any("libgpuslice.so at 0x" in ln for ln in head), head
    report = harness.crash_report(res.stderr)
    assert report is not None
    stack = report["stack"]
    # from the faulting frame on: NVML's query, then the library's sampler, by name and line
    assert "nvmlDeviceGetProcessUtilization" in stack[1], stack
    assert any(f.startswith("sample_slot (slices.c:") for f in stack), stack
    assert any("sampler (reconcile.c:" in f for f in stack), stack
    assert not any(f.startswith("crash_handler") for f in stack), stack
    # the harness's one-line account, and the summary's line for it
    text = harness._crash(res.stderr)
    assert text.startswith("SIGSEGV (code ") and "sample_slot (slices.c:" in text, text
    lines = [{"kind": "crash", "child": "gsprobe", "report": report}] * 2
    assert summary.crashes(lines) == [
        "crash (2 children): SIGSEGV in thread 'gpuslice': " + " < ".join(stack[:4])]


def test_without_the_variable_nothing_is_reported(release_lab):
    res = release_lab.run("init", "ctx", "0", "bench", "2", "kernel", **OVERFLOW)
    assert res.returncode == -signal.SIGSEGV, res.stderr
    assert report_lines(res.stderr) == []
    assert harness.crash_report(res.stderr) is None


def test_the_programs_own_handler_still_runs_after_the_report(release_lab):
    # gsprobe's handler (installed before CUDA, as Python's faulthandler is) says so and exits
    # with 42; the report comes first and gives it back the signal
    res = release_lab.run("sigcatch", "init", "ctx", "0", "segv", GPUSLICE_CRASH_REPORT="1")
    assert res.returncode == 42, res.stderr
    assert res.stdout.splitlines()[-1] == "probe handler"
    head = report_lines(res.stderr)
    assert head and "SIGSEGV (code 1) at 0x0 in thread" in head[0], res.stderr
    report = harness.crash_report(res.stderr)
    assert report is not None and any("gsprobe" in f for f in report["stack"][:2]), report


def test_a_fault_while_the_report_unwinds_still_reaches_the_programs_handler(release_lab):
    # a smashed stack's frame pointer (gsprobe badframe, x86_64): the report's unwinding faults
    # on it too.  With the signal blocked in the report's handler the kernel killed the process
    # outright, and the program's own handler (Python's faulthandler, its threads' stacks)
    # never ran
    res = release_lab.run("sigcatch", "init", "ctx", "0", "badframe", GPUSLICE_CRASH_REPORT="1")
    if res.of("badframe"):
        pytest.skip("gsprobe badframe is x86_64 only")
    assert res.returncode == 42, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1] == "probe handler"
    head = report_lines(res.stderr)
    assert head and "SIGSEGV (code 1) at 0x0 in thread" in head[0], res.stderr


def test_a_fault_the_programs_own_handler_recovers_from_is_still_its_own(release_lab):
    # a handler of the program's (installed before CUDA, as a runtime's is) makes a guard page
    # readable when the fault's code and address say the fault is on it, and the load runs
    # again.  Given the report's raise() instead of the fault (SI_TKILL, no address), it took
    # the fault for someone else's and the process died of it
    res = release_lab.run("sigguard", "init", "ctx", "0", "guard", GPUSLICE_CRASH_REPORT="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.values("guard") == [0], res.stdout


def test_a_program_that_never_touches_cuda_is_left_alone(release_lab):
    # the handler is installed when the library first resolves libcuda or NVML: a program that
    # never does (a shell, ls) keeps its own signal handling untouched
    res = release_lab.run("sigcatch", "segv", GPUSLICE_CRASH_REPORT="1")
    assert res.returncode == 42, res.stderr
    assert report_lines(res.stderr) == []
    res = release_lab.run("segv", GPUSLICE_CRASH_REPORT="1")
    assert res.returncode == -signal.SIGSEGV and report_lines(res.stderr) == [], res.stderr


def test_a_child_past_its_time_is_aborted_and_says_where_it_waited(release_lab, tmp_path,
                                                                    monkeypatch):
    # the GPU check's harness sends SIGABRT to a child past its time (then SIGKILL): a hang
    # names the native frames its main thread waits in, not only the tail of its log
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results.jsonl")
    env = release_lab.env(GPUSLICE_CRASH_REPORT="1")
    with pytest.raises(harness.ChildError) as caught:
        harness.run(release_lab.command("init", "ctx", "0", "sleep", "60000"), env, timeout=3)
    text = str(caught.value)
    assert "timed out after 3s" in text and "SIGABRT" in text and "'gsprobe'" in text, text
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    crash = [r["report"] for r in records if r["kind"] == "crash"]
    assert len(crash) == 1 and any(f.startswith("gsprobe(") for f in crash[0]["stack"]), crash


def test_a_server_child_without_an_answer_is_aborted_and_says_where_it_waited(release_lab,
                                                                               tmp_path,
                                                                               monkeypatch):
    # gpubench serve stands in for every line-driven child: one that gives no answer in time
    # (here a stand-in that never answers: gsprobe asleep) is aborted the same way
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results.jsonl")
    probe = tmp_path / "gpubench"
    # (its answers' pipe kept open on fd 3, its own lines sent to stderr)
    probe.write_text(f"#!/bin/sh\necho ready $$\nexec 3>&1\nexec {release_lab.command()[0]} "
                     "--api direct init ctx 0 sleep 60000 >&2\n")
    probe.chmod(0o755)
    server = harness.Server(probe, release_lab.env(GPUSLICE_CRASH_REPORT="1"))
    with pytest.raises(harness.ChildError) as caught:
        server.ask("info", timeout=2)
    text = str(caught.value)
    assert "no answer in 2s" in text and "SIGABRT" in text and "'gsprobe'" in text, text
