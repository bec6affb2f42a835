"""The agent stops promptly on SIGTERM: a round waiting on an API server that never answers is
cancelled, well within the pod's grace period."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from node.fakenvml import two_a100s

from webhook.node.config import AgentSettings
from webhook.node.inventory import Inventory
from webhook.node.loop import Agent

NODE = "gpu-node-1"
LIB = b"\x7fELF" + b"interposer" * 50


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
