"""Everything an agent does with the plane it is enrolled in, built in one place: the sync up
(`PlaneSync`, with the reporters that add replicas, events, components, cache residency and
operation phases to each batch) and the fetch down of the cluster's desired state
(deployments, endpoint routes, operations, the warm set).

`plane_link()` returns None when the node is not enrolled (`[plane]` unset).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.jobs import JobsStore, JobsWriter
from broker.records import NodeRecord
from certs import Identity
from plane.desired import DesiredState

from .config import PlaneSettings
from .deployments import Deployments
from .endpoint_routes import persisted_desired
from .facade import Facade
from .members import Members
from .operations import Operations
from .plane_reports import Reporter
from .plane_sync import PlaneSync
from .replicas import ReplicaControl
from .usage_store import UsageStore

__all__ = ["PlaneLink", "plane_link"]


@dataclass(frozen=True)
class PlaneParts:
    """The agent's parts the plane link drives: the cluster's deployment machinery, its
    operations, the facade (endpoint routes), the members and the replica controller."""

    deployments: Deployments
    operations: Operations
    facade: Facade
    members: Members
    control: ReplicaControl


@dataclass
class PlaneLink:
    """The agent's plane parts; `loops` are the background tasks to spawn, by name."""

    sync: PlaneSync
    loops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=dict)
    # Each fetched (or, at start, persisted) desired state is handed to these in order:
    # the deployments' converger, the facade's endpoint routes, the operations.
    on_desired: list[Callable[[DesiredState], Awaitable[None]]] = field(default_factory=list)

    def counters(self) -> tuple[int, int]:
        """(failures in a row, jobs synced) for `nvpair status`."""
        return self.sync.failures, self.sync.synced


def plane_link(
    settings: PlaneSettings | None,
    *,
    home: Path,
    identity: Identity,
    store: JobsStore,
    writer: JobsWriter,
    record: Callable[[], NodeRecord],
    usage: UsageStore | None,
    parts: PlaneParts,
) -> PlaneLink | None:
    """The plane parts of an enrolled node, or None."""
    if settings is None:
        return None
    reporters: list[Reporter] = []
    sync = PlaneSync(
        settings,
        identity=identity,  # signs every batch: the plane takes it as this node's
        store=store,
        writer=writer,
        record=record,
        usage=usage,
        reporters=reporters,
    )
    link = PlaneLink(sync)
    link.loops["plane-sync"] = sync.run
    link.on_desired.append(parts.facade.endpoints.update)  # endpoint routes (agent.endpoint_routes)
    # Until the channel (agent/plane_down.py) lands: the state it keeps, fed once at start.
    link.loops["plane-desired-file"] = lambda: persisted_desired(home, link.on_desired)
    return link
