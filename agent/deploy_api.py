"""The local API's deployment routes (behind its owner token, like every other route):

- `GET /v1/deployments` -- the declared deployments, each with its replicas' counts by state
  across the cluster.
- `POST /v1/deployments` -- declare one (`DeploymentRequest`; 201 with the signed version).
- `POST /v1/deployments/{name}/scale` -- `{"replicas": N}`.
- `POST /v1/deployments/{name}/undeploy` -- its replicas stop everywhere.
- `GET /v1/replicas` -- every member's replicas, as their records say.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import msgspec
from aiohttp import web

from broker.deployments import Deployment
from broker.records import NodeRecord

from .deployments import DeploymentRefused, DeploymentRequest, Deployments

__all__ = ["deployment_routes", "deployment_view"]

_request: Final = msgspec.json.Decoder(DeploymentRequest)


class _Scale(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int


_scale: Final = msgspec.json.Decoder(_Scale)


def deployment_view(deployment: Deployment, records: list[NodeRecord]) -> dict[str, Any]:
    """A deployment as people read it: no signature, its replicas counted by state."""
    shown: dict[str, Any] = msgspec.to_builtins(deployment)
    for hidden in ("byCert", "signature"):
        shown.pop(hidden, None)
    states = Counter(
        r.state
        for record in records
        for r in record.replicas
        if r.deployment == deployment.name and r.deploymentId == deployment.id
    )
    shown["replicaStates"] = dict(sorted(states.items()))
    return shown


def deployment_routes(
    deployments: Deployments,
    records: Callable[[], list[NodeRecord]],
) -> list[web.RouteDef]:
    """The routes, over this node's `Deployments` (whose `on_change` pushes a change to the
    members) and the members' records."""

    async def listing(request: web.Request) -> web.Response:
        held = records()
        return _json([deployment_view(d, held) for d in deployments.live()])

    async def declare(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            made = deployments.declare(_request.decode(body))
        except (msgspec.DecodeError, msgspec.ValidationError, DeploymentRefused) as exc:
            raise web.HTTPBadRequest(text=f"{_reason(exc)}\n") from None
        return _json(deployment_view(made, records()), status=201)

    async def scale(request: web.Request) -> web.Response:
        try:
            wanted = _scale.decode(await request.read()).replicas
            made = deployments.scale(request.match_info["name"], wanted)
        except (msgspec.DecodeError, msgspec.ValidationError, DeploymentRefused) as exc:
            raise _refused(exc) from None
        return _json(deployment_view(made, records()))

    async def undeploy(request: web.Request) -> web.Response:
        try:
            made = deployments.undeploy(request.match_info["name"])
        except DeploymentRefused as exc:
            raise _refused(exc) from None
        return _json({"undeployed": made.name, "version": made.version})

    async def replicas(request: web.Request) -> web.Response:
        rows = [
            {"nodeId": record.nodeId, "node": record.name, **msgspec.to_builtins(r)}
            for record in records()
            for r in record.replicas
        ]
        return _json(sorted(rows, key=lambda row: (row["deployment"], row["node"], row["id"])))

    return [
        web.get("/v1/deployments", listing),
        web.post("/v1/deployments", declare),
        web.post("/v1/deployments/{name}/scale", scale),
        web.post("/v1/deployments/{name}/undeploy", undeploy),
        web.get("/v1/replicas", replicas),
    ]


def _refused(exc: Exception) -> web.HTTPException:
    if isinstance(exc, DeploymentRefused) and str(exc).startswith("no deployment named"):
        return web.HTTPNotFound(text=f"{exc}\n")
    return web.HTTPBadRequest(text=f"{_reason(exc)}\n")


def _reason(exc: Exception) -> str:
    return str(exc)[:500]


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(value), status=status, content_type="application/json"
    )
