"""A throw-away PostgreSQL for the plane tests, started from the installed server binaries.

`NVPAIR_TEST_PG_DSN` names a server to use instead. Without either, the tests are skipped --
unless `NVPAIR_REQUIRE_PG=1` (CI sets it), which turns a missing Postgres into a failure.
`initdb` refuses to run as root, so as root the server runs as `nobody` in a directory it
owns. Each test gets a fresh database.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest


def _binaries() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(candidates[0]).parent if candidates else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A DSN for a server the tests may create databases on."""
    given = os.environ.get("NVPAIR_TEST_PG_DSN")
    if given:
        yield given
        return
    bindir = _binaries()
    if bindir is None:
        message = "no PostgreSQL server binaries (initdb) installed"
        if os.environ.get("NVPAIR_REQUIRE_PG") == "1":
            pytest.fail(message + " and NVPAIR_REQUIRE_PG=1")
        pytest.skip(message + "; set NVPAIR_TEST_PG_DSN or install postgresql")
    root = Path(tempfile.mkdtemp(prefix="nvpair-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, port = root / "data", _free_port()

    def run(*args: str) -> None:
        subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)

    run(
        str(bindir / "initdb"),
        "-D",
        str(data),
        "-A",
        "trust",
        "-U",
        "nvpair",
        "--no-sync",
        "-E",
        "UTF8",
    )
    options = f"-h 127.0.0.1 -p {port} -k {root} -F -c max_connections=100"
    run(
        str(bindir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(root / "log"),
        "-w",
        "start",
    )
    try:
        yield f"postgresql://nvpair@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def pg_dsn(pg_server: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    yield pg_server.rsplit("/", 1)[0] + "/" + name
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())
