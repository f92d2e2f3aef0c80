"""Cost of the per-request pin check (issue 3).

Two aiohttp servers behind the same cluster mTLS in a child process: one whose handler is
guarded by the pin check (`netkit.guard.pinned`, as the inter-node endpoints use it), one
without. The client (this process) sends the same requests to each in turn over
kept-alive connections, 16 in flight, in paired rounds; the ratio is guarded / unguarded.

    python bench/pin_check.py [--requests 1500] [--rounds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from pathlib import Path

import aiohttp
from _interleave import report
from aiohttp import web

from certs import ClientContexts, ClusterDir, ServerContexts, server_hostname_for
from netkit.guard import pinned
from netkit.sites import start_site

CONCURRENCY = 16


async def _serve(cluster_path: str, ports: multiprocessing.Queue[tuple[int, int]]) -> None:
    cluster = ClusterDir(Path(cluster_path))

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    found = []
    for handler in (pinned(cluster.pins)(ping), ping):
        app = web.Application()
        app.router.add_get("/ping", handler)
        runner = web.AppRunner(app, access_log=None)
        listening = ServerContexts(cluster).listening
        found.append(await start_site(runner, "127.0.0.1", 0, ssl_context=listening))
    ports.put((found[0], found[1]))
    await asyncio.Event().wait()


def serve(cluster_path: str, ports: multiprocessing.Queue[tuple[int, int]]) -> None:
    """The child: a guarded and an unguarded server on 127.0.0.1 until terminated."""
    asyncio.run(_serve(cluster_path, ports))


async def rate(session: aiohttp.ClientSession, url: str, hostname: str, count: int) -> float:
    """Requests per second for `count` GETs, CONCURRENCY in flight."""
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            async with session.get(url, server_hostname=hostname) as resp:
                await resp.read()
                assert resp.status == 200, resp.status

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return count / (time.perf_counter() - start)


async def client(
    b: ClusterDir, a_id: str, ports: tuple[int, int], args: argparse.Namespace
) -> None:
    """Alternate baseline and guarded rounds over kept-alive connections."""
    hostname = server_hostname_for(a_id)
    guarded_url = f"https://127.0.0.1:{ports[0]}/ping"
    plain_url = f"https://127.0.0.1:{ports[1]}/ping"
    connector = aiohttp.TCPConnector(ssl=ClientContexts(b).current(), limit=2 * CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (guarded_url, plain_url):  # warm up: connections and caches
            await rate(session, url, hostname, 500)
        base_rates: list[float] = []
        subject_rates: list[float] = []
        for i in range(args.rounds):  # paired rounds, alternating which goes first
            if i % 2 == 0:
                base_rates.append(await rate(session, plain_url, hostname, args.requests))
                subject_rates.append(await rate(session, guarded_url, hostname, args.requests))
            else:
                subject_rates.append(await rate(session, guarded_url, hostname, args.requests))
                base_rates.append(await rate(session, plain_url, hostname, args.requests))
    report(base_rates, subject_rates, unit="requests/s", label="mTLS GET with pin guard:")


def main() -> None:
    """Build a five-member cluster, start the servers, measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a = ClusterDir(Path(tmp) / "a")
        a.init("bench", "gpu-a")
        for name in ("gpu-c", "gpu-d", "gpu-e"):  # a few members, as in a real cluster
            a.issue(name, Path(tmp) / name)
        a.issue("gpu-b", Path(tmp) / "b")
        a_id = a.node_id()
        assert a_id is not None
        ports: multiprocessing.Queue[tuple[int, int]] = multiprocessing.Queue()
        child = multiprocessing.Process(target=serve, args=(str(a.path), ports), daemon=True)
        child.start()
        try:
            asyncio.run(client(ClusterDir(Path(tmp) / "b"), a_id, ports.get(timeout=30), args))
        finally:
            child.terminate()
            child.join()


if __name__ == "__main__":
    main()
