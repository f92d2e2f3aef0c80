"""The plane's Postgres access: enrolment, idempotent sync, fleet views.

Every node syncs only its own objects -- its node row, its devices and topology domains,
and the jobs it originated -- so each observed object has one writer (seed 000). Upserts are
newer-wins (`generation` for node objects, `seq` for jobs) and batched with `executemany`,
which psycopg runs in pipeline mode: a replayed batch changes nothing and no statement waits
for a round trip per row.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from broker.inventory import Device, TopologyDomain
from workload_manager.workload import Workload

from .ids import is_id, new_id
from .tokens import hash_token, mint_token, token_cluster, token_matches

__all__ = ["NodeSummary", "PlaneStore", "SyncBatch", "SyncRefused"]

STALE_AFTER: Final = datetime.timedelta(seconds=30)  # a node that has not synced is unreachable


class SyncRefused(ValueError):
    """A batch that breaks the one-writer rule or names objects badly (the sender's fault)."""


class NodeSummary(Struct, kw_only=True, frozen=True):
    """The node's own row."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]
    version: Annotated[str, Meta(max_length=64)]
    cordoned: bool = False


class SyncBatch(Struct, kw_only=True, frozen=True):
    """What one node pushes: its own observed objects, newest generation first."""

    nodeId: Annotated[str, Meta(pattern=r"^nod_[0-9a-hjkmnp-tv-z]{26}$")]
    generation: Annotated[int, Meta(ge=1)]
    node: NodeSummary | None = None
    devices: Annotated[list[Device], Meta(max_length=1024)] = []
    domains: Annotated[list[TopologyDomain], Meta(max_length=1024)] = []
    jobs: Annotated[list[Workload], Meta(max_length=50_000)] = []


def _opt(value: Any) -> Any:
    return None if value is msgspec.UNSET else value


_JOB_COLUMNS: Final = (
    "cluster_id, origin, run_id, id, seq, state, model, engine, scheduled_on, requester_id, "
    "created_at, started_at, completed_at, error"
)
_STAGE: Final = (
    "CREATE TEMP TABLE IF NOT EXISTS staged_jobs "
    "(LIKE jobs INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
)
_MERGE: Final = f"""
WITH prior AS (
    SELECT j.cluster_id, j.origin, j.run_id, j.id, j.state, j.model, j.started_at, j.completed_at
    FROM jobs j JOIN staged_jobs s USING (cluster_id, origin, run_id, id)
), merged AS (
    INSERT INTO jobs ({_JOB_COLUMNS}) SELECT {_JOB_COLUMNS} FROM staged_jobs
    ON CONFLICT (cluster_id, origin, run_id, id) DO UPDATE SET
        seq = excluded.seq, state = excluded.state, model = excluded.model,
        engine = excluded.engine, scheduled_on = excluded.scheduled_on,
        requester_id = excluded.requester_id, created_at = excluded.created_at,
        started_at = excluded.started_at, completed_at = excluded.completed_at,
        error = excluded.error
    WHERE excluded.seq > jobs.seq
    RETURNING cluster_id, origin, run_id, id, state, model, created_at, started_at, completed_at
), changed AS (
    SELECT m.*, p.state AS old_state, p.model AS old_model,
           p.started_at AS old_started, p.completed_at AS old_completed,
           p.id IS NOT NULL AS existed
    FROM merged m LEFT JOIN prior p USING (cluster_id, origin, run_id, id)
), counts AS (
    INSERT INTO job_rollup (cluster_id, state, model, jobs)
    SELECT cluster_id, state, model, sum(n) FROM (
        SELECT cluster_id, state, model, 1 AS n FROM changed
        UNION ALL
        SELECT cluster_id, old_state, old_model, -1 FROM changed WHERE existed
    ) AS d GROUP BY 1, 2, 3
    ON CONFLICT (cluster_id, state, model) DO UPDATE SET jobs = job_rollup.jobs + excluded.jobs
)
INSERT INTO job_timing (cluster_id, hour, kind, bucket, jobs)
SELECT cluster_id, hour, kind, bucket, count(*) FROM (
    SELECT cluster_id, created_at / 3600000 AS hour, 'q'::"char" AS kind,
           floor(ln(1 + greatest(started_at - created_at, 0)) / ln(1.1))::int AS bucket
    FROM changed WHERE started_at IS NOT NULL AND old_started IS NULL
    UNION ALL
    SELECT cluster_id, created_at / 3600000, 'r'::"char",
           floor(ln(1 + greatest(completed_at - started_at, 0)) / ln(1.1))::int
    FROM changed WHERE completed_at IS NOT NULL AND started_at IS NOT NULL AND old_completed IS NULL
) AS t GROUP BY 1, 2, 3, 4
ON CONFLICT (cluster_id, hour, kind, bucket) DO UPDATE SET jobs = job_timing.jobs + excluded.jobs
"""


async def _merge_jobs(cur: Any, cluster_id: str, jobs: list[Workload]) -> int:
    """COPY the batch into a staging table and merge it with one statement.

    Within a batch only the newest seq per job is staged: one INSERT cannot update the same
    row twice.
    """
    newest: dict[tuple[str, str, str], Workload] = {}
    for job in jobs:
        key = (job.originatedFrom, job.runId, job.id)
        held = newest.get(key)
        if held is None or held.seq < job.seq:
            newest[key] = job
    await cur.execute(_STAGE)
    async with cur.copy(f"COPY staged_jobs ({_JOB_COLUMNS}) FROM STDIN".encode()) as copy:
        for j in newest.values():
            await copy.write_row(
                (
                    cluster_id,
                    j.originatedFrom,
                    j.runId,
                    j.id,
                    j.seq,
                    j.state.value,
                    j.model,
                    j.engine,
                    _opt(j.scheduledOn),
                    _opt(j.requesterId),
                    j.createdAt,
                    _opt(j.startedAt),
                    _opt(j.completedAt),
                    _opt(j.error),
                )
            )
    # A temp table has no statistics until analysed; without them the planner joins the
    # staged rows to `jobs` by scanning all of it. With them it looks each one up by key.
    await cur.execute(b"ANALYZE staged_jobs")
    # Each staged job is looked up by key; a hash join over all of `jobs` costs the whole
    # table per batch when its statistics lag behind its growth.
    await cur.execute(b"SET LOCAL enable_hashjoin = off")
    await cur.execute(b"SET LOCAL enable_mergejoin = off")
    await cur.execute(_MERGE.encode())
    return len(newest)


class PlaneStore:
    """Queries over a connection pool."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[tuple[Any, ...]]]) -> None:
        self.pool = pool

    # -- admin and enrolment ----------------------------------------------------------------

    async def ensure_admin(self, token: str | None) -> str | None:
        """Store the admin token's hash on first start; returns a new token to print once."""
        async with self.pool.connection() as conn:
            cursor = await conn.execute("SELECT token_hash FROM admin WHERE id = 1")
            row = await cursor.fetchone()
            if token is not None:
                await conn.execute(
                    "INSERT INTO admin (id, token_hash) VALUES (1, %s) "
                    "ON CONFLICT (id) DO UPDATE SET token_hash = excluded.token_hash",
                    (hash_token(token),),
                )
                return None
            if row is not None:
                return None
            fresh = "nvpadm1." + secrets.token_urlsafe(32)
            await conn.execute(
                "INSERT INTO admin (id, token_hash) VALUES (1, %s)", (hash_token(fresh),)
            )
            return fresh

    async def is_admin(self, token: str) -> bool:
        async with self.pool.connection() as conn:
            cursor = await conn.execute("SELECT token_hash FROM admin WHERE id = 1")
            row = await cursor.fetchone()
        return row is not None and token_matches(token, row[0])

    async def enrol(self, name: str) -> tuple[str, str]:
        """A new cluster and its token (shown once; stored as a hash)."""
        cluster_id = new_id("clu")
        token = mint_token(cluster_id)
        async with self.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO clusters (id, name, token_hash) VALUES (%s, %s, %s)",
                (cluster_id, name, hash_token(token)),
            )
        return cluster_id, token

    async def revoke(self, cluster_id: str) -> bool:
        async with self.pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE clusters SET revoked_at = now() WHERE id = %s AND revoked_at IS NULL",
                (cluster_id,),
            )
            return cursor.rowcount == 1

    async def cluster_for(self, token: str) -> str | None:
        """The cluster a valid, unrevoked token belongs to."""
        cluster_id = token_cluster(token)
        if cluster_id is None:
            return None
        async with self.pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT token_hash FROM clusters WHERE id = %s AND revoked_at IS NULL",
                (cluster_id,),
            )
            row = await cursor.fetchone()
        return cluster_id if row is not None and token_matches(token, row[0]) else None

    # -- sync --------------------------------------------------------------------------------

    async def sync(self, cluster_id: str, batch: SyncBatch) -> dict[str, int]:
        """Upsert one node's batch in one transaction; newer wins, replays change nothing."""
        node_id = batch.nodeId
        for job in batch.jobs:
            if job.originatedFrom != node_id:
                raise SyncRefused(f"job {job.id} originated on {job.originatedFrom}, not {node_id}")
        for domain in batch.domains:
            if not is_id(domain.id, "tpd"):
                raise SyncRefused(f"{domain.id!r} is not a topology domain id")
        for device in batch.devices:
            if not is_id(device.id, "dev"):
                raise SyncRefused(f"{device.id!r} is not a device id")
        async with self.pool.connection() as conn, conn.transaction():
            # A node belongs to the cluster that first synced it: no cluster can overwrite
            # another's node.
            cursor = await conn.execute("SELECT cluster_id FROM nodes WHERE id = %s", (node_id,))
            owner = await cursor.fetchone()
            if owner is not None and owner[0] != cluster_id:
                raise SyncRefused(f"{node_id} belongs to another cluster")
            written = {"node": 0, "devices": 0, "domains": 0, "jobs": 0}
            if batch.node is not None:
                cursor = await conn.execute(
                    "INSERT INTO nodes (id, cluster_id, name, reachable, cordoned, version, generation) "
                    "VALUES (%s, %s, %s, true, %s, %s, %s) "
                    "ON CONFLICT (id) DO UPDATE SET name = excluded.name, reachable = true, "
                    "cordoned = excluded.cordoned, version = excluded.version, "
                    "generation = excluded.generation, updated_at = now() "
                    "WHERE excluded.generation > nodes.generation",
                    (
                        node_id,
                        cluster_id,
                        batch.node.name,
                        batch.node.cordoned,
                        batch.node.version,
                        batch.generation,
                    ),
                )
                written["node"] = cursor.rowcount
                if written["node"]:
                    # The node's own device list replaces the old one (devices come and go).
                    await conn.execute(
                        "DELETE FROM devices WHERE node_id = %s AND NOT (id = ANY(%s))",
                        (node_id, [d.id for d in batch.devices]),
                    )
                    await conn.execute(
                        "DELETE FROM topology_domains WHERE node_id = %s AND NOT (id = ANY(%s))",
                        (node_id, [d.id for d in batch.domains]),
                    )
            async with conn.cursor() as cur:
                if batch.node is not None and batch.devices:
                    await cur.executemany(
                        "INSERT INTO devices (id, node_id, cluster_id, uuid, device_class, health, "
                        "memory_total, memory_used, utilization, domain_id, generation) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET health = excluded.health, "
                        "memory_total = excluded.memory_total, memory_used = excluded.memory_used, "
                        "utilization = excluded.utilization, domain_id = excluded.domain_id, "
                        "generation = excluded.generation WHERE excluded.generation > devices.generation",
                        [
                            (
                                d.id,
                                node_id,
                                cluster_id,
                                d.uuid,
                                d.deviceClass,
                                d.health,
                                d.memoryTotal,
                                d.memoryUsed,
                                d.utilization,
                                d.domainId,
                                batch.generation,
                            )
                            for d in batch.devices
                        ],
                    )
                    written["devices"] = len(batch.devices)
                if batch.node is not None and batch.domains:
                    await cur.executemany(
                        "INSERT INTO topology_domains (id, node_id, cluster_id, kind, device_ids, generation) "
                        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
                        "kind = excluded.kind, device_ids = excluded.device_ids, "
                        "generation = excluded.generation WHERE excluded.generation > topology_domains.generation",
                        [
                            (d.id, node_id, cluster_id, d.kind, d.devices, batch.generation)
                            for d in batch.domains
                        ],
                    )
                    written["domains"] = len(batch.domains)
                if batch.jobs:
                    written["jobs"] = await _merge_jobs(cur, cluster_id, batch.jobs)
            await conn.execute(
                "UPDATE clusters SET last_sync_at = now() WHERE id = %s", (cluster_id,)
            )
        return written

    # -- views -------------------------------------------------------------------------------

    async def clusters(self) -> list[dict[str, Any]]:
        async with self.pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT id, name, created_at, last_sync_at, revoked_at FROM clusters ORDER BY name"
            )
            return [
                {
                    "id": r[0],
                    "name": r[1],
                    "createdAt": _iso(r[2]),
                    "lastSyncAt": _iso(r[3]),
                    "revokedAt": _iso(r[4]),
                }
                for r in await cursor.fetchall()
            ]

    async def fleet_summary(
        self, *, window_s: int = 3600, cluster_id: str | None = None
    ) -> dict[str, Any]:
        """Clusters with nodes, GPUs by class and health, memory, jobs by state and model,
        queue and run time percentiles over the window."""
        where, args = ("WHERE c.id = %s", [cluster_id]) if cluster_id else ("", [])
        async with self.pool.connection() as conn:
            nodes = await (
                await conn.execute(
                    "SELECT c.id, c.name, "
                    " count(n.id) FILTER (WHERE n.updated_at > now() - %s),"
                    " count(n.id) FILTER (WHERE n.updated_at <= now() - %s),"
                    " count(n.id) FILTER (WHERE n.cordoned) "
                    f"FROM clusters c LEFT JOIN nodes n ON n.cluster_id = c.id {where} "
                    "GROUP BY c.id, c.name ORDER BY c.name",
                    [STALE_AFTER, STALE_AFTER, *args],
                )
            ).fetchall()
            devices = await (
                await conn.execute(
                    "SELECT cluster_id, device_class, health, count(*), sum(memory_total), sum(memory_used) "
                    f"FROM devices {'WHERE cluster_id = %s' if cluster_id else ''} GROUP BY 1, 2, 3",
                    args,
                )
            ).fetchall()
            # The rollups the sync keeps (migration 0002): no scan over the jobs themselves.
            first_hour = int((datetime.datetime.now(datetime.UTC).timestamp() - window_s) // 3600)
            only = "AND cluster_id = %s" if cluster_id else ""
            by_state = await (
                await conn.execute(
                    "SELECT cluster_id, state, sum(jobs) FROM job_rollup "
                    f"WHERE jobs > 0 {only} GROUP BY 1, 2",
                    args,
                )
            ).fetchall()
            # By model and the time percentiles: for the whole fleet (or the one cluster asked
            # for). Per cluster they would be clusters x models rows on every call.
            by_model = await (
                await conn.execute(
                    f"SELECT model, sum(jobs) FROM job_rollup WHERE jobs > 0 {only} GROUP BY 1",
                    args,
                )
            ).fetchall()
            timing = await (
                await conn.execute(
                    "WITH t AS (SELECT kind, bucket, sum(jobs) AS n FROM job_timing "
                    f"  WHERE hour >= %s {only} GROUP BY 1, 2),"
                    " c AS (SELECT kind, bucket,"
                    "  sum(n) OVER (PARTITION BY kind ORDER BY bucket) AS running,"
                    "  sum(n) OVER (PARTITION BY kind) AS total FROM t) "
                    "SELECT kind,"
                    " min(bucket) FILTER (WHERE running >= 0.5 * total),"
                    " min(bucket) FILTER (WHERE running >= 0.95 * total),"
                    " min(bucket) FILTER (WHERE running >= 0.99 * total) "
                    "FROM c GROUP BY 1",
                    [first_hour, *args],
                )
            ).fetchall()
        summary: dict[str, dict[str, Any]] = {}
        for cid, name, reachable, unreachable, cordoned in nodes:
            summary[cid] = {
                "id": cid,
                "name": name,
                "nodes": {"reachable": reachable, "unreachable": unreachable, "cordoned": cordoned},
                "gpus": {},
                "memory": {"total": 0, "used": 0, "free": 0},
                "jobs": {"byState": {}},
            }
        for cid, cls, health, count, total, used in devices:
            entry = summary.get(cid)
            if entry is None:
                continue
            entry["gpus"].setdefault(cls, {})[health] = count
            entry["memory"]["total"] += int(total or 0)
            entry["memory"]["used"] += int(used or 0)
        for entry in summary.values():
            entry["memory"]["free"] = entry["memory"]["total"] - entry["memory"]["used"]
        for cid, state, count in by_state:
            if cid in summary:
                summary[cid]["jobs"]["byState"][state] = int(count)
        percentiles: dict[str, dict[str, float] | None] = {"queueMs": None, "runMs": None}
        for kind, *buckets in timing:
            # Each percentile is its bucket's upper edge: within ~10 % of the true value.
            edges = [round(1.1 ** (b + 1) - 1, 1) for b in buckets]
            percentiles["queueMs" if kind == "q" else "runMs"] = dict(
                zip(("p50", "p95", "p99"), edges, strict=True)
            )
        jobs_by_state: dict[str, int] = {}
        for entry in summary.values():
            for state, count in entry["jobs"]["byState"].items():
                jobs_by_state[state] = jobs_by_state.get(state, 0) + count
        return {
            "windowS": window_s,
            "jobs": {
                "byState": jobs_by_state,
                "byModel": {model: int(count) for model, count in by_model},
                **percentiles,
            },
            "clusters": list(summary.values()),
        }

    async def jobs(
        self,
        *,
        cluster_id: str | None,
        state: str | None,
        model: str | None,
        after: Sequence[Any] | None,
        limit: int,
    ) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """Jobs newest first with keyset pagination; returns the page and the next cursor."""
        clauses, args = [], []
        for column, value in (("cluster_id", cluster_id), ("state", state), ("model", model)):
            if value is not None:
                clauses.append(f"{column} = %s")
                args.append(value)
        if after is not None:
            clauses.append("(created_at, cluster_id, origin, run_id, id) < (%s, %s, %s, %s, %s)")
            args.extend(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        async with self.pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT created_at, cluster_id, origin, run_id, id, seq, state, model, engine, "
                "scheduled_on, requester_id, started_at, completed_at, error FROM jobs "
                f"{where} ORDER BY created_at DESC, cluster_id DESC, origin DESC, run_id DESC, id DESC "
                "LIMIT %s",
                [*args, limit],
            )
            rows = await cursor.fetchall()
        page = [
            {
                "createdAt": r[0],
                "clusterId": r[1],
                "originatedFrom": r[2],
                "runId": r[3],
                "id": r[4],
                "seq": r[5],
                "state": r[6],
                "model": r[7],
                "engine": r[8],
                "scheduledOn": r[9],
                "requesterId": r[10],
                "startedAt": r[11],
                "completedAt": r[12],
                "error": r[13],
            }
            for r in rows
        ]
        cursor_next = list(rows[-1][:5]) if len(rows) == limit else None
        return page, cursor_next


def _iso(value: datetime.datetime | None) -> str | None:
    return value.isoformat() if value else None
