"""Where a request runs: a deployment's replicas ranked on engine load, else the nodes'
engines ranked on GPUs and pending work -- the best target and the next best, for one
failover.

A model that any member runs as a deployment is routed per replica (`rank_replicas`: a
replica reporting a queue gets less new work; what this member sent and has not seen finish
counts between two load reports). A model only served by engines given with `--engine` is
routed per node (`rank`), as before. Either way the answer is up to two `Target`s: a request
whose first target refuses the connection or fails before any byte reached the client is
sent once to the second.

Among a deployment's replicas the policy decides (`POLICIES`; the member's `[routing]
policy`, changed at run time with `nvpair routing`): `prefix` (the default) sends a request
to its anchor's replica within the load bound (`scheduler.prefix`: the turns of one
conversation, and requests sharing a system prompt, reach the replica whose prefix cache
holds them, from whichever member they enter), its second target the next within the bound
in the anchor's order; `load` is the load ranking alone; `round-robin` takes the ready
replicas in turn, load unseen (a baseline for `bench/prefix_routing.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from facts.deployments import Deployment
from facts.records import NodeRecord, is_worker
from scheduler import Cluster, Load, Ranking, Refusal, Request, prefix, top
from scheduler.replicas import ReplicaRanking, ReplicaView, ReportedLoad, rank_replicas

__all__ = [
    "FAILOVER_STATUSES",
    "NO_ANCHOR",
    "POLICIES",
    "Anchor",
    "Target",
    "choose",
    "explain",
    "replica_views",
    "served_models",
    "sse_error",
]

FAILOVER_STATUSES: Final = frozenset({502, 503})  # a target that could not take it at all
POLICIES: Final = ("prefix", "load", "round-robin")
Policy = Literal["prefix", "load", "round-robin"]


@dataclass(frozen=True, slots=True)
class Anchor:
    """What a request is routed by under the `prefix` policy (`scheduler.prefix.anchor_of`):
    a keyed hash, never the text; `session` when a client named the conversation."""

    digest: bytes = b""
    session: bool = False


NO_ANCHOR: Final = Anchor()  # a request routed on load alone
# An anchor, or how to make it: hashing the prompt is left until a replica ranking asks for
# it (a model served by `--engine`s never does).
AnchorSource = Anchor | Callable[[], Anchor]


def lazy_anchor(body: Mapping[str, Any], key: bytes, session: str) -> Callable[[], Anchor]:
    """`scheduler.prefix.anchor_of(body, key, session=session)` when first asked, then kept."""
    made: list[Anchor] = []

    def anchor() -> Anchor:
        if not made:
            made.append(Anchor(*prefix.anchor_of(body, key, session=session)))
        return made[0]

    return anchor


@dataclass(frozen=True, slots=True)
class Target:
    """A node to run on and, for a deployment, the replica there."""

    node_id: str
    replica: str = ""  # "" : the node's engines (`--engine`)
    kind: str = "unknown"  # the engine kind, for the job record
    reason: str = "load"  # why it was chosen: prefix, session, load (a failover: the second)
    score: float = 0.0  # its score when chosen (higher is better), for the trace


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
            if is_worker(r, record.nodeId):
                continue  # a part of a replica across members: its head serves
            load = ReportedLoad(r.running, r.waiting, r.kvUsage) if r.loadAt else None
            deployment = deployment_of(r.deployment)
            views.append(
                ReplicaView(
                    r.id,
                    record.nodeId,
                    r.deployment,
                    kind=deployment.engine if deployment else "unknown",
                    max_in_flight=deployment.maxInFlight if deployment else 0,
                    limit_known=deployment is not None,
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
    anchor: AnchorSource = NO_ANCHOR,
    policy: Policy = "prefix",
    turn: int = 0,
) -> list[Target] | Refusal:
    """Up to two targets, best first; or why no member can take the request. `turn` is
    the model's request count, for `round-robin`."""
    if any(r.model == model for r in replicas):
        ranking = rank_replicas(model, replicas, pending, pending_then=pending_then)
        if not ranking.ranked:
            return ranking.refusal() or Refusal.REPLICA_NOT_READY
        if not isinstance(anchor, Anchor):
            anchor = anchor() if policy == "prefix" else NO_ANCHOR
        kinds = {r.replica_id: r.kind for r in replicas}
        scores = {rid: score for rid, _, score in ranking.ranked}
        return [
            Target(node, rid, kinds.get(rid, "unknown"), reason, scores[rid])
            for rid, node, reason in _replicas_in_order(ranking, anchor, policy, turn)
        ]
    cluster, load = nodes()
    if (None, model) not in cluster.served:  # served by some engine (of any kind)
        return Refusal.MODEL_NOT_SERVED
    best = top(Request(model, origin=origin), cluster, load, 2)  # remembered per load
    if isinstance(best, Ranking):
        return best.refusal() or Refusal.MODEL_NOT_SERVED
    return [Target(node, "", kind_on(node, model), "load", score) for node, score in best]


def _replicas_in_order(
    ranking: ReplicaRanking, anchor: Anchor, policy: Policy, turn: int
) -> list[tuple[str, str, str]]:
    """The first two replicas (id, node, reason) of the ranking as the policy orders
    them."""
    ranked = ranking.ranked
    if policy == "round-robin":
        by_id = sorted(ranked)
        first = by_id[turn % len(by_id)]
        second = [r for r in ranked if r[0] != first[0]][:1]
        return [(first[0], first[1], "load")] + [(r, n, "load") for r, n, _ in second]
    if policy == "prefix" and anchor.digest:
        work = ranking.work
        chosen: list[tuple[str, str, str]] = []
        left = list(ranked)
        while left and len(chosen) < 2:
            choice = prefix.choose(anchor.digest, left, work, session=anchor.session)
            if choice is None:
                break
            chosen.append((choice.replica_id, choice.node_id, choice.reason))
            left = [r for r in left if r[0] != choice.replica_id]
        return chosen
    return [(r, n, "load") for r, n, _ in ranked[:2]]


def explain(
    model: str,
    *,
    replicas: list[ReplicaView],
    pending: Mapping[str, int],
    anchor: Anchor,
    policy: Policy,
    pending_then: Callable[[str, float], int] | None = None,
) -> dict[str, Any]:
    """What `choose` sees for a request of a deployment's `model` and what it chooses:
    each replica's place in the anchor's order, work, load score, whether it is within the
    bound, or why it cannot take the request (`nvpair explain MODEL --prompt-file`)."""
    ranking = rank_replicas(model, replicas, pending, pending_then=pending_then)
    ranked = ranking.ranked
    order = prefix.rendezvous(anchor.digest, [r for r, _, _ in ranked]) if anchor.digest else []
    work = ranking.work
    limit = prefix.limit(sum(max(0.0, w) for w in work.values()), len(ranked))
    chosen = _replicas_in_order(ranking, anchor, policy, 0) if ranked else []
    rows: list[dict[str, Any]] = [
        {
            "replicaId": rid,
            "nodeId": node,
            "loadScore": round(score, 3),
            "work": round(max(0.0, work[rid]), 3),
            "order": order.index(rid) if rid in order else None,
            "withinBound": prefix.fits(work[rid], limit),
        }
        for rid, node, score in ranked
    ]
    rows.sort(key=lambda row: (row["order"] is None, row["order"] or 0, row["replicaId"]))
    refused = [{"replicaId": rid, "reason": reason.value} for rid, reason in ranking.refused]
    return {
        "model": model,
        "policy": policy,
        "anchor": anchor.digest[:6].hex() if anchor.digest else None,
        "session": anchor.session,
        "bound": limit,
        "replicas": rows,
        "refused": [r for r in refused if r["reason"] != Refusal.MODEL_NOT_SERVED.value],
        "choice": (
            {"replicaId": chosen[0][0], "nodeId": chosen[0][1], "reason": chosen[0][2]}
            if chosen
            else None
        ),
        "then": ({"replicaId": chosen[1][0], "nodeId": chosen[1][1]} if len(chosen) > 1 else None),
    }


def served_models(
    engines: Mapping[str, Iterable[str]],
    replicas: Iterable[ReplicaView],
    *,
    elastic: Iterable[str] = (),
) -> list[dict[str, object]]:
    """`/v1/models`: the engines' models (`--engine`, by node), every deployment with a
    ready replica on a reachable member, and every deployment that scales on load, ready
    or not (a request for one at zero waits while a replica starts)."""
    served = {model: set(nodes) for model, nodes in engines.items()}
    for model in elastic:
        served.setdefault(model, set())
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
