"""What creating or changing each declared object checks against what is stored: that what it
names exists and is the caller's tenant's, and the rules that span stored and new fields
(a quota's floor, a pool's bounds, a policy's merged spec). Each error names the field."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from msgspec import UNSET

from plane.core.errors import BadInput, PlaneError
from plane.core.ids import is_id, new_id
from plane.db.connection import Conn
from plane.declared import sql
from plane.declared.objects import (
    ArtifactCreate,
    PolicyCreate,
    PolicyPatch,
    PolicySpec,
    PoolCreate,
    PoolPatch,
    PoolSpec,
    PriorityClassCreate,
    PriorityClassPatch,
    ProjectCreate,
    ProjectPatch,
    QuotaCreate,
    QuotaPatch,
    TenantCreate,
    TenantPatch,
    check_floor,
    check_nodes,
)

__all__ = ["CREATES", "PATCHES", "Forbidden", "NotFound"]


class NotFound(PlaneError):
    """No such object, or another tenant's (which reads as absent)."""

    status = 404


class Forbidden(PlaneError):
    """The caller's token may not do that (a tenant key setting quotas, say)."""

    status = 403


_TENANT: Final = sql.KINDS["tenant"]


def _fields(body: msgspec.Struct, columns: dict[str, str]) -> dict[str, Any]:
    """The PATCH body's given fields (not UNSET), by column."""
    return {
        column: getattr(body, field)
        for field, column in columns.items()
        if getattr(body, field) is not UNSET
    }


def _checked(check: Callable[[], None]) -> None:
    try:
        check()
    except msgspec.ValidationError as exc:
        raise BadInput(str(exc)) from None


async def _own_tenant(conn: Conn, named: str | None, scope: str | None) -> str:
    """The tenant a new object goes in: the key's own, or the one the admin names."""
    if scope is not None:
        if named not in (None, scope):
            raise NotFound(f"no tenant {named!r} - at `$.tenantId`")
        return scope
    if named is None:
        raise BadInput("tenantId is required with the admin token - at `$.tenantId`")
    if not await sql.exists(conn, _TENANT, named, None):
        raise NotFound(f"no tenant {named!r} - at `$.tenantId`")
    return named


async def _cluster_exists(conn: Conn, cluster_id: str | None, where: str) -> None:
    if cluster_id is not None and await sql.cluster_ids_missing(conn, [cluster_id]):
        raise NotFound(f"no cluster {cluster_id!r} - at `{where}`")


async def _get(conn: Conn, kind: sql.Kind, object_id: str, scope: str | None) -> dict[str, Any]:
    row = await sql.get(conn, kind, object_id, scope, lock=True)
    if row is None:
        raise NotFound(f"no {kind.label} {object_id!r}")
    return row


async def _updated(
    conn: Conn, kind: sql.Kind, object_id: str, scope: str | None, sets: dict[str, Any]
) -> dict[str, Any]:
    row = await sql.update(conn, kind, object_id, scope, sets)
    if row is None:
        raise NotFound(f"no {kind.label} {object_id!r}")
    return row


# -- creates ----------------------------------------------------------------------------------


async def _tenant(conn: Conn, kind: sql.Kind, body: TenantCreate, _: str | None) -> Any:
    host = None if body.host is None else body.host.lower()
    return await sql.insert(conn, kind, {"id": new_id("ten"), "name": body.name, "host": host})


async def _project(conn: Conn, kind: sql.Kind, body: ProjectCreate, scope: str | None) -> Any:
    tenant = await _own_tenant(conn, body.tenantId, scope)
    values = {"id": new_id("prj"), "tenant_id": tenant, "name": body.name}
    return await sql.insert(conn, kind, values)


async def _quota(conn: Conn, kind: sql.Kind, body: QuotaCreate, _: str | None) -> Any:
    if not await sql.exists(conn, sql.KINDS["project"], body.projectId, None):
        raise NotFound(f"no project {body.projectId!r} - at `$.projectId`")
    await _cluster_exists(conn, body.clusterId, "$.clusterId")
    values = {
        "id": new_id("qta"),
        "project_id": body.projectId,
        "device_class": body.deviceClass,
        "cluster_id": body.clusterId,
        "max_devices": body.maxDevices,
        "guaranteed": body.guaranteed,
        "over_quota_weight": body.overQuotaWeight,
    }
    return await sql.insert(conn, kind, values)


async def _priority(conn: Conn, kind: sql.Kind, body: PriorityClassCreate, _: str | None) -> Any:
    values = {
        "id": new_id("prc"),
        "name": body.name,
        "value": body.value,
        "preemptible": body.preemptible,
        "description": body.description,
    }
    return await sql.insert(conn, kind, values)


async def _spec_clusters(conn: Conn, spec: PolicySpec) -> None:
    """Clusters a spec names by id must be enrolled (a name may be a cluster enrolled later)."""
    for field in ("allowClusters", "denyClusters"):
        ids = [c for c in getattr(spec, field) if is_id(c, "clu")]
        missing = await sql.cluster_ids_missing(conn, ids)
        if missing:
            raise NotFound(f"no cluster {missing[0]!r} - at `$.spec.{field}`")


async def _policy(conn: Conn, kind: sql.Kind, body: PolicyCreate, scope: str | None) -> Any:
    if scope is not None and body.attachedTo.startswith("clu_"):
        raise Forbidden("only the admin token attaches policies to clusters - at `$.attachedTo`")
    # A tenant key's policy is its tenant's; the admin's is nobody's but the admin's unless
    # it names the tenant whose object it attaches to.
    tenant = None
    if scope is not None or body.tenantId is not None:
        tenant = await _own_tenant(conn, body.tenantId, scope)
    found, owner = await sql.owner_of(conn, body.attachedTo)
    if not found or (scope is not None and owner != scope):
        raise NotFound(f"no object {body.attachedTo!r} to attach to - at `$.attachedTo`")
    if tenant is not None and owner != tenant:
        raise BadInput(f"{body.attachedTo} is not tenant {tenant}'s - at `$.attachedTo`")
    await _spec_clusters(conn, body.spec)
    values = {
        "id": new_id("plc"),
        "tenant_id": tenant,
        "name": body.name,
        "attached_to": body.attachedTo,
        "spec": msgspec.to_builtins(body.spec),
    }
    return await sql.insert(conn, kind, values)


async def _pool(conn: Conn, kind: sql.Kind, body: PoolCreate, _: str | None) -> Any:
    await _cluster_exists(conn, body.clusterId, "$.clusterId")
    values = {
        "id": new_id("pol"),
        "name": body.name,
        "cluster_id": body.clusterId,
        "device_class": body.deviceClass,
        "min_nodes": body.minNodes,
        "max_nodes": body.maxNodes,
        "spec": msgspec.to_builtins(body.spec),
    }
    return await sql.insert(conn, kind, values)


async def _artifact(conn: Conn, kind: sql.Kind, body: ArtifactCreate, scope: str | None) -> Any:
    tenant = await _own_tenant(conn, body.tenantId, scope)
    values = {
        "id": new_id("art"),
        "tenant_id": tenant,
        "name": body.name,
        "digest": body.digest,
        "kind": body.kind,
        "locations": body.locations,
    }
    return await sql.insert(conn, kind, values)


# -- patches ----------------------------------------------------------------------------------


async def _patch_tenant(
    conn: Conn, kind: sql.Kind, object_id: str, body: TenantPatch, scope: str | None
) -> Any:
    sets = _fields(body, {"name": "name", "host": "host"})
    if isinstance(sets.get("host"), str):
        sets["host"] = sets["host"].lower()
    return await _updated(conn, kind, object_id, scope, sets)


async def _patch_project(
    conn: Conn, kind: sql.Kind, object_id: str, body: ProjectPatch, scope: str | None
) -> Any:
    return await _updated(conn, kind, object_id, scope, _fields(body, {"name": "name"}))


async def _patch_quota(
    conn: Conn, kind: sql.Kind, object_id: str, body: QuotaPatch, scope: str | None
) -> Any:
    stored = await _get(conn, kind, object_id, scope)
    sets = _fields(
        body,
        {
            "maxDevices": "max_devices",
            "guaranteed": "guaranteed",
            "overQuotaWeight": "over_quota_weight",
        },
    )
    floor = sets.get("guaranteed", stored["guaranteed"])
    _checked(lambda: check_floor(floor, sets.get("max_devices", stored["maxDevices"])))
    return await _updated(conn, kind, object_id, scope, sets)


async def _patch_priority(
    conn: Conn, kind: sql.Kind, object_id: str, body: PriorityClassPatch, scope: str | None
) -> Any:
    columns = {"name": "name", "value": "value", "preemptible": "preemptible"}
    sets = _fields(body, {**columns, "description": "description"})
    return await _updated(conn, kind, object_id, scope, sets)


def _merged(stored: Any, patch: msgspec.Struct, shape: type[Any]) -> Any:
    """A stored spec with the patch's given fields replacing its own."""
    base = msgspec.convert(stored, shape)
    given = {f: getattr(patch, f) for f in patch.__struct_fields__}
    return msgspec.structs.replace(base, **{f: v for f, v in given.items() if v is not UNSET})


async def _patch_policy(
    conn: Conn, kind: sql.Kind, object_id: str, body: PolicyPatch, scope: str | None
) -> Any:
    stored = await _get(conn, kind, object_id, scope)
    sets = _fields(body, {"name": "name"})
    if body.spec is not UNSET:
        spec = _merged(stored["spec"], body.spec, PolicySpec)
        await _spec_clusters(conn, spec)
        sets["spec"] = msgspec.to_builtins(spec)
    return await _updated(conn, kind, object_id, scope, sets)


async def _patch_pool(
    conn: Conn, kind: sql.Kind, object_id: str, body: PoolPatch, scope: str | None
) -> Any:
    stored = await _get(conn, kind, object_id, scope)
    columns = {"name": "name", "clusterId": "cluster_id", "deviceClass": "device_class"}
    sets = _fields(body, {**columns, "minNodes": "min_nodes", "maxNodes": "max_nodes"})
    _checked(
        lambda: check_nodes(
            sets.get("min_nodes", stored["minNodes"]), sets.get("max_nodes", stored["maxNodes"])
        )
    )
    await _cluster_exists(conn, sets.get("cluster_id"), "$.clusterId")
    if body.spec is not UNSET:
        sets["spec"] = msgspec.to_builtins(_merged(stored["spec"], body.spec, PoolSpec))
    return await _updated(conn, kind, object_id, scope, sets)


Create = Callable[[Conn, sql.Kind, Any, "str | None"], Awaitable[Any]]
Patch = Callable[[Conn, sql.Kind, str, Any, "str | None"], Awaitable[Any]]
CREATES: Final[dict[str, Create]] = {
    "tenant": _tenant,
    "project": _project,
    "quota": _quota,
    "priority-class": _priority,
    "policy": _policy,
    "pool": _pool,
    "artifact": _artifact,
}
PATCHES: Final[dict[str, Patch]] = {
    "tenant": _patch_tenant,
    "project": _patch_project,
    "quota": _patch_quota,
    "priority-class": _patch_priority,
    "policy": _patch_policy,
    "pool": _patch_pool,
}
