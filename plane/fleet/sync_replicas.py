"""The replicas, allocations and facade address one node reports in its `SyncBatch`.

The node that runs a replica is its one writer: a node's batch replaces that node's rows and
no other's. A replica id another node (or cluster) holds is left as it is, and a replica
naming a deployment of another cluster is kept with its name only (`deployment_id` NULL),
so no batch can attach replicas to a deployment it was not placed on. Rows go in with
`executemany` (psycopg's pipeline: no round trip per row), in the sync's transaction.
"""

from __future__ import annotations

from typing import Final

from psycopg import AsyncCursor

from plane.core.ids import is_id, new_id
from plane.core.wire import SyncBatch

__all__ = ["write_replicas"]

# The upsert never takes over a row of another node or cluster (the WHERE below); the
# deployment id is kept only when it is a deployment placed on this cluster.
_UPSERT: Final = b"""
INSERT INTO replicas (id, deployment_id, cluster_id, node_id, ready, engine_version,
                      generation, deployment_name, state, drift, updated_at)
SELECT %(id)s, (SELECT d.id FROM deployments d WHERE d.id = %(dep)s AND d.cluster_id = %(clu)s),
       %(clu)s, %(node)s, %(state)s = 'ready', %(version)s, %(gen)s, %(name)s, %(state)s,
       %(drift)s, now()
ON CONFLICT (id) DO UPDATE SET
    deployment_id = excluded.deployment_id, ready = excluded.ready,
    engine_version = excluded.engine_version, generation = excluded.generation,
    deployment_name = excluded.deployment_name, state = excluded.state,
    drift = excluded.drift, updated_at = now()
WHERE replicas.node_id = excluded.node_id AND replicas.cluster_id = excluded.cluster_id
"""
_ALLOCATE: Final = (
    b"INSERT INTO allocations (id, replica_id, device_ids, cluster_id, node_id) "
    b"SELECT %s, r.id, %s, r.cluster_id, r.node_id FROM replicas r "
    b"WHERE r.id = %s AND r.node_id = %s AND r.cluster_id = %s ON CONFLICT (id) DO NOTHING"
)


async def write_replicas(
    cur: AsyncCursor[tuple[object, ...]], cluster_id: str, node_id: str, batch: SyncBatch
) -> dict[str, int]:
    """Replace this node's replicas and allocations with the batch's (when it carries
    them); counts written by kind."""
    written: dict[str, int] = {}
    if batch.facadeUrl:
        await cur.execute(
            b"UPDATE nodes SET facade_url = %s WHERE id = %s AND cluster_id = %s "
            b"AND facade_url <> %s",
            (batch.facadeUrl, node_id, cluster_id, batch.facadeUrl),
        )
    if batch.replicas is None:
        return written
    reported = {r.id: r for r in batch.replicas}  # one row per id, the last said wins
    ids = list(reported)
    await cur.execute(
        b"DELETE FROM replicas WHERE node_id = %s AND cluster_id = %s AND NOT (id = ANY(%s))",
        (node_id, cluster_id, ids),
    )
    # Allocations are re-said whole: what the node reports now is what it holds.
    await cur.execute(
        b"DELETE FROM allocations WHERE node_id = %s AND cluster_id = %s",
        (node_id, cluster_id),
    )
    if not reported:
        written["replicas"] = 0
        return written
    await cur.executemany(
        _UPSERT,
        [
            {
                "id": r.id,
                "dep": r.deploymentId,
                "clu": cluster_id,
                "node": node_id,
                "state": r.state,
                "version": r.engineVersion,
                "gen": batch.generation,
                "name": r.deployment,
                "drift": r.drift,
            }
            for r in reported.values()
        ],
    )
    with_devices = [r for r in reported.values() if r.devices]
    if with_devices:
        await cur.executemany(
            _ALLOCATE,
            [
                (_allocation_id(r.allocation), r.devices, r.id, node_id, cluster_id)
                for r in with_devices
            ],
        )
    written["replicas"] = len(reported)
    written["allocations"] = len(with_devices)
    return written


def _allocation_id(reported: str) -> str:
    """The node's own allocation id when it is one, else a fresh one (rows are re-said
    each batch: a fresh id costs nothing)."""
    return reported if is_id(reported, "alc") else new_id("alc")
