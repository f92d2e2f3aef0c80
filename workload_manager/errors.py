"""The workload manager's errors, by whose fault they are.

Everything the package raises across its boundary is a `WorkloadManagerError`. A peer's or
the broker's bad input never raises at all: it is answered with a JSON-RPC error (`RpcError`
stays inside the codec). What is left are the operator's faults (a port or socket path in
use, a bad setting) and our own (an object used out of order).
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ConfigurationError",
    "IpcPathInUse",
    "PortInUse",
    "UsageError",
    "WorkloadManagerError",
]


class WorkloadManagerError(Exception):
    """Base of every error the workload manager raises to its caller."""


class ConfigurationError(WorkloadManagerError, ValueError):
    """A setting is out of its bounds: the operator's (or the caller's) value, not a peer's."""


class PortInUse(WorkloadManagerError):
    """The inter-node port is taken by another process: the operator's to free or change."""

    def __init__(self, port: int, host: str | None = None) -> None:
        self.port = port
        self.host = host
        where = f"{host}:{port}" if host else f"port {port}"
        super().__init__(
            f"cannot listen on {where}: it is in use (another agent may be running; "
            "--port changes it)"
        )


class IpcPathInUse(WorkloadManagerError):
    """The `--ipc` path is another process's socket, or not a socket at all."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        super().__init__(f"{path} {why}")


class UsageError(WorkloadManagerError, RuntimeError):
    """An object was used out of order (feed after close, ack with nothing in flight): our
    bug, never a peer's."""
