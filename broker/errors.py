"""The broker's errors, by whose fault they are.

`BrokerError` is the base of everything the broker raises across its boundary, so the agent
can name the part that failed (`/healthz`) without knowing every cause.
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "InvalidCursor",
    "ManagerPortInUse",
    "ManagerRefused",
    "ManagerStartFailed",
    "ManagerUnavailable",
    "StoreUnavailable",
]


class BrokerError(Exception):
    """Base of every error the broker raises to its caller."""


class StoreUnavailable(BrokerError):
    """The Jobs store cannot be written (locked, read-only, full, failing): nothing handed
    in is lost, it is written once the store takes writes again."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the Jobs store is unavailable: {reason}")


class InvalidCursor(BrokerError):
    """A `workloads:snapshot` cursor that this store never gave out: the caller's fault."""

    def __init__(self, cursor: str) -> None:
        self.cursor = cursor
        super().__init__(f"not a snapshot cursor of this store: {cursor[:80]!r}")


class ManagerUnavailable(BrokerError):
    """The workload manager child is not there to answer (exited, restarting, silent)."""


class ManagerRefused(BrokerError):
    """The workload manager answered a request with a JSON-RPC error."""

    def __init__(self, method: str, code: int, message: str, data: object = None) -> None:
        self.method = method
        self.code = code
        self.message = message
        self.data = data
        detail = f": {data}" if data is not None else ""
        super().__init__(f"the workload manager refused {method}: {code} {message}{detail}")


class ManagerPortInUse(BrokerError):
    """The manager's inter-node port is taken: restarting cannot help, so start() says so."""

    def __init__(self, port: int, line: str = "") -> None:
        self.port = port
        self.line = line
        super().__init__(
            f"the workload manager cannot listen on port {port}: it is in use (another agent "
            "may be running; the manager port setting changes it)"
        )


class ManagerStartFailed(BrokerError):
    """The manager exited before its first `ready` with a status that restarting cannot
    fix (2: a usage or configuration error); `line` is the last thing it said on stderr."""

    def __init__(self, code: int, line: str) -> None:
        self.code = code
        self.line = line
        super().__init__(f"the workload manager exited with status {code}: {line or '(nothing)'}")
