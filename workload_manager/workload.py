"""The workload record of seed 002 and the events that carry it.

`Workload` has exactly the seed's thirteen fields under their JSON names. Absent and null
are kept apart (`scheduledOn` is absent until a target is chosen; the nullable fields may be
null), so a record re-encodes to the JSON it was decoded from. Unknown fields -- a `prompt`,
`messages`, a response body -- are dropped on decode: prompts never enter this contract.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

__all__ = [
    "LIFECYCLE_METHODS",
    "MAX_SEQ",
    "METHOD_FOR_STATE",
    "REMOVE_METHOD",
    "LifecycleParams",
    "Workload",
    "WorkloadRemoval",
    "WorkloadState",
    "decode_workload",
    "encode_workload",
    "lifecycle_mismatch",
]

# Bounds keep one record small whatever a peer sends; the numbers are generous for real use
# (a model name, a ULID, a node id) and tight enough that 10,000 live records stay a few MB.
_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_Text = Annotated[str, Meta(max_length=4096)]
# Integers stay within int64: the Jobs store (SQLite INTEGER) and the plane (bigint) hold no
# more, and a larger one taken here would fail every write of the batch it is in.
_INT64_MAX: Final = 2**63 - 1
_EpochMs = Annotated[int, Meta(ge=0, le=_INT64_MAX)]
# A seq past this is refused. Not 2**31: `seq` counts a facade's events over its whole run
# (3 a job), and one taking 1,000 events/s passes 2**31 in 25 days. 2**53 - 1 is the largest
# integer every JSON reader holds exactly (a JavaScript Number: the web page, many clients),
# so past it two seqs may compare equal; an honest facade at 10,000 events/s takes ~28,000
# years to reach it. It does not stop a member forging a third node's job with a huge seq
# (only the origin signing its events would); a node's own jobs are guarded by the relay,
# which drops any peer's event claiming to originate here (relay.py).
MAX_SEQ: Final = 2**53 - 1
_Seq = Annotated[int, Meta(ge=1, le=MAX_SEQ)]


class WorkloadState(enum.Enum):
    """A workload's state, as seed 002 lists them."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    # Members are singletons compared by identity, so identity's hash agrees with equality;
    # Enum's own hashes the name in Python, and a state is hashed on every event (`in
    # _TERMINAL`, a method by state).
    __hash__ = object.__hash__

    @property
    def is_terminal(self) -> bool:
        """Whether no further lifecycle event is expected after this state."""
        return self in _TERMINAL


_TERMINAL: Final = frozenset(
    {WorkloadState.COMPLETED, WorkloadState.FAILED, WorkloadState.CANCELLED}
)


class Workload(Struct, kw_only=True, frozen=True, gc=False):
    """One inference request's lifecycle record (seed 002 "Workload shape")."""

    id: _Name
    model: _Name
    engine: _Name
    runId: _Name
    state: WorkloadState
    originatedFrom: _Name
    # Absent until a target is chosen; never null (the seed's pointer with omitempty).
    scheduledOn: _Name | UnsetType = UNSET
    createdAt: _EpochMs
    # Nullable fields keep "absent" and "null" apart so a peer's payload round-trips.
    startedAt: _EpochMs | UnsetType | None = UNSET
    completedAt: _EpochMs | UnsetType | None = UNSET
    error: _Text | UnsetType | None = UNSET
    requesterId: _Name | UnsetType | None = UNSET
    seq: _Seq

    @property
    def key(self) -> tuple[str, str]:
        """The workload's identity for dedup: `(runId, id)` (seed 002)."""
        return (self.runId, self.id)


class LifecycleParams(Struct, kw_only=True, frozen=True, gc=False):
    """Params of `workload:submitted|started|completed|errored`."""

    workloadInfo: Workload


class WorkloadRemoval(Struct, kw_only=True, frozen=True, gc=False):
    """A removal, `{workloadId, originatedFrom}`: the params of `workloads:remove`, an event
    in the relay and the outboxes, a row of the Jobs store and an entry of a view alike.

    It names no `runId` (seed 002), so it removes every run of the workload from that origin.
    """

    workloadId: _Name
    originatedFrom: _Name

    @property
    def pair(self) -> tuple[str, str]:
        """`(originatedFrom, workloadId)`: what the tombstone is keyed by."""
        return (self.originatedFrom, self.workloadId)


# Seed 002's lifecycle methods and the states each may carry. `workload:errored` also carries
# `cancelled`: the seed lists the state but names no method for it, and a cancelled request
# is a request that did not complete (docs/protocol.md).
LIFECYCLE_METHODS: Final[dict[str, tuple[WorkloadState, ...]]] = {
    "workload:submitted": (WorkloadState.QUEUED,),
    "workload:started": (WorkloadState.RUNNING,),
    "workload:completed": (WorkloadState.COMPLETED,),
    "workload:errored": (WorkloadState.FAILED, WorkloadState.CANCELLED),
}
REMOVE_METHOD: Final = "workloads:remove"

# The method that carries each state, for re-sending a record to peers.
METHOD_FOR_STATE: Final[dict[WorkloadState, str]] = {
    state: method for method, states in LIFECYCLE_METHODS.items() for state in states
}


def lifecycle_mismatch(method: str, workload: Workload) -> str | None:
    """Why `method` cannot carry this record, or `None` when it can."""
    allowed = LIFECYCLE_METHODS.get(method)
    if allowed is None:
        return f"{method!r} is not a lifecycle method"
    if workload.state in allowed:
        return None
    states = " or ".join(sorted(state.value for state in allowed))
    return f"{method} carries state {states}, not {workload.state.value}"


_workload_decoder: Final = msgspec.json.Decoder(Workload)
_encoder: Final = msgspec.json.Encoder()


def decode_workload(data: bytes | str) -> Workload:
    """Decode one JSON workload record; raises `msgspec.ValidationError` on bad values."""
    return _workload_decoder.decode(data)


def encode_workload(workload: Workload) -> bytes:
    """Encode a workload record as compact JSON (unknown fields are already gone)."""
    return _encoder.encode(workload)
