"""The plane's Postgres access: enrolment, idempotent sync, fleet views, over one pool.

Each method takes a pooled connection for one unit of work and runs the matching function
of `enrolment`, `sync` or `views`. Errors come out as `PlaneError`s saying whose fault
(`plane.core.errors`): `DatabaseUnavailable` when PostgreSQL cannot be reached, `Conflict` for a
unique key, `SyncRefused` / `BadInput` for a caller's bad data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plane.core import tenant_keys
from plane.core.errors import SyncRefused
from plane.core.wire import NodeSummary, SyncBatch
from plane.db.connection import Pool, connection
from plane.fleet import enrolment, views
from plane.fleet.node_signing import ClusterCa
from plane.fleet.sync import sync_batch

# NodeSummary, SyncBatch and SyncRefused are re-exported for callers that still import them
# from here; their homes are `plane.core.wire` and `plane.core.errors`.
__all__ = ["NodeSummary", "PlaneStore", "SyncBatch", "SyncRefused"]


class PlaneStore:
    """The plane's queries over a psycopg connection pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    # -- admin and enrolment ----------------------------------------------------------------

    async def ensure_admin(self, token: str | None) -> str | None:
        """Store the admin token's hash on first start; returns a new token to print once."""
        async with connection(self.pool) as conn:
            return await enrolment.ensure_admin(conn, token)

    async def is_admin(self, token: str) -> bool:
        """Whether `token` is the admin token."""
        async with connection(self.pool) as conn:
            return await enrolment.is_admin(conn, token)

    async def enrol(self, name: str, ca: ClusterCa | None = None) -> tuple[str, str]:
        """A new cluster and its token (shown once; stored as a hash), bound to `ca` if
        given; `ClusterNameTaken` when the name is in use."""
        async with connection(self.pool) as conn:
            return await enrolment.enrol(conn, name, ca)

    async def revoke(self, cluster_id: str) -> bool:
        """Revoke a cluster's token; False when there is no such active cluster."""
        async with connection(self.pool) as conn:
            return await enrolment.revoke(conn, cluster_id)

    async def cluster_for(self, token: str) -> str | None:
        """The cluster a valid, unrevoked token belongs to."""
        async with connection(self.pool) as conn:
            return await enrolment.cluster_for(conn, token)

    async def tenant_for(self, key: str) -> str | None:
        """The tenant an unrevoked tenant key (`nvt1.`) belongs to."""
        async with connection(self.pool) as conn:
            return await tenant_keys.tenant_for(conn, key)

    # -- sync --------------------------------------------------------------------------------

    async def sync(
        self, cluster_id: str, batch: SyncBatch, *, ca: ClusterCa | None = None
    ) -> dict[str, int]:
        """Upsert one node's batch in one transaction; newer wins, replays change nothing.
        `ca`, the CA its signature verified against, is bound or must be the bound one."""
        async with connection(self.pool) as conn:
            return await sync_batch(conn, cluster_id, batch, ca=ca)

    # -- views -------------------------------------------------------------------------------

    async def clusters(self) -> list[dict[str, Any]]:
        """Every enrolled cluster, by name."""
        async with connection(self.pool) as conn:
            return await views.clusters(conn)

    async def fleet_summary(
        self, *, window_s: int = 3600, cluster_id: str | None = None
    ) -> dict[str, Any]:
        """Clusters with nodes, GPUs by class and health, memory, jobs by state and model,
        queue and run time percentiles over the window."""
        async with connection(self.pool) as conn:
            return await views.fleet_summary(conn, window_s=window_s, cluster_id=cluster_id)

    async def jobs(
        self,
        *,
        cluster_id: str | None,
        state: str | None,
        model: str | None,
        after: Sequence[Any] | None,
        limit: int,
    ) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """Jobs newest first with keyset pagination; returns the page and the next cursor."""
        async with connection(self.pool) as conn:
            return await views.jobs_page(
                conn, cluster_id=cluster_id, state=state, model=model, after=after, limit=limit
            )
