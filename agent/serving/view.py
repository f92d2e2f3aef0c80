"""The cluster as the scheduler sees it: node records compiled into `scheduler.Cluster`.

Compiling costs more than ranking, so the compiled view is reused while no record, pin or
reachability changed (reachability moves with time, so at most every `TTL_S`). The pending
work per node is copied fresh on every call, since the caller adds its own to it.

A member that comes back is therefore seen up to `TTL_S` late. A refusal must not rest on
that: the facade asks `expire()` before refusing, and places once more on a view compiled
then (at most every `RECHECK_S`, so a flood of requests for a model nobody serves does not
compile the cluster for each).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final

from agent.serving.routing import replica_views
from facts.deployments import Deployment
from facts.records import NodeRecord
from scheduler import Cluster, DeviceView, EngineView, Load, NodeView
from scheduler.replicas import ReplicaView

__all__ = ["ReplicaViews", "SchedulingView"]

TTL_S: Final = 0.5
RECHECK_S: Final = 0.05  # a refusal recompiles a view older than this, at most
REPLICA_TTL_S: Final = 0.1  # load ages and reachability may lag this much (STALE_MS is 5 s)


class SchedulingView:
    """`current()` -> (Cluster, Load); `engine_kind_for()` for the job record."""

    def __init__(
        self,
        *,
        self_id: str,
        records: Callable[[], list[NodeRecord]],
        record_of: Callable[[str], NodeRecord | None],
        is_member: Callable[[str], bool],
        reachable: Callable[[str, float], bool],
        remote_load: Callable[[], Mapping[str, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._self_id = self_id
        self._records = records
        self._record_of = record_of
        self._is_member = is_member
        self._reachable = reachable
        self._remote_load = remote_load
        self._clock = clock
        self._cache: tuple[list[NodeRecord], float, Cluster] | None = None

    def current(self) -> tuple[Cluster, Load]:
        """The compiled cluster and a fresh copy of the pending work per node."""
        now = self._clock()
        records = self._records()
        cached = self._cache
        if cached is None or now - cached[1] > TTL_S or _moved(cached[0], records):
            cached = self._cache = (records, now, self._compile(records, now))
        cluster = cached[2]
        return cluster, Load.of(cluster, self._remote_load())

    def expire(self, older_than_s: float = RECHECK_S) -> bool:
        """Drop the compiled view when it is older than `older_than_s`; whether it was (the
        next `current()` then compiles what the records and reachability say now)."""
        cached = self._cache
        if cached is None or self._clock() - cached[1] <= older_than_s:
            return False
        self._cache = None
        return True

    def _compile(self, records: list[NodeRecord], now: float) -> Cluster:
        return Cluster.compile(
            [
                NodeView(
                    record.nodeId,
                    member=record.nodeId == self._self_id or self._is_member(record.nodeId),
                    reachable=self._reachable(record.nodeId, now),
                    cordoned=record.cordoned,
                    queue_limit=record.queueLimit,
                    engines=tuple(
                        EngineView(e.name, e.kind, frozenset(e.models), e.up)
                        for e in record.engines
                    ),
                    devices=tuple(
                        DeviceView(
                            d.memoryFree,
                            d.memoryTotal,
                            float(d.utilization or 0),
                            d.health == "ok",
                            d.domainId or "none",
                            d.deviceClass,
                        )
                        for d in record.devices
                    ),
                )
                for record in records
            ]
        )

    def engine_kind_for(self, node_id: str, model: str) -> str:
        """The kind of the engine serving `model` on `node_id` (for the job record)."""
        record = self._record_of(node_id)
        for engine in record.engines if record else []:
            if model in engine.models and engine.up:
                return engine.kind
        return "unknown"


class ReplicaViews:
    """Every member's replicas as ranking sees them (`routing.replica_views`), built again
    when a record changes and otherwise at most every `REPLICA_TTL_S` -- not per request."""

    def __init__(
        self,
        *,
        self_id: str,
        records: Callable[[], list[NodeRecord]],
        reachable: Callable[[str, float], bool],
        deployment_of: Callable[[str], Deployment | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._self_id = self_id
        self._records = records
        self._reachable = reachable
        self._deployment_of = deployment_of
        self._clock = clock
        self._cache: tuple[list[NodeRecord], float, list[ReplicaView]] | None = None

    def current(self) -> list[ReplicaView]:
        """The views (shared: callers do not change them)."""
        now = self._clock()
        records = self._records()
        cached = self._cache
        if cached is None or now - cached[1] > REPLICA_TTL_S or _moved(cached[0], records):
            views = replica_views(
                records,
                self_id=self._self_id,
                reachable=lambda node_id: self._reachable(node_id, now),
                deployment_of=self._deployment_of,
                now_ms=int(time.time() * 1000),
            )
            cached = self._cache = (records, now, views)
        return cached[2]


def _moved(held: list[NodeRecord], records: list[NodeRecord]) -> bool:
    # Whether the records differ from those a view was built from: not when they are the
    # same list (`Members.working_records` hands out one until something changes), nor when
    # every member's generation is the same.
    if held is records:
        return False
    return len(held) != len(records) or any(
        a.nodeId != b.nodeId or a.generation != b.generation
        for a, b in zip(held, records, strict=True)
    )
