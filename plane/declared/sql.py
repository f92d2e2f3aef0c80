"""The SQL of the declared objects (`plane.declared.objects`): one `Kind` per table says how its
rows read as JSON and which tenant owns a row, so get, list, update and delete are written once.

`scope` is the tenant a tenant key acts as (None: the admin). A row of another tenant is
filtered out in the query itself, so it reads as absent: a 404, never a 403 that would say
it exists. The statements are built from the constants below only; values are parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from plane.core.errors import BadInput, Conflict
from plane.db.connection import Conn, Pool, connection

__all__ = [
    "KINDS",
    "Kind",
    "delete",
    "exists",
    "get",
    "insert",
    "list_page",
    "transaction",
    "update",
]


@dataclass(frozen=True, slots=True)
class Kind:
    """One declared object's table: `select` lists its columns as JSON fields (table alias
    `t`); `owner` is the SQL of the tenant that owns a row, None for installation-wide
    objects; `filters` maps list query parameters to columns."""

    label: str
    table: str
    prefix: str
    select: str
    owner: str | None
    filters: Mapping[str, str]
    jsonb: frozenset[str] = frozenset()


_CREATED: Final = 't.created_at AS "createdAt"'
KINDS: Final = {
    "tenant": Kind(
        "tenant",
        "tenants",
        "ten",
        f"t.id, t.name, t.host, {_CREATED}",
        "t.id",
        {"name": "t.name", "host": "lower(t.host)"},
    ),
    "project": Kind(
        "project",
        "projects",
        "prj",
        f't.id, t.tenant_id AS "tenantId", t.name, {_CREATED}',
        "t.tenant_id",
        {"tenant": "t.tenant_id", "name": "t.name"},
    ),
    "quota": Kind(
        "quota",
        "quotas",
        "qta",
        't.id, t.project_id AS "projectId", '
        '(SELECT p.tenant_id FROM projects p WHERE p.id = t.project_id) AS "tenantId", '
        't.device_class AS "deviceClass", t.cluster_id AS "clusterId", '
        't.max_devices AS "maxDevices", t.guaranteed, t.over_quota_weight AS "overQuotaWeight"',
        "(SELECT p.tenant_id FROM projects p WHERE p.id = t.project_id)",
        {"project": "t.project_id", "cluster": "t.cluster_id", "deviceClass": "t.device_class"},
    ),
    "priority-class": Kind(
        "priority class",
        "priority_classes",
        "prc",
        "t.id, t.name, t.value, t.preemptible, t.description",
        None,
        {"name": "t.name"},
    ),
    "policy": Kind(
        "policy",
        "policies",
        "plc",
        f't.id, t.tenant_id AS "tenantId", t.name, t.attached_to AS "attachedTo", t.spec, '
        f"{_CREATED}",
        "t.tenant_id",
        {"tenant": "t.tenant_id", "attachedTo": "t.attached_to", "name": "t.name"},
        frozenset({"spec"}),
    ),
    "pool": Kind(
        "pool",
        "pools",
        "pol",
        't.id, t.name, t.cluster_id AS "clusterId", t.device_class AS "deviceClass", '
        't.min_nodes AS "minNodes", t.max_nodes AS "maxNodes", t.spec',
        None,
        {"cluster": "t.cluster_id", "name": "t.name"},
        frozenset({"spec"}),
    ),
    "artifact": Kind(
        "artifact",
        "artifacts",
        "art",
        f't.id, t.tenant_id AS "tenantId", t.name, t.digest, t.kind, t.locations, {_CREATED}',
        "t.tenant_id",
        {"tenant": "t.tenant_id", "digest": "t.digest", "kind": "t.kind"},
    ),
}

# What a unique key that clashes means, by constraint (the detail names the values).
_CLASHES: Final = {
    "tenants_name_key": "a tenant of that name exists (`$.name`)",
    "tenants_host": "another tenant has that host (`$.host`, compared case-insensitively)",
    "projects_tenant_id_name_key": "the tenant has a project of that name (`$.name`)",
    "quotas_scope": "the project has a quota for that device class and cluster (`$.deviceClass`)",
    "priority_classes_name_key": "a priority class of that name exists (`$.name`)",
    "artifacts_tenant_digest": "the tenant has an artifact with that digest (`$.digest`)",
}


@contextlib.asynccontextmanager
async def transaction(pool: Pool) -> AsyncIterator[Conn]:
    """One transaction, with the integrity errors of declared objects said in their words."""
    async with connection(pool) as conn:
        try:
            async with conn.transaction():
                yield conn
        except psycopg.errors.UniqueViolation as exc:
            what = _CLASHES.get(exc.diag.constraint_name or "", "it clashes with one that exists")
            detail = exc.diag.message_detail or ""
            raise Conflict(f"{what}: {detail}".rstrip(": ")) from exc
        except psycopg.errors.ForeignKeyViolation as exc:
            # A delete of a row that others still name (a project with workloads).
            raise Conflict(
                f"still referenced by {exc.diag.table_name or 'another object'}: "
                f"{exc.diag.message_detail or ''}"
            ) from exc
        except psycopg.errors.IntegrityError as exc:
            raise BadInput(f"the database refused a value: {exc.diag.message_primary}") from exc


def _scoped(kind: Kind, scope: str | None) -> tuple[str, list[Any]]:
    if scope is None or kind.owner is None:
        return "", []
    return f" AND {kind.owner} = %s", [scope]


async def get(
    conn: Conn, kind: Kind, object_id: str, scope: str | None, *, lock: bool = False
) -> dict[str, Any] | None:
    """One object as JSON fields, or None when absent (or another tenant's)."""
    where, args = _scoped(kind, scope)
    query = f"SELECT {kind.select} FROM {kind.table} t WHERE t.id = %s{where}"
    async with conn.cursor(row_factory=dict_row) as cursor:
        await cursor.execute(query + (" FOR UPDATE OF t" if lock else ""), [object_id, *args])
        return await cursor.fetchone()


async def exists(conn: Conn, kind: Kind, object_id: str, scope: str | None) -> bool:
    """Whether `object_id` is one of `kind` that `scope` may see."""
    where, args = _scoped(kind, scope)
    cursor = await conn.execute(
        f"SELECT 1 FROM {kind.table} t WHERE t.id = %s{where}", [object_id, *args]
    )
    return await cursor.fetchone() is not None


async def list_page(
    conn: Conn,
    kind: Kind,
    scope: str | None,
    *,
    filters: Mapping[str, str],
    after: str | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Objects by id (ids are ULIDs: oldest first), after `after`, at most `limit`."""
    where, args = _scoped(kind, scope)
    for name, value in filters.items():
        where += f" AND {kind.filters[name]} = %s"
        args.append(value.lower() if name == "host" else value)
    if after is not None:
        where += " AND t.id > %s"
        args.append(after)
    query = f"SELECT {kind.select} FROM {kind.table} t WHERE true{where} ORDER BY t.id LIMIT %s"
    async with conn.cursor(row_factory=dict_row) as cursor:
        await cursor.execute(query, [*args, limit])
        return await cursor.fetchall()


def _value(kind: Kind, column: str, value: Any) -> Any:
    return Jsonb(value) if column in kind.jsonb else value


async def insert(conn: Conn, kind: Kind, values: Mapping[str, Any]) -> dict[str, Any]:
    """Insert a row (`values` by column, with its id) and return it as JSON fields."""
    columns = list(values)
    placeholders = ", ".join(["%s"] * len(columns))
    await conn.execute(
        f"INSERT INTO {kind.table} ({', '.join(columns)}) VALUES ({placeholders})",
        [_value(kind, c, values[c]) for c in columns],
    )
    row = await get(conn, kind, values["id"], None)
    assert row is not None  # just inserted, in this transaction
    return row


async def update(
    conn: Conn, kind: Kind, object_id: str, scope: str | None, sets: Mapping[str, Any]
) -> dict[str, Any] | None:
    """Set `sets` (by column) on one object; the object after, or None when absent."""
    if sets:
        where, args = _scoped(kind, scope)
        assignments = ", ".join(f"{column} = %s" for column in sets)
        values = [_value(kind, c, v) for c, v in sets.items()]
        cursor = await conn.execute(
            f"UPDATE {kind.table} t SET {assignments} WHERE t.id = %s{where}",
            [*values, object_id, *args],
        )
        if cursor.rowcount == 0:
            return None
    return await get(conn, kind, object_id, scope)


async def delete(conn: Conn, kind: Kind, object_id: str, scope: str | None) -> bool:
    """Delete one object; False when absent (or another tenant's)."""
    where, args = _scoped(kind, scope)
    cursor = await conn.execute(
        f"DELETE FROM {kind.table} t WHERE t.id = %s{where}", [object_id, *args]
    )
    return cursor.rowcount > 0


_OWNERS: Final = {
    "ten": "SELECT id FROM tenants WHERE id = %s",
    "end": "SELECT tenant_id FROM endpoints WHERE id = %s",
    "wkl": "SELECT p.tenant_id FROM workloads w JOIN projects p ON p.id = w.project_id "
    "WHERE w.id = %s",
    "clu": "SELECT NULL FROM clusters WHERE id = %s",
}


async def owner_of(conn: Conn, object_id: str) -> tuple[bool, str | None]:
    """(exists, owning tenant) of what a policy attaches to: a tenant, endpoint, workload or
    cluster (a cluster is the installation's: no tenant)."""
    cursor = await conn.execute(_OWNERS[object_id[:3]], (object_id,))
    row = await cursor.fetchone()
    return (False, None) if row is None else (True, row[0])


async def cluster_ids_missing(conn: Conn, ids: Sequence[str]) -> list[str]:
    """The ids among `ids` that name no enrolled cluster."""
    if not ids:
        return []
    cursor = await conn.execute("SELECT id FROM clusters WHERE id = ANY(%s)", (list(ids),))
    found = {row[0] for row in await cursor.fetchall()}
    return [i for i in ids if i not in found]


# -- tenant keys ---------------------------------------------------------------------------

KEY_ID_LENGTH: Final = 16  # hex characters of the stored hash that name a key
_KEY_FIELDS: Final = (
    'left(hash, 16) AS id, tenant_id AS "tenantId", name, created_at AS "createdAt", '
    'revoked_at AS "revokedAt"'
)


async def add_key(conn: Conn, tenant_id: str, key_hash: str, name: str) -> dict[str, Any]:
    """Store a new key's hash; the key's listing (without the secret)."""
    async with conn.cursor(row_factory=dict_row) as cursor:
        await cursor.execute(
            f"INSERT INTO tenant_keys (hash, tenant_id, name) VALUES (%s, %s, %s) "
            f"RETURNING {_KEY_FIELDS}",
            (key_hash, tenant_id, name),
        )
        row = await cursor.fetchone()
    assert row is not None
    return row


async def keys(conn: Conn, tenant_id: str) -> list[dict[str, Any]]:
    """A tenant's keys, oldest first, revoked ones too (bounded: the API mints at most
    `MAX_KEYS` unrevoked ones per tenant)."""
    async with conn.cursor(row_factory=dict_row) as cursor:
        await cursor.execute(
            f"SELECT {_KEY_FIELDS} FROM tenant_keys WHERE tenant_id = %s "
            "ORDER BY created_at, hash LIMIT 1000",
            (tenant_id,),
        )
        return await cursor.fetchall()


async def live_keys(conn: Conn, tenant_id: str) -> int:
    """How many unrevoked keys a tenant has."""
    cursor = await conn.execute(
        "SELECT count(*) FROM tenant_keys WHERE tenant_id = %s AND revoked_at IS NULL",
        (tenant_id,),
    )
    row = await cursor.fetchone()
    return int(row[0]) if row else 0


async def revoke_key(conn: Conn, tenant_id: str, key_id: str) -> bool:
    """Revoke the tenant's key whose id (`left(hash, 16)`) is `key_id`; False if none."""
    cursor = await conn.execute(
        "UPDATE tenant_keys SET revoked_at = coalesce(revoked_at, now()) "
        "WHERE tenant_id = %s AND left(hash, 16) = %s",
        (tenant_id, key_id),
    )
    return cursor.rowcount > 0
