"""A throw-away PostgreSQL started from the installed server binaries, for tests and benches.

`initdb` refuses to run as root, so as root the server runs as `nobody` in a directory it
owns. fsync is off: this server holds nothing worth keeping.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "server_binaries", "throwaway_postgres"]


def server_binaries() -> Path | None:
    """The directory holding `initdb` and `pg_ctl`, or None."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(candidates[0]).parent if candidates else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def throwaway_postgres(bindir: Path, port: int | None = None) -> Iterator[str]:
    """Start a server on 127.0.0.1 (on `port`, else a free one); yields an admin DSN;
    removes everything at exit."""
    root = Path(tempfile.mkdtemp(prefix="nvpair-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, port = root / "data", port or free_port()

    def run(*args: str) -> None:
        subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "nvpair", "--no-sync")
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
        yield f"postgresql://nvpair@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)
