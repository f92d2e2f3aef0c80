"""Migrations on a real PostgreSQL: applied once, in order, even by two planes at once."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from plane.core.ids import new_id
from plane.db.migrate import migrate, migrations


async def test_migrations_apply_once(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        assert await migrate(conn) == [m.version for m in migrations()]
        assert await migrate(conn) == []
        cursor = await conn.execute("SELECT version, name FROM schema_migrations ORDER BY version")
        assert await cursor.fetchall() == [(m.version, m.name) for m in migrations()]


async def test_two_planes_starting_together_migrate_once(pg_dsn: str) -> None:
    async def plane() -> list[int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            return await migrate(conn)

    results = await asyncio.gather(*(plane() for _ in range(4)))
    assert sorted(results, key=len) == [[], [], [], [m.version for m in migrations()]]


async def test_schema_checks_ids_and_never_holds_a_prompt(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        await migrate(conn)
        cluster = new_id("clu")
        await conn.execute(
            "INSERT INTO clusters (id, name, token_hash) VALUES (%s, %s, %s)", (cluster, "a", "h")
        )
        with pytest.raises(psycopg.errors.CheckViolation):
            await conn.execute(
                "INSERT INTO clusters (id, name, token_hash) VALUES (%s, %s, %s)",
                ("clu_NOT-AN-ID", "b", "h"),
            )
        await conn.rollback()
        cursor = await conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'jobs'"
        )
        columns = {row[0] for row in await cursor.fetchall()}
        assert not columns & {"prompt", "messages", "body", "response"}
