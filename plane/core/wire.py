"""What crosses the wire to and from the plane's HTTP API, without psycopg.

The agent builds `SyncBatch`es and the plane decodes them; both import this module, so a node
that syncs into a plane never loads a database driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct

from facts.inventory import Device, TopologyDomain
from plane.desired.state import (
    MAX_EVENTS,
    CacheReport,
    ComponentReport,
    EventReport,
    OperationReport,
    ReplicaReport,
)
from workload_manager.workload import Workload

__all__ = [
    "JOB_STATES",
    "MAX_CLUSTER_NAME",
    "EnrolRequest",
    "JobUsage",
    "JobsCursor",
    "NodeSummary",
    "SyncBatch",
    "decode_cursor",
    "encode_cursor",
]

MAX_CLUSTER_NAME: Final = 128  # the `clusters.name` CHECK in migration 0001
JOB_STATES: Final = ("queued", "running", "completed", "failed", "cancelled")

# Text that PostgreSQL stores: no NUL anywhere in it (a NUL is refused as data).
_Text = Annotated[str, Meta(pattern=r"^[^\x00]*$")]
_NodeId = Annotated[str, Meta(pattern=r"^nod_[0-9a-hjkmnp-tv-z]{26}$")]


class NodeSummary(Struct, kw_only=True, frozen=True):
    """The node's own row."""

    name: Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00]*$")]
    version: Annotated[str, Meta(max_length=64, pattern=r"^[^\x00]*$")]
    cordoned: bool = False


_Count = Annotated[int, Meta(ge=0, le=2**53 - 1)] | None
_Key = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00]*$")]


class JobUsage(Struct, kw_only=True, frozen=True):
    """One finished job's usage (`SyncBatch.usage`), sent with the job's record: tokens the
    engine reported and times in ms; counts only, never text. None: not known."""

    runId: _Key
    id: _Key
    promptTokens: _Count = None
    completionTokens: _Count = None
    ttftMs: _Count = None  # streamed answers only
    totalMs: _Count = None


class SyncBatch(Struct, kw_only=True, frozen=True):
    """What one node pushes (`POST /v1/sync`): its own observed objects at one generation."""

    nodeId: _NodeId
    generation: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    node: NodeSummary | None = None
    devices: Annotated[list[Device], Meta(max_length=1024)] = []
    domains: Annotated[list[TopologyDomain], Meta(max_length=1024)] = []
    jobs: Annotated[list[Workload], Meta(max_length=50_000)] = []
    # Optional: an agent without usage sends none, and a plane that predates it ignores it.
    usage: Annotated[list[JobUsage], Meta(max_length=50_000)] = []
    # Issue 16, all optional the same way (`plane.desired.state`): what this node runs and saw.
    # `replicas` and `components` are the node's whole current set (a replica missing from
    # them is gone); `events` and `operations` are what changed since the last batch.
    facadeUrl: Annotated[str, Meta(max_length=512, pattern=r"^[^\x00]*$")] = ""
    replicas: Annotated[list[ReplicaReport], Meta(max_length=64)] | None = None
    components: Annotated[list[ComponentReport], Meta(max_length=256)] | None = None
    events: Annotated[list[EventReport], Meta(max_length=MAX_EVENTS)] = []
    cache: Annotated[list[CacheReport], Meta(max_length=4096)] | None = None
    operations: Annotated[list[OperationReport], Meta(max_length=1024)] = []


class EnrolRequest(Struct, kw_only=True, frozen=True):
    """`POST /v1/clusters`: the name of the cluster to enrol, and optionally the PEM of its
    CA, bound up front instead of on the cluster's first signed sync."""

    name: Annotated[str, Meta(min_length=1, max_length=MAX_CLUSTER_NAME, pattern=r"^[^\x00]*$")]
    ca: Annotated[str, Meta(max_length=16_384)] | None = None


# The keyset cursor of `GET /v1/jobs`: (createdAt, clusterId, originatedFrom, runId, id) of
# the last job of the previous page, in the page's sort order.
JobsCursor = tuple[Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)], _Text, _Text, _Text, _Text]
_cursor_decoder: Final = msgspec.json.Decoder(JobsCursor)


def encode_cursor(cursor: Sequence[Any]) -> str:
    """The `next` value a page carries; the client passes it back as `after`."""
    return msgspec.json.encode(cursor).decode()


def decode_cursor(text: str) -> JobsCursor:
    """The cursor in an `after` parameter; `msgspec.ValidationError` or `DecodeError` when it
    is not one a page gave."""
    return _cursor_decoder.decode(text)


def without_nul(batch: SyncBatch) -> SyncBatch:
    """`batch` with every NUL in its strings replaced by U+FFFD. JSON and the agents' stores
    carry a NUL; PostgreSQL's text cannot, and refusing the batch would stop that node's
    sync for good (its outbox resends the same job forever). The plane is a view: it keeps
    the job, marked where the NUL was."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("\x00", "\ufffd")
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        return value

    return msgspec.convert(clean(msgspec.to_builtins(batch)), SyncBatch)
