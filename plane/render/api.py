"""A plane deployment rendered as an NVIDIA Dynamo `DynamoGraphDeployment` (mounted through
`plane.http.mounts`), for a cluster that runs Kubernetes and Dynamo:

    GET /v1/deployments/{id}/dynamo?format=yaml|json&image=&frontendType=
        admin, or the tenant whose workload it is (another tenant's: 404)

The deployment is rendered as the cluster receives it (`plane.desired.sql`): the workload's
serving configuration, that cluster's share of the replicas. `nvpair plane render DEPLOYMENT
--plane URL` prints it.
"""

from __future__ import annotations

import json
from typing import Final

from aiohttp import web

from plane.core.errors import BadInput, PlaneError
from plane.core.ids import is_id
from plane.core.roles import Role
from plane.db.connection import connection
from plane.desired.sql import deployment_of
from plane.http.answers import refusal
from plane.http.context import ApiContext
from plane.render.dynamo import DynamoSettings, RenderInput, RenderRefused, render
from plane.render.yaml_text import dump

__all__ = ["mount"]

_MAX_PARAM: Final = 512


class NotFound(PlaneError):
    """No such deployment (or another tenant's)."""

    status = 404


class Unrenderable(PlaneError):
    """A deployment Dynamo has no rendering for (its words say which and why)."""

    status = 422


def mount(app: web.Application, context: ApiContext) -> None:
    """Add the rendering route to `app`, served over `context`."""

    async def dynamo(request: web.Request) -> web.Response:
        role, own = await context.caller(request)
        if role is Role.CLUSTER:
            raise refusal(403, "rendering is the admin's or a tenant's", spaced=True)
        deployment_id = request.match_info["id"]
        query = request.query
        fmt = query.get("format", "yaml")
        if fmt not in ("yaml", "json"):
            raise BadInput("format: yaml or json")
        image, frontend = query.get("image", ""), query.get("frontendType", "frontend")
        if len(image) > _MAX_PARAM or len(frontend) > 64 or "\x00" in image + frontend:
            raise BadInput("image and frontendType are short strings")
        found = None
        if is_id(deployment_id, "dep"):
            async with connection(context.pool) as conn:
                found = await deployment_of(
                    conn, deployment_id, tenant=own if role is Role.TENANT else None
                )
        if found is None:
            raise NotFound(f"no deployment {deployment_id[:40]!r}")
        try:
            rendered = render(
                RenderInput.from_deployment(found),
                DynamoSettings(frontend_type=frontend),
                image=image,
            )
        except RenderRefused as exc:
            raise Unrenderable(str(exc)) from None
        if fmt == "json":
            text = json.dumps(rendered, indent=2) + "\n"
            return web.Response(text=text, content_type="application/json")
        return web.Response(text=dump(rendered), content_type="application/yaml")

    app.router.add_get("/v1/deployments/{id}/dynamo", dynamo)
