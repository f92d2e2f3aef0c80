"""The plane's warm set made true (issue 28, done-when): `nvpair plane serve` on a real
PostgreSQL, three real agents enrolled in it. An artifact added on a is declared in the
plane (by its digest) and put in the cluster's warm set by the admin; b and c fetch it in
the background, and the plane's `GET /v1/cache` shows it resident on all three -- from each
member's store, every piece verified. Before the warm set names it, only a holds it (the
control), and b's copy is byte-identical to a's files (the test hashes them itself).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.agent.harness import Node, eventually, make_node, start_cluster

from ..plane_process import ADMIN, PlaneProcess, point_at_plane


@pytest.fixture
async def plane_process(pg_dsn: str) -> AsyncIterator[PlaneProcess]:
    process = PlaneProcess(pg_dsn)
    await process.start()
    yield process
    await process.stop()


async def call(plane: PlaneProcess, method: str, path: str, body: Any, token: str) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, plane.url + path, json=body, headers={"Authorization": f"Bearer {token}"}
        ) as response,
    ):
        assert response.status in (200, 201), await response.text()
        return await response.json()


def tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


async def test_a_warm_set_declared_in_the_plane_is_fetched_and_shown_resident(
    tmp_path: Path, plane_process: PlaneProcess
) -> None:
    token = (await plane_process.cli("enrol-cluster", "lab")).strip()
    nodes = [make_node(tmp_path, name, None) for name in "abc"]
    for node in nodes:
        point_at_plane(node.home, plane_process, token)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 0.5\n")
    cluster = start_cluster(nodes)
    a, b, c = await cluster.__anext__()
    try:
        weights = tmp_path / "weights"
        weights.mkdir()
        (weights / "config.json").write_text("{}")
        (weights / "model.safetensors").write_bytes(os.urandom(1024 * 1024 + 3))
        code, out, err = await a.cli("artifact", "add", str(weights), "--name", "w")
        assert code == 0, err
        digest = out.split()[2]
        (cluster_id,) = [c["id"] for c in await plane_process.get("/v1/clusters")]
        tenant = await call(plane_process, "POST", "/v1/tenants", {"name": "acme"}, ADMIN)
        key = (await call(plane_process, "POST", f"/v1/tenants/{tenant['id']}/keys", {}, ADMIN))[
            "key"
        ]
        # A location `nvpair://CLUSTER/NAME`: a cluster's own artifact store (docs/artifacts.md).
        declared = {"digest": digest, "kind": "base", "locations": ["nvpair://lab/w"]}
        artifact = (await call(plane_process, "POST", "/v1/artifacts", declared, key))["id"]

        async def entry() -> dict[str, Any] | None:
            items = (await plane_process.get(f"/v1/cache?cluster={cluster_id}"))["items"]
            return next((e for e in items if e["artifact"] == artifact), None)

        # The control: not yet warm, nobody fetches it; only a holds it.
        assert await entry() is None
        assert not await _resident(b, "w")
        await call(
            plane_process,
            "PUT",
            f"/v1/clusters/{cluster_id}/warm",
            {"artifacts": [artifact]},
            ADMIN,
        )
        ids = {await n.node_id() for n in (a, b, c)}

        async def everywhere() -> bool:
            seen = await entry()
            return seen is not None and set(seen["residentOn"]) == ids

        await eventually(everywhere, "the plane showing w resident on a, b and c", within_s=60)
        seen = await entry()
        assert seen is not None
        assert seen["declaredWarm"] is True
        assert (seen["missingOn"], seen["fetchingOn"]) == ([], [])
        for node in (b, c):
            ready = node.home / "artifacts" / "ready" / digest.removeprefix("sha256:")
            assert tree(ready) == tree(weights), node.name
    finally:
        with pytest.raises(StopAsyncIteration):
            await cluster.__anext__()


async def _resident(node: Node, name: str) -> bool:
    found = [x for x in await node.get("/v1/artifacts") if x["name"] == name]
    return bool(found) and found[0]["here"] == "resident"
