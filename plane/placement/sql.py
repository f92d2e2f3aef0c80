"""Placement against the database: read one workload's snapshot in a handful of queries,
decide (`plane.placement.decide`, pure), write its deployments and bump the desired generation of
every cluster whose deployments changed, in the caller's transaction.

Placements are serialized by a transaction-scoped advisory lock: two workloads placed at
once would otherwise both count the same free devices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from plane.core.errors import Conflict, PlaneError
from plane.core.ids import new_id
from plane.db.connection import Conn
from plane.placement.decide import (
    Ask,
    ClusterCapacity,
    Decision,
    Policy,
    Quota,
    Reservation,
    Snapshot,
    decide,
)

__all__ = [
    "PLACEMENT_LOCK",
    "PlacementRefused",
    "WorkloadNotFound",
    "WorkloadRow",
    "explain",
    "load_workload",
    "place",
    "remove_deployments",
]

PLACEMENT_LOCK: Final = 0x6E76_7069  # pg_advisory_xact_lock key: placement, one at a time


class WorkloadNotFound(PlaneError):
    """No such workload (or one another tenant owns: the same answer)."""

    status = 404


class PlacementRefused(Conflict):
    """Past a quota (naming it) or not enough capacity (saying what fits); nothing written."""

    def __init__(self, decision: Decision) -> None:
        assert decision.refusal is not None
        super().__init__(decision.refusal.message)
        self.decision = decision


@dataclass(frozen=True, slots=True)
class WorkloadRow:
    """What placement needs of a stored workload."""

    id: str
    name: str
    tenant_id: str
    project_id: str
    replicas: int
    serving: Mapping[str, Any]
    constraints: Mapping[str, Any]
    paused: bool


_WORKLOAD: Final = (
    b"SELECT w.id, w.name, p.tenant_id, w.project_id, w.replicas, w.serving, w.constraints, "
    b"w.paused FROM workloads w JOIN projects p ON p.id = w.project_id WHERE w.id = %s"
)
_CLUSTERS: Final = (
    b"SELECT id, name, region, residency, cost_per_device_hour FROM clusters "
    b"WHERE revoked_at IS NULL ORDER BY id"
)
_POLICIES: Final = (
    b"SELECT id, attached_to, spec FROM policies "
    b"WHERE attached_to = ANY(%s) OR attached_to LIKE 'clu\\_%%'"
)
# Healthy devices of reachable, uncordoned nodes that no replica's allocation holds.
_FREE_DEVICES: Final = (
    b"WITH taken AS (SELECT DISTINCT dev FROM allocations, unnest(device_ids) AS dev "
    b"WHERE dev IS NOT NULL) "
    b"SELECT d.cluster_id, d.node_id, d.device_class, d.memory_total, d.domain_id "
    b"FROM devices d JOIN nodes n ON n.id = d.node_id "
    b"WHERE n.reachable AND NOT n.cordoned AND d.health = 'ok' "
    b"AND d.id NOT IN (SELECT dev FROM taken) AND d.uuid NOT IN (SELECT dev FROM taken)"
)
# Deployments placed and not yet running (replicas with no allocation yet) will take devices.
_RESERVED: Final = (
    b"SELECT d.id, d.cluster_id, d.workload_id, d.replicas, w.serving, w.constraints, "
    b"(SELECT count(*) FROM replicas r JOIN allocations a ON a.replica_id = r.id "
    b" WHERE r.deployment_id = d.id) "
    b"FROM deployments d JOIN workloads w ON w.id = d.workload_id"
)
_QUOTAS: Final = (
    b"SELECT q.id, q.project_id, q.device_class, q.cluster_id, q.max_devices, "
    b"coalesce((SELECT sum(d.replicas * coalesce((w.serving->>'gpus')::int, 1)) "
    b"  FROM deployments d JOIN workloads w ON w.id = d.workload_id "
    b"  WHERE w.project_id = q.project_id AND w.constraints->>'deviceClass' = q.device_class "
    b"  AND (q.cluster_id IS NULL OR d.cluster_id = q.cluster_id)), 0) "
    b"FROM quotas q WHERE q.project_id = %s"
)


async def load_workload(conn: Conn, workload_id: str, *, lock: bool = False) -> WorkloadRow:
    """The workload (`WorkloadNotFound` when absent); `lock` takes the placement lock first."""
    if lock:
        await conn.execute(b"SELECT pg_advisory_xact_lock(%s)", (PLACEMENT_LOCK,))
    row = await (await conn.execute(_WORKLOAD, (workload_id,))).fetchone()
    if row is None:
        raise WorkloadNotFound(f"no workload {workload_id[:40]!r}")
    return WorkloadRow(
        id=row[0],
        name=row[1],
        tenant_id=row[2],
        project_id=row[3],
        replicas=int(row[4]),
        serving=row[5],
        constraints=row[6],
        paused=bool(row[7]),
    )


async def snapshot_for(conn: Conn, workload: WorkloadRow) -> tuple[Ask, Snapshot, dict[str, str]]:
    """The ask, the snapshot and the current deployment ids by cluster (five queries)."""
    policies: dict[str, list[Policy]] = defaultdict(list)
    rows = await (await conn.execute(_POLICIES, ([workload.id, workload.tenant_id],))).fetchall()
    for policy_id, attached_to, spec in rows:
        policies[attached_to].append(Policy.from_spec(policy_id, spec))
    devices: dict[str, list[tuple[str, str, int, str | None]]] = defaultdict(list)
    for cluster_id, node_id, device_class, memory, domain in await (
        await conn.execute(_FREE_DEVICES)
    ).fetchall():
        devices[cluster_id].append((node_id, device_class, int(memory), domain))
    reserved: dict[str, list[Reservation]] = defaultdict(list)
    current: dict[str, int] = {}
    deployment_ids: dict[str, str] = {}
    for deployment_id, cluster_id, workload_id, replicas, serving, constraints, running in await (
        await conn.execute(_RESERVED)
    ).fetchall():
        if workload_id == workload.id:
            current[cluster_id] = int(replicas)
            deployment_ids[cluster_id] = deployment_id
        waiting = int(replicas) - int(running)
        if waiting > 0:
            reserved[cluster_id].append(
                Reservation(
                    str(constraints.get("deviceClass", "")),
                    int(serving.get("gpus", 1)),
                    bool(constraints.get("oneDomain", False)),
                    waiting,
                )
            )
    clusters = [
        ClusterCapacity.build(
            id=cid,
            name=name,
            region=region,
            residency=residency,
            cost_per_device_hour=float(cost),
            policies=policies.get(cid, ()),
            devices=devices.get(cid, ()),
            reserved=reserved.get(cid, ()),
        )
        for cid, name, region, residency, cost in await (await conn.execute(_CLUSTERS)).fetchall()
    ]
    quotas = [
        Quota(qid, pid, cls, clu, int(limit), int(used))
        for qid, pid, cls, clu, limit, used in await (
            await conn.execute(_QUOTAS, (workload.project_id,))
        ).fetchall()
    ]
    c = workload.constraints
    ask = Ask(
        workload_id=workload.id,
        project_id=workload.project_id,
        replicas=workload.replicas,
        device_class=str(c.get("deviceClass", "")),
        gpus=int(workload.serving.get("gpus", 1)),
        one_domain=bool(c.get("oneDomain", False)),
        min_memory=int(c.get("minMemory", 0)),
        regions=frozenset(c.get("regions", ())),
        clusters=frozenset(c.get("clusters", ())),
        policies=tuple(policies.get(workload.id, ())) + tuple(policies.get(workload.tenant_id, ())),
        current=current,
    )
    return ask, Snapshot(clusters, quotas), deployment_ids


async def place(conn: Conn, workload: WorkloadRow) -> Decision:
    """Place `workload` at its `replicas` (only the delta from its current shares moves) and
    write the deployments; `PlacementRefused` (409) writes nothing. The caller holds the
    transaction and the placement lock (`load_workload(lock=True)`)."""
    ask, snapshot, deployment_ids = await snapshot_for(conn, workload)
    decision = decide(ask, snapshot)
    if decision.refusal is not None:
        raise PlacementRefused(decision)
    changed = sorted(decision.changed)
    for cluster_id in changed:
        share = decision.shares.get(cluster_id, 0)
        if share == 0:  # a cluster whose share drops to 0 keeps no deployment row
            await conn.execute(
                b"DELETE FROM deployments WHERE workload_id = %s AND cluster_id = %s",
                (workload.id, cluster_id),
            )
        elif cluster_id in deployment_ids:
            await conn.execute(
                b"UPDATE deployments SET replicas = %s, generation = generation + 1, "
                b"updated_at = now() WHERE id = %s",
                (share, deployment_ids[cluster_id]),
            )
        else:
            await conn.execute(
                b"INSERT INTO deployments (id, workload_id, cluster_id, replicas, authority) "
                b"VALUES (%s, %s, %s, %s, 'managed')",
                (new_id("dep"), workload.id, cluster_id, share),
            )
    await bump_generations(conn, changed)
    return decision


async def bump_generations(conn: Conn, cluster_ids: list[str]) -> None:
    """Those clusters' desired state changed: they fetch it again."""
    if cluster_ids:
        await conn.execute(
            b"UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = ANY(%s)",
            (cluster_ids,),
        )


async def remove_deployments(conn: Conn, workload_id: str) -> list[str]:
    """Delete the workload's deployments (their clusters undeploy); the clusters touched."""
    rows = await (
        await conn.execute(
            b"DELETE FROM deployments WHERE workload_id = %s RETURNING cluster_id", (workload_id,)
        )
    ).fetchall()
    touched = sorted({str(r[0]) for r in rows})
    await bump_generations(conn, touched)
    return touched


async def explain(conn: Conn, workload: WorkloadRow) -> dict[str, Any]:
    """Why each cluster has its share or none, as the API and `nvpair plane explain` show."""
    ask, snapshot, deployment_ids = await snapshot_for(conn, workload)
    decision = decide(ask, snapshot)
    return decision_view(workload, decision, deployment_ids)


def decision_view(
    workload: WorkloadRow, decision: Decision, deployment_ids: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A decision as JSON: per cluster chosen or refused and why, and the shares."""
    ids = deployment_ids or {}
    clusters = []
    for v in decision.verdicts:
        entry: dict[str, Any] = {
            "cluster": v.cluster_id,
            "name": v.name,
            "chosen": v.share > 0,
            "share": v.share,
            "available": v.available,
        }
        if v.reason is not None:
            entry["refusedBy" if v.share == 0 else "note"] = v.field
            entry["reason"] = v.reason
        if v.cluster_id in ids:
            entry["deployment"] = ids[v.cluster_id]
        clusters.append(entry)
    body: dict[str, Any] = {
        "workload": workload.id,
        "name": workload.name,
        "replicas": workload.replicas,
        "placed": sum(decision.shares.values()),
        "paused": workload.paused,
        "shares": dict(sorted(decision.shares.items())),
        "clusters": clusters,
    }
    if decision.refusal is not None:
        body["refused"] = decision.refusal.message
    return body
