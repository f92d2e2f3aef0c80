"""The one place the plane takes a database connection, and translates psycopg's errors.

Translated once here, `from` the original: whoever calls the store sees only `PlaneError`s
for what is not our bug, and the HTTP API maps each to its status.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Final, TypeAlias

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from plane.core.errors import BadInput, Conflict, DatabaseUnavailable

__all__ = ["UNAVAILABLE", "Conn", "Pool", "connection", "first_line"]

Conn: TypeAlias = AsyncConnection[tuple[Any, ...]]
Pool: TypeAlias = AsyncConnectionPool[Conn]

UNAVAILABLE: Final = "the plane's database is not reachable; try again shortly"


@contextlib.asynccontextmanager
async def connection(pool: Pool) -> AsyncIterator[Conn]:
    """A pooled connection for one unit of work, with psycopg's errors made the plane's."""
    try:
        async with pool.connection() as conn:
            yield conn
    except psycopg.OperationalError as exc:
        # A pool timeout, a connection refused or lost, the server shutting down. The
        # message stays general (callers need not learn where the database lives); the
        # cause, chained, says what happened, for the log.
        raise DatabaseUnavailable(UNAVAILABLE) from exc
    except psycopg.errors.UniqueViolation as exc:
        raise Conflict(f"already exists ({exc.diag.constraint_name or 'a unique key'})") from exc
    except psycopg.DataError as exc:
        raise BadInput(f"the database refused a value: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    """An error's first line, bounded: what a log line or an error body shows of it."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
