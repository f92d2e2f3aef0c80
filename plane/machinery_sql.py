"""What a cluster is asked to carry out (`DesiredState.operations`) and keep warm
(`DesiredState.warm`)."""

from __future__ import annotations

from ._db import Conn
from .desired import DesiredOperation, WarmArtifact

__all__ = ["pending_operations", "warm_set"]


async def pending_operations(conn: Conn, cluster_id: str) -> list[DesiredOperation]:
    """The operations `cluster_id` should carry out now: pending or running, oldest first."""
    return []


async def warm_set(conn: Conn, cluster_id: str) -> list[WarmArtifact]:
    """The artifacts declared warm on `cluster_id`."""
    return []
