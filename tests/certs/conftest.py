"""Real clusters on disk and real aiohttp mTLS servers on 127.0.0.1 for the certs tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from certs import ClientContexts, ClusterDir, ServerContexts, server_hostname_for
from netkit.guard import peer_node_id, pin_guard, pinned
from netkit.sites import start_site


@dataclass
class Cluster:
    """A cluster of three members: `a` (CA holder, the server), `b` and `c`."""

    a: ClusterDir
    b: ClusterDir
    c: ClusterDir

    @property
    def a_id(self) -> str:
        node_id = self.a.node_id()
        assert node_id is not None
        return node_id


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    a = ClusterDir(tmp_path / "a")
    a.init("lab", "gpu-a", ["127.0.0.1"])
    a.issue("gpu-b", tmp_path / "b")
    a.issue("gpu-c", tmp_path / "c")
    return Cluster(a, ClusterDir(tmp_path / "b"), ClusterDir(tmp_path / "c"))


@dataclass
class Server:
    """An aiohttp app behind cluster mTLS whose one route is pin-guarded."""

    contexts: ServerContexts
    url: str
    handled: list[str] = field(default_factory=list)


async def start_server(
    cluster_dir: ClusterDir, *, guard: str = "middleware"
) -> tuple[Server, web.AppRunner]:
    """Serve GET /ping, guarded by the `pin_guard` middleware or the `pinned` decorator."""
    contexts = ServerContexts(cluster_dir)
    handled: list[str] = []

    async def ping(request: web.Request) -> web.Response:
        caller = peer_node_id(request)
        handled.append(caller)
        return web.Response(text=caller)

    if guard == "middleware":
        app = web.Application(middlewares=[pin_guard(cluster_dir.pins)])
        app.router.add_get("/ping", ping)
    else:
        app = web.Application()
        app.router.add_get("/ping", pinned(cluster_dir.pins)(ping))
    runner = web.AppRunner(app)
    port = await start_site(runner, "127.0.0.1", 0, ssl_context=contexts.listening)
    server = Server(contexts, f"https://127.0.0.1:{port}/ping", handled)
    return server, runner


@pytest.fixture(params=["middleware", "decorator"])
async def server(cluster: Cluster, request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    """Every guarded-server test runs against both forms of the guard."""
    srv, runner = await start_server(cluster.a, guard=request.param)
    yield srv
    await runner.cleanup()


def client_session(
    member: ClusterDir, *, limit: int = 10, force_close: bool = False
) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        ssl=ClientContexts(member).current(), limit=limit, force_close=force_close
    )
    return aiohttp.ClientSession(connector=connector)


async def get(session: aiohttp.ClientSession, server: Server, expected_node: str) -> int:
    async with session.get(server.url, server_hostname=server_hostname_for(expected_node)) as resp:
        await resp.read()
        return resp.status
