"""Versioned SQL migrations, applied at start under an advisory lock.

Migrations are `plane/migrations/NNNN_name.sql`, applied in order, each in the same
transaction as its row in `schema_migrations`. The whole run holds a transaction-level
advisory lock, so two planes that start together apply each migration once: the second
waits, then finds nothing left to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final

import psycopg

from plane.core.errors import MigrationError

__all__ = ["Migration", "migrate", "migrations"]

LOCK_KEY: Final = 0x6E7670_6C616E  # "nvp" "lan": any constant shared by every plane
_NAME: Final = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step."""

    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every migration shipped with the package, in order."""
    found = []
    for entry in resources.files("plane.migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found


async def migrate(conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> list[int]:
    """Apply what is missing; returns the versions this call applied."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cursor = await conn.execute("SELECT version FROM schema_migrations")
        done = {row[0] for row in await cursor.fetchall()}
        for migration in migrations():
            if migration.version in done:
                continue
            await conn.execute(migration.sql.encode())  # bytes: a file, not a literal
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
            applied.append(migration.version)
    return applied
