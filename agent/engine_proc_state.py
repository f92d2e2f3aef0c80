"""A replica's engine process as a state machine, what observers see of it, and its errors.

    starting -> ready        the readiness path answered 200
    starting -> failed       never ready within the timeout, exited before it was ever
                             ready, or could not be started (no such program)
    ready    -> starting     it exited and is being restarted (after a backoff)
    starting -> starting     a restart that exited again before ready (still backing off)
    ready    -> failed       a crash loop: five exits within a minute
    any      -> stopping     `stop()`: SIGTERM to its process group, SIGKILL after the grace

A `failed` replica is not restarted; stopping it clears it, and the caller may start it again.
A replica that has stopped is gone: it is no longer listed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = [
    "EngineProcError",
    "IllegalTransition",
    "NoFreePort",
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
    log_tail: tuple[str, ...] = ()  # the log's last lines when it failed

    @property
    def url(self) -> str:
        """The engine's base URL (it listens on loopback only)."""
        return f"http://127.0.0.1:{self.port}"
