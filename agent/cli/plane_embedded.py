"""`nvpair plane serve` without `--dsn`, and `nvpair plane psql`: the plane's own PostgreSQL
in `$NVPAIR_HOME/plane` (`plane/db/embedded.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from plane.db.embedded import EmbeddedError, EmbeddedPostgres, bin_dir, running_dsn

__all__ = ["embedded_database", "psql"]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through stop(): SIGTERM while starting stops it too


def embedded_database(
    stack: contextlib.ExitStack, home: Path, say: Callable[[str], None]
) -> str | None:
    """Start the embedded server (stopped when `stack` closes); its DSN, or None once `say`
    has told why it cannot start."""
    signal.signal(signal.SIGTERM, _interrupt)
    server = EmbeddedPostgres(home / "plane")
    try:
        dsn = server.start()
    except EmbeddedError as exc:
        say(f"nvpair: {exc}")
        return None
    stack.callback(server.stop)
    say(f"plane database: embedded PostgreSQL in {server.data} (nvpair plane psql opens it)")
    return dsn


def psql(home: Path, args: list[str], say: Callable[[str], None]) -> int:
    """The wheel's psql on the embedded `plane` database: the running server's, else one
    started for the session."""
    root = home / "plane"
    try:
        program = str(bin_dir() / "psql")
    except EmbeddedError as exc:
        say(f"nvpair: {exc}")
        return 1
    if not (root / "data" / "PG_VERSION").exists():
        say(f"nvpair: no embedded plane database in {root} yet (`nvpair plane serve` makes it)")
        return 1
    if args[:1] == ["--"]:
        args = args[1:]
    dsn = running_dsn(root)
    if dsn is not None:
        os.execv(program, [program, "-d", dsn, *args])
    try:
        with EmbeddedPostgres(root) as started:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # psql's Ctrl-C is psql's
            try:
                return subprocess.call([program, "-d", started, *args])
            finally:
                signal.signal(signal.SIGINT, previous)
    except EmbeddedError as exc:
        say(f"nvpair: {exc}")
        return 1
