"""Cordon, uncordon and drain as operations with a lifecycle (the Wingsmith Operation).

An operation has a target node, a requester, a reason, a phase and a result. Phases move
along a table; anything else is a bug and raises `IllegalTransition`:

    pending -> running -> succeeded
                       -> failed
    pending -> failed

`drain` cordons the target (no new placements), then waits for the jobs running there to
finish; past its timeout it fails, saying what it still waits for -- or, with `force`,
cancels what is left and succeeds. The phase diagram in docs/operations.md comes from
`TRANSITIONS`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Final

from ulid import ULID

__all__ = ["TRANSITIONS", "IllegalTransition", "Operation", "Phase"]


class Phase(enum.Enum):
    """Where an operation is."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


TRANSITIONS: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.PENDING: frozenset({Phase.RUNNING, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.SUCCEEDED, Phase.FAILED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A phase change the table does not allow (our bug, not the caller's)."""


@dataclass
class Operation:
    """One cordon, uncordon or drain."""

    kind: str  # "cordon", "uncordon" or "drain"
    target: str  # node id
    requester: str
    reason: str = ""
    timeout_s: float | None = None
    force: bool = False
    id: str = field(default_factory=lambda: "opr_" + str(ULID()).lower())
    phase: Phase = Phase.PENDING
    result: str | None = None
    waiting_for: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def move(self, phase: Phase, result: str | None = None) -> None:
        """Change phase along the table."""
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.id}: {self.phase.value} -> {phase.value}")
        self.phase = phase
        if result is not None:
            self.result = result
        if phase in (Phase.SUCCEEDED, Phase.FAILED):
            self.waiting_for = None
        self.updated_at = time.time()

    def view(self) -> dict[str, object]:
        """For the local API and `nvpair ops`."""
        return {
            "id": self.id,
            "kind": self.kind,
            "target": self.target,
            "requester": self.requester,
            "reason": self.reason,
            "phase": self.phase.value,
            "result": self.result,
            "waitingFor": self.waiting_for,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
        }
