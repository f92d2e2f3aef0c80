"""Demand-side rows written with plain SQL on migration 0006's schema, for tests that need a
tenant, project, artifact, workload or deployment without the API that declares them."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import psycopg

from plane.core.ids import new_id
from plane.core.tenant_keys import mint_tenant_key
from plane.core.tokens import hash_token

__all__ = ["bump", "deployment", "tenant", "workload"]


async def tenant(conn: psycopg.AsyncConnection[Any], name: str) -> tuple[str, str, str]:
    """A tenant with one project and one API key: (ten_ id, prj_ id, key)."""
    ten, prj, key = new_id("ten"), new_id("prj"), mint_tenant_key()
    await conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (ten, name))
    await conn.execute(
        "INSERT INTO projects (id, tenant_id, name) VALUES (%s, %s, 'default')", (prj, ten)
    )
    await conn.execute(
        "INSERT INTO tenant_keys (hash, tenant_id) VALUES (%s, %s)", (hash_token(key), ten)
    )
    return ten, prj, key


async def workload(
    conn: psycopg.AsyncConnection[Any],
    project: str,
    name: str,
    *,
    serving: dict[str, Any] | None = None,
    source: str = "",
    constraints: dict[str, Any] | None = None,
    replicas: int = 1,
) -> str:
    """A workload `name` of `project` (its artifact made too, `source` its one location)."""
    cursor = await conn.execute("SELECT tenant_id FROM projects WHERE id = %s", (project,))
    row = await cursor.fetchone()
    assert row is not None
    serving = serving if serving is not None else {"engine": "mock", "gpus": 1}
    body = msgspec.json.encode(serving)
    art, wkl = new_id("art"), new_id("wkl")
    await conn.execute(
        "INSERT INTO artifacts (id, digest, kind, locations, tenant_id, name) "
        "VALUES (%s, %s, 'weights', %s, %s, %s)",
        (
            art,
            "sha256:" + hashlib.sha256(name.encode()).hexdigest(),
            [source] if source else [],
            row[0],
            name,
        ),
    )
    await conn.execute(
        "INSERT INTO workloads (id, project_id, artifact_id, serving_digest, serving, name, "
        "replicas, constraints, max_replicas) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            wkl,
            project,
            art,
            "svg_" + hashlib.sha256(body).hexdigest(),
            body.decode(),
            name,
            replicas,
            msgspec.json.encode(constraints or {}).decode(),
            max(1, replicas),
        ),
    )
    return wkl


async def deployment(
    conn: psycopg.AsyncConnection[Any],
    workload_id: str,
    cluster_id: str,
    replicas: int,
    *,
    authority: str = "managed",
    url: str = "",
    node: str = "",
) -> str:
    """A deployment of `workload_id` on `cluster_id` (the cluster's desired state bumped)."""
    dep = new_id("dep")
    await conn.execute(
        "INSERT INTO deployments (id, workload_id, cluster_id, replicas, authority, url, node) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (dep, workload_id, cluster_id, replicas, authority, url, node),
    )
    await bump(conn, cluster_id)
    return dep


async def bump(conn: psycopg.AsyncConnection[Any], cluster_id: str) -> None:
    """The cluster's desired state changed (what every writer of it does)."""
    await conn.execute(
        "UPDATE clusters SET desired_generation = desired_generation + 1 WHERE id = %s",
        (cluster_id,),
    )
