"""A job's lifecycle as a table: the events that move a job, the state each leads to, and the
record and wire method each change announces (h11's `_state.py` is the model).

A job's state is its record's `state`, seed 002's `WorkloadState`: a job is born `queued`
(announced with `SUBMITTED`), and the facade (`agent.serving.facade`) moves it with one event per
change -- `Start` when it is placed, `Failover` when its first target failed before any byte
reached the client and a second one takes it, and one ending: `Complete`, `Fail` with a
phrase of the closed vocabulary (`agent.serving.job_errors`), or `Cancel` when the client hung up or
a forced drain cancelled it, waiting or running. `TRANSITIONS` says which event may move a
job in which state; any other is our bug and raises `IllegalTransition`. The three final
states have no way out. The table in docs/inference.md is this one (a test compares them).

`step` applies an event to a record: the new record, with the `seq` it is given (the
facade's event counter, seed 002's dedup key), and the method that carries its new state
(`workload_manager.workload.METHOD_FOR_STATE`, the seed's table), so no method is typed by
hand. Time is passed in. Pure: no I/O, no clock, no asyncio (aiohttp is loaded only because
`agent.serving.job_errors`, whose vocabulary `Fail` carries, reads aiohttp's exceptions).
"""

from __future__ import annotations

from typing import Final, NamedTuple, TypeAlias

import msgspec
from msgspec import Struct

from agent.serving.job_errors import JobError
from workload_manager.workload import METHOD_FOR_STATE, Workload, WorkloadState

__all__ = [
    "EVENTS",
    "SUBMITTED",
    "TRANSITIONS",
    "Cancel",
    "Complete",
    "Ending",
    "Fail",
    "Failover",
    "IllegalTransition",
    "JobEvent",
    "Outcome",
    "Start",
    "Step",
    "next_state",
    "step",
]


class Start(Struct, kw_only=True, frozen=True):
    """Placed: the job runs on `scheduled_on`'s `engine` kind, from now."""

    scheduled_on: str
    engine: str


class Failover(Struct, kw_only=True, frozen=True):
    """Its target failed before any byte reached the client; `scheduled_on` takes it. The
    engine and `startedAt` stay the first start's."""

    scheduled_on: str


class Complete(Struct, kw_only=True, frozen=True):
    """The answer reached the client whole."""


class Fail(Struct, kw_only=True, frozen=True):
    """It did not complete, for `error` (never an engine's words: `agent.serving.job_errors`)."""

    error: JobError


class Cancel(Struct, kw_only=True, frozen=True):
    """The client hung up, or a forced drain (or the facade closing) cancelled it."""


JobEvent: TypeAlias = Start | Failover | Complete | Fail | Cancel
Outcome: TypeAlias = Complete | Fail  # what running a job came to (`agent.serving.relay`)
Ending: TypeAlias = Complete | Fail | Cancel  # the event that makes a job final
EVENTS: Final[tuple[type[JobEvent], ...]] = (Start, Failover, Complete, Fail, Cancel)

_Q, _R = WorkloadState.QUEUED, WorkloadState.RUNNING
# state -> {event -> next state}; a pair not listed is illegal. The final states are listed
# with nothing: no event leaves them.
TRANSITIONS: Final[dict[WorkloadState, dict[type[JobEvent], WorkloadState]]] = {
    _Q: {
        Start: _R,
        Fail: WorkloadState.FAILED,  # waited too long, its model went, or our bug
        Cancel: WorkloadState.CANCELLED,  # the client hung up while it waited
    },
    _R: {
        Failover: _R,  # the second target: a new `workload:started`
        Complete: WorkloadState.COMPLETED,
        Fail: WorkloadState.FAILED,
        Cancel: WorkloadState.CANCELLED,
    },
    WorkloadState.COMPLETED: {},
    WorkloadState.FAILED: {},
    WorkloadState.CANCELLED: {},
}

SUBMITTED: Final = METHOD_FOR_STATE[_Q]  # the method announcing a new job


class IllegalTransition(Exception):
    """An event the table does not allow in the job's state: our bug, never a client's."""

    def __init__(self, state: WorkloadState, event: type[JobEvent]) -> None:
        super().__init__(f"a {state.value} job cannot take {event.__name__}")
        self.state = state
        self.event = event


class Step(NamedTuple):
    """A change of a job: its new record and the method that announces it."""

    record: Workload
    method: str


def next_state(state: WorkloadState, event: type[JobEvent]) -> WorkloadState:
    """The state `event` moves a job in `state` to; `IllegalTransition` when none."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(state, event) from None


def step(record: Workload, event: JobEvent, *, seq: int, now: int) -> Step:
    """`record` after `event`, numbered `seq`, at `now` (epoch ms), and the method that
    announces it. Only the fields the event changes change; the rest are kept, so a record
    keeps its `scheduledOn`, `engine` and `startedAt` to the end."""
    state = next_state(record.state, type(event))
    replace = msgspec.structs.replace
    if isinstance(event, Start):
        new = replace(
            record,
            state=state,
            scheduledOn=event.scheduled_on,
            engine=event.engine,
            startedAt=now,
            seq=seq,
        )
    elif isinstance(event, Failover):
        new = replace(record, state=state, scheduledOn=event.scheduled_on, seq=seq)
    else:  # an ending: `error` is a phrase of the closed vocabulary, or null
        new = replace(record, state=state, completedAt=now, error=_error_of(event), seq=seq)
    return Step(new, METHOD_FOR_STATE[state])


def _error_of(ending: Ending) -> str | None:
    if isinstance(ending, Fail):
        return ending.error.value
    if isinstance(ending, Cancel):
        return JobError.CANCELLED.value
    return None
