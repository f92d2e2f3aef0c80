"""Sync: one node's own observed objects merged into the plane, newer wins.

Every node syncs only its own objects -- its node row, its devices and topology domains,
and the jobs it originated -- so each observed object has one writer (seed 000). Upserts are
newer-wins (`generation` for node objects, `seq` for jobs). Devices and domains go in with
`executemany`, which psycopg runs in pipeline mode (no round trip per row); jobs are COPYed
into a staging table and merged with one statement that also keeps the rollups exact. A
replayed batch changes nothing.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from plane.core.errors import SyncRefused
from plane.core.ids import is_id
from plane.core.wire import SyncBatch
from plane.db.connection import Conn
from plane.fleet.cluster_ca import bind_ca, refuse_another_ca
from plane.fleet.node_signing import ClusterCa
from plane.fleet.sync_replicas import write_replicas
from plane.fleet.usage import merge_usage
from plane.machinery.sync import write_machinery
from workload_manager.workload import Workload

__all__ = ["check_batch", "sync_batch"]


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


def check_batch(batch: SyncBatch) -> None:
    """`SyncRefused` unless every object in `batch` is the sending node's own, with ids of
    the right kinds. Pure: runs before any statement."""
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


async def _refuse_foreign(cur: Any, cluster_id: str, batch: SyncBatch) -> None:
    """`SyncRefused` when a device or domain of `batch` is another node's (or cluster's)."""
    params = {
        "devices": [d.id for d in batch.devices],
        "domains": [d.id for d in batch.domains],
        "node": batch.nodeId,
        "cluster": cluster_id,
    }
    await cur.execute(_FOREIGN, params)
    foreign = await cur.fetchone()
    if foreign is not None:
        raise SyncRefused(f"{foreign[0]} belongs to another node")


_UPSERT_NODE: Final = (
    b"INSERT INTO nodes (id, cluster_id, name, reachable, cordoned, version, generation) "
    b"VALUES (%s, %s, %s, true, %s, %s, %s) "
    b"ON CONFLICT (id) DO UPDATE SET name = excluded.name, reachable = true, "
    b"cordoned = excluded.cordoned, version = excluded.version, "
    b"generation = excluded.generation, updated_at = now() "
    b"WHERE excluded.generation > nodes.generation"
)
_UPSERT_DEVICE: Final = (
    b"INSERT INTO devices (id, node_id, cluster_id, uuid, device_class, health, "
    b"memory_total, memory_used, utilization, domain_id, generation) "
    b"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
    b"ON CONFLICT (id) DO UPDATE SET health = excluded.health, "
    b"memory_total = excluded.memory_total, memory_used = excluded.memory_used, "
    b"utilization = excluded.utilization, domain_id = excluded.domain_id, "
    b"generation = excluded.generation WHERE excluded.generation > devices.generation "
    b"AND devices.node_id = excluded.node_id AND devices.cluster_id = excluded.cluster_id"
)
_UPSERT_DOMAIN: Final = (
    b"INSERT INTO topology_domains (id, node_id, cluster_id, kind, device_ids, generation) "
    b"VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
    b"kind = excluded.kind, device_ids = excluded.device_ids, "
    b"generation = excluded.generation "
    b"WHERE excluded.generation > topology_domains.generation "
    b"AND topology_domains.node_id = excluded.node_id "
    b"AND topology_domains.cluster_id = excluded.cluster_id"
)
# A device or domain id is its node's alone (the agent derives it from the node id). The
# upserts above never touch another owner's row; this check, run after them in the same
# transaction, sees a row another node holds -- committed before, or by a sync racing this
# one, which the upsert waited for -- and refuses the whole batch.
_FOREIGN: Final = (
    b"SELECT id FROM devices WHERE id = ANY(%(devices)s) "
    b"AND (node_id <> %(node)s OR cluster_id <> %(cluster)s) "
    b"UNION ALL SELECT id FROM topology_domains WHERE id = ANY(%(domains)s) "
    b"AND (node_id <> %(node)s OR cluster_id <> %(cluster)s) LIMIT 1"
)


async def sync_batch(
    conn: Conn, cluster_id: str, batch: SyncBatch, *, ca: ClusterCa | None = None
) -> dict[str, int]:
    """Upsert one node's batch in one transaction; newer wins, replays change nothing.

    `SyncRefused` (nothing written) for a batch that breaks the one-writer rule. `ca` is the
    CA the batch's signature verified against (the HTTP API always passes it): bound to
    the cluster if none is, `SignatureRefused` (nothing written) if another is.
    """
    check_batch(batch)
    node_id = batch.nodeId
    written = {"node": 0, "devices": 0, "domains": 0, "jobs": 0}
    async with conn.transaction():
        if ca is not None:
            await refuse_another_ca(conn, cluster_id, ca)
        # A node belongs to the cluster that first synced it: no cluster can overwrite
        # another's node.
        cursor = await conn.execute(b"SELECT cluster_id FROM nodes WHERE id = %s", (node_id,))
        owner = await cursor.fetchone()
        if owner is not None and owner[0] != cluster_id:
            raise SyncRefused(f"{node_id} belongs to another cluster")
        node = batch.node
        if node is not None:
            row = (node_id, cluster_id, node.name, node.cordoned, node.version, batch.generation)
            written["node"] = (await conn.execute(_UPSERT_NODE, row)).rowcount
            if written["node"]:
                # The node's own device list replaces the old one (devices come and go).
                await conn.execute(
                    b"DELETE FROM devices WHERE node_id = %s AND NOT (id = ANY(%s))",
                    (node_id, [d.id for d in batch.devices]),
                )
                await conn.execute(
                    b"DELETE FROM topology_domains WHERE node_id = %s AND NOT (id = ANY(%s))",
                    (node_id, [d.id for d in batch.domains]),
                )
        async with conn.cursor() as cur:
            if node is not None and batch.devices:
                await cur.executemany(
                    _UPSERT_DEVICE,
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
            if node is not None and batch.domains:
                await cur.executemany(
                    _UPSERT_DOMAIN,
                    [
                        (d.id, node_id, cluster_id, d.kind, d.devices, batch.generation)
                        for d in batch.domains
                    ],
                )
                written["domains"] = len(batch.domains)
            if node is not None and (batch.devices or batch.domains):
                await _refuse_foreign(cur, cluster_id, batch)
            if batch.jobs:
                written["jobs"] = await _merge_jobs(cur, cluster_id, batch.jobs)
            if batch.usage:  # after the jobs: only rows of jobs the plane holds are taken
                written["usage"] = await merge_usage(cur, cluster_id, node_id, batch.usage)
            # The demand and machinery sides this node reports (issue 16).
            written.update(await write_replicas(cur, cluster_id, node_id, batch))
            written.update(await write_machinery(cur, cluster_id, node_id, batch))
        if ca is None:
            await conn.execute(
                b"UPDATE clusters SET last_sync_at = now() WHERE id = %s", (cluster_id,)
            )
        else:
            await bind_ca(conn, cluster_id, ca)
    return written
