"""Ports handed to a process that binds them later: free now, and not the kernel's to give.

A port the kernel hands out (for port 0, or to an outgoing connection) lies in its
ephemeral range, 32768 up on Linux; one probed free there can go to any outgoing connection
before the process it was picked for binds it. The callers pick below that range
(`nvpair demo`, the throw-away PostgreSQL of the tests and benches, the test harness).
"""

from __future__ import annotations

import socket

__all__ = ["bindable"]


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing is bound to `port` on `host` now (a probe binds it and lets it go)."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
