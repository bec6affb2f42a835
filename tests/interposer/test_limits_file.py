"""The limits file: limits a tenant's shell cannot change.

The webhook writes each GPU container's limits and region path into a pod annotation that
kubelet mounts read-only at ``/etc/gpuslice/limits``. Where that file exists the library reads
those names from it alone: a process started with other limits in its environment, or with
another region, still gets the container's slice. Here the file is named by
``GPUSLICE_LIMITS_FILE`` (honoured only where ``/etc/gpuslice/limits`` does not exist), except in
the test that mounts one at the real path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

GIB = 1 << 30
MIB = 1 << 20
CUDA_ERROR_OUT_OF_MEMORY = 2
# what a tenant's shell might export to lift its slice
LIFTING = {"CUDA_DEVICE_MEMORY_LIMIT": "12g", "CUDA_DEVICE_MEMORY_LIMIT_0": "14g",
           "CUDA_DEVICE_SM_LIMIT": "100", "CUDA_DEVICE_SM_LIMIT_0": "100",
           "GPUSLICE_MEMORY_PERCENT": "100"}


def limits(lab, text: str, region: bool = True) -> dict[str, str]:
    """The env naming a limits file of ``text`` plus the lab's region (as the webhook writes)."""
    path = lab.tmp / "limits"
    path.write_text(f"{text}CUDA_DEVICE_MEMORY_SHARED_CACHE={lab.region_path}\n" if region else text)
    return {"GPUSLICE_LIMITS_FILE": str(path)}


def lines(res, level: str, word: str) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if f"{level}:" in ln and word in ln]


def test_the_file_decides_whatever_the_environment_says(lab):
    # the tenant's process is the first one: it would define the container's limits from its
    # environment, and it points the region elsewhere to get a budget of its own
    elsewhere = lab.tmp / "elsewhere.region"
    env = limits(lab, "CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_SM_LIMIT=30\n")
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", "alloc", "2g", "alloc", "512m",
                  CUDA_DEVICE_MEMORY_SHARED_CACHE=str(elsewhere), **LIFTING, **env)
    assert res.values("meminfo")[1] == GIB
    assert res.values("nvml")[0] == GIB
    assert res.rc("alloc", 0) == CUDA_ERROR_OUT_OF_MEMORY and res.rc("alloc", 1) == 0
    region = lab.region()
    assert region.devices[0].limit_bytes == GIB and region.devices[0].sm_limit == 30
    assert not elsewhere.exists()
    assert len(lines(res, "warning", "from the environment")) == 1, res.stderr


def test_a_second_process_with_lifted_env_shares_the_files_budget(lab):
    env = limits(lab, "CUDA_DEVICE_MEMORY_LIMIT=1g\n")
    ready = lab.tmp / "ready"
    keeper = lab.start("init", "ctx", "0", "alloc", "768m", "touch", str(ready), "sleep", "30000",
                       **env)
    lab.wait_for(ready)
    res = lab.run("init", "ctx", "0", "alloc", "512m", "alloc", "128m",
                  CUDA_DEVICE_MEMORY_SHARED_CACHE=str(lab.tmp / "mine.region"), **LIFTING, **env)
    assert [res.rc("alloc", 0), res.rc("alloc", 1)] == [CUDA_ERROR_OUT_OF_MEMORY, 0]
    keeper.kill()
    keeper.wait(timeout=10)


def test_a_percentage_in_the_file_resolves_against_the_device(lab):
    env = limits(lab, "GPUSLICE_MEMORY_PERCENT=25\n")
    res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="12g", **env)
    assert res.values("meminfo")[1] == 4 * GIB  # of the fake's 16 GiB; the env's 12g is ignored


def test_the_file_is_read_like_the_environment(lab):
    # comments, blank lines, spaces around the names and values, CRLF, a name given twice
    # (the last wins), the per-device names, and an unknown name (an error, the rest applies)
    env = limits(lab, "# written by the gpuslice webhook\r\n\n  CUDA_DEVICE_MEMORY_LIMIT = 4g \r\n"
                      "CUDA_DEVICE_MEMORY_LIMIT_0=3g\nCUDA_DEVICE_SM_LIMIT=50\n"
                      "CUDA_DEVICE_SM_LIMIT=20\nLD_PRELOAD=/tmp/x.so\n")
    res = lab.run("init", "ctx", "0", "meminfo", **env)
    assert res.values("meminfo")[1] == 3 * GIB  # the file's own per-device name is trusted
    assert lab.region().devices[0].sm_limit == 20
    assert len(lines(res, "error", "line 7: ignoring 'LD_PRELOAD' (not one of")) == 1, res.stderr
    assert not lines(res, "warning", "from the environment")


@pytest.mark.parametrize(("text", "why"), [
    ("", "it names no memory limit"),
    ("CUDA_DEVICE_SM_LIMIT=30\n", "it names no memory limit"),
    ("CUDA_DEVICE_MEMORY_LIMIT=lots\n", "CUDA_DEVICE_MEMORY_LIMIT has the value 'lots'"),
    ("GPUSLICE_MEMORY_PERCENT=0\n", "GPUSLICE_MEMORY_PERCENT has the value '0'"),
    ("CUDA_DEVICE_MEMORY_LIMIT=0\n", "CUDA_DEVICE_MEMORY_LIMIT has the value '0'"),
    # a line the library would drop could be the one that limits: the file is the webhook's,
    # so anything it would not write makes the whole file untrusted (found by review)
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_SM_LIMIT=30%\n", "CUDA_DEVICE_SM_LIMIT has the value '30%'"),
    # strtol's sign: the check took '+30' for 30, the reader for no compute limit at all
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_SM_LIMIT=+30\n", "CUDA_DEVICE_SM_LIMIT has the value '+30'"),
    # the check took what its reader skips: 40 zeros and 30 (the reader's buffer holds 31
    # characters: no compute limit, 1 GiB granted), a per-device name with a leading zero (the
    # reader asks for _0: the 512 MiB cap was dropped without a word, 1 GiB granted)
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_SM_LIMIT=" + "0" * 40 + "30\n",
     "CUDA_DEVICE_SM_LIMIT has the value '" + "0" * 40 + "'"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_LIMIT_00=512m\n",
     "line 2 names a device index with a leading zero"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_LIMIT_0\n", "line 2 is not NAME=VALUE"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\0\nCUDA_DEVICE_MEMORY_LIMIT_0=512m\n", "it holds a NUL byte"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\n" + "#" * 4096 + "\n", "it is longer than 4096 bytes"),
    ("".join(f"CUDA_DEVICE_SM_LIMIT_{i}=30\n" for i in range(16)) + "CUDA_DEVICE_MEMORY_LIMIT=1g\n",
     "more than 16 names"),
    ("CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_SHARED_CACHE=/" + "r" * 300 + "\n", "line 2 is too long"),
], ids=["empty", "no-memory-name", "bad-size", "bad-percent", "zero", "bad-sm", "signed-sm", "long-sm",
        "zero-padded-index", "no-equals",
        "nul", "too-long", "too-many-names", "long-value"])
def test_a_file_without_a_usable_memory_limit_grants_nothing(lab, text, why, default_region):
    # an empty file is what kubelet writes when the annotation is missing: the whole device
    # must not become the slice
    env = limits(lab, text)
    res = lab.run("init", "ctx", "0", "alloc", "1m", "nvml", "0", CUDA_DEVICE_MEMORY_LIMIT="8g",
                  FAKE_CUDA_CTX_BYTES="100m", **env)
    assert res.rc("init") == 0
    assert res.rc("ctx") == CUDA_ERROR_OUT_OF_MEMORY  # not even a context fits
    assert res.rc("alloc") != 0
    assert res.values("nvml")[0] == 1  # the cap is one byte (in the file's region, if it named one)
    assert len(lines(res, "error", "no device memory is granted")) == 1, res.stderr
    assert len(lines(res, "error", f"cannot be trusted: {why}")) == 1, res.stderr


def test_a_file_without_a_region_grants_nothing(lab, default_region):
    # without its region path the file's processes would share the per-user default region,
    # which any process of the container could have made first
    env = limits(lab, "CUDA_DEVICE_MEMORY_LIMIT=1g\n", region=False)
    res = lab.run("init", "ctx", "0", CUDA_DEVICE_MEMORY_LIMIT="8g", FAKE_CUDA_CTX_BYTES="100m", **env)
    assert res.rc("ctx") == CUDA_ERROR_OUT_OF_MEMORY
    assert len(lines(res, "error", "cannot be trusted: it names no region")) == 1, res.stderr


@pytest.fixture
def default_region() -> Iterator[Path]:
    """The region path used where no file names one (removed afterwards if a test made it)."""
    path = Path(f"/tmp/gpuslice-{os.getuid()}.region")
    existed = path.exists()
    yield path
    if not existed:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_file_grants_nothing(lab, kind, default_region):
    # nor does the environment's region path count: the region is the default one
    path = lab.tmp / "limits.d"
    if kind == "directory":
        path.mkdir()
    res = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_LIMITS_FILE=str(path),
                  CUDA_DEVICE_MEMORY_LIMIT="8g", FAKE_CUDA_CTX_BYTES="100m")
    assert res.rc("ctx") == CUDA_ERROR_OUT_OF_MEMORY
    assert not lab.region_path.exists() and default_region.exists()
    reason = "is not a plain file" if kind == "directory" else "cannot be read (No such file or directory)"
    assert len(lines(res, "error", f"limits file {path} cannot be trusted: it {reason}")) == 1
    assert len(lines(res, "error", "no device memory is granted")) == 1, res.stderr


def test_without_a_file_the_environment_still_decides(lab):
    res = lab.run("init", "ctx", "0", "meminfo", CUDA_DEVICE_MEMORY_LIMIT="3g")
    assert res.values("meminfo")[1] == 3 * GIB
    assert not lines(res, "info", "limits from")


def test_processes_that_never_touch_cuda_do_not_read_the_file(release_lab):
    # the file is read at device discovery, never at exec
    env = limits(release_lab, "CUDA_DEVICE_MEMORY_LIMIT=1g\n")
    proc = release_lab.run_program(["/bin/true"], LIBCUDA_LOG_LEVEL="4", **env)
    assert proc.returncode == 0 and "limits from" not in proc.stderr


def _overlay_etc(tmp: Path, text: str) -> list[str] | None:
    """A command prefix running its command in a mount namespace where /etc also holds
    gpuslice/limits (an overlay over the real /etc); None where that cannot be done here."""
    unshare = shutil.which("unshare")
    if not unshare:
        return None
    upper, work = tmp / "etc-upper", tmp / "etc-work"
    (upper / "gpuslice").mkdir(parents=True)
    work.mkdir()
    (upper / "gpuslice" / "limits").write_text(text)
    script = ('mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc '
              '&& shift 2 && exec "$@"')
    prefix = [unshare, "--mount", "sh", "-c", script, "sh", str(upper), str(work)]
    probe = subprocess.run([*prefix, "cat", "/etc/gpuslice/limits"], capture_output=True,
                           text=True, check=False)
    return prefix if probe.returncode == 0 and probe.stdout == text else None


def test_the_real_path_wins_over_any_file_the_environment_names(lab):
    region = lab.region_path
    prefix = _overlay_etc(lab.tmp, f"CUDA_DEVICE_MEMORY_LIMIT=2g\nCUDA_DEVICE_MEMORY_SHARED_CACHE={region}\n")
    if prefix is None:
        pytest.skip("cannot mount over /etc in a private mount namespace here (needs root)")
    env = lab.env(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(lab.tmp / "mine.region"), LIBCUDA_LOG_LEVEL="3",
                  **LIFTING, **limits(lab, "CUDA_DEVICE_MEMORY_LIMIT=15g\n"))
    proc = subprocess.run([*prefix, *lab.command("init", "ctx", "0", "meminfo")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    lab.check_sanitizers(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert f"meminfo 0 {2 * GIB} {2 * GIB}" in proc.stdout
    assert "limits from /etc/gpuslice/limits: 2 names" in proc.stderr
    assert lab.region().devices[0].limit_bytes == 2 * GIB


def test_the_webhooks_limits_file_as_kubelet_writes_it(lab):
    # The whole path: the webhook's mutation, the file kubelet makes of it (mount -> volume item
    # -> annotation), and the library reading it under a tenant's lifted environment.
    from webhook.admission.mutate import mutate_pod
    from webhook.settings import settings_from_mapping

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"},
           "spec": {"containers": [{"name": "trainer", "image": "pytorch", "resources": {
               "limits": {"nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}}}]}}
    mutated = mutate_pod(pod, settings_from_mapping({})).pod
    container = mutated["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/gpuslice/limits")
    assert mount["readOnly"] is True
    volume = next(v for v in mutated["spec"]["volumes"] if v["name"] == mount["name"])
    item = next(i for i in volume["downwardAPI"]["items"] if i["path"] == mount["subPath"])
    key = item["fieldRef"]["fieldPath"].removeprefix("metadata.annotations['").removesuffix("']")
    text = mutated["metadata"]["annotations"][key]
    # the container's /var/run/gpuslice is the lab's directory
    path = lab.tmp / "limits"
    path.write_text(text.replace("/var/run/gpuslice/region", str(lab.region_path)))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "3000m"  # the env says the same as the file
    env.update(LIFTING, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(lab.tmp / "mine.region"))
    res = lab.run("init", "ctx", "0", "meminfo", GPUSLICE_LIMITS_FILE=str(path), **env)
    assert res.values("meminfo")[1] == 3000 * MIB
    assert lab.region().devices[0].sm_limit == 30


def test_a_cap_written_into_the_region_is_taken_only_up_to_the_files(lab):
    # The region file is writable by every process of the container: one raised the cap in it
    # to 15 GiB, and a new process took the region's cap (found by review).  Where the file
    # decides, each process holds to its own.
    from webhook.node import region as mirror

    env = limits(lab, "CUDA_DEVICE_MEMORY_LIMIT=1g\n")
    ready = lab.tmp / "ready"
    keeper = lab.start("init", "ctx", "0", "touch", str(ready), "sleep", "30000", **env)
    lab.wait_for(ready)
    with open(lab.region_path, "r+b") as f:  # what a tenant's process can do
        f.seek(mirror.DEVICES_OFFSET + mirror.UUID_LEN)
        f.write((15 * GIB).to_bytes(8, "little"))
    assert lab.region().devices[0].limit_bytes == 15 * GIB
    res = lab.run("init", "ctx", "0", "meminfo", "nvml", "0", "alloc", "2g", "alloc", "512m", **env)
    assert res.values("meminfo")[1] == GIB and res.values("nvml")[0] == GIB
    assert [res.rc("alloc", 0), res.rc("alloc", 1)] == [CUDA_ERROR_OUT_OF_MEMORY, 0]
    keeper.kill()
    keeper.wait(timeout=10)
