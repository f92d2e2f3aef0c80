"""Demand rows for the endpoint tests, written with plain SQL on the 0006 schema: a tenant
(with a key), a project, an artifact, workloads and their deployments, replicas and the
nodes' facade URLs, as the workloads API and the sync would leave them."""

from __future__ import annotations

import hashlib

import psycopg

from certs.ids import prefixed_ulid
from plane.core.tenant_keys import mint_tenant_key
from plane.core.tokens import hash_token

__all__ = ["Rows"]


class Rows:
    """Writes rows on one database (a DSN): each call its own short connection."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def sql(self, query: str, *args: object) -> list[tuple[object, ...]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cursor = await conn.execute(query.encode(), args)
            return await cursor.fetchall() if cursor.description else []

    async def tenant(self, name: str, host: str | None = None) -> tuple[str, str, str]:
        """A tenant with a project and an artifact; (tenant id, project id, tenant key)."""
        tenant, project, artifact = prefixed_ulid("ten"), prefixed_ulid("prj"), prefixed_ulid("art")
        key = mint_tenant_key()
        await self.sql(
            "INSERT INTO tenants (id, name, host) VALUES (%s, %s, %s)", tenant, name, host
        )
        await self.sql(
            "INSERT INTO tenant_keys (hash, tenant_id) VALUES (%s, %s)", hash_token(key), tenant
        )
        await self.sql(
            "INSERT INTO projects (id, tenant_id, name) VALUES (%s, %s, 'main')", project, tenant
        )
        await self.sql(
            "INSERT INTO artifacts (id, tenant_id, digest, kind) VALUES (%s, %s, %s, 'model')",
            artifact, tenant, "sha256:" + hashlib.sha256(tenant.encode()).hexdigest(),
        )  # fmt: skip
        return tenant, project, key

    async def deployment(self, project: str, name: str, cluster: str) -> str:
        """A workload named `name` of `project`, deployed on `cluster`; the deployment's id."""
        workload, deployment = prefixed_ulid("wkl"), prefixed_ulid("dep")
        (artifact,) = (
            await self.sql(
                "SELECT a.id FROM artifacts a JOIN projects p ON p.tenant_id = a.tenant_id"
                " WHERE p.id = %s",
                project,
            )
        )[0]
        await self.sql(
            "INSERT INTO workloads (id, project_id, artifact_id, serving_digest, serving, name)"
            " VALUES (%s, %s, %s, %s, '{\"engine\": \"mock\", \"gpus\": 0}', %s)",
            workload, project, artifact, "svg_" + hashlib.sha256(name.encode()).hexdigest(), name,
        )  # fmt: skip
        await self.sql(
            "INSERT INTO deployments (id, workload_id, cluster_id, replicas, authority)"
            " VALUES (%s, %s, %s, 1, 'managed')",
            deployment, workload, cluster,
        )  # fmt: skip
        return deployment

    async def node(self, cluster: str, facade_url: str, *, reachable: bool = True) -> str:
        """A node of `cluster` whose facade is `facade_url`."""
        node = prefixed_ulid("nod")
        await self.sql(
            "INSERT INTO nodes (id, cluster_id, name, reachable, cordoned, version, generation,"
            " facade_url) VALUES (%s, %s, %s, %s, false, 'test', 1, %s)",
            node, cluster, node[-6:], reachable, facade_url,
        )  # fmt: skip
        return node

    async def replica(
        self, deployment: str | None, cluster: str, node: str, state: str = "ready", name: str = ""
    ) -> None:
        """A replica of `deployment` (None: of a cluster's own deployment `name`) on `node`."""
        await self.sql(
            "INSERT INTO replicas (id, deployment_id, cluster_id, node_id, ready, generation,"
            " state, deployment_name) VALUES (%s, %s, %s, %s, %s, 1, %s, %s)",
            prefixed_ulid("rep"), deployment, cluster, node, state == "ready", state, name,
        )  # fmt: skip
