"""The agent's typed errors: each says whose fault it is and maps to one exit status or
HTTP status where it crosses a boundary."""

from __future__ import annotations

__all__ = [
    "AgentError",
    "AgentLocked",
    "HomeUnusable",
    "MemberRefused",
    "MemberUnreachable",
    "PortInUse",
    "StartupError",
]


class AgentError(Exception):
    """Base of the agent's errors."""


class StartupError(AgentError):
    """The agent cannot start here as configured; the message is the one line to print."""


class PortInUse(StartupError):
    """A port the agent must bind is taken (another agent, or another program)."""

    def __init__(self, port: int, what: str, flag: str) -> None:
        super().__init__(
            f"port {port} ({what}) is already in use; another agent may be running, "
            f"or choose another port with {flag}"
        )
        self.port = port
        self.flag = flag


class AgentLocked(StartupError):
    """Another agent holds this `NVPAIR_HOME`."""

    def __init__(self, home: str, pid: int | None) -> None:
        who = f"another agent (pid {pid})" if pid else "another agent"
        super().__init__(f"{who} is running with NVPAIR_HOME={home}")
        self.pid = pid


class HomeUnusable(StartupError):
    """`NVPAIR_HOME` cannot be created, written or locked."""

    def __init__(self, home: str, reason: str) -> None:
        super().__init__(f"NVPAIR_HOME={home} cannot be used: {reason}")


class MemberUnreachable(AgentError):
    """A member did not answer (connection, TLS or timeout): the network's or its fault."""


class MemberRefused(AgentError):
    """A member answered with an error status: it refused what we asked."""

    def __init__(self, node_id: str, status: int, why: str = "") -> None:
        super().__init__(f"{node_id} answered {status}" + (f": {why}" if why else ""))
        self.status = status
        self.why = why  # what the member said, when it says (409: releases too far apart)
