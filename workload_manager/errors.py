"""The workload manager's errors, by whose fault they are.

Everything the package raises across its boundary is a `WorkloadManagerError`. A peer's or
the broker's bad input never raises at all: it is answered with a JSON-RPC error (`RpcError`
stays inside the codec). What is left are the operator's faults (a port or socket path in
use, a bad setting) and our own (an object used out of order).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

__all__ = [
    "CannotListen",
    "ChannelFailed",
    "ConfigurationError",
    "IpcPathInUse",
    "PortInUse",
    "UsageError",
    "WorkloadManagerError",
    "port_in_use_from",
]


class WorkloadManagerError(Exception):
    """Base of every error the workload manager raises to its caller."""


class ConfigurationError(WorkloadManagerError, ValueError):
    """A setting is out of its bounds: the operator's (or the caller's) value, not a peer's."""


class CannotListen(WorkloadManagerError):
    """The inter-node server cannot bind its address (a bad `NVPAIR_WM_BIND`, a port the
    process may not use): the operator's to fix; restarting cannot help."""

    def __init__(self, port: int, host: str | None, why: str) -> None:
        self.port = port
        self.host = host
        where = f" on {host}" if host else ""
        super().__init__(f"cannot listen on port {port}{where}: {why}")


class PortInUse(CannotListen):
    """The inter-node port is taken by another process: the operator's to free or change.

    Its message is the one line `python -m workload_manager` prints before it exits with
    status 2; `port_in_use_from()` reads the port back from that line (the broker does).
    """

    def __init__(self, port: int, host: str | None = None) -> None:
        super().__init__(
            port, host, "it is in use (another agent may be running; --port changes it)"
        )


_PORT_IN_USE: Final = re.compile(r"cannot listen on port (\d+)(?: on \S+)?: it is in use")


def port_in_use_from(line: str) -> int | None:
    """The port named by a `PortInUse` line (as the manager prints it), else None."""
    found = _PORT_IN_USE.search(line)
    return int(found.group(1)) if found else None


class IpcPathInUse(WorkloadManagerError):
    """The `--ipc` path is another process's socket, or not a socket at all."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        super().__init__(f"{path} {why}")


class ChannelFailed(WorkloadManagerError):
    """The local channel broke under us (reading stdin failed): not the broker's doing."""


class UsageError(WorkloadManagerError, RuntimeError):
    """An object was used out of order (feed after close, ack with nothing in flight): our
    bug, never a peer's."""
