"""The events, components, cache residency and operation phases one node reports in its
`SyncBatch`, written in the sync's transaction.

One writer for each (seed 000): every row written here is the sending node's own -- events
are stored under its node id (an event id another node holds already is left as it is),
its components and cache rows replace only its own, and it moves only the phases of this
cluster's operations that target it (a report of any other is ignored, and logged).
Events are inserted once (a replay inserts nothing) and each cluster keeps the newest
`MAX_EVENTS_PER_CLUSTER`. Phases only move forward, so a replayed or stale report changes
nothing; a batch older than the node row the plane holds changes no component or cache row.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from psycopg import AsyncCursor

from plane.core.ids import new_id
from plane.core.wire import SyncBatch
from plane.machinery.sql import NODE_KINDS, PHASE_RANK, bump_generation

__all__ = ["MAX_EVENTS_PER_CLUSTER", "write_machinery"]

log = logging.getLogger(__name__)

MAX_EVENTS_PER_CLUSTER: Final = 10_000

_INSERT_EVENTS: Final = (
    "INSERT INTO events (id, cluster_id, node_id, about, kind, message, at) "
    "SELECT u.id, %s, %s, u.about, u.kind, u.message, to_timestamp(u.at / 1000.0) "
    "FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[]) "
    "AS u(id, about, kind, message, at) ON CONFLICT (id) DO NOTHING"
)
_PRUNE_EVENTS: Final = (
    "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE cluster_id = %s "
    "ORDER BY at DESC, id DESC OFFSET %s)"
)
_UPSERT_COMPONENTS: Final = (
    "INSERT INTO components (id, cluster_id, node_id, name, observed_version) "
    "SELECT u.id, %s, %s, u.name, u.version FROM unnest(%s::text[], %s::text[], %s::text[]) "
    "AS u(id, name, version) ON CONFLICT (cluster_id, node_id, name) DO UPDATE SET "
    "observed_version = excluded.observed_version, updated_at = now() "
    "WHERE components.observed_version IS DISTINCT FROM excluded.observed_version"
)
# Only artifacts the plane knows: a node may hold weights of one the plane never declared.
_UPSERT_CACHE: Final = (
    "INSERT INTO cache_entries (artifact_id, cluster_id, node_id, resident, state, progress) "
    "SELECT u.id, %s, %s, u.resident, u.state, u.progress "
    "FROM unnest(%s::text[], %s::bool[], %s::text[], %s::real[]) "
    "AS u(id, resident, state, progress) "
    "JOIN artifacts a ON a.id = u.id "
    "ON CONFLICT (artifact_id, cluster_id, node_id) DO UPDATE SET "
    "resident = excluded.resident, state = excluded.state, progress = excluded.progress, "
    "updated_at = now() "
    "WHERE (cache_entries.resident, cache_entries.state, cache_entries.progress) "
    "IS DISTINCT FROM (excluded.resident, excluded.state, excluded.progress)"
)


async def write_machinery(
    cur: AsyncCursor[tuple[object, ...]], cluster_id: str, node_id: str, batch: SyncBatch
) -> dict[str, int]:
    """Write what the batch carries of the machinery side; counts written by kind."""
    written: dict[str, int] = {}
    if batch.operations:
        written["operations"] = await _operations(cur, cluster_id, node_id, batch)
    if batch.events:
        written["events"] = await _events(cur, cluster_id, node_id, batch)
    if batch.components is None and batch.cache is None:
        return written
    await cur.execute("SELECT generation FROM nodes WHERE id = %s", (node_id,))
    row = await cur.fetchone()
    if row is not None and batch.generation < int(str(row[0])):
        return written  # a stale batch: the node has said newer things since
    if batch.components is not None:
        written["components"] = await _components(cur, cluster_id, node_id, batch)
    if batch.cache is not None:
        written["cache"] = await _cache(cur, cluster_id, node_id, batch)
    return written


async def _operations(cur: Any, cluster_id: str, node_id: str, batch: SyncBatch) -> int:
    newest = {report.id: report for report in batch.operations}  # the last report wins
    await cur.execute(
        "SELECT id, cluster_id, target, kind, phase FROM operations WHERE id = ANY(%s) FOR UPDATE",
        (list(newest),),
    )
    moved = 0
    final = False
    for op_id, owner, target, kind, phase in await cur.fetchall():
        if owner != cluster_id or target != node_id or kind not in NODE_KINDS:
            # Not this node's to move: nothing is written. The rest of the batch is, so a
            # node whose home holds a stale report (another node's, once) keeps syncing.
            log.warning("%s reported %s, which is not its operation; ignored", node_id, op_id)
            continue
        report = newest[op_id]
        if PHASE_RANK[report.phase] <= PHASE_RANK[phase]:
            continue  # phases only move forward: a replay or a stale report changes nothing
        await cur.execute(
            "UPDATE operations SET phase = %s, result = %s, updated_at = now() WHERE id = %s",
            (report.phase, report.result or None, op_id),
        )
        moved += 1
        final = final or report.phase in ("succeeded", "failed")
    if final:  # it leaves the cluster's desired state
        await bump_generation(cur.connection, cluster_id)
    return moved


async def _events(cur: Any, cluster_id: str, node_id: str, batch: SyncBatch) -> int:
    events = batch.events
    await cur.execute(
        _INSERT_EVENTS,
        (
            cluster_id,
            node_id,
            [e.id for e in events],
            [e.about for e in events],
            [e.kind for e in events],
            [e.message for e in events],
            [e.at for e in events],
        ),
    )
    inserted = int(cur.rowcount)
    if inserted:
        await cur.execute(_PRUNE_EVENTS, (cluster_id, MAX_EVENTS_PER_CLUSTER))
    return inserted


async def _components(cur: Any, cluster_id: str, node_id: str, batch: SyncBatch) -> int:
    versions = {c.name: c.version for c in batch.components or []}
    names = sorted(versions)
    await cur.execute(
        "DELETE FROM components WHERE cluster_id = %s AND node_id = %s AND NOT (name = ANY(%s))",
        (cluster_id, node_id, names),
    )
    await cur.execute(
        _UPSERT_COMPONENTS,
        (
            cluster_id,
            node_id,
            [new_id("cmp") for _ in names],
            names,
            [versions[n] for n in names],
        ),
    )
    return int(cur.rowcount)


async def _cache(cur: Any, cluster_id: str, node_id: str, batch: SyncBatch) -> int:
    reports = {c.artifact: c for c in batch.cache or []}
    ids = sorted(reports)
    await cur.execute(
        "DELETE FROM cache_entries WHERE cluster_id = %s AND node_id = %s "
        "AND NOT (artifact_id = ANY(%s))",
        (cluster_id, node_id, ids),
    )
    await cur.execute(
        _UPSERT_CACHE,
        (
            cluster_id,
            node_id,
            ids,
            [reports[i].resident for i in ids],
            [reports[i].state for i in ids],
            [reports[i].progress for i in ids],
        ),
    )
    return int(cur.rowcount)
