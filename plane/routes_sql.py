"""The routing table every cluster fetches (`DesiredState.routes`): each endpoint of every
tenant with its targets, where they run and whether they are ready."""

from __future__ import annotations

from ._db import Conn
from .desired import Route

__all__ = ["routes"]


async def routes(conn: Conn) -> list[Route]:
    """Every endpoint as a route (built by the endpoints work of issue 16)."""
    return []
