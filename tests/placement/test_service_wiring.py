"""The service mounts the extender: its verbs answer and /readyz counts the placement state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from webhook.placement.extender import PLACEMENT_KEY
from webhook.service import create_app
from webhook.settings import Settings


async def test_service_serves_the_extender_verbs(aiohttp_client: Any, tmp_path: Path) -> None:
    app = create_app(Settings(cert_dir=str(tmp_path)))
    client = await aiohttp_client(app)
    pod = {"metadata": {"name": "p", "uid": "u",
                        "annotations": {"gpuslice.io/mutated": "0.1.0"}},
           "spec": {"containers": [{"name": "c", "resources": {
               "limits": {"nvidia.com/gpumem": "100"}}}]}}
    resp = await client.post("/scheduler/filter", json={"Pod": pod, "NodeNames": ["n1"]})
    assert resp.status == 200
    assert (await resp.json())["FailedAndUnresolvableNodes"] == {"n1": "gpuslice: node not known"}
    resp = await client.get("/readyz")
    assert "placement state not ready" not in await resp.text()


async def test_readyz_waits_for_the_placement_state(aiohttp_client: Any, tmp_path: Path) -> None:
    app = create_app(Settings(cert_dir=str(tmp_path), kube_enabled=True))
    app.on_startup.clear()  # no API server here: the watches never start
    app.on_cleanup.clear()
    client = await aiohttp_client(app)
    assert not app[PLACEMENT_KEY].ready()
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert "placement state not ready" in await resp.text()


def test_placement_can_be_turned_off(tmp_path: Path) -> None:
    app = create_app(Settings(cert_dir=str(tmp_path), placement_enabled=False))
    assert PLACEMENT_KEY not in app
    assert not any(r.resource is not None and r.resource.canonical.startswith("/scheduler")
                   for r in app.router.routes())
