"""The agent's loop against the fake API server and fake NVML: rounds, outages, recovery."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pynvml
import pytest
from fakekube import FakeKube
from node.agentcli import no_kube_args
from node.fakenvml import FakeNvml, two_a100s

from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.loop import Agent, Backoff

NODE = "gpu-node-1"
LIB = b"\x7fELF" + b"interposer" * 50


def _node() -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}}}


def _settings(tmp_path: Path, **kw) -> AgentSettings:
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    base = {"node_name": NODE, "host_library_dir": str(tmp_path / "lib"),
            "host_state_dir": str(tmp_path / "state"), "proc_root": str(tmp_path / "proc"),
            "metrics_host": "127.0.0.1", "metrics_port": 0, "interval": 30.0,
            "cleanup_grace": 60.0}
    base.update(kw)
    return AgentSettings(**base)


def _old_pod_dir(state: Path, uid: str) -> Path:
    d = state / uid / "main"
    d.mkdir(parents=True)
    old = time.time() - 3600
    os.utime(d, (old, old))
    os.utime(d.parent, (old, old))
    return d.parent


def _live_pod_with_old_dir(kube: FakeKube, state: Path) -> tuple[str, Path]:
    """A pod on the node (namespace ml, name p) and a state dir of its past the grace: its UID
    and the dir."""
    live = kube.put({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": "p", "namespace": "ml"},
                     "spec": {"nodeName": NODE, "containers": []}})["metadata"]["uid"]
    return live, _old_pod_dir(state, live)


async def _scrape(port: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_one_round_installs_publishes_and_removes_departed_pod_dirs(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        live, kept = _live_pod_with_old_dir(kube, tmp_path / "state")
        gone = _old_pod_dir(tmp_path / "state", str(uuid.uuid4()))
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            delay = await agent.step()
        assert delay == settings.interval
        assert (tmp_path / "lib" / "ld.so.preload").read_text() == \
            "/usr/local/gpuslice/libgpuslice.so.0.1.0\n"
        node = kube.get("nodes", NODE)
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "20"
        assert node["status"]["allocatable"]["nvidia.com/gpumem"] == "163840"
        assert node["metadata"]["labels"]["gpuslice.io/gpu.count"] == "2"
        assert kept.exists() and not gone.exists()
        assert agent.status.cleanup_removed == 1
        # the metrics name the pods' state dirs after the API server's list, not their regions
        assert agent.collector.pod_names == {live: ("ml", "p")}
        # every container user can make the region file (kubelet gives new dirs the root's mode)
        assert (tmp_path / "state").stat().st_mode & 0o7777 == 0o1777
        assert (kept / "main").stat().st_mode & 0o7777 == 0o1777


async def test_the_rounds_pod_list_comes_from_the_watch_cache_and_a_removal_is_confirmed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without resourceVersion (and with limit) every list is a quorum read from etcd, which
    # reads every pod of the cluster to filter this node's: every GPU node every interval.
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        _, kept = _live_pod_with_old_dir(kube, tmp_path / "state")
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            await agent.step()
            lists = kube.requests_to("GET", r"^/api/v1/pods$")
            assert [r.query.get("resourceVersion") for r in lists] == ["0"]
            # a departed pod's dir: removed only after a consistent list says so
            gone = _old_pod_dir(tmp_path / "state", str(uuid.uuid4()))
            kube.requests.clear()
            await agent.step()
            lists = kube.requests_to("GET", r"^/api/v1/pods$")
            assert [r.query.get("resourceVersion") for r in lists] == ["0", None]
            assert kept.exists() and not gone.exists()
            # a watch cache that lags (the pod not in it yet) removes nothing the API server has
            assert agent.publisher is not None
            consistent = agent.publisher.node_pods

            async def lagging(*, cached: bool = False) -> list:
                return [] if cached else await consistent()

            monkeypatch.setattr(agent.publisher, "node_pods", lagging)
            assert await agent.step() == settings.interval
            assert kept.exists() and agent.status.cleanup_removed == 1


async def test_nothing_is_published_until_the_library_is_installed(tmp_path: Path) -> None:
    blocker = tmp_path / "lib"
    blocker.write_text("a file where the library dir should be")
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            delay = await agent.step()
            assert delay < settings.interval
            assert kube.requests_to("PATCH", "/nodes/") == []
            blocker.unlink()
            assert await agent.step() == settings.interval
        assert kube.get("nodes", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "20"


async def test_a_throttled_api_server_is_not_asked_again_before_its_retry_after(
        tmp_path: Path) -> None:
    """The API server sheds load (429, Retry-After: 20, as priority and fairness answers while
    it keeps dropping requests): every node's agent came back after its own 1 s back-off,
    20 times sooner than asked. The round after is no sooner than Retry-After (at most the
    interval)."""
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            agent.backoff = Backoff(base=1.0, cap=settings.interval, rng=lambda: 1.0)
            kube.throttle("*", r"^/api/v1/", times=2, retry_after=20)  # the node, its pods
            assert await agent.step() == 20.0
            kube.throttle("*", r"^/api/v1/", times=2, retry_after=3600)
            assert await agent.step() == settings.interval
            assert await agent.step() == settings.interval
            assert agent.backoff.failures == 0
            assert kube.get("nodes", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "20"


async def test_api_outage_backs_off_keeps_serving_metrics_then_recovers(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        departed = _old_pod_dir(tmp_path / "state", str(uuid.uuid4()))
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            agent.backoff = Backoff(base=1.0, cap=settings.interval, rng=lambda: 1.0)
            await agent.start()
            try:
                kube.down = True
                delays = [await agent.step() for _ in range(4)]
                assert delays == [1.0, 2.0, 4.0, 8.0]
                assert departed.exists()  # a failed pod list removes nothing
                text = await _scrape(agent.metrics_port)
                assert "gpuslice_agent_publish_errors_total 4.0" in text
                assert "gpuslice_gpu_memory_total_bytes{" in text
                assert agent.status.last_publish_success == 0
                kube.down = False
                assert await agent.step() == settings.interval
                assert agent.backoff.failures == 0
                assert kube.get("nodes", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "20"
                assert not departed.exists()
                assert "gpuslice_agent_last_publish_success_timestamp_seconds 0.0" \
                    not in await _scrape(agent.metrics_port)
            finally:
                await agent.close()


async def test_an_unreachable_api_server_is_retried_not_fatal(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        api = kube.api_client()
    # the server is gone now: connections are refused
    try:
        agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
        assert await agent.step() < settings.interval
        assert agent.status.publish_errors == 1
        assert (tmp_path / "lib" / "ld.so.preload").exists()  # the install does not wait on it
    finally:
        await api.close()


async def test_status_patch_rejected_is_retried_next_round(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        kube.fail("PATCH", r"/nodes/gpu-node-1/status$", 500)
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            assert await agent.step() < settings.interval
            assert "nvidia.com/gpu" not in kube.get("nodes", NODE)["status"]["capacity"]
            assert await agent.step() == settings.interval
        assert kube.get("nodes", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "20"


async def test_the_loop_reasserts_resources_after_the_node_is_recreated(tmp_path: Path) -> None:
    settings = _settings(tmp_path, interval=0.1)
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))

            async def published() -> None:
                while "nvidia.com/gpu" not in (kube.get("nodes", NODE) or {}).get(
                        "status", {}).get("capacity", {}):
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(published(), 5)
            kube.delete("nodes", NODE)
            kube.put(_node())  # re-registered by kubelet without our resources
            await asyncio.wait_for(published(), 5)
            stop.set()
            await asyncio.wait_for(task, 5)
        node = kube.get("nodes", NODE)
        assert node["metadata"]["annotations"]["gpuslice.io/gpus"].startswith('[{"uuid":"GPU-0')


async def test_a_node_without_driver_publishes_zero_and_picks_gpus_up_later(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    nvml = two_a100s()
    nvml.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    async with FakeKube() as kube:
        kube.put(_node())
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(nvml), api_client=api)
            await agent.start()
            try:
                assert await agent.step() == settings.interval  # no crash, no fast loop
                node = kube.get("nodes", NODE)
                assert node["status"]["capacity"]["nvidia.com/gpu"] == "0"
                assert node["metadata"]["annotations"]["gpuslice.io/gpus"] == "[]"
                assert "gpuslice_nvml_available 0.0" in await _scrape(agent.metrics_port)
                nvml.init_error = None
                await agent.step()
                assert kube.get("nodes", NODE)["status"]["capacity"]["nvidia.com/gpu"] == "20"
            finally:
                await agent.close()


async def test_no_kube_mode_installs_and_serves_metrics_without_api_calls(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path, kube_enabled=False, node_name="")
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    await agent.start()
    try:
        assert await agent.step() == settings.interval
        assert (tmp_path / "lib" / "libgpuslice.so.0.1.0").read_bytes() == LIB
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{agent.metrics_port}/healthz") as r:
            assert r.status == 200
        assert 'gpuslice_agent_info{library="libgpuslice.so.0.1.0"' in \
            await _scrape(agent.metrics_port)
    finally:
        await agent.close()


async def test_metrics_are_served_on_the_configured_address_only_until_close(tmp_path: Path) -> None:
    # a metrics host given (127.0.0.1 here): bound there alone, not on every interface; after
    # close() nothing listens (an agent started again in the same process found the port taken)
    import socket
    settings = _settings(tmp_path, kube_enabled=False, node_name="")
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    await agent.start()
    port = agent.metrics_port
    try:
        assert agent._runner is not None
        assert [a[0] for a in agent._runner.addresses] == ["127.0.0.1"]
    finally:
        await agent.close()
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", port))


async def test_a_state_dir_that_cannot_be_prepared_fails_the_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the host path is a file (a mistyped hostPath): logged, and the round is retried soon
    settings = _settings(tmp_path, kube_enabled=False, node_name="",
                         host_state_dir=str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    with caplog.at_level("ERROR", logger="webhook.node.loop"):
        assert await agent.step() < settings.interval
    assert any(r.message.startswith("cannot prepare the state dirs") for r in caplog.records)
    (tmp_path / "a-file").unlink()
    assert await agent.step() == settings.interval


async def test_an_nvml_shutdown_that_hangs_is_left_behind_at_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # nvmlShutdown itself hung (not only a call holding NVML): close() gives up on it, says so,
    # and returns within its bound
    from webhook.node import loop

    class Hanging(Inventory):
        def close(self, timeout: float | None = None) -> bool:
            time.sleep(3.0)
            return True

    monkeypatch.setattr(loop, "NVML_CLOSE_S", 0.05)
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB,
                  inventory=Hanging(FakeNvml([])))
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="webhook.node.loop"):
        await agent.close()
    assert time.monotonic() - began < 2.5  # (0.55 s: NVML_CLOSE_S and the half second after it)
    assert any(r.message.startswith("NVML not shut down") for r in caplog.records)


async def test_a_failed_consistent_read_before_a_removal_fails_the_round(tmp_path: Path) -> None:
    # the cached list shows a departed pod's dir; the consistent read that must confirm it
    # before anything is removed is refused: nothing removed, and the round is retried soon
    settings = _settings(tmp_path)
    async with FakeKube() as kube:
        kube.put(_node())
        gone = _old_pod_dir(tmp_path / "state", str(uuid.uuid4()))
        async with kube.api_client() as api:
            from kubernetes_asyncio import client
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            assert agent.publisher is not None
            listed = agent.publisher.node_pods

            async def node_pods(*, cached: bool = False) -> list:
                if not cached:
                    raise client.ApiException(status=500, reason="Internal Server Error")
                return await listed(cached=True)

            agent.publisher.node_pods = node_pods  # type: ignore[method-assign]
            assert await agent.step() < settings.interval
            assert gone.exists()
            agent.publisher.node_pods = listed  # type: ignore[method-assign]
            assert await agent.step() == settings.interval
            assert not gone.exists()


async def test_the_checks_and_rounds_wait_their_intervals(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # rounds, outside checks and compute samples each at its own interval, not back to back
    from webhook.node import loop
    monkeypatch.setattr(loop, "SAMPLE_INTERVAL", 30.0)  # (1 s: a loaded machine's scheduling)
    settings = _settings(tmp_path, kube_enabled=False, node_name="", audit_interval=60.0)
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    assert agent.auditor is not None and agent.auditor.compute is not None
    calls = {"round": 0, "check": 0, "sample": 0}

    async def step() -> float:
        calls["round"] += 1
        return settings.interval

    async def check() -> None:
        calls["check"] += 1

    def poll() -> None:
        calls["sample"] += 1

    agent.step = step  # type: ignore[method-assign]
    agent.auditor.check = check  # type: ignore[method-assign]
    agent.auditor.compute.poll = poll  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    deadline = time.monotonic() + 10
    while not all(calls.values()):
        assert time.monotonic() < deadline, calls
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert calls == {"round": 1, "check": 1, "sample": 1}


async def test_a_check_that_raises_is_counted_and_the_checks_go_on(tmp_path: Path) -> None:
    settings = _settings(tmp_path, kube_enabled=False, node_name="", audit_interval=60.0)
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    assert agent.auditor is not None and agent.auditor.compute is not None

    async def check() -> None:
        raise RuntimeError("a bug")

    def poll() -> None:
        raise RuntimeError("another")

    agent.auditor.check = check  # type: ignore[method-assign]
    agent.auditor.compute.poll = poll  # type: ignore[method-assign]
    await agent.audit()
    await agent.sample_compute()
    await agent.audit()
    assert agent.auditor.errors == 3 and agent.status.last_audit == 0.0


def test_the_exit_waits_for_worker_threads_up_to_its_bound() -> None:
    # serve()'s exit: a worker that ends within the bound is waited for (the normal exit, atexit
    # handlers run); one still busy past it (an NVML call hung) is left behind (os._exit).  In a
    # process of its own: this one's threads are the test runner's
    script = """if True:
        import threading, time
        from webhook.node.loop import _threads_end
        done = threading.Event()
        print(_threads_end(0.0))
        threading.Thread(target=lambda: done.wait(0.2)).start()
        began = time.monotonic()
        print(_threads_end(5.0), round(time.monotonic() - began, 1) < 2.0)
        threading.Thread(target=lambda: done.wait(10.0)).start()
        began = time.monotonic()
        print(_threads_end(0.3), 0.25 < time.monotonic() - began < 2.0)
        done.set()
    """
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split("\n")[:3] == ["True", "True True", "False True"], out.stderr


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    b = Backoff(base=1.0, cap=10.0, rng=lambda: 0.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    b = Backoff(base=1.0, cap=10.0, rng=lambda: 1.0)
    assert [b.next() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    b.reset()
    assert b.next() == 1.0


def test_cli_agent_exits_2_when_the_image_has_no_library(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    from webhook.cli import main
    rc = main(["agent", "--no-kube", "--library-source", str(tmp_path / "absent.so"),
               "--host-library-dir", str(tmp_path / "lib")])
    assert rc == 2
    assert "no usable library" in capsys.readouterr().err
    assert not (tmp_path / "lib").exists()


def test_agent_process_installs_serves_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    src = tmp_path / "libgpuslice.so"
    src.write_bytes(LIB)
    (tmp_path / "state").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "webhook", "agent", *no_kube_args(tmp_path, src)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import json
        import urllib.request
        assert proc.stderr is not None
        import select
        head = ""
        deadline = time.time() + 20
        while '"msg": "metrics served"' not in head:  # the first lines, up to that one
            assert time.time() < deadline and proc.poll() is None, head
            if select.select([proc.stderr], [], [], 0.1)[0]:
                head += os.read(proc.stderr.fileno(), 65536).decode()
        served = next(ln for ln in head.splitlines() if '"msg": "metrics served"' in ln)
        port = json.loads(served)["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"gpuslice_agent_info" in r.read()
        deadline = time.time() + 20
        while not (tmp_path / "lib" / "ld.so.preload").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert '"msg": "agent stopped"' in err


@pytest.mark.parametrize(("interval", "limit"), [(30.0, 300.0), (100.0, 500.0)])
def test_the_agent_is_stalled_only_past_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  interval: float, limit: float) -> None:
    # five intervals, at least five minutes: at the bound itself the agent is still healthy
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name="", interval=interval), LIB,
                  inventory=Inventory(two_a100s()))
    agent._round_done = 1000.0
    for quiet, stalled in ((limit - 1, False), (limit, False), (limit + 0.5, True)):
        monkeypatch.setattr(time, "monotonic", lambda q=quiet: 1000.0 + q)
        assert (agent.stalled() is not None) == stalled, quiet


async def test_healthz_fails_when_no_round_ends_so_the_probe_restarts_a_stuck_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from webhook.node import loop
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB,
                  inventory=Inventory(two_a100s()))
    await agent.start()
    try:
        url = f"http://127.0.0.1:{agent.metrics_port}/healthz"
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                assert (r.status, await r.text()) == (200, "ok\n")
            # a round stuck in a call that never returns: 5 intervals of 30 s, at least 300 s
            now = time.monotonic()
            monkeypatch.setattr(loop.time, "monotonic", lambda: now + 301)
            async with s.get(url) as r:
                assert r.status == 503
                assert "no agent round has ended for 301 s" in await r.text()
            # once a round ends, it is healthy again
            stop = asyncio.Event()
            step = agent.step

            async def last_round() -> float:
                delay = await step()
                stop.set()  # after the round: a stop during one cancels it
                return delay

            monkeypatch.setattr(agent, "step", last_round)
            await agent.run(stop)
            async with s.get(url) as r:
                assert r.status == 200
    finally:
        await agent.close()


async def test_an_install_failure_shows_in_the_metrics(tmp_path: Path) -> None:
    """A library dir that stops taking the library (a full or read-only disk, the dir removed
    by hand and a file in its place) must show in the metrics, not only in the log: the info
    metric no longer names a library, and a counter counts the failures."""
    settings = _settings(tmp_path, kube_enabled=False, node_name="")
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    await agent.start()
    try:
        assert await agent.step() == settings.interval
        assert "gpuslice_agent_install_errors_total 0.0" in await _scrape(agent.metrics_port)
        lib = tmp_path / "lib"
        for p in lib.iterdir():
            p.unlink()
        lib.rmdir()
        lib.write_text("a file where the library dir should be")
        assert await agent.step() < settings.interval
        text = await _scrape(agent.metrics_port)
        assert 'gpuslice_agent_info{library=""' in text
        assert "gpuslice_agent_install_errors_total 1.0" in text
    finally:
        await agent.close()


async def test_a_library_clean_up_blocked_by_the_proc_scan_shows_in_the_metrics(
        tmp_path: Path) -> None:
    """A process the agent cannot inspect (AppArmor, no SYS_PTRACE, a /proc that is not the
    host's) keeps every old library, round after round, with a warning in the log only: the
    metrics must say that old libraries are left and that the clean-up is blocked, so an
    operator can alert on it; and both clear once the scan is whole again."""
    settings = _settings(tmp_path, kube_enabled=False, node_name="")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libgpuslice.so.0.0.9").write_bytes(b"\x7fELF" + b"older" * 50)
    proc = tmp_path / "proc"
    (proc / "2" / "maps").mkdir(parents=True)  # reading it fails with an error other than ENOENT
    agent = Agent(settings, LIB, inventory=Inventory(FakeNvml([])))
    await agent.start()
    try:
        assert await agent.step() == settings.interval
        assert (lib / "libgpuslice.so.0.0.9").exists()
        text = await _scrape(agent.metrics_port)
        assert "gpuslice_agent_library_cleanup_blocked 1.0" in text
        assert "gpuslice_agent_old_libraries 1.0" in text
        (proc / "2" / "maps").rmdir()
        (proc / "2" / "maps").write_text("")
        await agent.step()
        assert not (lib / "libgpuslice.so.0.0.9").exists()
        text = await _scrape(agent.metrics_port)
        assert "gpuslice_agent_library_cleanup_blocked 0.0" in text
        assert "gpuslice_agent_old_libraries 0.0" in text
        assert "gpuslice_agent_libraries_removed_total 1.0" in text
    finally:
        await agent.close()


def _gpu_pod(kube: FakeKube, name: str, started: float, runtime: str = "gvisor") -> None:
    """A running GPU pod the webhook mutated (so its containers bind-mount the host's
    ld.so.preload), in a sandbox runtime, its container started at ``started`` (Unix time)."""
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    kube.put({"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": name, "namespace": "ml",
                           "annotations": {"gpuslice.io/mutated": "true"}},
              "spec": {"nodeName": NODE, "runtimeClassName": runtime,
                       "containers": [{"name": "main", "image": "cuda"}]},
              "status": {"phase": "Running", "containerStatuses": [
                  {"name": "main", "ready": True, "restartCount": 0, "image": "cuda",
                   "imageID": "", "containerID": "containerd://" + "ab" * 32,
                   "state": {"running": {"startedAt": at}}}]}})


async def test_the_oldest_gpu_container_is_the_earliest_running_one_of_a_mutated_pod(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the oldest running container of a pod the webhook mutated started: the clean-up
    keeps every old library while one may have pinned the host's ld.so.preload of before."""
    import datetime as dt
    import math

    from kubernetes_asyncio import client

    from webhook.node.loop import oldest_gpu_container

    def pod(main: dict | None = None, sidecar: dict | None = None, mutated: bool = True,
            status: bool = True) -> dict:
        def of(name: str, state: dict | None) -> list[dict]:
            return [{"name": name, "ready": True, "restartCount": 0, "image": "cuda", "imageID": "",
                     "state": state}] if state is not None else []
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ml",
                             "annotations": {"gpuslice.io/mutated": "true"} if mutated else {}},
                "spec": {"containers": [{"name": "main", "image": "cuda"}]},
                **({"status": {"phase": "Running", "containerStatuses": of("main", main),
                               "initContainerStatuses": of("sidecar", sidecar)}} if status else {})}

    def running(at: str) -> dict:
        return {"running": {"startedAt": at}}

    async with client.ApiClient() as api:
        def oldest(*pods: dict) -> float:
            return oldest_gpu_container([api._ApiClient__deserialize(p, "V1Pod") for p in pods])

        t1 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC).timestamp()
        t0 = t1 - 3600
        at0, at1 = "2026-12-01T09:00:00Z", "2026-12-01T10:00:00Z"
        assert oldest() == math.inf
        assert oldest(pod(main=running(at1), sidecar=running(at0))) == t0  # a sidecar's counts
        assert oldest(pod(main=running(at1), sidecar={"terminated": {"exitCode": 0}})) == t1
        assert oldest(pod(main={"waiting": {"reason": "ContainerCreating"}})) == math.inf
        # pods the webhook did not mutate bind-mount nothing of ours; a pod without status runs nothing
        assert oldest(pod(main=running(at0), mutated=False), pod(status=False), pod(main=running(at1))) == t1
        # a running container without a start time may be the oldest of all
        assert oldest(pod(main={"running": {}}), pod(main=running(at1))) == -math.inf
        # the API server's times are UTC, whether or not the client made them aware
        naive = api._ApiClient__deserialize(pod(main=running(at1)), "V1Pod")
        naive.status.container_statuses[0].state.running.started_at = dt.datetime(2026, 12, 1, 10, 0)
        monkeypatch.setenv("TZ", "America/New_York")  # a node not on UTC
        time.tzset()
        try:
            assert oldest_gpu_container([naive]) == t1
        finally:
            monkeypatch.undo()
            time.tzset()


async def test_a_library_a_sandboxed_gpu_pod_started_with_is_kept_while_it_runs(
        tmp_path: Path) -> None:
    """A container's /etc/ld.so.preload is a bind mount of the host's file as it was when the
    container started: it names the library of then. The clean-up finds a library in use
    through /proc, which does not show the processes of a Kata or gVisor sandbox (a VM, a
    user-space kernel; the webhook mounts the library into such pods as into any other). After
    an upgrade, the old library went at once, and the sandboxed pod's next program (an exec, a
    shell's next command) found its preload missing and ran without the interposer: no cap.
    The API server lists the pod and when its container started: before the host's file last
    changed, so the library it names may be any older one."""
    settings = _settings(tmp_path)
    lib = tmp_path / "lib"
    lib.mkdir()
    old = lib / "libgpuslice.so.0.0.9"
    old.write_bytes(b"\x7fELF" + b"older" * 50)
    (lib / "ld.so.preload").write_text(f"/usr/local/gpuslice/{old.name}\n")
    hour_ago = time.time() - 3600
    os.utime(lib / "ld.so.preload", (hour_ago, hour_ago))
    async with FakeKube() as kube:
        kube.put(_node())
        _gpu_pod(kube, "sandboxed", started=hour_ago + 600)  # pinned the file naming 0.0.9
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
            assert await agent.step() == settings.interval  # the upgrade to 0.1.0
            assert (lib / "ld.so.preload").read_text() == \
                "/usr/local/gpuslice/libgpuslice.so.0.1.0\n"
            assert old.exists(), "removed while a GPU pod started with it still runs"
            assert agent.status.old_libraries == 1
            # a pod started well after the change pinned the new file: it keeps nothing
            kube.delete("pods", "sandboxed", "ml")
            long_ago = time.time() - 7200
            os.utime(lib / "ld.so.preload", (long_ago, long_ago))
            _gpu_pod(kube, "newer", started=long_ago + 600)
            kube.fail("GET", r"^/api/v1/pods$", 500)  # no list: nothing known, nothing goes
            assert await agent.step() < settings.interval
            assert old.exists()
            assert await agent.step() == settings.interval
            assert not old.exists()
            assert agent.status.libraries_removed == 1 and agent.status.old_libraries == 0


async def test_a_round_lists_the_nodes_pods_once_while_a_gpu_is_unhealthy(
        tmp_path: Path) -> None:
    """With a GPU unhealthy (or one gone since), the publish lists the node's pods for what they
    hold on it; the clean-up of the same round, after it, uses that list rather than listing
    again: one list per round per GPU node, as with every GPU healthy."""
    settings = _settings(tmp_path)
    nvml = two_a100s()
    nvml.devices[1].retired_pending = True
    async with FakeKube() as kube:
        kube.put(_node())
        live, kept = _live_pod_with_old_dir(kube, tmp_path / "state")
        gone = _old_pod_dir(tmp_path / "state", str(uuid.uuid4()))
        async with kube.api_client() as api:
            agent = Agent(settings, LIB, inventory=Inventory(nvml), api_client=api)
            await agent.step()
            lists = kube.requests_to("GET", r"^/api/v1/pods$")
            # the cached list, then the consistent read confirming the departed pod's removal
            assert [r.query.get("resourceVersion") for r in lists] == ["0", None]
            assert kept.exists() and not gone.exists()
            assert agent.collector.pod_names == {live: ("ml", "p")}
            kube.requests.clear()
            await agent.step()
            lists = kube.requests_to("GET", r"^/api/v1/pods$")
            assert [r.query.get("resourceVersion") for r in lists] == ["0"]
        node = kube.get("nodes", NODE)
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "10"
