"""The local API's deployment routes (behind its owner token, like every other route):

- `GET /v1/deployments` -- the declared deployments, each with its replicas' counts by state
  across the cluster.
- `POST /v1/deployments` -- declare one (`DeploymentRequest`; 201 with the signed version).
- `POST /v1/deployments/{name}/scale` -- `{"replicas": N}`.
- `POST /v1/deployments/{name}/undeploy` -- its replicas stop everywhere.
- `GET /v1/replicas` -- every member's replicas, as their records say; this node's failed
  ones with `logTail`, their engine log's last lines.
- `GET /v1/replicas/{id}/log?tail=N` (or `?from=OFFSET`, how `--follow` polls) -- a replica's
  engine log, on the node that runs it only (`replica_logs` bounds it). Asked elsewhere it
  is a 404 naming that node: an engine's log may hold prompts, so it is shown to the owner
  of that node's local API and never leaves the node (not in records, events or metrics).
- `GET /v1/deployments/{name}/explain?node=X` -- for each member (or X), why a replica of
  `name` can or cannot be placed there now, and the last plan's reason it is unplaced.
- `GET /v1/deployments/events?deployment=NAME` -- what elastic deployments did as this
  member saw it, the newest first: scale-ups, scale-downs, cold starts with their seconds
  (`agent.cluster.scale_events`; the page's Deployments view shows them).
- `GET /v1/explain/replicas?model=M` -- the replicas of `M` ranked as the facade ranks them
  (`scheduler.rank_replicas`, with what this member has sent and not seen finish).

The API key routes (`agent.apis.keys`) are served with these.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from aiohttp import web

from agent.apis.answers import bad_request, json_answer, read_json
from agent.apis.keys import key_routes
from agent.artifacts.weights import StoreWeights, where
from agent.cluster.deployments import DeploymentRefused, DeploymentRequest, Deployments
from agent.cluster.members import Members
from agent.cluster.scale_events import ScaleEvents
from agent.engines import replica_logs
from agent.engines.parts import UNTRUSTED
from agent.engines.proc_state import ReplicaState
from agent.engines.replicas import ReplicaControl
from agent.engines.templates import check_replica_id
from agent.serving.in_flight import InFlight
from agent.serving.routing import replica_views
from facts.deployments import Deployment
from facts.records import NodeRecord
from scheduler.replicas import rank_replicas

__all__ = ["DeployPorts", "deployment_routes", "deployment_view"]

_request: Final = msgspec.json.Decoder(DeploymentRequest)


class _Scale(msgspec.Struct, forbid_unknown_fields=True):
    replicas: int


_scale: Final = msgspec.json.Decoder(_Scale)


@dataclass(frozen=True)
class DeployPorts:
    """What the deployment routes read and ask: the declared set (whose `on_change` pushes a
    change to the members), this node's replicas, the members, and what this member's facade
    has sent each replica and not seen finish."""

    deployments: Deployments
    control: ReplicaControl
    members: Members
    pending: InFlight = field(default_factory=InFlight)
    weights: StoreWeights | None = None  # this member's artifacts (issue 28)
    # What this member sees of an elastic deployment's load (`Scaler.explain`, issue 30).
    scaling: Callable[[str], dict[str, object] | None] = lambda _name: None
    # What elastic deployments did as this member saw it (`Scaler.events`, issue 30).
    scale_events: ScaleEvents = field(default_factory=ScaleEvents)


def deployment_view(deployment: Deployment, records: list[NodeRecord]) -> dict[str, Any]:
    """A deployment as people read it: no signature, its replicas counted by state."""
    shown: dict[str, Any] = msgspec.to_builtins(deployment)
    for hidden in ("byCert", "signature"):
        shown.pop(hidden, None)
    states = Counter(
        r.state
        for record in records
        for r in record.replicas
        if r.deployment == deployment.name and r.deploymentId == deployment.id
    )
    shown["replicaStates"] = dict(sorted(states.items()))
    return shown


def deployment_routes(
    ports: DeployPorts,
    records: Callable[[], list[NodeRecord]],
) -> list[web.RouteDef]:
    """The routes, over this node's parts and the members' records."""
    deployments, control = ports.deployments, ports.control

    async def listing(request: web.Request) -> web.Response:
        held = records()
        return json_answer([deployment_view(d, held) for d in deployments.live()])

    async def declare(request: web.Request) -> web.Response:
        wanted = _with_weights(await read_json(request, _request), ports, records())
        if wanted.minReplicas is not None or wanted.maxReplicas is not None:
            _needs(ports, "elastic-deployments", "minReplicas/maxReplicas: every member must "
                   "know deployments that scale on load first")  # fmt: skip
        if wanted.nodes != 1:
            _needs(ports, "spanning-replicas", "nodes: every member must know replicas that "
                   "span members first")  # fmt: skip
            template = control.supervisor.template(wanted.engine)
            if template is not None and template.span is None:
                raise bad_request(f"the {wanted.engine!r} engine cannot span members", "nodes")
            spans = template.span if template is not None else None
            if spans is not None and spans.channel == "network" and not control.trusted_network:
                raise bad_request(UNTRUSTED, "nodes")  # NCCL, Ray: not carried by nvpair
        try:
            made = deployments.declare(wanted)
        except DeploymentRefused as exc:
            raise bad_request(exc) from None
        return json_answer(deployment_view(made, records()), status=201)

    async def scale(request: web.Request) -> web.Response:
        wanted = (await read_json(request, _scale)).replicas
        try:
            made = deployments.scale(request.match_info["name"], wanted)
        except DeploymentRefused as exc:
            raise _refused(exc) from None
        return json_answer(deployment_view(made, records()))

    async def undeploy(request: web.Request) -> web.Response:
        try:
            made = deployments.undeploy(request.match_info["name"])
        except DeploymentRefused as exc:
            raise _refused(exc) from None
        return json_answer({"undeployed": made.name, "version": made.version})

    async def replicas(request: web.Request) -> web.Response:
        rows = []
        for record in records():
            for r in record.replicas:
                row = {"nodeId": record.nodeId, "node": record.name, **msgspec.to_builtins(r)}
                if record.nodeId == control.self_id:
                    row |= _log_tail(control, r.id)
                    if (tunnel := control.tunnels.totals().get(r.id)) is not None:
                        row["tunnel"] = msgspec.to_builtins(tunnel)
                rows.append(row)
        return json_answer(
            sorted(rows, key=lambda row: (row["deployment"], row["node"], row["id"]))
        )

    async def log(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        try:
            path = control.supervisor.logs(check_replica_id(rid))
            lines = int(request.query.get("tail", replica_logs.DEFAULT_LINES))
            offset = int(request.query["from"]) if "from" in request.query else None
        except ValueError as exc:
            raise bad_request(exc) from None
        if not path.exists():
            raise web.HTTPNotFound(text=_elsewhere(rid, records(), control.self_id))
        try:
            chunk = (
                replica_logs.tail(path, lines)
                if offset is None
                else replica_logs.since(path, offset)
            )
        except OSError as exc:
            raise web.HTTPServiceUnavailable(text=f"cannot read {path.name}: {exc}\n") from None
        return json_answer({"replica": rid, **msgspec.to_builtins(chunk)})

    async def explain_deployment(request: web.Request) -> web.Response:
        name, only = request.match_info["name"], request.query.get("node", "")
        verdicts = control.why_not(name)
        if verdicts is None:
            found = deployments.get(name)
            if found is None:
                raise web.HTTPNotFound(text=f"no deployment named {name!r}\n")
            raise web.HTTPBadRequest(text=f"{name} is observed: nvpair does not place it\n")
        held = records()
        names = {r.nodeId: r.name for r in held}
        rows = [
            {
                "nodeId": host.node_id,
                "node": names.get(host.node_id, host.name),
                "placeable": why is None,
                "reason": why or "",
                "replicas": sum(1 for r in host.replicas if r.deployment == name),
            }
            for host, why in sorted(verdicts, key=lambda v: names.get(v[0].node_id, v[0].node_id))
            if not only or only in (host.node_id, names.get(host.node_id))
        ]
        if only and not rows:
            raise web.HTTPNotFound(text=f"no member {only!r} in this node's view\n")
        unplaced = [why for dep, why in control.last_plan.unplaced if dep == name]
        found = deployments.get(name)
        weights: dict[str, Any] | None = None
        if found is not None and found.weights:
            weights = {"artifact": found.weights, "members": where(found.weights, held)}
            for row in rows:
                row["weights"] = weights["members"].get(row["node"], "absent")
        scaling = ports.scaling(name)
        return json_answer(
            {
                "deployment": name,
                "nodes": rows,
                "unplaced": unplaced,
                "weights": weights,
                "scaling": scaling,
            }
        )

    async def scale_events(request: web.Request) -> web.Response:
        only = request.query.get("deployment", "")
        kept = [e for e in ports.scale_events.events if not only or e.deployment == only]
        return json_answer([e.to_json() for e in reversed(kept)])  # the newest first

    async def explain_replicas(request: web.Request) -> web.Response:
        model = request.query.get("model")
        if not model:
            raise web.HTTPBadRequest(text="model=NAME is required\n")
        return json_answer(_replica_ranking(model, ports, records()))

    return [
        web.get("/v1/deployments", listing),
        web.post("/v1/deployments", declare),
        web.post("/v1/deployments/{name}/scale", scale),
        web.post("/v1/deployments/{name}/undeploy", undeploy),
        web.get("/v1/replicas", replicas),
        web.get("/v1/replicas/{id}/log", log),
        web.get("/v1/deployments/{name}/explain", explain_deployment),
        web.get("/v1/deployments/events", scale_events),
        web.get("/v1/explain/replicas", explain_replicas),
        *key_routes(ports.members.api_keys),  # the cluster's API keys (agent.apis.keys)
    ]


def _needs(ports: DeployPorts, feature: str, what: str) -> None:
    """409 with `what` and the members that hold `feature` back, until it is on."""
    gate = ports.members.gate()
    if not gate.allows(feature):
        behind = ", ".join(f"{n} ({r.release})" for n, r in gate.held_back_by) or "a member"
        raise web.HTTPConflict(text=f"{what}; {behind} does not (docs/upgrade.md)\n")


def _with_weights(
    wanted: DeploymentRequest, ports: DeployPorts, records: list[NodeRecord]
) -> DeploymentRequest:
    """`wanted` with its artifact named by digest (its source, when none is given, the
    artifact's name); refused when the cluster cannot use artifacts yet, no such artifact is
    known, or no member holds it."""
    if not wanted.artifact:
        return wanted
    weights = ports.weights
    if weights is None:
        raise bad_request("this member keeps no artifacts", "artifact")
    _needs(ports, "artifacts", "artifact: every member must know artifacts first")
    found = weights.artifacts.get(wanted.artifact) or next(
        (a for a in weights.artifacts.live() if a.digest == wanted.artifact), None
    )
    if found is None:
        raise bad_request(f"no artifact named {wanted.artifact[:256]!r}", "artifact")
    holders = [n for n, state in where(found.digest, records).items() if state == "resident"]
    if not holders and weights.fetches.store.resident(found.digest) is None:
        raise web.HTTPConflict(
            text=f"artifact: no member holds {found.name} ({found.digest[:19]}); add it on a "
            "member that has its files (nvpair artifact add)\n"
        )
    return msgspec.structs.replace(
        wanted, artifact=found.digest, source=wanted.source or found.name
    )


def _log_tail(control: ReplicaControl, replica_id: str) -> dict[str, Any]:
    # A failed replica's last log lines, for this node's owner only: never in the record.
    status = control.supervisor.status(replica_id)
    if status is None or status.state is not ReplicaState.FAILED or not status.log_tail:
        return {}
    return {"logTail": list(status.log_tail)}


def _elsewhere(replica_id: str, records: list[NodeRecord], self_id: str) -> str:
    """Why this node has no log of `replica_id`: where it runs, when a record says."""
    for record in records:
        if record.nodeId != self_id and any(r.id == replica_id for r in record.replicas):
            return (
                f"{replica_id} runs on {record.name} ({record.nodeId}): its log stays there; "
                f"run `nvpair logs {replica_id}` on {record.name}\n"
            )
    return f"no replica {replica_id} on this node or in any member's record\n"


def _replica_ranking(model: str, ports: DeployPorts, records: list[NodeRecord]) -> dict[str, Any]:
    """`nvpair explain MODEL` for a deployment's model: the facade's ranking, spelled out."""
    members = ports.members
    views = replica_views(
        records,
        self_id=ports.control.self_id,
        reachable=lambda n: members.reachable(n, time.monotonic()),
        deployment_of=ports.deployments.get,
        now_ms=int(time.time() * 1000),
    )
    mine = {v.replica_id: v for v in views if v.model == model}
    names = {r.nodeId: r.name for r in records}
    ranking = rank_replicas(model, mine.values(), ports.pending, pending_then=ports.pending.then)
    ranked = []
    for rid, node_id, score in ranking.ranked:
        view = mine[rid]
        ranked.append(
            {
                "replica": rid,
                "nodeId": node_id,
                "node": names.get(node_id, node_id),
                "score": score,
                "pending": ports.pending.get(rid, 0),
                "running": view.load.running if view.load else None,
                "waiting": view.load.waiting if view.load else None,
                "kvUsage": view.load.kv_usage if view.load else None,
                "loadAgeMs": view.load_age_ms,
            }
        )
    refused = [
        {
            "replica": rid,
            "nodeId": mine[rid].node_id,
            "node": names.get(mine[rid].node_id, ""),
            "reason": str(why),
        }
        for rid, why in ranking.refused
    ]
    return {"model": model, "deployment": bool(mine), "ranked": ranked, "refused": refused}


def _refused(exc: DeploymentRefused) -> web.HTTPException:
    if str(exc).startswith("no deployment named"):
        return web.HTTPNotFound(text=f"{exc}\n")
    return bad_request(exc)
