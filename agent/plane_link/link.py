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

import msgspec
from aiohttp import web

from agent.artifacts.weights import StoreWeights
from agent.cluster.deployments import Deployments
from agent.cluster.members import Members
from agent.cluster.operations import Operations
from agent.cluster.scale_events import ScaleEvents
from agent.config import PlaneSettings
from agent.engines.replicas import ReplicaControl
from agent.plane_link.deployments import PlaneConverger
from agent.plane_link.down import PlaneDown
from agent.plane_link.events import machinery_reporters
from agent.plane_link.replica_report import ReplicaReporter
from agent.plane_link.reports import Reporter
from agent.plane_link.sync import PlaneSync
from agent.serving.facade import Facade
from agent.serving.usage_store import UsageStore
from broker.jobs import JobsStore, JobsWriter
from certs import Identity
from facts.records import NodeRecord
from plane.desired.state import DesiredState

__all__ = ["PlaneLink", "plane_link", "plane_routes"]


@dataclass(frozen=True)
class PlaneParts:
    """The agent's parts the plane link drives: the cluster's deployment machinery, its
    operations, the facade (endpoint routes), the members and the replica controller."""

    deployments: Deployments
    operations: Operations
    facade: Facade
    members: Members
    control: ReplicaControl
    weights: StoreWeights | None = None  # this member's artifacts: the warm set, residency
    scale_events: ScaleEvents | None = None  # what elastic deployments did (`Scaler.events`)


@dataclass
class PlaneLink:
    """The agent's plane parts; `loops` are the background tasks to spawn, by name."""

    sync: PlaneSync
    down: PlaneDown | None = None
    converger: PlaneConverger | None = None
    loops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=dict)
    # Each fetched (or, at start, persisted) desired state is handed to these in order:
    # the deployments' converger, the facade's endpoint routes, the operations.
    on_desired: list[Callable[[DesiredState], Awaitable[None]]] = field(default_factory=list)

    def counters(self) -> dict[str, Any]:
        """The sync's failures in a row and jobs synced, and what the fetch down got, for
        `nvpair status` and `/metrics`."""
        out: dict[str, Any] = {"failures": self.sync.failures, "synced": self.sync.synced}
        if self.down is not None:
            out.update(self.down.counters())
        if self.converger is not None:
            out["deploymentConflicts"] = dict(self.converger.conflicts)
            out["deploymentError"] = self.converger.last_error
        return out


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
    node_id = identity.node.node_id
    machinery, handlers = machinery_reporters(
        parts.operations,
        parts.deployments.get,
        home=home,
        node_id=node_id,
        plane_url=settings.url,
        weights=parts.weights,
        scale_events=parts.scale_events,
    )
    reporters: list[Reporter] = [*machinery]  # operations, events, components, cache
    reporters.append(ReplicaReporter(parts.control.observed.drifts))  # replicas, facade URL
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
    link.on_desired.extend(handlers)  # plane operations this node carries out; the warm set
    link.loops["plane-sync"] = sync.run
    link.down = down = PlaneDown(settings, home=home, handlers=link.on_desired)
    link.converger = converger = PlaneConverger(
        parts.deployments,
        placed=down.placed,
        elastic=lambda: parts.members.gate().allows("elastic-deployments"),
    )
    link.on_desired.insert(0, converger)  # the deployments first (docs: the channel)
    link.loops["plane-down"] = down.run
    link.loops["plane-converge"] = lambda: converger.run(lambda: down.state)
    # endpoint routes (agent.serving.endpoint_routes)
    link.on_desired.append(parts.facade.endpoints.update)
    return link


def plane_routes(link: PlaneLink | None) -> list[web.RouteDef]:
    """`GET /v1/plane` on the local API: the link's counters (null when not enrolled) and
    the desired state last fetched (`nvpair status`)."""

    async def show(request: web.Request) -> web.Response:
        body: dict[str, Any] = {"enrolled": link is not None}
        if link is not None:
            body["counters"] = link.counters()
            body["desired"] = None if link.down is None else link.down.state
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    return [web.get("/v1/plane", show)]
