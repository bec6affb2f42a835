"""The agent stops promptly on SIGTERM: a round waiting on an API server that never answers is
cancelled, and an NVML call that never returns (a GPU fallen off the bus) holds up neither the
event loop nor the process's exit; all of it well within the pod's grace period."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client
from node.agentcli import no_kube_args
from node.fakenvml import FakeNvml, two_a100s

from webhook.node import loop
from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.loop import Agent

NODE = "gpu-node-1"
LIB = b"\x7fELF" + b"interposer" * 50
TESTS = Path(__file__).resolve().parents[1]
GRACE_S = 30.0
"""The agent pod's grace period: the chart sets none, so Kubernetes' default."""


def _settings(tmp_path: Path, **kw: object) -> AgentSettings:
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    base: dict[str, object] = {
        "node_name": NODE, "host_library_dir": str(tmp_path / "lib"),
        "host_state_dir": str(tmp_path / "state"), "proc_root": str(tmp_path / "proc"),
        "metrics_host": "127.0.0.1", "metrics_port": 0, "interval": 30.0,
        "cleanup_grace": 60.0}
    base.update(kw)
    return AgentSettings(**base)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def silent_api_server() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An API server whose traffic is dropped: connections are accepted, requests read, and
    nothing is ever answered. Yields its URL and an event set once a request has come."""
    requested = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            if await reader.readline():
                requested.set()
            while await reader.read(65536):
                pass

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", requested
    finally:
        server.close()
        for w in writers:
            w.close()
        await server.wait_closed()


def _hanging(nvml: FakeNvml) -> tuple[threading.Event, threading.Event]:
    """Make ``nvmlDeviceGetCount`` hang until released; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    count = nvml.nvmlDeviceGetCount

    def hung() -> int:
        entered.set()
        release.wait()
        return count()

    nvml.nvmlDeviceGetCount = hung  # type: ignore[method-assign]
    return entered, release


async def test_sigterm_cancels_a_round_waiting_on_an_api_server_that_never_answers(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    async with silent_api_server() as (url, requested), \
            client.ApiClient(client.Configuration(host=url)) as api:
        agent = Agent(settings, LIB, inventory=Inventory(two_a100s()), api_client=api)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await asyncio.wait_for(requested.wait(), 10)  # the round waits on its answer (30 s)
        stop.set()
        started = time.monotonic()
        try:
            await asyncio.wait_for(task, 5)
        except TimeoutError:
            pytest.fail("the round ran on after stop: it waits out its API requests' timeouts")
        assert time.monotonic() - started < 1
    # what the round had done before it was cancelled is whole
    assert (tmp_path / "lib" / "ld.so.preload").read_text() == \
        "/usr/local/gpuslice/libgpuslice.so.0.1.0\n"
    assert (tmp_path / "lib" / "libgpuslice.so.0.1.0").read_bytes() == LIB
    assert agent.status.publish_errors == 0  # cancelled, not counted as a failed publish


async def test_agent_process_exits_promptly_on_sigterm_while_the_api_server_never_answers(
        tmp_path: Path) -> None:
    src = tmp_path / "libgpuslice.so"
    src.write_bytes(LIB)
    (tmp_path / "state").mkdir()
    async with silent_api_server() as (url, requested):
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(textwrap.dedent(f"""\
            apiVersion: v1
            kind: Config
            clusters: [{{name: c, cluster: {{server: "{url}"}}}}]
            users: [{{name: u, user: {{token: t}}}}]
            contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
            current-context: x
            """))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "webhook", "agent", "--kubeconfig", str(kubeconfig),
            "--node-name", NODE, "--library-source", str(src),
            "--host-library-dir", str(tmp_path / "lib"),
            "--host-state-dir", str(tmp_path / "state"), "--proc-root", str(tmp_path / "proc"),
            "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--audit-interval", "0",
            "--log-format", "json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            await asyncio.wait_for(requested.wait(), 20)
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            try:
                _, err = await asyncio.wait_for(proc.communicate(), 10)
            except TimeoutError:
                pytest.fail("the agent did not exit within 10 s of SIGTERM")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err
    assert time.monotonic() - started < 5
    assert '"msg": "agent stopped"' in err.decode()


async def test_close_does_not_block_the_loop_on_a_hung_nvml_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loop, "NVML_CLOSE_S", 0.5, raising=False)
    nvml = two_a100s()
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB,
                  inventory=Inventory(nvml))
    await agent.start()
    entered, release = _hanging(nvml)
    hung = asyncio.create_task(asyncio.to_thread(agent.inventory.discover))  # holds NVML's lock
    timer = threading.Timer(3, release.set)  # so that a close that waits on it ends at all
    try:
        assert await asyncio.to_thread(entered.wait, 5)
        gaps: list[float] = []

        async def heartbeat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.1)
        timer.start()
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="webhook.node.loop"):
            await agent.close()
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.05)
        beat.cancel()
        assert max(gaps) < 0.3, f"the event loop stood still for {max(gaps):.1f} s"
        assert elapsed < 1.5
        assert "NVML not shut down" in caplog.text
        assert nvml.initialised  # skipped: the hung call still holds it
    finally:
        timer.cancel()
        release.set()
        await hung


async def test_a_scrape_waiting_on_a_hung_nvml_call_does_not_hold_up_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "NVML_CLOSE_S", 0.5, raising=False)
    monkeypatch.setattr(loop, "METRICS_SHUTDOWN_S", 0.5, raising=False)
    nvml = two_a100s()
    agent = Agent(_settings(tmp_path, kube_enabled=False, node_name=""), LIB,
                  inventory=Inventory(nvml))
    await agent.start()
    await asyncio.to_thread(agent.inventory.discover)  # the scrape then reads the GPUs
    entered, release = _hanging(nvml)
    hung = asyncio.create_task(asyncio.to_thread(agent.inventory.discover))
    timer = threading.Timer(3, release.set)
    try:
        assert await asyncio.to_thread(entered.wait, 5)
        session = aiohttp.ClientSession()
        scrape = asyncio.create_task(
            session.get(f"http://127.0.0.1:{agent.metrics_port}/metrics"))
        await asyncio.sleep(0.2)  # in its handler, waiting for NVML's lock
        assert not scrape.done()
        timer.start()
        started = time.monotonic()
        await agent.close()
        elapsed = time.monotonic() - started
        assert elapsed < 2.0, f"close waited {elapsed:.1f} s for the scrape"
    finally:
        timer.cancel()
        release.set()
        await hung
        with contextlib.suppress(aiohttp.ClientError):
            (await scrape).release()
        await session.close()


@pytest.mark.parametrize("judged_hung", [False, True], ids=["at-once", "judged-hung"])
def test_agent_process_exits_on_sigterm_while_an_nvml_call_hangs(
        tmp_path: Path, judged_hung: bool) -> None:
    """Also once the call has been judged hung (inventory.HUNG_S) and the rounds, scrapes and
    checks have gone on without it."""
    import subprocess
    src = tmp_path / "libgpuslice.so"
    src.write_bytes(LIB)
    (tmp_path / "state").mkdir()
    mark = tmp_path / "hung"
    script = textwrap.dedent(f"""\
        import sys, threading
        sys.path.insert(0, {str(TESTS)!r})
        from node.fakenvml import two_a100s
        from webhook.cli import main
        from webhook.node import inventory, loop
        from webhook.node.inventory import Inventory

        nvml = two_a100s()

        def hung():  # a GPU fallen off the bus: the call never returns
            open({str(mark)!r}, "w").close()
            threading.Event().wait()

        nvml.nvmlDeviceGetCount = hung
        inventory.HUNG_S = {0.5 if judged_hung else 3600.0}
        loop.Inventory = lambda **kw: Inventory(nvml, **kw)
        raise SystemExit(main(sys.argv[1:]))
        """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "agent", *no_kube_args(tmp_path, src)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 20
        while not mark.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline
            time.sleep(0.05)
        if judged_hung:
            time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            _, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not exit within the grace period ({GRACE_S:.0f} s)")
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert elapsed < loop_bound(), f"exit took {elapsed:.1f} s"
    assert '"msg": "agent stopped"' in err
    assert "NVML not shut down" in err
    assert ('"msg": "NVML call hung' in err) == judged_hung


def loop_bound() -> float:
    """The most the agent's shutdown may take (its own bound, once it has one), plus slack for
    a slow machine; at most the grace period."""
    return min(getattr(loop, "SHUTDOWN_BOUND_S", GRACE_S) + 3.0, GRACE_S)
