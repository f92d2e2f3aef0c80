"""Where a request runs: a deployment's replicas ranked on engine load, else the nodes'
engines ranked on GPUs and pending work -- the best target and the next best, for one
failover.

A model that any member runs as a deployment is routed per replica (`rank_replicas`: a
replica reporting a queue gets less new work; what this member sent and has not seen finish
counts between two load reports). A model only served by engines given with `--engine` is
routed per node (`rank`), as before. Either way the answer is up to two `Target`s: a request
whose first target refuses the connection or fails before any byte reached the client is
sent once to the second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import msgspec

from facts.deployments import Deployment
from facts.records import NodeRecord
from scheduler import Cluster, Load, Refusal, Request, rank
from scheduler.replicas import ReplicaView, ReportedLoad, rank_replicas

__all__ = ["FAILOVER_STATUSES", "Target", "choose", "replica_views", "served_models", "sse_error"]

FAILOVER_STATUSES: Final = frozenset({502, 503})  # a target that could not take it at all


@dataclass(frozen=True, slots=True)
class Target:
    """A node to run on and, for a deployment, the replica there."""

    node_id: str
    replica: str = ""  # "" : the node's engines (`--engine`)
    kind: str = "unknown"  # the engine kind, for the job record


def replica_views(
    records: Iterable[NodeRecord],
    *,
    self_id: str,
    reachable: Callable[[str], bool],
    deployment_of: Callable[[str], Deployment | None],
    now_ms: int,
) -> list[ReplicaView]:
    """Every member's replicas as ranking sees them, with their last load reports and their
    deployment's engine kind and `maxInFlight`."""
    views = []
    for record in records:
        up = record.nodeId == self_id or reachable(record.nodeId)
        for r in record.replicas:
            load = ReportedLoad(r.running, r.waiting, r.kvUsage) if r.loadAt else None
            deployment = deployment_of(r.deployment)
            views.append(
                ReplicaView(
                    r.id,
                    record.nodeId,
                    r.deployment,
                    kind=deployment.engine if deployment else "unknown",
                    max_in_flight=deployment.maxInFlight if deployment else 0,
                    state=r.state,
                    load=load,
                    load_age_ms=max(0, now_ms - r.loadAt) if r.loadAt else None,
                    reachable=up,
                    cordoned=record.cordoned,
                )
            )
    return views


def choose(
    model: str,
    *,
    replicas: list[ReplicaView],
    pending: Mapping[str, int],
    nodes: Callable[[], tuple[Cluster, Load]],
    origin: str,
    kind_on: Callable[[str, str], str],
    pending_then: Callable[[str, float], int] | None = None,
) -> list[Target] | Refusal:
    """Up to two targets, best first; or why no member can take the request."""
    if any(r.model == model for r in replicas):
        ranking = rank_replicas(model, replicas, pending, pending_then=pending_then)
        if not ranking.ranked:
            return ranking.refusal() or Refusal.REPLICA_NOT_READY
        kinds = {r.replica_id: r.kind for r in replicas}
        return [Target(node, rid, kinds.get(rid, "unknown")) for rid, node, _ in ranking.ranked[:2]]
    cluster, load = nodes()
    if (None, model) not in cluster.served:  # served by some engine (of any kind)
        return Refusal.MODEL_NOT_SERVED
    ranked = rank(Request(model, origin=origin), cluster, load)
    top = ranked.top(2)
    if not top:
        return ranked.refusal() or Refusal.MODEL_NOT_SERVED
    return [Target(node, "", kind_on(node, model)) for node, _ in top]


def served_models(
    engines: Mapping[str, Iterable[str]], replicas: Iterable[ReplicaView]
) -> list[dict[str, object]]:
    """`/v1/models`: the engines' models (`--engine`, by node) and every deployment with a
    ready replica on a reachable member."""
    served = {model: set(nodes) for model, nodes in engines.items()}
    for replica in replicas:
        if replica.state == "ready" and replica.reachable:
            served.setdefault(replica.model, set()).add(replica.node_id)
    return [
        {"id": model, "object": "model", "created": 0, "owned_by": "nvpair", "nodes": sorted(n)}
        for model, n in sorted(served.items())
    ]


def sse_error(message: str) -> bytes:
    """An OpenAI-shaped error event ending a stream that broke after bytes were sent
    (`message` is ours: never the engine's words)."""
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return b"data: " + msgspec.json.encode(error) + b"\n\ndata: [DONE]\n\n"
