"""Inter-node broadcast: throughput between two managers, and end-to-end latency on five.

1. Throughput. Manager B is a real `python -m workload_manager` process. Subject: manager A,
   another real process, gets N local events on its stdin and relays them to B over mTLS;
   the clock stops when B has told its broker about all N. Baseline: this process posts the
   same frames straight to B with raw aiohttp over the same mTLS (batches of 1,024, 4 in
   flight, A's identity), the clock stopping at the same point. Paired rounds, fresh
   workloads each round; ratio = subject / baseline.

2. Latency. Five managers, all peers of each other. Local events enter at manager A at
   1,000 events/s; for each, the time until each of the four other brokers is told
   (`workloads:upsert`). Prints p50 and p99 over every (event, receiver) pair.

    python bench/broadcast.py [--events 20000] [--rounds 5] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _interleave import report

from certs import ClientContexts, ClusterDir, server_hostname_for
from certs.identity import load_cert

BATCH = 1024  # the broadcaster's own largest batch
IN_FLIGHT = 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def frame(origin: str, run: str, wid: int) -> bytes:
    """One submitted event, about 300 bytes on the wire."""
    record = {
        "id": str(wid),
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "engine": "vllm",
        "runId": run,
        "state": "queued",
        "originatedFrom": origin,
        "createdAt": 1_764_000_000_000 + wid,
        "requesterId": "team-search",
        "seq": 1,
    }
    params = {"workloadInfo": record}
    return json.dumps({"jsonrpc": "2.0", "method": "workload:submitted", "params": params}).encode()


class Manager:
    """A manager process whose broker side this process plays, minimally."""

    def __init__(self, cluster: ClusterDir, port: int) -> None:
        self.cluster = cluster
        self.port = port
        self.told = 0
        self.arrivals: dict[bytes, float] = {}  # workload id -> first time told
        self.watch = False
        self._target = 0
        self._done: asyncio.Future[None] | None = None
        self.proc: asyncio.subprocess.Process

    @property
    def node_id(self) -> str:
        node_id = self.cluster.node_id()
        assert node_id is not None
        return node_id

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workload_manager", "--cluster-dir", str(self.cluster.path),
            "--port", str(self.port), "--log-level", "warn",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=16 * 1024 * 1024,
            env={**os.environ, "NVPAIR_WM_BIND": "127.0.0.1"},
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            if b'"workloads:upsert"' in line:
                self.told += 1
                if self.watch:
                    start = line.index(b'"id":"') + 6
                    self.arrivals.setdefault(
                        line[start : line.index(b'"', start)], time.perf_counter()
                    )
                if self._done is not None and self.told >= self._target:
                    self._done.set_result(None)
                    self._done = None
            elif b'"workloads:snapshot"' in line:
                request_id = json.loads(line)["id"]
                self.send([json.dumps({"jsonrpc": "2.0", "result": {}, "id": request_id}).encode()])

    def until_told(self, count: int) -> asyncio.Future[None]:
        """Resolves when the broker has been told `count` upserts in all."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.told >= count:
            future.set_result(None)
        else:
            self._target, self._done = count, future
        return future

    def send(self, frames: list[bytes]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n".join(frames) + b"\n")

    async def set_peers(self, peers: list[Manager]) -> None:
        listed = [{"nodeId": p.node_id, "host": "127.0.0.1", "port": p.port} for p in peers]
        self.send(
            [
                json.dumps(
                    {"jsonrpc": "2.0", "method": "peers:set", "params": {"peers": listed}}
                ).encode()
            ]
        )

    async def stop(self) -> None:
        self.proc.terminate()
        await self.proc.wait()


def make_cluster(root: Path, count: int) -> list[Manager]:
    first = ClusterDir(root / "m0")
    first.init("bench", "m0", ["127.0.0.1"])
    for i in range(1, count):
        first.issue(f"m{i}", root / f"m{i}", ["127.0.0.1"])
    pems = [load_cert(pem) for pem in first.pins.pems()]
    for i in range(1, count):
        for cert in pems:
            ClusterDir(root / f"m{i}").pins.pin(cert)
    return [Manager(ClusterDir(root / f"m{i}"), free_port()) for i in range(count)]


async def warm_up(origin: Manager, receivers: list[Manager]) -> None:
    """One event through, so connections and catch-up are done before measuring."""
    targets = [r.until_told(r.told + 1) for r in receivers]
    origin.send([frame(origin.node_id, "warm-up", 0)])
    await asyncio.wait_for(asyncio.gather(*targets), 30)


async def throughput(args: argparse.Namespace, root: Path) -> None:
    a, b = make_cluster(root, 2)
    await b.start()
    await a.start()
    await a.set_peers([b])
    await b.set_peers([])  # B only receives; its broker is what we watch
    await warm_up(a, [b])
    a_id = a.node_id
    connector = aiohttp.TCPConnector(ssl=ClientContexts(a.cluster).current())
    url = f"https://127.0.0.1:{b.port}/v1/workloads/events"
    hostname = server_hostname_for(b.node_id)
    base_rates: list[float] = []
    subject_rates: list[float] = []
    async with aiohttp.ClientSession(connector=connector) as session:

        async def raw_round(run: str) -> float:
            frames = [frame(a_id, run, i) for i in range(args.events)]
            bodies = [
                b"[" + b",".join(frames[i : i + BATCH]) + b"]" for i in range(0, len(frames), BATCH)
            ]
            done = b.until_told(b.told + args.events)
            start = time.perf_counter()
            queue = iter(bodies)

            async def poster() -> None:
                for body in queue:
                    async with session.post(
                        url,
                        data=body,
                        server_hostname=hostname,
                        headers={"Content-Type": "application/json"},
                    ) as resp:
                        await resp.read()
                        assert resp.status == 202, resp.status

            await asyncio.gather(*(poster() for _ in range(IN_FLIGHT)))
            await done
            return float(args.events / (time.perf_counter() - start))

        async def manager_round(run: str) -> float:
            frames = [frame(a_id, run, i) for i in range(args.events)]
            done = b.until_told(b.told + args.events)
            start = time.perf_counter()
            for i in range(0, len(frames), 1000):
                a.send(frames[i : i + 1000])
                assert a.proc.stdin is not None
                await a.proc.stdin.drain()
            await done
            return float(args.events / (time.perf_counter() - start))

        await raw_round("warm-raw")
        await manager_round("warm-mgr")
        for i in range(args.rounds):
            if i % 2 == 0:
                base_rates.append(await raw_round(f"raw-{i}"))
                subject_rates.append(await manager_round(f"mgr-{i}"))
            else:
                subject_rates.append(await manager_round(f"mgr-{i}"))
                base_rates.append(await raw_round(f"raw-{i}"))
    report(
        base_rates, subject_rates, unit="events/s", label="A->B over mTLS, manager vs raw aiohttp:"
    )
    await a.stop()
    await b.stop()


async def latency(args: argparse.Namespace, root: Path) -> None:
    managers = make_cluster(root, 5)
    for m in managers:
        await m.start()
    for m in managers:
        await m.set_peers([p for p in managers if p is not m])
    origin, receivers = managers[0], managers[1:]
    await warm_up(origin, receivers)
    for m in receivers:
        m.watch = True
    sent: dict[bytes, float] = {}
    total = int(1000 * args.seconds)
    tick = 0.005  # 5 events every 5 ms = 1,000 events/s
    start = time.perf_counter()
    for n in range(0, total, 5):
        target = start + (n // 5) * tick
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        batch = [frame(origin.node_id, "lat", n + k) for k in range(5)]
        now = time.perf_counter()
        for k in range(5):
            sent[str(n + k).encode()] = now
        origin.send(batch)
    elapsed = time.perf_counter() - start
    for m in receivers:
        await asyncio.wait_for(m.until_told(total + 1), 30)
    latencies = sorted((m.arrivals[wid] - at) * 1000 for m in receivers for wid, at in sent.items())
    p50 = statistics.median(latencies)
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(
        f"end-to-end latency, 5 managers, {total / elapsed:,.0f} events/s offered for "
        f"{elapsed:.1f} s, {len(latencies):,} deliveries: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"max {latencies[-1]:.1f} ms"
    )
    for m in managers:
        await m.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(throughput(args, Path(tmp) / "t"))
        asyncio.run(latency(args, Path(tmp) / "l"))


if __name__ == "__main__":
    main()
