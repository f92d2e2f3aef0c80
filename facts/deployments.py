"""Deployments: declared, cluster-wide, signed by the member that declared them. Sans-I/O.

A `Deployment` says what should run: the model name clients use, the engine kind and what
it loads, extra engine arguments, GPUs per replica, replicas, the requests a replica takes
at once (`maxInFlight`, for routing: the facade's wait line), where they may go, and who
starts the engines (`managed`: the agents; `observed`: an engine that already runs, watched
and never restarted). Any member may declare, scale or undeploy one (the operator of any
machine owns the cluster, as with removals); each version is a statement signed by the
member that made it (`facts.record_signing.sign_statement`), so members check it against
the cluster CA alone, whoever relays it.

A field this release does not know (a later release's) is kept, not refused: the version
is held and relayed as the bytes it was signed as (`facts.kept`, docs/upgrade.md).

**Convergence** is that of every signed cluster fact (`facts.signed_set`). Deployments are
keyed by name. Every edit at a member sets `version` to one more than the highest it holds
for that name; a member takes a version when it is higher in `(version, updatedAt, by)`
order than the one it holds -- the same total order everywhere, so concurrent edits at two
members converge to one of them on every member, whichever arrives first. An undeploy is a
version with `deleted` set (a tombstone: a late copy of an older version cannot bring the
deployment back); tombstones older than `TOMBSTONE_MS` may be forgotten, by then every
member has long taken them (no member does yet: they go to make room). A deployment never
expires.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from facts.signed_set import FactKind, SignedSet

__all__ = [
    "DEPLOYMENT",
    "MAX_DEPLOYMENTS",
    "TOMBSTONE_MS",
    "Constraints",
    "Deployment",
    "DeploymentSet",
    "Elastic",
    "spec_digest",
]

MAX_DEPLOYMENTS: Final = 256  # declared at once in one cluster, tombstones included
TOMBSTONE_MS: Final = 7 * 24 * 3600 * 1000

_Name = Annotated[
    str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]
_Arg = Annotated[str, Meta(max_length=4096)]
Authority = Literal["managed", "observed"]


class Constraints(Struct, kw_only=True, frozen=True):
    """Where a deployment's replicas may go."""

    node: Annotated[str, Meta(max_length=256)] = ""  # a node id or name; "" anywhere
    deviceClass: Annotated[str, Meta(max_length=64)] = ""  # e.g. h100-80gb-sxm; "" any
    oneDomain: bool = False  # every GPU of a replica in one topology domain
    minMemory: Annotated[int, Meta(ge=0)] = 0  # bytes of memory each GPU must have


_Seconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600)]


class Elastic(Struct, kw_only=True, frozen=True):
    """A deployment that scales on its load between bounds (issue 30, `scheduler.scale`):
    its `replicas` is then the desired count, which one member changes as the load does
    (docs/deployments.md, "Elastic deployments")."""

    min: Annotated[int, Meta(ge=0, le=1024)] = 1
    max: Annotated[int, Meta(ge=1, le=1024)] = 1
    targetWaiting: Annotated[float, Meta(ge=0, le=1_000_000)] = 0.0  # per ready replica
    scaleDownAfterS: _Seconds = 300.0  # quiet this long before a replica goes
    idleToZeroS: _Seconds = 900.0  # idle this long before the last one goes (min 0)
    # Why `replicas` last changed (scheduler.scale's reasons; "declared" when made so).
    reason: Annotated[str, Meta(max_length=32)] = "declared"
    # Its class when GPUs are short (higher first; `scheduler.scale.share`); unset: 0.
    priority: Annotated[int, Meta(ge=0, le=100)] | UnsetType = UNSET
    # How long a request may wait while a replica starts from none ready, when that is
    # longer than the members' `wait_timeout_s` (an engine that loads for minutes); unset:
    # the wait line's own timeout.
    coldStartS: Annotated[float, Meta(gt=0, le=3600)] | UnsetType = UNSET

    @property
    def cold_start_s(self) -> float:
        """Its cold-start timeout in seconds, or 0 for the wait line's own."""
        return self.coldStartS if isinstance(self.coldStartS, float | int) else 0.0


class Deployment(Struct, kw_only=True, frozen=True):
    """One version of a declared deployment (a signed statement)."""

    id: Annotated[str, Meta(pattern=r"^dep_[0-9a-z]{26}$")]
    name: _Name  # the model name clients use; unique in the cluster
    engine: Annotated[str, Meta(min_length=1, max_length=64)]  # a template: vllm, sglang, ...
    source: Annotated[str, Meta(max_length=4096)] = ""  # what the engine loads: path or id
    args: Annotated[list[_Arg], Meta(max_length=256)] = []
    gpus: Annotated[int, Meta(ge=0, le=64)] = 1  # per replica
    tp: Annotated[int, Meta(ge=1, le=64)] = 1  # tensor-parallel size
    replicas: Annotated[int, Meta(ge=0, le=1024)] = 1
    maxInFlight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0  # per replica; 0: no limit
    constraints: Constraints = Constraints()
    authority: Authority = "managed"
    url: Annotated[str, Meta(max_length=2048)] = ""  # observed: the engine that runs
    # The engine's API key, by reference only (never the key): "" none, "generate" a fresh
    # one per replica, "file:PATH" read on the node that runs it (relative to NVPAIR_HOME).
    engineKey: Annotated[str, Meta(max_length=1024, pattern=r"^(generate|file:[^\x00]+)?$")] = ""
    # The weights it loads, by digest (facts.artifacts): the node that runs a replica
    # fetches them from the members that hold them, and the engine loads the assembled copy.
    # Absent, not empty, when there are none: a member of 0.1.0 refuses a deployment with a
    # field it does not know, and deployments without weights must stay readable to it.
    artifact: Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")] | UnsetType = UNSET
    # Bounds and a policy when it scales on load; absent when fixed (as `artifact`, for
    # members that do not know the field: `elastic-deployments` in facts.wire).
    elastic: Elastic | UnsetType = UNSET
    # Members one replica spans (issue 32: `gpus` on each, the first part the head); absent
    # when one, as `artifact` (`spanning-replicas` in facts.wire).
    nodes: Annotated[int, Meta(ge=2, le=64)] | UnsetType = UNSET
    deleted: bool = False
    version: Annotated[int, Meta(ge=1, le=2**53 - 1)] = 1
    updatedAt: Annotated[int, Meta(ge=0)] = 0  # epoch ms
    by: Annotated[str, Meta(max_length=256)] = ""  # the member that made this version
    byCert: Annotated[str, Meta(max_length=8192)] = ""
    signature: Annotated[str, Meta(max_length=256)] = ""

    @property
    def weights(self) -> str:
        """The digest of the artifact it loads, or ""."""
        return self.artifact if isinstance(self.artifact, str) else ""

    @property
    def scaling(self) -> Elastic | None:
        """Its bounds and policy when it scales on load, else None (a fixed count)."""
        return self.elastic if isinstance(self.elastic, Elastic) else None

    @property
    def span(self) -> int:
        """Members one replica spans (1: a replica on one member)."""
        return self.nodes if isinstance(self.nodes, int) else 1


def _says(d: Deployment) -> str:
    if d.deleted:
        return "undeployed"
    if (e := d.scaling) is not None:
        return f"{d.replicas} replica(s) of {e.min}..{e.max} ({e.reason})"
    return f"declared: {d.replicas} replica(s)"


DEPLOYMENT: Final[FactKind[Deployment]] = FactKind(
    what="deployment",
    struct=Deployment,
    key=lambda d: d.name,
    is_tombstone=lambda d: d.deleted,
    says=_says,
    capacity=MAX_DEPLOYMENTS,
    tombstone_ms=TOMBSTONE_MS,
)


class DeploymentSet(SignedSet[Deployment]):
    """The versions of deployments this member holds, one per name, at most `MAX_DEPLOYMENTS`."""

    def __init__(self) -> None:
        super().__init__(DEPLOYMENT)

    def offer(self, fact: Deployment, now_ms: int = 0, raw: bytes | None = None) -> bool:
        """Take `fact` when it is newer than the version held; returns if taken. A
        deployment never expires, so the time changes nothing here."""
        return super().offer(fact, now_ms, raw)


def spec_digest(deployment: Deployment) -> str:
    """What a replica was started from: engine, source, arguments, GPUs and TP (not the
    replica count nor its bounds -- scaling must not restart anything). A replica whose
    digest differs from its deployment's is replaced."""
    spec: tuple[object, ...] = (
        deployment.id,
        deployment.engine,
        deployment.source,
        deployment.args,
        deployment.gpus,
        deployment.tp,
        deployment.authority,
        deployment.url,
    )
    if deployment.engineKey:  # appended only when set: digests made before it stay the same
        spec = (*spec, deployment.engineKey)
    if deployment.weights:  # likewise
        spec = (*spec, "artifact", deployment.weights)
    if deployment.span > 1:  # likewise
        spec = (*spec, "nodes", deployment.span)
    return hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:16]
