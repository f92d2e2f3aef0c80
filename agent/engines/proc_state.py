"""A replica's engine process as a state machine, what observers see of it, its errors, and
the supervisor's own record of it (`ReplicaRun`).

    starting -> ready        the readiness path answered 200 from the engine's own socket
    starting -> failed       never ready within the timeout, exited before it was ever
                             ready, could not be started (no such program), or its port was
                             taken and no other was free
    ready    -> starting     it exited and is being restarted (after a backoff)
    starting -> starting     a restart that exited again before ready (still backing off),
                             or another process holds its port: moved to another free one
    ready    -> failed       a crash loop: five exits within a minute
    any      -> stopping     `stop()`: SIGTERM to its process group, SIGKILL after the grace

A `failed` replica is not restarted; stopping it clears it, and the caller may start it again.
A replica that has stopped is gone: it is no longer listed.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Final

from agent.engines.proc_files import ReplicaFiles
from agent.engines.proc_os import ProcessId
from agent.engines.templates import LaunchSpec, LaunchTemplate
from broker.restarts import RestartPolicy

__all__ = [
    "EngineProcError",
    "IllegalTransition",
    "NoFreePort",
    "ReplicaRun",
    "ReplicaState",
    "ReplicaStatus",
    "TooManyReplicas",
    "UnknownTemplate",
    "check_transition",
]


class ReplicaState(enum.Enum):
    """Where a replica's engine is in its life."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


_S = ReplicaState
TRANSITIONS: Final[dict[ReplicaState, frozenset[ReplicaState]]] = {
    _S.STARTING: frozenset({_S.STARTING, _S.READY, _S.FAILED, _S.STOPPING}),
    _S.READY: frozenset({_S.STARTING, _S.FAILED, _S.STOPPING}),
    _S.FAILED: frozenset({_S.STOPPING}),
    _S.STOPPING: frozenset(),
}


class EngineProcError(Exception):
    """Base of the supervisor's errors: the caller asked for something it cannot do."""


class IllegalTransition(EngineProcError):
    """A bug in the supervisor: a state change the table does not allow."""


class TooManyReplicas(EngineProcError):
    """The node already runs its maximum number of replicas."""


class NoFreePort(EngineProcError):
    """Every port of `[engines] port_range` is taken (by replicas or by other programs)."""


class UnknownTemplate(EngineProcError):
    """The spec names a template kind this agent does not have."""


def check_transition(old: ReplicaState, new: ReplicaState) -> None:
    """Raise `IllegalTransition` unless `old -> new` is in the table."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old.value} -> {new.value}")


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What `nvpair replicas` shows of one replica on this node."""

    replica_id: str
    kind: str
    served: str
    state: ReplicaState
    port: int
    pid: int | None  # None while it is between a crash and its restart, or failed
    restarts: int
    adopted: bool  # found running at agent start (left by a previous agent)
    last_error: str | None = None
    not_ready: str | None = None  # starting: its port was taken, it serves another model
    log_tail: tuple[str, ...] = ()  # the log's last lines when it failed

    @property
    def reason(self) -> str:
        """What its node record's `error` says, in our own words (the log's lines stay on
        this node): why it failed, or why a starting one is not ready yet, when known."""
        if self.state is ReplicaState.FAILED:
            return (self.last_error or "failed")[:256]
        return (self.not_ready or "")[:256] if self.state is ReplicaState.STARTING else ""

    @property
    def url(self) -> str:
        """The engine's base URL (it listens on loopback only)."""
        return f"http://127.0.0.1:{self.port}"


@dataclass(eq=False)
class ReplicaRun:
    """One replica as its supervisor holds it (mutable, the supervisor's alone); `status()`
    is what observers see of it."""

    spec: LaunchSpec  # its port filled in (moved when another process took it)
    template: LaunchTemplate
    files: ReplicaFiles
    policy: RestartPolicy
    adopted: bool = False
    state: ReplicaState = ReplicaState.STARTING
    process: ProcessId | None = None
    restarts: int = 0
    last_error: str | None = None
    not_ready: str | None = None  # starting: why it is not ready yet, when it knows
    moves: int = 0  # to another port since it was last ready
    log_tail: tuple[str, ...] = ()
    task: asyncio.Task[None] | None = None
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> ReplicaStatus:
        """A snapshot for observers."""
        return ReplicaStatus(
            replica_id=self.spec.replica_id,
            kind=self.spec.kind,
            served=self.spec.served,
            state=self.state,
            port=self.spec.port,
            pid=None if self.process is None else self.process.pid,
            restarts=self.restarts,
            adopted=self.adopted,
            last_error=self.last_error,
            not_ready=self.not_ready,
            log_tail=self.log_tail,
        )
