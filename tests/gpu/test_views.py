"""Real GPU, what a capped process is told: cuMemGetInfo, cuDeviceTotalMem, PyTorch's and
NVML's in-process views, a device picked by UUID, GPUSLICE_MEMORY_PERCENT, and nvidia-smi
run inside the container."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpu import harness
from gpu.fills import Fills, watched
from gpu.harness import CAP_MIB, GIB, MIB, Server, record
from gpu.nvmlwatch import Nvml, Poller

pytestmark = pytest.mark.gpu

TOLERANCE_MIB = 64


def test_process_views_report_cap_and_usage(nvml: Nvml, gpubench: Path, fills: Fills) -> None:
    env = harness.capped_env(harness.new_region("views"))
    info = harness.run([str(gpubench), "info"], env, 30)
    by_uuid = harness.run([str(gpubench), "info"],
                          {**env, "CUDA_VISIBLE_DEVICES": nvml.uuid}, 30)
    torch_fill = fills.fill("torch")
    peak, outside = torch_fill["peak"], torch_fill["outside"]["max_mib"]
    torch_used = (peak["view"]["total"] - peak["view"]["free"]) / MIB
    inside = peak["nvml"]
    views: dict[str, bool] = {
        "cuMemGetInfo total": info["total"] == CAP_MIB * MIB,
        "cuMemGetInfo free <= total": info["free"] <= info["total"],
        "cuDeviceTotalMem": info["device_total"] == CAP_MIB * MIB,
        "by UUID (CUDA_VISIBLE_DEVICES)": by_uuid["total"] == CAP_MIB * MIB,
        "torch mem_get_info total": peak["view"]["total"] == CAP_MIB * MIB,
        "torch used = outside": abs(torch_used - outside) <= TOLERANCE_MIB,
        "NVML total (in process)": inside.get("total") == CAP_MIB * MIB,
        "NVML used = outside": abs(inside.get("used", -GIB) / MIB - outside) <= TOLERANCE_MIB,
    }
    failed = [name for name, good in views.items() if not good]
    record("process_views",
           f"{len(views) - len(failed)}/{len(views)} right" + (f"; wrong: {failed}" if failed else ""),
           not failed, views=views, info=info, by_uuid=by_uuid, torch_view=peak["view"],
           nvml_inside=inside, outside_mib=outside)
    assert not failed, f"views off: {failed} (info={info}, torch={peak['view']}, nvml={inside})"


def test_memory_percent_resolves_against_real_total(nvml: Nvml, gpubench: Path,
                                                    lib: Path) -> None:
    # The percentage resolves against NVML's total (143,771 MiB on an H200), not
    # cuDeviceTotalMem's (143,156 MiB): the node agent publishes NVML's total as memoryMiB and
    # the extender resolves gpumem-percentage against it, so the library must agree with them.
    real = harness.run([str(gpubench), "info"], harness.plain_env(), 30)
    env = harness.capped_env(harness.new_region("percent"), mem=None,
                             extra={"GPUSLICE_MEMORY_PERCENT": "10"})
    capped = harness.run([str(gpubench), "info"], env, 30)
    expected = nvml.total * 10 / 100 / MIB
    got = capped["total"] / MIB
    ok = abs(got - expected) <= 2
    record("memory_percent", f"{got:,.0f} MiB of NVML's {nvml.total / MIB:,.0f} (10%)", ok,
           expected_mib=expected, got_mib=got, nvml_total_mib=nvml.total / MIB, real=real,
           capped=capped)
    assert ok, f"GPUSLICE_MEMORY_PERCENT=10 gave {got:,.1f} MiB, expected {expected:,.1f}"


def _smi(env: dict[str, str]) -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.fail("nvidia-smi not found on PATH")
    query = [exe, "--query-gpu=memory.total,memory.used,memory.free",
             "--format=csv,noheader,nounits"]
    done = subprocess.run(query, check=False, env=env, capture_output=True, text=True,
                          timeout=harness.budget(30))
    if done.returncode != 0:
        pytest.fail(f"nvidia-smi failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    fields = [f.strip() for f in done.stdout.strip().splitlines()[0].split(",")]
    try:
        total, used, free = (int(f) for f in fields)
    except ValueError:
        pytest.fail(f"nvidia-smi printed {fields}")
    return {"total": total, "used": used, "free": free}


def test_nvidia_smi_in_container_shows_cap_and_usage(nvml: Nvml, gpubench: Path,
                                                     lib: Path) -> None:
    env = harness.capped_env(harness.new_region("smi"))
    empty = _smi(env)
    with Poller(nvml, "smi-holder") as poll:
        holder = Server(gpubench, env, poll)
        try:
            granted = holder.alloc(4 * GIB)
            time.sleep(0.3)
            poll.sample()
            holding = _smi(env)
            table = subprocess.run(["nvidia-smi"], check=False, env=env, capture_output=True,
                                   text=True, timeout=harness.budget(30)).stdout
        finally:
            holder.kill()
    usage = watched(poll)["max_mib"]
    time.sleep(0.2)
    after_kill = _smi(env)
    samples = {"empty": empty, "holding 4 GiB": holding, "after SIGKILL": after_kill}
    problems = [f"{name}: total {s['total']}" for name, s in samples.items()
                if s["total"] != CAP_MIB]
    problems += [f"{name}: used {s['used']} / free {s['free']} > total" for name, s in
                 samples.items() if s["used"] > s["total"] or s["free"] > s["total"]]
    if not granted.startswith("ok"):
        problems.append(f"holder's 4 GiB refused: {granted}")
    if abs(holding["used"] - usage) > TOLERANCE_MIB:
        problems.append(f"used {holding['used']} while the container uses {usage:,.0f}")
    for name in ("empty", "after SIGKILL"):
        if samples[name]["used"] > TOLERANCE_MIB:
            problems.append(f"{name}: used {samples[name]['used']} with nothing running")
    record("smi_view",
           f"{holding['total']:,} / {holding['used']:,} MiB (usage {usage:,.0f}); "
           f"empty {empty['used']}, after kill {after_kill['used']}",
           not problems, samples=samples, usage_mib=usage, problems=problems,
           table=table.splitlines()[:24])
    assert not problems, "; ".join(problems)


def test_the_limits_file_wins_over_a_lifted_environment(nvml: Nvml, gpubench: Path,
                                                         lib: Path) -> None:
    # What the webhook mounts at /etc/gpuslice/limits (named here by GPUSLICE_LIMITS_FILE,
    # honoured only where that path does not exist): a tenant's shell that exports a bigger
    # cap and another region still gets the file's slice.
    region = harness.new_region("limitsfile")
    limits = region.with_suffix(".limits")
    limits.write_text(f"CUDA_DEVICE_MEMORY_LIMIT={CAP_MIB}m\n"
                      f"CUDA_DEVICE_MEMORY_SHARED_CACHE={region}\n")
    env = harness.capped_env(harness.new_region("lifted"), mem=f"{4 * CAP_MIB}m",
                             extra={"GPUSLICE_LIMITS_FILE": str(limits)})
    got = harness.run([str(gpubench), "info"], env, 30)
    ok = got["total"] == CAP_MIB * MIB and got["device_total"] == CAP_MIB * MIB
    record("limits_file", f"{got['total'] / MIB:,.0f} MiB with {4 * CAP_MIB} MiB in the env", ok,
           info=got)
    assert ok, f"the limits file's {CAP_MIB} MiB did not win: {got}"
