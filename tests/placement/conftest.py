"""Fixtures for placement tests: the fake API server and extender apps running against it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from fakekube import FakeKube

from webhook.placement.extender import PLACEMENT_KEY, setup
from webhook.placement.placer import Placer
from webhook.settings import Settings


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        yield fake


class Extender:
    """A running extender app (its own ApiClient) on the fake API server."""

    def __init__(self, kube: FakeKube, aiohttp_client: Any, settings: Settings) -> None:
        self.kube, self._factory, self.settings = kube, aiohttp_client, settings
        self.http: Any = None
        self.api: Any = None

    async def start(self, wait_ready: bool = True) -> Extender:
        self.api = self.kube.api_client()
        app = web.Application()
        setup(app, self.settings, api_client=self.api)
        self.http = await self._factory(app)
        if wait_ready:
            await asyncio.wait_for(self.placer.sync.ready.wait(), 5)  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        """Stop the app (its clean-up stops the watches), then close our ApiClient."""
        if self.http is not None:
            await self.http.close()
        if self.api is not None:
            await self.api.close()
        self.http = self.api = None

    @property
    def placer(self) -> Placer:
        return self.http.app[PLACEMENT_KEY]

    async def post(self, verb: str, body: Any) -> Any:
        resp = await self.http.post(f"/scheduler/{verb}", json=body)
        assert resp.status == 200, await resp.text()
        return await resp.json()

    async def bind(self, pod: dict[str, Any], node: str) -> str:
        meta = pod["metadata"]
        out = await self.post("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                       "PodUID": meta["uid"], "Node": node})
        return str(out["Error"])


@pytest.fixture
async def extender(kube: FakeKube, aiohttp_client: Any) -> AsyncIterator[Callable[..., Any]]:
    """``await extender(**settings)`` starts an extender app against ``kube`` and waits until
    it has listed the cluster (``wait_ready=False``: returns at once)."""
    started: list[Extender] = []

    async def start(wait_ready: bool = True, **overrides: Any) -> Extender:
        ext = Extender(kube, aiohttp_client, Settings(kube_enabled=True, **overrides))
        started.append(ext)
        return await ext.start(wait_ready)

    yield start
    for ext in started:
        await ext.stop()
