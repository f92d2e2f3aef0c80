"""The plane API's endpoints: a tenant's stable public model names, each resolving to
deployments of that tenant's workloads by weights or by failover order (issue 16, item 5).

    POST   /v1/endpoints        {tenant (the admin names it), modelName, mode, targets}
    GET    /v1/endpoints[?tenant=ten_...]
    GET    /v1/endpoints/{id}
    PATCH  /v1/endpoints/{id}   {modelName?, mode?, targets?}: canary and blue-green
    DELETE /v1/endpoints/{id}

`mode` is `weighted` (targets `[{deployment, weight}]`, weights 0 to 1,000,000, at least one
above 0) or `failover` (targets `[{deployment, order}]`, the lowest order that is up serves;
`order` defaults to the target's place in the list). The admin may act on any tenant's
endpoints; a tenant key on its own only (another tenant's endpoint is a 404, as if absent);
a cluster token on none. Errors name the field: `targets[1].deployment: ...`.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from plane.core.errors import PlaneError
from plane.core.ids import is_id
from plane.core.roles import Role
from plane.db.connection import connection
from plane.desired import endpoints_sql
from plane.http.answers import JsonBody, json_answer
from plane.http.context import ApiContext

__all__ = ["MAX_TARGETS", "EndpointRefused", "checked_targets", "mount"]

MAX_TARGETS: Final = 64  # plane.desired.state.Route.targets
MAX_WEIGHT: Final = 1_000_000
MAX_ORDER: Final = 1_000
MAX_NAME: Final = 256
MODES: Final = ("weighted", "failover")
_FIELDS: Final = frozenset({"tenant", "modelName", "mode", "targets"})


class EndpointRefused(PlaneError):
    """An endpoint body that breaks a rule; the message names the field (the caller's)."""

    status = 400


class _Forbidden(PlaneError):
    status = 403


class _NotFound(PlaneError):
    status = 404


def _model_name(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= MAX_NAME
        or not value.isprintable()
        or any(c.isspace() for c in value)
    ):
        raise EndpointRefused(
            f"modelName: 1 to {MAX_NAME} printable characters without spaces (the public "
            "name clients send as `model`)"
        )
    return value


def _mode(value: Any) -> str:
    if value not in MODES:
        raise EndpointRefused(f"mode: one of {', '.join(MODES)}")
    return str(value)


def _number(value: Any, field: str, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise EndpointRefused(f"{field}: a whole number from 0 to {high}")
    return value


def checked_targets(value: Any, mode: str) -> list[dict[str, Any]]:
    """The targets of a `mode` endpoint as stored, or `EndpointRefused` naming the field.
    Whose deployments they are is checked against the database afterwards."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TARGETS:
        raise EndpointRefused(f"targets: a list of 1 to {MAX_TARGETS} targets")
    key = "weight" if mode == "weighted" else "order"
    targets: list[dict[str, Any]] = []
    for n, given in enumerate(value):
        field = f"targets[{n}]"
        if not isinstance(given, dict):
            raise EndpointRefused(f"{field}: an object {{deployment, {key}}}")
        extra = sorted(set(given) - {"deployment", key})
        if extra:
            raise EndpointRefused(
                f"{field}.{str(extra[0])[:64]}: not a field of a {mode} endpoint's target"
            )
        deployment = given.get("deployment")
        if not isinstance(deployment, str) or not is_id(deployment, "dep"):
            raise EndpointRefused(f"{field}.deployment: a Deployment id (dep_...)")
        if any(t["deployment"] == deployment for t in targets):
            raise EndpointRefused(f"{field}.deployment: {deployment} is a target already")
        if mode == "weighted":
            if "weight" not in given:
                raise EndpointRefused(f"{field}.weight: required for a weighted endpoint")
            number = _number(given["weight"], f"{field}.weight", MAX_WEIGHT)
        else:
            number = _number(given.get("order", n), f"{field}.order", MAX_ORDER)
            if any(t["order"] == number for t in targets):
                raise EndpointRefused(f"{field}.order: {number} is another target's order")
        targets.append({"deployment": deployment, key: number})
    if mode == "weighted" and not any(t["weight"] > 0 for t in targets):
        raise EndpointRefused("targets: at least one weight above 0")
    return targets


_ENDPOINT: Final = JsonBody(dict[str, Any], malformed="the body is a JSON object")


async def _body(request: web.Request) -> dict[str, Any]:
    body = await _ENDPOINT.read(request)
    unknown = sorted(str(k) for k in body if k not in _FIELDS)
    if unknown:
        raise EndpointRefused(f"{unknown[0][:64]}: not a field of an endpoint")
    return body


def _endpoint_id(request: web.Request) -> str:
    endpoint = request.match_info["id"]
    if not is_id(endpoint, "end"):
        raise _NotFound(f"no endpoint {endpoint[:40]!r}")
    return endpoint


class _Endpoints:
    """The handlers, over the `ApiContext` they are mounted with."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context

    async def _tenant_or_admin(self, request: web.Request) -> str | None:
        """The calling tenant, or None for the admin; a cluster may not."""
        role, own = await self.context.caller(request)
        if role is Role.CLUSTER:
            raise _Forbidden("endpoints are a tenant's: use the admin token or a tenant key")
        return own if role is Role.TENANT else None

    async def _owned(self, conn: Any, tenant: str, targets: list[dict[str, Any]]) -> None:
        ids = [t["deployment"] for t in targets]
        owned = await endpoints_sql.tenant_deployments(conn, tenant, ids)
        for n, deployment in enumerate(ids):
            if deployment not in owned:
                raise EndpointRefused(
                    f"targets[{n}].deployment: {deployment} is not a deployment of the "
                    "tenant's workloads"
                )

    async def create(self, request: web.Request) -> web.Response:
        own = await self._tenant_or_admin(request)
        body = await _body(request)
        tenant = body.get("tenant", own)
        if own is not None and tenant != own:
            raise EndpointRefused("tenant: a tenant key creates its own tenant's endpoints")
        if not isinstance(tenant, str) or not is_id(tenant, "ten"):
            raise EndpointRefused("tenant: the Tenant id (ten_...) the endpoint belongs to")
        name = _model_name(body.get("modelName"))
        mode = _mode(body.get("mode", "weighted"))
        targets = checked_targets(body.get("targets"), mode)
        async with connection(self.context.pool) as conn:
            if not await endpoints_sql.tenant_exists(conn, tenant):
                raise EndpointRefused(f"tenant: no tenant {tenant}")
            await self._owned(conn, tenant, targets)
            made = await endpoints_sql.create(conn, tenant, name, mode, targets)
        return json_answer(made, 201)

    async def listing(self, request: web.Request) -> web.Response:
        own = await self._tenant_or_admin(request)
        tenant = request.query.get("tenant")
        if tenant is not None and not is_id(tenant, "ten"):
            raise EndpointRefused("tenant: a Tenant id (ten_...)")
        if own is not None:
            if tenant not in (None, own):
                return json_answer({"items": []})  # another tenant's: as if it had none
            tenant = own
        async with connection(self.context.pool) as conn:
            return json_answer({"items": await endpoints_sql.list_endpoints(conn, tenant)})

    async def one(self, request: web.Request) -> web.Response:
        own = await self._tenant_or_admin(request)
        endpoint = _endpoint_id(request)
        async with connection(self.context.pool) as conn:
            found = await endpoints_sql.get(conn, endpoint, own)
        if found is None:
            raise _NotFound(f"no endpoint {endpoint}")
        return json_answer(found)

    async def patch(self, request: web.Request) -> web.Response:
        own = await self._tenant_or_admin(request)
        endpoint = _endpoint_id(request)
        body = await _body(request)
        if "tenant" in body:
            raise EndpointRefused("tenant: an endpoint stays its tenant's")
        changes: dict[str, Any] = {}
        if "modelName" in body:
            changes["modelName"] = _model_name(body["modelName"])
        async with connection(self.context.pool) as conn:
            found = await endpoints_sql.get(conn, endpoint, own)
            if found is None:
                raise _NotFound(f"no endpoint {endpoint}")
            mode = _mode(body["mode"]) if "mode" in body else found["mode"]
            if mode != found["mode"] and "targets" not in body:
                raise EndpointRefused(f"targets: a {mode} endpoint needs its targets given")
            changes["mode"] = mode
            if "targets" in body:
                changes["targets"] = checked_targets(body["targets"], mode)
                await self._owned(conn, found["tenant"], changes["targets"])
            changed = await endpoints_sql.update(conn, endpoint, found["tenant"], changes)
        if changed is None:
            raise _NotFound(f"no endpoint {endpoint}")
        return json_answer(changed)

    async def delete(self, request: web.Request) -> web.Response:
        own = await self._tenant_or_admin(request)
        endpoint = _endpoint_id(request)
        async with connection(self.context.pool) as conn:
            if not await endpoints_sql.delete(conn, endpoint, own):
                raise _NotFound(f"no endpoint {endpoint}")
        return json_answer({"deleted": endpoint})


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the endpoints' routes to `app`, served over `context`."""
    handlers = _Endpoints(context)
    app.router.add_post("/v1/endpoints", handlers.create)
    app.router.add_get("/v1/endpoints", handlers.listing)
    app.router.add_get("/v1/endpoints/{id}", handlers.one)
    app.router.add_patch("/v1/endpoints/{id}", handlers.patch)
    app.router.add_delete("/v1/endpoints/{id}", handlers.delete)
