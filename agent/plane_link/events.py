"""What this node tells the plane about its machinery in each sync batch
(docs/plane-operations.md): events, its components and the residency of warm artifacts.

- `EventReports`: facts read off consecutive own records -- `node-joined` (the first start
  that syncs into this plane), `device-degraded` / `device-failed` (a device's health got
  worse), `replica-ready`, `engine-load-failed` (a replica went failed; the message is the
  replica's error, which is our own words, never an engine's body); and what elastic
  deployments did (`scale-up`, `scale-down`, `cold-start` with its seconds;
  `agent.cluster.scale_events`) where this node signed the version -- every member sees
  each change, only its decider tells the plane, so the plane has each once. Kept in a
  bounded ring (the newest win) and each sent until a batch carrying it is accepted.
- `ComponentReports`: the agent's version and each replica's engine version; sent when the
  set changed since the plane last accepted it.
- `CacheReports`: for each artifact of the cluster's warm set, whether this node holds it
  resident, is fetching it (and how far) or lacks it -- from its artifact store, every piece
  verified (issue 28); for an artifact the cluster does not know, one of its locations is
  a local path that exists here, or a ready replica of this node runs a deployment whose
  source is one of them (or its digest).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from agent.artifacts.weights import StoreWeights
from agent.cluster.operations import Operations
from agent.cluster.scale_events import ScaleEvents
from agent.plane_link.ops import PlaneOps
from agent.plane_link.reports import Reporter
from certs import write_atomic
from certs.ids import prefixed_ulid
from facts.deployments import Deployment
from facts.records import NodeRecord
from plane.desired.state import (
    MAX_EVENTS,
    CacheReport,
    ComponentReport,
    DesiredState,
    EventReport,
    WarmArtifact,
)

__all__ = [
    "JOINED_FILE",
    "MAX_PENDING_EVENTS",
    "CacheReports",
    "ComponentReports",
    "EventReports",
    "machinery_reporters",
]

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS: Final = 1024  # events not yet accepted; past it the oldest are dropped
JOINED_FILE: Final = "plane-joined"  # the plane URL this node's node-joined was accepted by
_HEALTH: Final = {"ok": 0, "degraded": 1, "failed": 2}

DeploymentOf = Callable[[str], Deployment | None]


def _event(kind: str, about: str, message: str, at_ms: int) -> EventReport:
    return EventReport(id=prefixed_ulid("evt"), kind=kind, about=about[:256],
                       message=message[:256], at=at_ms)  # fmt: skip


class EventReports:
    """The events reporter: compares each own record with the one before it."""

    def __init__(
        self,
        *,
        home: Path,
        plane_url: str,
        node_id: str,
        clock: Callable[[], float] = time.time,
        scale_events: ScaleEvents | None = None,
    ) -> None:
        self._node_id = node_id
        self._scale_events = scale_events
        self._scale_seen = 0  # the last scale event looked at
        self._joined_file = home / JOINED_FILE
        self._plane_url = plane_url
        self._clock = clock
        self._pending: collections.deque[EventReport] = collections.deque(maxlen=MAX_PENDING_EVENTS)
        self._health: dict[str, str] = {}
        self._states: dict[str, str] = {}
        self._sent: list[EventReport] = []
        self._joined_id: str | None = None
        if self._joined_to() != plane_url:
            joined = _event("node-joined", node_id, "joined the plane", self._ms())
            self._joined_id = joined.id
            self._pending.append(joined)

    def _ms(self) -> int:
        return int(self._clock() * 1000)

    def _joined_to(self) -> str | None:
        try:
            return self._joined_file.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None

    def observe(self, record: NodeRecord) -> None:
        """Add the events `record` shows against the previous one."""
        now = self._ms()
        for device in record.devices:
            before = self._health.get(device.id, "ok")
            self._health[device.id] = device.health
            if _HEALTH.get(device.health, 0) > _HEALTH.get(before, 0):
                kind = "device-failed" if device.health == "failed" else "device-degraded"
                why = f": {device.problem}" if device.problem else ""
                self._pending.append(
                    _event(kind, device.id, f"{device.name} {before} -> {device.health}{why}", now)
                )
        states: dict[str, str] = {}
        for replica in record.replicas:
            states[replica.id] = replica.state
            if replica.state == self._states.get(replica.id):
                continue
            if replica.state == "ready":
                version = f" ({replica.engineVersion})" if replica.engineVersion else ""
                text = f"{replica.deployment} ready{version}"
                self._pending.append(_event("replica-ready", replica.id, text, now))
            elif replica.state == "failed":
                text = f"{replica.deployment}: {replica.error or 'the engine failed to load'}"
                self._pending.append(_event("engine-load-failed", replica.id, text, now))
        self._states = states  # replicas gone are forgotten: the map stays the record's size
        if self._scale_events is not None:
            for event in self._scale_events.since(self._scale_seen):
                self._scale_seen = event.seq
                if event.by == self._node_id:  # its decider's: the plane has each once
                    self._pending.append(
                        _event(event.kind, event.deployment, event.message(), event.at)
                    )

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """The oldest pending events, at most `MAX_EVENTS`."""
        self.observe(record)
        self._sent = list(self._pending)[:MAX_EVENTS]
        return {"events": self._sent} if self._sent else {}

    def sent(self) -> None:
        """Drop the events the plane accepted."""
        accepted = {e.id for e in self._sent}
        self._pending = collections.deque(
            (e for e in self._pending if e.id not in accepted), maxlen=MAX_PENDING_EVENTS
        )
        if self._joined_id in accepted:
            self._joined_id = None
            try:
                write_atomic(self._joined_file, self._plane_url.encode())
            except OSError as exc:
                log.warning("could not write %s: %s", self._joined_file, exc)
        self._sent = []


class _WholeSet:
    """Sends a reporter's whole set when it differs from what the plane last accepted."""

    def __init__(self) -> None:
        self._accepted: list[Any] | None = None
        self._offered: list[Any] | None = None

    def offer(self, field: str, now: list[Any]) -> dict[str, Any]:
        self._offered = now
        return {} if now == self._accepted else {field: now}

    def sent(self) -> None:
        self._accepted, self._offered = self._offered, None


class ComponentReports(_WholeSet):
    """The components reporter: the agent, and each replica's engine with its version."""

    def __init__(self, deployment_of: DeploymentOf) -> None:
        super().__init__()
        self._deployment_of = deployment_of

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """This node's components, when they changed."""
        components = {"agent": record.version}
        for engine in record.engines:
            components.setdefault(f"engine:{engine.kind}:{engine.name}", "")
        for replica in record.replicas:
            declared = self._deployment_of(replica.deployment)
            kind = declared.engine if declared is not None else "engine"
            name = f"engine:{kind}:{replica.deployment}"
            if replica.engineVersion or name not in components:
                components[name] = replica.engineVersion
        now = [
            ComponentReport(name=n[:128], version=v[:128]) for n, v in sorted(components.items())
        ]
        return self.offer("components", now[:256])


def _local_path(location: str) -> Path | None:
    path = location.removeprefix("file://")
    return Path(path) if path.startswith("/") and "\x00" not in path else None


class CacheReports(_WholeSet):
    """The cache reporter; also an `on_desired` handler that keeps the warm set (and hands
    it to this member's artifacts, which fetch it: `StoreWeights.keep_warm`)."""

    def __init__(self, deployment_of: DeploymentOf, weights: StoreWeights | None = None) -> None:
        super().__init__()
        self._deployment_of = deployment_of
        self._weights = weights
        self._warm: list[WarmArtifact] = []

    async def on_desired(self, state: DesiredState) -> None:
        """Keep the cluster's declared warm set."""
        self._warm = list(state.warm)
        if self._weights is not None:
            self._weights.set_plane_warm((a.artifact, a.digest, a.locations) for a in self._warm)

    def report(self, artifact: WarmArtifact, record: NodeRecord) -> CacheReport:
        """Where `artifact`'s weights stand on this node: from the artifact store (pieces
        verified against the manifest its digest names); for a node without one, and
        an artifact the cluster does not know, a local path among its locations, or a ready
        replica of this node serving a deployment whose source is one of them."""
        if self._weights is not None:
            state, progress = self._weights.state_of(artifact.digest)
            if state != "missing" or any(a.digest == artifact.digest for a in self._weights.warm()):
                return CacheReport(
                    artifact=artifact.artifact,
                    resident=state == "resident",
                    state=state,  # type: ignore[arg-type]  # one of the three
                    progress=progress,
                )
        resident = self._elsewhere(artifact, record)
        return CacheReport(
            artifact=artifact.artifact,
            resident=resident,
            state="resident" if resident else "missing",
            progress=1.0 if resident else 0.0,
        )

    def _elsewhere(self, artifact: WarmArtifact, record: NodeRecord) -> bool:
        names = {*artifact.locations, artifact.digest} - {""}
        for location in artifact.locations:
            path = _local_path(location)
            if path is not None and os.path.exists(path):
                return True
        for replica in record.replicas:
            declared = self._deployment_of(replica.deployment)
            if replica.state == "ready" and declared is not None and declared.source in names:
                return True
        return False

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """Residency of each warm artifact, when it changed (progress in tenths: a fetch
        is not a report every beat)."""
        now = []
        for artifact in self._warm:
            report = self.report(artifact, record)
            now.append(msgspec.structs.replace(report, progress=int(report.progress * 10) / 10))
        return self.offer("cache", now)


def machinery_reporters(
    operations: Operations,
    deployment_of: DeploymentOf,
    *,
    home: Path,
    node_id: str,
    plane_url: str,
    weights: StoreWeights | None = None,
    scale_events: ScaleEvents | None = None,
) -> tuple[list[Reporter], list[Any]]:
    """The machinery side's sync reporters and `on_desired` handlers, for `plane_link`."""
    ops = PlaneOps(operations, self_id=node_id, home=home)
    cache = CacheReports(deployment_of, weights)
    events = EventReports(
        home=home, plane_url=plane_url, node_id=node_id, scale_events=scale_events
    )
    reporters: list[Reporter] = [ops, events, ComponentReports(deployment_of), cache]
    return reporters, [ops.on_desired, cache.on_desired]
