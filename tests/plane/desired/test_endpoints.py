"""Endpoints end to end (issue 16, item 5): a real plane (`nvpair plane serve` on a real
PostgreSQL) holds a tenant's endpoints; two clusters of one real agent each run the
deployments behind them (mock engines), and requests sent with the `openai` client to the
east facade are served as the routing table says -- in east, or forwarded to west.

The routing table reaches the east agent through the desired-state channel where the tree
has it (the plane's `GET /v1/desired`, fetched by agent/plane_link/down.py; the clusters then
converge the plane's deployments themselves). Without it, the test plays the channel: the
deployments are declared in each cluster directly, the nodes' sync reports written as rows,
and a refresh is the document the channel keeps (`$NVPAIR_HOME/plane-desired.json`, made of
the plane's `routes_sql.routes`) written and read as the agent restarts.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import openai
import psycopg
import pytest
import pytest_asyncio

from plane.desired.routes_sql import routes
from plane.desired.state import Route
from tests.agent.deploy_harness import kill_engines, post, ready_everywhere
from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.workload_manager.cluster_harness import engine_ports

from ..endpoint_rows import Rows
from ..plane_process import PlaneProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

AT_ONCE = 16  # requests in flight at a time


@dataclass
class World:
    dsn: str
    plane: PlaneProcess
    rows: Rows
    east: Node  # the facade the client talks to
    west: Node
    clusters: dict[str, str]  # name -> clu_ id
    key: str  # the tenant's plane key
    deployments: dict[str, str]  # workload (deployment) name -> dep_ id
    channel: bool  # the plane serves GET /v1/desired (agent/plane_link/down.py fetches it)
    generation: int = 0

    async def table(self) -> list[Route]:
        async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
            return await routes(conn)

    async def refresh(self) -> None:
        """The east agent's next refresh: it holds the plane's routing table as it is now.
        With the channel in the tree, its own fetch (`GET /v1/plane` shows what it holds);
        without it, the document the channel keeps, written and read as the agent starts."""
        if self.channel:
            # The table as it is at each look, not as it was once: a replica's health probe
            # that times out on a loaded machine turns it `starting` and back, and east's
            # next fetch holds the table after that, not a copy read during it.
            seen: dict[str, Any] = {}

            async def holds() -> bool:
                seen["table"] = table = msgspec.to_builtins(await self.table())
                ready = all(t["ready"] for route in table for t in route["targets"])
                seen["east"] = plane = await self.east.get("/v1/plane")
                desired = plane["desired"]
                return ready and desired is not None and desired["routes"] == table

            try:
                await eventually(holds, "east holds the plane's routing table, all ready")
            except AssertionError as exc:  # what was seen last: the fetch's error, the two
                raise AssertionError(f"{exc}; last seen: {seen}") from None
            return
        table = msgspec.to_builtins(await self.table())
        self.generation += 1
        state = {"cluster": self.clusters["east"], "generation": self.generation, "routes": table}
        path = self.east.home / "plane-desired.json"
        path.write_bytes(msgspec.json.encode({"state": state}))
        path.chmod(0o600)
        await self.east.stop()
        await self.east.start()
        await eventually(lambda: ready_everywhere([self.east], "blue", 1), "blue ready again")

    async def stop_engine(self, name: str, cluster: str, node: Node) -> None:
        """Stop the engine of deployment `name`: where the plane places it (the channel),
        by scaling its plane deployment to 0; else by undeploying it in its cluster."""
        if self.channel:
            await self.rows.sql(
                "UPDATE deployments SET replicas = 0 WHERE id = %s", self.deployments[name]
            )
            await self.rows.sql(
                "UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = %s",
                self.clusters[cluster],
            )
        else:
            code, said = await post(node, f"/v1/deployments/{name}/undeploy", {})
            assert code == 200, said

        async def stopped() -> bool:
            return not [r for r in await node.get("/v1/replicas") if r["deployment"] == name]

        await eventually(stopped, f"{name}'s engine stopped in {cluster}")


def _home(node: Node, plane: PlaneProcess, token: str) -> None:
    node.home.mkdir(parents=True)
    low, high = engine_ports()
    (node.home / "nvpair.toml").write_text(
        f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
    )
    (node.home / "plane.json").write_text(f'{{"url": "{plane.url}", "token": "{token}"}}')
    (node.home / "plane.json").chmod(0o600)


async def _has_channel(plane: PlaneProcess, token: str) -> bool:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(plane.url + "/v1/desired", headers=headers) as r,
    ):
        return r.status != 404


async def _deploy(node: Node, name: str, channel: bool) -> None:
    if not channel:  # with the channel, the cluster converges the plane's deployments
        body = {"name": name, "engine": "mock", "gpus": 0}
        code, said = await post(node, "/v1/deployments", body)
        assert code == 201, said
    await eventually(lambda: ready_everywhere([node], name, 1), f"{name} ready")


async def _all_ready(world: World) -> bool:
    return all(t.ready and t.urls for r in await world.table() for t in r.targets)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(pg_server: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    name = f"test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    dsn = pg_server.rsplit("/", 1)[0] + "/" + name
    root = tmp_path_factory.mktemp("endpoints")
    plane = PlaneProcess(dsn)
    await plane.start()
    east, west = make_node(root / "east", "e1", None), make_node(root / "west", "w1", None)
    try:
        async with AsyncExitStack() as stack:
            for cname, node in (("west", west), ("east", east)):
                token = (await plane.cli("enrol-cluster", cname)).strip()
                _home(node, plane, token)
            channel = await _has_channel(plane, token)
            clusters = {c["name"]: c["id"] for c in await plane.get("/v1/clusters")}
            rows = Rows(dsn)
            _, project, key = await rows.tenant("acme")  # no host: any request's
            deployments = {
                "blue": await rows.deployment(project, "blue", clusters["east"]),
                "green": await rows.deployment(project, "green", clusters["west"]),
            }
            world = World(dsn, plane, rows, east, west, clusters, key, deployments, channel)
            for node in (west, east):
                cluster = start_cluster([node])
                await cluster.__anext__()
                stack.push_async_callback(_finish, cluster)
            await _deploy(west, "green", channel)
            await _deploy(east, "blue", channel)
            # What each node's sync reports (its replicas, its facade URL), as rows: the
            # channel's sync writes the same.
            for cname, node, deployment in (("west", west, "green"), ("east", east, "blue")):
                node_id = await node.node_id()
                await eventually(lambda n=node_id: _synced(rows, n), f"{node.name} in the plane")
                if not channel:
                    url = f"http://127.0.0.1:{node.ports['facade']}"
                    await rows.sql("UPDATE nodes SET facade_url = %s WHERE id = %s", url, node_id)
                    await rows.replica(deployments[deployment], clusters[cname], node_id)
            await eventually(lambda: _all_ready(world), "the plane sees both ready")
            yield world
    finally:
        for node in (east, west):
            kill_engines(node.home)
        await plane.stop()
        async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


async def _finish(cluster: AsyncIterator[list[Node]]) -> None:
    async for _ in cluster:
        pass


async def _synced(rows: Rows, node_id: str) -> bool:
    return bool(await rows.sql("SELECT 1 FROM nodes WHERE id = %s", node_id))


async def plane_call(world: World, method: str, path: str, body: Any) -> Any:
    """A plane API call with the tenant's key; the decoded answer of a success."""
    headers = {"Authorization": f"Bearer {world.key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, world.plane.url + path, json=body, headers=headers) as r,
    ):
        said = await r.json()
        assert r.status < 300, said
        return said


async def served_by(node: Node, model: str, count: int) -> collections.Counter[str]:
    """Which engine answered each of `count` chat requests for `model` through `node`'s
    facade (a deployment's mock engine serves its own name only, and answers with it)."""
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    gate = asyncio.Semaphore(AT_ONCE)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:

        async def one() -> str:
            async with gate:
                answer = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                return answer.model

        return collections.Counter(await asyncio.gather(*(one() for _ in range(count))))


def near(counts: collections.Counter[str], want: dict[str, float], total: int) -> bool:
    return sum(counts.values()) == total and all(
        abs(counts[name] / total - share) <= 0.03 for name, share in want.items()
    )


async def test_ninety_ten_then_a_weight_change_on_the_next_refresh(world: World) -> None:
    blue, green = world.deployments["blue"], world.deployments["green"]
    made = await plane_call(
        world,
        "POST",
        "/v1/endpoints",
        {
            "modelName": "chat",
            "targets": [{"deployment": blue, "weight": 90}, {"deployment": green, "weight": 10}],
        },
    )
    await world.refresh()
    listed = {m.id for m in (await _models(world.east)).data}
    assert {"chat", "blue"} <= listed
    counts = await served_by(world.east, "chat", 200)  # two cycles of the weights: exact
    assert near(counts, {"blue": 0.9, "green": 0.1}, 200), counts  # green: forwarded west
    await plane_call(
        world,
        "PATCH",
        f"/v1/endpoints/{made['id']}",
        {"targets": [{"deployment": blue, "weight": 30}, {"deployment": green, "weight": 70}]},
    )
    if not world.channel:  # (the channel's next fetch is within seconds)
        # Until the next refresh the facade routes by the table it holds ...
        assert near(await served_by(world.east, "chat", 100), {"blue": 0.9}, 100)
    await world.refresh()
    counts = await served_by(world.east, "chat", 200)  # ... and then by the new weights
    assert near(counts, {"blue": 0.3, "green": 0.7}, 200), counts


async def _models(node: Node) -> Any:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        return await client.models.list()


async def test_routing_goes_on_through_a_plane_outage(world: World) -> None:
    blue, green = world.deployments["blue"], world.deployments["green"]
    await plane_call(
        world,
        "POST",
        "/v1/endpoints",
        {
            "modelName": "chat-ha",
            "mode": "failover",
            "targets": [{"deployment": green, "order": 0}, {"deployment": blue, "order": 1}],
        },
    )
    await world.refresh()
    await world.plane.stop()
    await world.east.stop()
    await world.east.start()  # starts with the plane away: the table it kept
    await eventually(lambda: ready_everywhere([world.east], "blue", 1), "blue ready again")
    assert await served_by(world.east, "chat-ha", 20) == {"green": 20}
    url = f"http://127.0.0.1:{world.east.ports['facade']}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="chat-ha", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [chunk async for chunk in stream]  # streamed back from west as it comes
    assert len(chunks) > 2
    assert {c.model for c in chunks} == {"green"}
    assert sum((await served_by(world.east, "chat", 100)).values()) == 100
    await world.plane.start()


async def test_failover_moves_to_the_second_target_when_the_first_stops(world: World) -> None:
    assert await served_by(world.east, "chat-ha", 10) == {"green": 10}  # the first, in west
    await world.stop_engine("green", "west", world.west)
    # The first target is down: the forward fails (or, once the plane is back and has seen
    # it, the table says so) and the next by order, blue here in east, serves. No request
    # fails.
    assert await served_by(world.east, "chat-ha", 50) == {"blue": 50}
    if not world.channel:  # the table still says green is ready: the forwards failed
        assert world.east.log_count("forward to green in") >= 1
