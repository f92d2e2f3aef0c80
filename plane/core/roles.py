"""Who calls the plane's API: the role a bearer token gives its caller (docs/plane.md)."""

from __future__ import annotations

import enum

__all__ = ["Role"]


class Role(enum.StrEnum):
    """The role of a caller, from the token it presents (`PlaneServer.caller`). A `StrEnum`:
    its value is what the API and the database hold."""

    ADMIN = "admin"  # the plane's admin token: everything
    CLUSTER = "cluster"  # a cluster's enrolment token: its own objects, its desired state
    TENANT = "tenant"  # a tenant's key: its own declared objects
