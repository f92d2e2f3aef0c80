"""The plane API's route groups beyond the supply side, each in its own module: a mount adds
its routes to the application, served over the `ApiContext` it is handed (the pool, and
`caller()` / `admin()`; plane/http/context.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aiohttp import web

from plane.declared import api as declared_api
from plane.declared import workloads_api
from plane.desired import api as desired_api
from plane.desired import endpoints_api
from plane.http.context import ApiContext
from plane.machinery import api as machinery_api
from plane.machinery import operations_api
from plane.render import api as render_api

__all__ = ["MOUNTS"]

Mount = Callable[[web.Application, ApiContext], None]

MOUNTS: Final[list[Mount]] = [
    workloads_api.mount,  # workloads, placement, explain (issue 16, item 3)
    desired_api.mount,  # the desired state down, deployments (issue 16, item 4)
    operations_api.mount,  # operations (issue 16, item 6)
    machinery_api.mount,  # events, components, cache, the warm set (issue 16, item 6)
    declared_api.mount,  # tenants, keys, projects, quotas, policies, pools, ... (item 2)
    endpoints_api.mount,  # endpoints (issue 16, item 5)
    render_api.mount,  # a plane deployment as a DynamoGraphDeployment (issue 16, item 8)
]
