"""The plane API's declared objects (seed 000's binding side, pools, artifacts and the
attributes of clusters): `POST` creates, `GET` lists or reads one, `PATCH` changes the fields
given, `DELETE` removes. docs/plane-objects.md lists who may do what.

    /v1/tenants  /v1/projects  /v1/quotas  /v1/priority-classes  /v1/policies  /v1/pools
    /v1/artifacts (no PATCH: immutable)      PATCH /v1/clusters/{id} (region, residency, cost)
    POST /v1/tenants/{id}/keys -> the nvt1. key, once; GET lists; DELETE .../keys/{keyId}

The admin token sees and changes everything. A tenant key acts as its tenant: another
tenant's object is a 404, as if absent, and lists hold its own objects only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, TypeVar

import msgspec
from aiohttp import web

from plane.core.errors import BadInput, Conflict, PlaneError
from plane.core.ids import is_id
from plane.core.roles import Role
from plane.core.tenant_keys import mint_tenant_key
from plane.core.tokens import hash_token
from plane.declared import sql
from plane.declared.objects import (
    ArtifactCreate,
    ClusterAttrsPatch,
    KeyCreate,
    PolicyCreate,
    PolicyPatch,
    PoolCreate,
    PoolPatch,
    PriorityClassCreate,
    PriorityClassPatch,
    ProjectCreate,
    ProjectPatch,
    QuotaCreate,
    QuotaPatch,
    TenantCreate,
    TenantPatch,
)
from plane.declared.rules import CREATES, PATCHES, Forbidden, NotFound
from plane.http.answers import JsonBody, json_answer
from plane.http.context import ApiContext

__all__ = ["MAX_BODY", "MAX_KEYS", "PATHS", "mount"]

MAX_BODY: Final = 256 * 1024  # a declared object is small; a policy's cluster lists the most
MAX_KEYS: Final = 100  # unrevoked keys per tenant
MAX_LIMIT: Final = 1000
T = TypeVar("T")
Access = Literal["any", "own", "admin"]

# kind -> (API path segment, who reads, who writes, the create and patch bodies)
PATHS: Final[dict[str, tuple[str, Access, Access, type[Any], type[Any] | None]]] = {
    "tenant": ("tenants", "own", "admin", TenantCreate, TenantPatch),
    "project": ("projects", "own", "own", ProjectCreate, ProjectPatch),
    "quota": ("quotas", "own", "admin", QuotaCreate, QuotaPatch),
    "priority-class": ("priority-classes", "any", "admin", PriorityClassCreate, PriorityClassPatch),
    "policy": ("policies", "own", "own", PolicyCreate, PolicyPatch),
    "pool": ("pools", "admin", "admin", PoolCreate, PoolPatch),
    "artifact": ("artifacts", "own", "own", ArtifactCreate, None),
}
_bodies: Final[dict[type[Any], JsonBody[Any]]] = {}


def _body_of(shape: type[T]) -> JsonBody[T]:
    """A declared object's body of type `shape` (made once): at most MAX_BODY bytes, and a
    refusal that names the field when its types are wrong."""
    body = _bodies.get(shape)
    if body is None:
        body = _bodies[shape] = JsonBody(
            shape,
            most=MAX_BODY,
            too_large=f"the body is at most {MAX_BODY} bytes",
            invalid=lambda why: why,
            malformed=lambda why: f"the body is not a JSON object: {why}",
            nested="the body is nested too deeply",
        )
    return body


async def _body(request: web.Request, shape: type[T], *, empty_ok: bool = False) -> T:
    """The request body as `shape` (an empty one as `{}` where `empty_ok`); 400 naming the
    field, 413 past MAX_BODY."""
    body = _body_of(shape)
    raw = await body.read_bytes(request)
    if not raw.strip() and empty_ok:
        raw = b"{}"
    return body.decode(raw)


class DeclaredApi:
    """The routes, over the `ApiContext` they are mounted with (`caller()`, the pool)."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context

    async def scope(self, request: web.Request, need: Access, what: str) -> str | None:
        """The tenant the caller acts as (None: the admin, or anyone for `any`); 403 when it
        may not do `what`."""
        role, own = await self.context.caller(request)
        if role is Role.ADMIN:
            return None
        if role is Role.TENANT and need != "admin":
            return str(own)
        if role is Role.CLUSTER and need == "any":
            return None
        if role is Role.CLUSTER:
            raise Forbidden(f"a cluster token may not {what}")
        raise Forbidden(f"only the admin token may {what}")

    def kind_routes(self, app: web.Application, kind_name: str) -> None:
        """The five routes of one kind."""
        segment, reads, writes, create_body, patch_body = PATHS[kind_name]
        kind = sql.KINDS[kind_name]
        plural = segment.replace("-", " ")
        pool = self.context.pool

        def target(request: web.Request) -> str:
            object_id = request.match_info["id"]
            if not is_id(object_id, kind.prefix):
                raise NotFound(f"no {kind.label} {object_id[:64]!r}")
            return object_id

        async def create(request: web.Request) -> web.Response:
            scope = await self.scope(request, writes, f"create {plural}")
            body = await _body(request, create_body)
            async with sql.transaction(pool) as conn:
                row = await CREATES[kind_name](conn, kind, body, scope)
            return json_answer(row, 201)

        async def listing(request: web.Request) -> web.Response:
            scope = await self.scope(request, reads, f"list {plural}")
            filters, after, limit = _list_query(request, kind)
            async with sql.transaction(pool) as conn:
                rows = await sql.list_page(
                    conn, kind, scope, filters=filters, after=after, limit=limit
                )
            answer: dict[str, Any] = {"items": rows}
            if len(rows) == limit:
                answer["next"] = rows[-1]["id"]
            return json_answer(answer)

        async def read(request: web.Request) -> web.Response:
            scope = await self.scope(request, reads, f"read {plural}")
            object_id = target(request)
            async with sql.transaction(pool) as conn:
                row = await sql.get(conn, kind, object_id, scope)
            if row is None:
                raise NotFound(f"no {kind.label} {object_id!r}")
            return json_answer(row)

        async def patch(request: web.Request) -> web.Response:
            if patch_body is None:
                raise _Immutable(f"{plural} are immutable: create another and delete this one")
            scope = await self.scope(request, writes, f"change {plural}")
            object_id = target(request)
            body = await _body(request, patch_body)
            async with sql.transaction(pool) as conn:
                row = await PATCHES[kind_name](conn, kind, object_id, body, scope)
            return json_answer(row)

        async def remove(request: web.Request) -> web.Response:
            scope = await self.scope(request, writes, f"delete {plural}")
            object_id = target(request)
            async with sql.transaction(pool) as conn:
                if not await sql.delete(conn, kind, object_id, scope):
                    raise NotFound(f"no {kind.label} {object_id!r}")
            return json_answer({"deleted": object_id})

        app.router.add_post(f"/v1/{segment}", create)
        app.router.add_get(f"/v1/{segment}", listing)
        app.router.add_get(f"/v1/{segment}/{{id}}", read)
        app.router.add_patch(f"/v1/{segment}/{{id}}", patch)
        app.router.add_delete(f"/v1/{segment}/{{id}}", remove)

    # -- tenant keys and cluster attributes --------------------------------------------------

    async def _key_tenant(self, request: web.Request, need: Access, what: str) -> str:
        """The tenant of a keys route, 404 when absent or not the caller's own."""
        scope = await self.scope(request, need, what)
        tenant_id = request.match_info["id"]
        if not is_id(tenant_id, "ten") or scope not in (None, tenant_id):
            raise NotFound(f"no tenant {tenant_id[:64]!r}")
        return tenant_id

    async def mint_key(self, request: web.Request) -> web.Response:
        """`POST /v1/tenants/{id}/keys` (admin): a new key, shown in this answer only."""
        tenant_id = await self._key_tenant(request, "admin", "mint tenant keys")
        body = await _body(request, KeyCreate, empty_ok=True)
        key = mint_tenant_key()
        async with sql.transaction(self.context.pool) as conn:
            if not await sql.exists(conn, sql.KINDS["tenant"], tenant_id, None):
                raise NotFound(f"no tenant {tenant_id!r}")
            if await sql.live_keys(conn, tenant_id) >= MAX_KEYS:
                raise Conflict(f"the tenant has {MAX_KEYS} unrevoked keys: revoke one first")
            row = await sql.add_key(conn, tenant_id, hash_token(key), body.name)
        return json_answer({**row, "key": key}, 201)

    async def list_keys(self, request: web.Request) -> web.Response:
        """`GET /v1/tenants/{id}/keys` (admin, or that tenant): ids and names, no secret."""
        tenant_id = await self._key_tenant(request, "own", "list tenant keys")
        async with sql.transaction(self.context.pool) as conn:
            if not await sql.exists(conn, sql.KINDS["tenant"], tenant_id, None):
                raise NotFound(f"no tenant {tenant_id!r}")
            rows = await sql.keys(conn, tenant_id)
        return json_answer({"items": rows})

    async def revoke_key(self, request: web.Request) -> web.Response:
        """`DELETE /v1/tenants/{id}/keys/{keyId}` (admin, or that tenant): refused from now."""
        tenant_id = await self._key_tenant(request, "own", "revoke tenant keys")
        key_id = request.match_info["key"]
        async with sql.transaction(self.context.pool) as conn:
            if not await sql.revoke_key(conn, tenant_id, key_id):
                raise NotFound(f"no key {key_id[:64]!r} of tenant {tenant_id!r}")
        return json_answer({"revoked": key_id})

    async def patch_cluster(self, request: web.Request) -> web.Response:
        """`PATCH /v1/clusters/{id}` (admin): the attributes policies test."""
        await self.scope(request, "admin", "change clusters")
        cluster_id = request.match_info["id"]
        body = await _body(request, ClusterAttrsPatch)
        columns = {"region": "region", "residency": "residency"}
        columns["costPerDeviceHour"] = "cost_per_device_hour"
        sets = {
            column: getattr(body, field)
            for field, column in columns.items()
            if getattr(body, field) is not msgspec.UNSET
        }
        assignments = ", ".join(f"{column} = %s" for column in sets) or "region = region"
        async with sql.transaction(self.context.pool) as conn:
            cursor = await conn.execute(
                f"UPDATE clusters SET {assignments} WHERE id = %s RETURNING id, name, region, "
                "residency, cost_per_device_hour",
                [*sets.values(), cluster_id],
            )
            row = await cursor.fetchone()
        if row is None:
            raise NotFound(f"no cluster {cluster_id[:64]!r}")
        keys = ("id", "name", "region", "residency", "costPerDeviceHour")
        return json_answer(dict(zip(keys, row, strict=True)))


class _Immutable(PlaneError):
    status = 405


def _list_query(request: web.Request, kind: sql.Kind) -> tuple[dict[str, str], str | None, int]:
    """(filters, after, limit) of a list's query; 400 naming a bad or unknown parameter."""
    filters: dict[str, str] = {}
    after, limit = None, 100
    for name, value in request.query.items():
        if name == "after":
            if not is_id(value, kind.prefix):
                raise BadInput(f"after is the `next` id a previous page gave, not {value[:64]!r}")
            after = value
        elif name == "limit":
            if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
                raise BadInput(f"limit is a number from 1 to {MAX_LIMIT}")
            limit = int(value)
        elif name in kind.filters:
            if len(value) > 256 or "\x00" in value:
                raise BadInput(f"{name} is at most 256 characters, without NUL")
            filters[name] = value
        else:
            known = ", ".join(["after", "limit", *kind.filters])
            raise BadInput(
                f"unknown query parameter {name[:64]!r}; {kind.label} lists take {known}"
            )
    return filters, after, limit


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the declared objects' routes to the plane's application, served over `context`."""
    api = DeclaredApi(context)
    for kind_name in PATHS:
        api.kind_routes(app, kind_name)
    handlers: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
        ("POST", "/v1/tenants/{id}/keys", api.mint_key),
        ("GET", "/v1/tenants/{id}/keys", api.list_keys),
        ("DELETE", "/v1/tenants/{id}/keys/{key}", api.revoke_key),
        ("PATCH", "/v1/clusters/{id}", api.patch_cluster),
    ]
    for method, path, handler in handlers:
        app.router.add_route(method, path, handler)
