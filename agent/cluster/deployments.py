"""This node's copy of the cluster's deployments: declared here or learnt from members,
kept in `$NVPAIR_HOME/deployments.json` (0600), pushed with every records push.

Declaring, scaling and undeploying sign a new version with this node's key
(`agent.cluster.signed_facts` says how they are kept, `facts.signed_set` how versions converge). A
file that cannot be read is set aside as `deployments.json.corrupt` and the node starts with
none: the members push theirs.
"""

from __future__ import annotations

from typing import Final

import msgspec
from msgspec import UNSET

from agent.cluster.signed_facts import FactRefused, SignedFacts
from facts.deployments import Constraints, Deployment, DeploymentSet, Elastic
from plane.core.ids import new_id

__all__ = ["DEPLOYMENTS_FILE", "DeploymentRefused", "DeploymentRequest", "Deployments"]

DEPLOYMENTS_FILE: Final = "deployments.json"


class DeploymentRefused(FactRefused):
    """A declaration that cannot be taken (no such deployment, a bad request)."""


class DeploymentRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of `POST /v1/deployments` (`nvpair deploy`): a deployment, less what the
    cluster adds (id, version, signature)."""

    name: str
    engine: str
    source: str = ""
    args: list[str] = []
    gpus: int = 1
    tp: int = 0  # 0: as many as GPUs per replica
    nodes: int = 1  # members one replica spans (issue 32), `gpus` on each
    replicas: int | None = None  # a fixed count (default 1); with bounds, the first count
    # Scaling on load (issue 30): either bound makes it elastic; min defaults to 1, max to
    # min (at least 1). `replicas` then starts it (default: min, or the count it has now).
    minReplicas: int | None = None
    maxReplicas: int | None = None
    targetWaiting: float = 0.0
    scaleDownAfterS: float = 300.0
    idleToZeroS: float = 900.0
    priority: int | None = None  # its class when GPUs are short, 0..100 (default 0)
    coldStartS: float | None = None  # a request's wait while one starts (default: the line's)
    maxInFlight: int = 0  # 0: no limit
    constraints: Constraints = Constraints()
    authority: str = "managed"
    url: str = ""
    engineKey: str = ""  # "", "generate" or "file:PATH" (facts.deployments)
    # The weights it loads: an artifact's name, id or digest (the local API resolves it to
    # the digest, and refuses one that no member holds).
    artifact: str = ""


class Deployments(SignedFacts[Deployment]):
    """Declared deployments, persisted (`SignedFacts`); declaring, scaling and undeploying
    make signed versions."""

    file = DEPLOYMENTS_FILE
    refused = DeploymentRefused

    def new_set(self) -> DeploymentSet:
        """An empty set of deployments."""
        return DeploymentSet()

    def get(self, name: str) -> Deployment | None:
        """The live deployment `name`, or None."""
        held = self.held.get(name)
        return None if held is None or held.deleted else held

    def declare(self, request: DeploymentRequest, *, id: str | None = None) -> Deployment:
        """Declare (or redeclare) a deployment; the version made here. `id`: the plane's
        deployment id (else the held one's, or a fresh one)."""
        held = self.held.get(request.name)
        if id is None:
            id = held.id if held is not None and not held.deleted else new_id("dep")
        elastic = _elastic(request)
        replicas = request.replicas if request.replicas is not None else 1
        if elastic is not None:
            if request.replicas is not None:
                if not elastic.min <= request.replicas <= elastic.max:
                    raise DeploymentRefused(
                        f"replicas: {request.replicas} is outside {elastic.min}..{elastic.max}"
                    )
            elif held is not None and not held.deleted:
                # Kept, moved inside the bounds -- a fixed count given bounds too: what runs
                # goes on running, and the load moves it from there.
                replicas = max(elastic.min, min(elastic.max, held.replicas))
            else:
                replicas = elastic.min
        try:
            fresh = Deployment(
                id=id,
                name=request.name,
                engine=request.engine,
                source=request.source,
                args=request.args,
                gpus=request.gpus,
                tp=request.tp or max(1, request.gpus),
                replicas=replicas,
                maxInFlight=request.maxInFlight,
                constraints=request.constraints,
                authority=request.authority,  # type: ignore[arg-type]  # checked just below
                url=request.url,
                engineKey=request.engineKey,
                artifact=request.artifact or UNSET,
                elastic=elastic if elastic is not None else UNSET,
                nodes=request.nodes if request.nodes != 1 else UNSET,
            )
            fresh = msgspec.convert(msgspec.to_builtins(fresh), Deployment)  # the wire's checks
        except msgspec.ValidationError as exc:
            raise DeploymentRefused(f"bad deployment: {exc}") from None
        if fresh.authority == "observed" and not fresh.url:
            raise DeploymentRefused("an observed deployment names the engine's url")
        if fresh.authority == "observed" and fresh.span > 1:
            raise DeploymentRefused("nodes: an observed engine is watched, never placed")
        return self.commit(fresh)

    def scale(self, name: str, replicas: int, reason: str = "operator") -> Deployment:
        """Change a deployment's replicas only; an elastic one's within its bounds, with
        why (`reason`: the scaler's, or "operator")."""
        held = self._live(name)
        if not 0 <= replicas <= 1024:
            raise DeploymentRefused("replicas: between 0 and 1024")
        elastic = held.scaling
        if elastic is None:
            return self.commit(msgspec.structs.replace(held, replicas=replicas))
        if not elastic.min <= replicas <= elastic.max:
            raise DeploymentRefused(
                f"replicas: {name} scales on load between {elastic.min} and {elastic.max}; "
                "redeploy with other bounds to go outside them"
            )
        moved = msgspec.structs.replace(elastic, reason=reason)
        return self.commit(msgspec.structs.replace(held, replicas=replicas, elastic=moved))

    def undeploy(self, name: str) -> Deployment:
        """Undeploy: a tombstone version; its replicas stop everywhere."""
        return self.commit(msgspec.structs.replace(self._live(name), deleted=True))

    def _live(self, name: str) -> Deployment:
        held = self.get(name)
        if held is None:
            raise DeploymentRefused(f"no deployment named {name!r}")
        return held


def _elastic(request: DeploymentRequest) -> Elastic | None:
    """The bounds and policy a declaration asks for, or None for a fixed count."""
    if request.minReplicas is None and request.maxReplicas is None:
        return None
    low = request.minReplicas if request.minReplicas is not None else 1
    high = request.maxReplicas if request.maxReplicas is not None else max(1, low)
    if low > high:
        raise DeploymentRefused(f"minReplicas {low} is more than maxReplicas {high}")
    try:
        made = Elastic(
            min=low,
            max=high,
            targetWaiting=request.targetWaiting,
            scaleDownAfterS=request.scaleDownAfterS,
            idleToZeroS=request.idleToZeroS,
            priority=UNSET if request.priority is None else request.priority,
            coldStartS=UNSET if request.coldStartS is None else request.coldStartS,
        )
        return msgspec.convert(msgspec.to_builtins(made), Elastic)  # the wire's checks
    except msgspec.ValidationError as exc:
        raise DeploymentRefused(f"bad bounds: {exc}") from None
