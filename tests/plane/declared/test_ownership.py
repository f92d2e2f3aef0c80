"""One plane cluster, or one node, cannot write another's rows; malformed query parameters
are refused. A real plane HTTP server on a real PostgreSQL (issue 12, item 7)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest
import yarl

from plane.core.ids import new_id
from plane.core.wire import SyncBatch

from ..db.test_store import batch
from ..plane_client import ADMIN, Plane, enrol

JSON = {"headers": {"Content-Type": "application/json"}}


async def rows(plane: Plane, table: str) -> dict[str, tuple[Any, ...]]:
    """Every row of `table` by id, as stored."""
    async with plane.store.pool.connection() as conn:
        cursor = await conn.execute(f"SELECT * FROM {table} ORDER BY id".encode())
        return {row[0]: row for row in await cursor.fetchall()}


async def sync(plane: Plane, token: str, sent: SyncBatch) -> tuple[int, Any]:
    return await plane.call("POST", "/v1/sync", token, msgspec.json.encode(sent), **JSON)


@pytest.mark.parametrize("table", ["devices", "topology_domains"])
async def test_a_node_cannot_write_another_nodes_device_or_domain(plane: Plane, table: str) -> None:
    _, token_a = await enrol(plane, "a")
    _, token_b = await enrol(plane, "b")
    owner = new_id("nod")
    assert (await sync(plane, token_a, batch(owner, 1, [])))[0] == 200
    before = {t: await rows(plane, t) for t in ("nodes", "devices", "topology_domains")}
    theirs = next(iter(before[table]))

    def forged(node: str) -> SyncBatch:
        # The forger's own inventory with one id replaced by the owner's, at a higher
        # generation and with other figures: newer-wins alone would have taken it.
        sent = batch(node, 9, [], gpus="l4:2")
        if table == "devices":
            device = msgspec.structs.replace(sent.devices[0], id=theirs, health="failed")
            return msgspec.structs.replace(sent, devices=[device, *sent.devices[1:]])
        domain = msgspec.structs.replace(sent.domains[0], id=theirs, kind="forged")
        return msgspec.structs.replace(sent, domains=[domain])

    for token in (token_b, token_a):  # another cluster's node, then a node of the same one
        forger = new_id("nod")
        status, answer = await sync(plane, token, forged(forger))
        assert (status, answer["error"]) == (400, f"{theirs} belongs to another node")
        now = {t: await rows(plane, t) for t in ("nodes", "devices", "topology_domains")}
        assert now == before  # the owner's row unchanged, and nothing of the batch written

    # The control: the same forger's own ids are taken, and the owner's rows stay its own.
    forger = new_id("nod")
    own = batch(forger, 9, [], gpus="l4:2")
    assert (await sync(plane, token_b, own))[0] == 200
    after = await rows(plane, table)
    mine = {d.id for d in (own.devices if table == "devices" else own.domains)}
    assert mine <= set(after)
    assert {k: v for k, v in after.items() if k not in mine} == before[table]


BAD_QUERIES = [
    "/v1/jobs?after=",
    "/v1/jobs?after=%ff",
    "/v1/jobs?after=[1]",
    "/v1/jobs?after=[1,2,3,4,5]",
    "/v1/jobs?after=[99999999999999999999,%22a%22,%22b%22,%22c%22,%22d%22]",
    "/v1/jobs?after=[1,%22a%5Cu0000%22,%22b%22,%22c%22,%22d%22]",
    "/v1/jobs?after=" + "[" * 4_000,  # nested JSON, under the request line's 8 KiB
    "/v1/jobs?limit=",
    "/v1/jobs?limit=1e3",
    "/v1/jobs?limit=%D9%A3",  # an Arabic-Indic digit: isdigit() but not a number here
    "/v1/jobs?limit=99999999999999999999",
    "/v1/jobs?state=exploded",
    "/v1/jobs?state=%00",
    "/v1/jobs?model=" + "m" * 300,
    "/v1/jobs?model=a%00b",
    "/v1/jobs?cluster=nope",
    "/v1/jobs?cluster=%ff",
    "/v1/fleet/summary?window=",
    "/v1/fleet/summary?window=0",
    "/v1/fleet/summary?window=-5",
    "/v1/fleet/summary?window=1.5",
    "/v1/fleet/summary?window=99999999999999999999",
    "/v1/fleet/summary?window=%00",
]


async def test_malformed_query_parameters_are_400(plane: Plane) -> None:
    cluster, _ = await enrol(plane, "a")
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as session:
        for query in BAD_QUERIES:
            # Sent as written: already encoded, bytes that are not UTF-8 included.
            url = yarl.URL(plane.url + query, encoded=True)
            async with session.get(url, headers=headers) as response:
                assert response.status == 400, query
                assert (await response.json())["error"], query
    # The control: the same parameters, well formed.
    for query in (
        f"/v1/jobs?cluster={cluster}&state=completed&model=llama&limit=5",
        "/v1/jobs?after=[1,%22a%22,%22b%22,%22c%22,%22d%22]",
        "/v1/fleet/summary?window=60",
    ):
        assert (await plane.call("GET", query, ADMIN))[0] == 200, query
