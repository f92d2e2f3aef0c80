"""The plane as `nvpair plane serve` runs it: the HTTP API, the schema, the admin token and the
connection pool, started and stopped as one.

The port is bound at once, whether or not PostgreSQL is up: until the database answers and
the migrations are applied every call is a 503 with `Retry-After` (and `/healthz` says why),
so a plane started before its database, or pointed at the wrong port, serves errors that say
so instead of crashing. A start-up failure that retrying cannot fix (a migration that fails,
a malformed DSN) resolves `failed`, for the command to end with it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from plane.db.connection import Conn, Pool, first_line
from plane.db.migrate import migrate
from plane.db.store import PlaneStore
from plane.fleet import enrolment
from plane.http.server import PlaneServer

__all__ = ["PlaneService"]

log = logging.getLogger(__name__)

RETRY_CAP_S: Final = 2.0  # a database that comes back is in use within about this long
CONNECT_TIMEOUT_S: Final = 5


def _ignore(_: object) -> None:
    return None


class PlaneService:
    """`start()` binds and begins connecting; `aclose()` stops everything it started.

    Build it inside the running event loop (it owns a future of that loop).
    """

    def __init__(
        self,
        dsn: str,
        *,
        host: str | None,
        port: int,
        admin_token: str | None = None,
        on_admin_token: Callable[[str], None] = _ignore,
        on_migrated: Callable[[list[int]], None] = _ignore,
        pool_timeout_s: float = 5.0,
        max_connections: int = 10,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.dsn = dsn
        self.admin_token = admin_token
        self.on_admin_token = on_admin_token
        self.on_migrated = on_migrated
        # A request waits at most `pool_timeout_s` for a connection, then gets a 503; a slot
        # that cannot reconnect gives up after a few seconds, so a request after an outage
        # tries afresh instead of queueing behind a long reconnect backoff.
        self.pool: Pool = AsyncConnectionPool(
            dsn,
            min_size=1,
            max_size=max_connections,
            open=False,
            timeout=pool_timeout_s,
            reconnect_timeout=10.0,
            kwargs={"connect_timeout": CONNECT_TIMEOUT_S},
        )
        self.store = PlaneStore(self.pool)
        self.server = PlaneServer(
            self.store, host=host, port=port, not_ready=self._not_ready, ssl_context=ssl_context
        )
        self.serving = asyncio.Event()  # set once the database answered and is migrated
        self.failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._why: str | None = "the plane's database has not answered yet"  # what callers see
        self._pool_open = False
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """Whether the database answered and the schema is current."""
        return self._why is None

    async def start(self) -> int:
        """Bind the HTTP port (returned) and start connecting to the database in the
        background. An address in use raises `OSError` with nothing left running."""
        port = await self.server.start()
        self._task = asyncio.create_task(self._bootstrap(), name="plane bootstrap")
        return port

    async def aclose(self) -> None:
        """Stop the HTTP API, the bootstrap if it still runs, and the pool."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.server.aclose()
        if self._pool_open:
            await self.pool.close()
        if not self.failed.done():
            self.failed.cancel()

    def _not_ready(self) -> str | None:
        return self._why

    async def _bootstrap(self) -> None:
        """Connect (retrying while the database is unreachable), migrate, store the admin
        token, then open the pool for requests."""
        failures, last = 0, ""
        while True:
            try:
                await self._prepare()
                break
            except psycopg.OperationalError as exc:
                failures += 1
                detail = first_line(exc)
                if detail != last:  # once per distinct reason, not once per retry
                    log.warning("the plane's database is not reachable (%s); retrying", detail)
                last = detail
                # What callers see stays general: they need not learn where it lives.
                self._why = "the plane's database is not reachable yet"
                await asyncio.sleep(min(RETRY_CAP_S, 0.1 * 2 ** min(failures, 8)))
            except psycopg.Error as exc:
                # A malformed DSN, a failing migration: retrying will not fix it.
                log.error("the plane cannot start: %s", exc)
                self._fail(f"the plane cannot start: {first_line(exc)}")
                return
            except Exception as exc:
                log.exception("the plane cannot start")  # a bug of ours: the traceback helps
                self._fail(f"the plane cannot start: {first_line(exc)}")
                return
        await self.pool.open(wait=False)
        self._pool_open = True
        self._why = None
        self.serving.set()
        log.info("the plane's database is ready")

    def _fail(self, why: str) -> None:
        self._why = "the plane cannot start"
        self.failed.set_result(why)

    async def _prepare(self) -> None:
        conn: Conn = await psycopg.AsyncConnection.connect(
            self.dsn, connect_timeout=CONNECT_TIMEOUT_S
        )
        async with conn:
            applied = await migrate(conn)
            fresh = await enrolment.ensure_admin(conn, self.admin_token)
            await conn.commit()
        if applied:
            self.on_migrated(applied)
        if fresh is not None:
            self.on_admin_token(fresh)
