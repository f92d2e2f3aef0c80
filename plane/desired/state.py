"""What a cluster fetches from the plane (`GET /v1/desired`, cluster token) and the extra
observed objects its nodes send back in each `SyncBatch`, without psycopg.

Down, one document per cluster (`DesiredState`): the deployments placed on it, the routing
table of every endpoint (all tenants' endpoints, since any facade may receive a request for
any of them), the operations it should carry out, and its declared warm set. `generation`
grows whenever any of it changes; the answer's ETag is a hash of the document, and the
plane answers `304` to an `If-None-Match` that names it (`plane.desired.api`).

Up, per node (`SyncBatch.replicas` ... `SyncBatch.operations`): what that node runs and
saw. Only the node itself reports them, in its own signed batch.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from facts.deployments import Constraints

__all__ = [
    "MAX_EVENTS",
    "CacheReport",
    "ComponentReport",
    "DesiredDeployment",
    "DesiredOperation",
    "DesiredState",
    "EventReport",
    "OperationReport",
    "ReplicaReport",
    "Route",
    "RouteTarget",
    "WarmArtifact",
    "desired_decoder",
]

MAX_EVENTS: Final = 256  # per batch; a node keeps the newest ones when it has more

_Text = Annotated[str, Meta(max_length=4096, pattern=r"^[^\x00]*$")]
_Short = Annotated[str, Meta(max_length=256, pattern=r"^[^\x00]*$")]


_DepId = Annotated[str, Meta(pattern=r"^dep_[0-9a-hjkmnp-tv-z]{26}$")]
_CluId = Annotated[str, Meta(pattern=r"^clu_[0-9a-hjkmnp-tv-z]{26}$")]
_OprId = Annotated[str, Meta(pattern=r"^opr_[0-9a-hjkmnp-tv-z]{26}$")]
_ArtId = Annotated[str, Meta(pattern=r"^art_[0-9a-hjkmnp-tv-z]{26}$")]
_EvtId = Annotated[str, Meta(pattern=r"^evt_[0-9a-hjkmnp-tv-z]{26}$")]
_RepId = Annotated[str, Meta(pattern=r"^rep_[0-9a-hjkmnp-tv-z]{26}$")]


# -- down -------------------------------------------------------------------------------------


class DesiredDeployment(Struct, kw_only=True, frozen=True):
    """One deployment placed on this cluster: the cluster declares it in its own deployment
    machinery under the same id and name (the workload's name), with this share of replicas."""

    id: _DepId
    workload: Annotated[str, Meta(pattern=r"^wkl_[0-9a-hjkmnp-tv-z]{26}$")]
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    engine: Annotated[str, Meta(min_length=1, max_length=64)]
    source: _Text = ""
    args: Annotated[list[_Text], Meta(max_length=256)] = []
    gpus: Annotated[int, Meta(ge=0, le=64)] = 1
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    replicas: Annotated[int, Meta(ge=0, le=1024)] = 1
    maxInFlight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    constraints: Constraints = Constraints()
    authority: Literal["managed", "observed"] = "managed"
    url: Annotated[str, Meta(max_length=2048)] = ""  # observed: the engine that runs
    node: _Short = ""  # observed: the node (id or name) it runs on
    paused: bool = False  # paused: 0 replicas run, the declaration stays
    # Its workload follows its load (issue 30): `replicas` is then this cluster's share of
    # the max, and this its share of the min; the cluster scales between them on load.
    # Absent otherwise (an agent of 0.1.0 ignores it and runs `replicas`, the max).
    minReplicas: Annotated[int, Meta(ge=0, le=1024)] | UnsetType = UNSET


class RouteTarget(Struct, kw_only=True, frozen=True):
    """One deployment an endpoint resolves to, where it runs and how to reach it."""

    deployment: _DepId
    cluster: _CluId
    name: Annotated[str, Meta(min_length=1, max_length=128)]  # its model name in that cluster
    weight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0  # weighted endpoints
    order: Annotated[int, Meta(ge=0, le=1_000)] = 0  # failover endpoints: lowest first
    ready: bool = False  # the plane last saw a ready replica of it
    urls: Annotated[list[Annotated[str, Meta(max_length=512)]], Meta(max_length=64)] = []


class Route(Struct, kw_only=True, frozen=True):
    """An endpoint: the public model name `model` of tenant `tenant`, matched on requests
    whose Host is `host` (any host when the tenant has none)."""

    endpoint: Annotated[str, Meta(pattern=r"^end_[0-9a-hjkmnp-tv-z]{26}$")]
    tenant: Annotated[str, Meta(pattern=r"^ten_[0-9a-hjkmnp-tv-z]{26}$")]
    host: _Short = ""
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    mode: Literal["weighted", "failover"] = "weighted"
    targets: Annotated[list[RouteTarget], Meta(max_length=64)] = []


class DesiredOperation(Struct, kw_only=True, frozen=True):
    """An operation this cluster carries out (its node target is one of this cluster's)."""

    id: _OprId
    kind: Literal["drain", "cordon", "uncordon", "scale", "pause", "resume"]
    target: _Short  # nod_ for drain / cordon / uncordon, dep_ for scale / pause / resume
    requester: _Short
    reason: _Text = ""
    force: bool = False
    timeoutS: Annotated[float, Meta(gt=0, le=86_400)] = 300.0
    replicas: Annotated[int, Meta(ge=0, le=1024)] | None = None  # scale


class WarmArtifact(Struct, kw_only=True, frozen=True):
    """An artifact this cluster should keep resident (its declared warm set)."""

    artifact: _ArtId
    digest: Annotated[str, Meta(max_length=128)]
    locations: Annotated[list[_Text], Meta(max_length=16)] = []


class DesiredState(Struct, kw_only=True, frozen=True):
    """Everything the plane wants of one cluster."""

    cluster: _CluId
    generation: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    deployments: Annotated[list[DesiredDeployment], Meta(max_length=4096)] = []
    routes: Annotated[list[Route], Meta(max_length=65_536)] = []
    operations: Annotated[list[DesiredOperation], Meta(max_length=1024)] = []
    warm: Annotated[list[WarmArtifact], Meta(max_length=4096)] = []


desired_decoder: Final = msgspec.json.Decoder(DesiredState)


# -- up (fields of SyncBatch) -----------------------------------------------------------------


class ReplicaReport(Struct, kw_only=True, frozen=True):
    """One replica this node runs (or watches, for an observed deployment)."""

    id: _RepId
    deploymentId: Annotated[str, Meta(max_length=64)]  # dep_ id (the plane's, if placed)
    deployment: Annotated[str, Meta(max_length=128)]  # its name in the cluster
    state: Literal["starting", "ready", "failed", "stopping"] = "starting"
    engineVersion: Annotated[str, Meta(max_length=64)] = ""
    devices: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=64)] = []
    allocation: Annotated[str, Meta(max_length=64)] = ""  # alc_ id of its devices
    drift: _Short = ""  # observed: how what runs differs from the declaration; "" none


class EventReport(Struct, kw_only=True, frozen=True):
    """A fact this node saw: node joined, device degraded, engine load failed, replica
    ready, ... `about` is the id of what it is about. Never a prompt or a response."""

    id: _EvtId
    kind: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9-]*$")]
    about: _Short
    message: _Short = ""
    at: Annotated[int, Meta(ge=0, le=2**53)]  # epoch ms


class ComponentReport(Struct, kw_only=True, frozen=True):
    """Something installed on this node and versioned on its own: the agent, an engine."""

    name: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[^\x00]*$")]
    version: Annotated[str, Meta(max_length=128, pattern=r"^[^\x00]*$")] = ""


class CacheReport(Struct, kw_only=True, frozen=True):
    """Whether an artifact's weights are resident on this node: from its store, pieces
    verified (issue 28). `state` and `progress` are new in 0.2.0 (a node of 0.1.0 sends
    `resident` alone; a plane of 0.1.0 ignores them)."""

    artifact: _ArtId
    resident: bool
    state: Literal["", "resident", "fetching", "missing"] = ""
    progress: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0  # share of pieces held


class OperationReport(Struct, kw_only=True, frozen=True):
    """Where a plane operation this node carries out stands."""

    id: _OprId
    phase: Literal["pending", "running", "succeeded", "failed"]
    result: _Short = ""
