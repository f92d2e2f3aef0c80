"""Endpoints in PostgreSQL: a tenant's public model names and the deployments they resolve
to (`plane.desired.endpoints_api` checks the input; this module only reads and writes it).

Every call is scoped to a tenant (None: the admin, who sees every tenant's): another
tenant's endpoint reads as absent. A change bumps every cluster's `desired_generation`,
since every cluster's desired state carries the whole routing table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from plane.core.errors import BadInput, Conflict
from plane.core.ids import new_id
from plane.db.connection import Conn

__all__ = [
    "MAX_LISTED",
    "create",
    "delete",
    "get",
    "list_endpoints",
    "tenant_deployments",
    "tenant_exists",
    "update",
]

MAX_LISTED: Final = 10_000  # endpoints one list answers with

_COLUMNS: Final = "id, tenant_id, model_name, mode, targets, created_at, updated_at"


def _row(row: Sequence[Any]) -> dict[str, Any]:
    return {
        "id": row[0],
        "tenant": row[1],
        "modelName": row[2],
        "mode": row[3],
        "targets": row[4],
        "createdAt": row[5].isoformat(),
        "updatedAt": row[6].isoformat(),
    }


async def tenant_exists(conn: Conn, tenant: str) -> bool:
    """Whether `tenant` is a tenant."""
    cursor = await conn.execute("SELECT 1 FROM tenants WHERE id = %s", (tenant,))
    return await cursor.fetchone() is not None


async def tenant_deployments(conn: Conn, tenant: str, ids: Sequence[str]) -> set[str]:
    """Those of `ids` that are deployments of `tenant`'s workloads."""
    cursor = await conn.execute(
        "SELECT d.id FROM deployments d JOIN workloads w ON w.id = d.workload_id"
        " JOIN projects p ON p.id = w.project_id WHERE p.tenant_id = %s AND d.id = ANY(%s)",
        (tenant, list(ids)),
    )
    return {str(row[0]) for row in await cursor.fetchall()}


async def _name_taken(conn: Conn, tenant: str, name: str, but: str = "") -> None:
    cursor = await conn.execute(
        "SELECT id FROM endpoints WHERE tenant_id = %s AND model_name = %s AND id <> %s",
        (tenant, name, but),
    )
    if (row := await cursor.fetchone()) is not None:
        raise Conflict(f"modelName: the tenant's endpoint {row[0]} is named {name[:256]!r}")


async def _changed(conn: Conn) -> None:
    await conn.execute("UPDATE clusters SET desired_generation = desired_generation + 1")


async def create(
    conn: Conn, tenant: str, name: str, mode: str, targets: list[dict[str, Any]]
) -> dict[str, Any]:
    """A new endpoint of `tenant` (its targets checked by the caller)."""
    async with conn.transaction():
        await _name_taken(conn, tenant, name)
        cursor = await conn.execute(
            f"INSERT INTO endpoints (id, tenant_id, model_name, mode, targets)"
            f" VALUES (%s, %s, %s, %s, %s::jsonb) RETURNING {_COLUMNS}",
            (new_id("end"), tenant, name, mode, msgspec.json.encode(targets).decode()),
        )
        row = await cursor.fetchone()
        await _changed(conn)
    assert row is not None
    return _row(row)


async def get(conn: Conn, endpoint: str, tenant: str | None) -> dict[str, Any] | None:
    """The endpoint, if it is `tenant`'s (any tenant's for None)."""
    cursor = await conn.execute(
        f"SELECT {_COLUMNS} FROM endpoints WHERE id = %s AND (%s::text IS NULL OR tenant_id = %s)",
        (endpoint, tenant, tenant),
    )
    row = await cursor.fetchone()
    return None if row is None else _row(row)


async def list_endpoints(conn: Conn, tenant: str | None) -> list[dict[str, Any]]:
    """`tenant`'s endpoints (every tenant's for None), by tenant and name."""
    cursor = await conn.execute(
        f"SELECT {_COLUMNS} FROM endpoints WHERE (%s::text IS NULL OR tenant_id = %s)"
        " ORDER BY tenant_id, model_name LIMIT %s",
        (tenant, tenant, MAX_LISTED),
    )
    return [_row(row) for row in await cursor.fetchall()]


async def update(
    conn: Conn, endpoint: str, tenant: str, changes: dict[str, Any]
) -> dict[str, Any] | None:
    """Apply `changes` (modelName, mode, targets; checked by the caller) to `tenant`'s
    endpoint; None when it has none of that id."""
    columns = {"modelName": "model_name", "mode": "mode", "targets": "targets"}
    sets, values = [], []
    for field, value in changes.items():
        if field not in columns:
            raise BadInput(f"{field} cannot be changed")
        cast = "::jsonb" if field == "targets" else ""
        sets.append(f"{columns[field]} = %s{cast}")
        values.append(msgspec.json.encode(value).decode() if field == "targets" else value)
    async with conn.transaction():
        if "modelName" in changes:
            await _name_taken(conn, tenant, changes["modelName"], but=endpoint)
        cursor = await conn.execute(
            f"UPDATE endpoints SET {', '.join([*sets, 'updated_at = now()'])}"
            f" WHERE id = %s AND tenant_id = %s RETURNING {_COLUMNS}",
            (*values, endpoint, tenant),
        )
        row = await cursor.fetchone()
        if row is not None:
            await _changed(conn)
    return None if row is None else _row(row)


async def delete(conn: Conn, endpoint: str, tenant: str | None) -> bool:
    """Delete the endpoint if it is `tenant`'s (any tenant's for None)."""
    async with conn.transaction():
        cursor = await conn.execute(
            "DELETE FROM endpoints WHERE id = %s AND (%s::text IS NULL OR tenant_id = %s)",
            (endpoint, tenant, tenant),
        )
        gone = cursor.rowcount > 0
        if gone:
            await _changed(conn)
    return gone
