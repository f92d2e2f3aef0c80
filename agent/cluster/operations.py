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

`drain_step()` is the drain's decision, pure (active jobs and time in, a `Step` out);
`Operations` starts operations and drives that step in one loop per operation.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from agent.core.errors import AgentError, MemberRefused, MemberUnreachable
from certs.ids import prefixed_ulid

__all__ = [
    "KINDS",
    "TRANSITIONS",
    "IllegalTransition",
    "Operation",
    "OperationRefused",
    "Operations",
    "Phase",
    "Step",
    "drain_step",
]

log = logging.getLogger(__name__)

KINDS: Final = ("cordon", "uncordon", "drain")
MAX_OPERATIONS: Final = 200  # operations kept for `nvpair ops`
POLL_S: Final = 0.25  # a drain looks at the jobs on its target this often


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


class IllegalTransition(AgentError):
    """A phase change the table does not allow (our bug, not the caller's)."""


class OperationRefused(AgentError):
    """An operation that cannot start: unknown kind or target (the caller's fault)."""


@dataclass
class Operation:
    """One cordon, uncordon or drain."""

    kind: str  # "cordon", "uncordon" or "drain"
    target: str  # node id
    requester: str
    reason: str = ""
    timeout_s: float | None = None
    force: bool = False
    id: str = field(default_factory=lambda: prefixed_ulid("opr"))
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


class Step(enum.Enum):
    """What a drain does next."""

    WAIT = "wait"  # jobs still run there; look again later
    CANCEL = "cancel"  # past the timeout with --force: cancel what is left, then wait
    DONE = "done"  # nothing runs there any more
    FAIL = "fail"  # past the timeout without --force


def drain_step(
    *, active: int, now: float, deadline: float | None, force: bool, cancelled: bool
) -> Step:
    """The drain's next step: done when nothing is active, else wait until the deadline,
    then fail -- or, forced, cancel once and wait for the cancelled jobs to end."""
    if active == 0:
        return Step.DONE
    if deadline is None or now <= deadline or cancelled:
        return Step.WAIT
    return Step.CANCEL if force else Step.FAIL


class Operations:
    """Starts operations and runs each in one loop; keeps the last `MAX_OPERATIONS`."""

    def __init__(
        self,
        *,
        self_id: str,
        requester: str,
        is_known: Callable[[str], bool],
        cordon_here: Callable[[bool], None],
        cordon_member: Callable[[str, bool], Awaitable[None]],
        active_on: Callable[[str], Awaitable[list[str]]],
        cancel_here: Callable[[str], object],
        cancel_member: Callable[[str, str], Awaitable[None]],
        peers: Callable[[], list[str]],
        spawn: Callable[[str, Coroutine[Any, Any, None]], object],
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        self._self_id = self_id
        self._requester = requester
        self._is_known = is_known
        self._cordon_here = cordon_here
        self._cordon_member = cordon_member
        self._active_on = active_on
        self._cancel_here = cancel_here
        self._cancel_member = cancel_member
        self._peers = peers
        self._spawn = spawn
        self._clock = clock
        self._poll_s = poll_s
        self._operations: dict[str, Operation] = {}

    def views(self) -> list[dict[str, object]]:
        """Every kept operation, newest first."""
        return [op.view() for op in reversed(self._operations.values())]

    def get(self, op_id: str) -> Operation | None:
        """A kept operation by id."""
        return self._operations.get(op_id)

    def start(
        self,
        kind: str,
        target: str,
        *,
        reason: str,
        timeout_s: float | None,
        force: bool,
        requester: str | None = None,
        op_id: str | None = None,
    ) -> Operation:
        """Begin a cordon, uncordon or drain; it runs in the background. A plane operation
        keeps the plane's id and names its requester (`agent.plane_link.ops`)."""
        if kind not in KINDS:
            raise OperationRefused("an operation is cordon, uncordon or drain")
        if target != self._self_id and not self._is_known(target):
            raise OperationRefused(f"{target} is not a member this node knows")
        if timeout_s is not None and not 0 <= timeout_s <= 7 * 86_400:
            raise OperationRefused("timeoutS is between 0 and a week")
        operation = Operation(
            kind, target, requester or self._requester, reason[:500], timeout_s, force
        )
        if op_id is not None:
            operation.id = op_id
        self._operations[operation.id] = operation
        while len(self._operations) > MAX_OPERATIONS:
            del self._operations[next(iter(self._operations))]
        self._spawn("operations", self._run(operation))
        return operation

    async def _cordon(self, target: str, cordoned: bool) -> None:
        if target == self._self_id:
            self._cordon_here(cordoned)
        else:
            await self._cordon_member(target, cordoned)

    async def _cancel_everywhere(self, target: str) -> None:
        # Every member's facade cancels what it placed on the target; one that cannot be
        # reached has its jobs there end with the target's own engines.
        self._cancel_here(target)
        for node_id in self._peers():
            try:
                await self._cancel_member(node_id, target)
            except (MemberUnreachable, MemberRefused) as exc:
                log.info("could not ask %s to cancel its jobs on %s: %s", node_id, target, exc)

    async def _run(self, op: Operation) -> None:
        op.move(Phase.RUNNING)
        try:
            await self._cordon(op.target, op.kind != "uncordon")
            if op.kind != "drain":
                op.move(Phase.SUCCEEDED, f"{op.target} {op.kind}ed")
                return
            await self._drain(op)
        except (MemberUnreachable, MemberRefused) as exc:
            log.warning("operation %s failed: %s", op.id, exc)
            op.move(Phase.FAILED, f"{type(exc).__name__}: {exc}")

    async def _drain(self, op: Operation) -> None:
        deadline = None if op.timeout_s is None else self._clock() + op.timeout_s
        cancelled = False
        while True:
            active = await self._active_on(op.target)
            step = drain_step(
                active=len(active),
                now=self._clock(),
                deadline=deadline,
                force=op.force,
                cancelled=cancelled,
            )
            if step is Step.DONE:
                done = f"drained after {op.result}" if cancelled else "drained: no job runs there"
                op.move(Phase.SUCCEEDED, done)
                return
            op.waiting_for = f"{len(active)} job(s) on {op.target}: {', '.join(active[:10])}"
            if step is Step.FAIL:
                op.move(Phase.FAILED, f"timed out; still waiting for {op.waiting_for}")
                return
            if step is Step.CANCEL:
                await self._cancel_everywhere(op.target)
                cancelled = True
                op.result = f"cancelling {len(active)} job(s) past the timeout"
            await asyncio.sleep(self._poll_s)
