"""The deployments' converger: the plane's deployments for this cluster, declared in the
cluster's own deployment machinery (`agent.cluster.deployments`).

Every node converges on each new desired state (`PlaneLink.on_desired`). `plan()` is pure:
it compares the plane's deployments with the live cluster ones and says what differs --
declare (under the plane deployment's id and name), scale, or undeploy a deployment the
plane placed earlier (its id is in `placed`) and lists no more. What is the same is left
alone, so a converged cluster makes no new version; two nodes converging at once make the
same content, and the deployments' version order keeps one of the two everywhere.

Between new states the converger runs again on the state held every `RECONVERGE_S`, so a
plane deployment scaled or undeployed in the cluster (`nvpair scale`) returns to what the
plane wants; a converged cluster costs a comparison.

A plane deployment whose workload follows its load (`minReplicas` set) is declared elastic:
its share of the workload's min and max as bounds. The cluster's own decider then moves its
count on load (`agent.cluster.scaler`), so the converger leaves the count alone and
redeclares only when the bounds or the rest of the spec differ. Until every member knows
elastic deployments (the `elastic-deployments` feature) it is declared at its max, a fixed
count: the plane reserved that much for it.

A cluster deployment of the same name that the plane did not place (declared with
`nvpair deploy`, another id) is left alone and reported (`conflicts`, logged once): the
operator of the cluster decides, by undeploying it, and the plane's is declared then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Final

from agent.cluster.deployments import DeploymentRefused, DeploymentRequest, Deployments
from facts.deployments import Constraints, Deployment
from plane.desired.state import DesiredDeployment, DesiredState

__all__ = ["Declare", "PlaneConverger", "Scale", "Undeploy", "plan", "request_for"]

log = logging.getLogger(__name__)

MAX_CONFLICTS: Final = 256
RECONVERGE_S: Final = 30.0  # the held state again: a cluster edit of a plane deployment is undone


@dataclass(frozen=True)
class Declare:
    """Declare `request` under the plane's deployment id."""

    id: str
    request: DeploymentRequest


@dataclass(frozen=True)
class Scale:
    """Only the replica count differs."""

    name: str
    replicas: int


@dataclass(frozen=True)
class Undeploy:
    """A deployment the plane placed and no longer lists."""

    name: str


Action = Declare | Scale | Undeploy


def request_for(d: DesiredDeployment, *, elastic: bool = False) -> DeploymentRequest:
    """The cluster declaration of a plane deployment (observed: its url, on its node); with
    `elastic` (the cluster knows bounds), one on load gets its shares of min and max."""
    observed = d.authority == "observed"
    low = d.minReplicas if isinstance(d.minReplicas, int) else None
    on_load = elastic and low is not None and not observed and not d.paused and d.replicas > 0
    return DeploymentRequest(
        name=d.name,
        engine=d.engine,
        source=d.source,
        args=list(d.args),
        gpus=d.gpus,
        tp=d.tp,
        replicas=None if on_load else (0 if d.paused else d.replicas),
        minReplicas=low if on_load else None,
        maxReplicas=d.replicas if on_load else None,
        maxInFlight=d.maxInFlight,
        constraints=Constraints(
            node=d.node if observed else d.constraints.node,
            deviceClass=d.constraints.deviceClass,
            oneDomain=d.constraints.oneDomain,
            minMemory=d.constraints.minMemory,
        ),
        authority=d.authority,
        url=d.url if observed else "",
    )


def _bounds(held: Deployment) -> tuple[int, int] | None:
    e = held.scaling
    return None if e is None else (e.min, e.max)


def _wanted_bounds(want: DeploymentRequest) -> tuple[int, int] | None:
    if want.minReplicas is None or want.maxReplicas is None:
        return None
    return (want.minReplicas, want.maxReplicas)


def _same_spec(held: Deployment, want: DeploymentRequest) -> bool:
    if _bounds(held) != _wanted_bounds(want):
        return False
    return (
        held.engine,
        held.source,
        list(held.args),
        held.gpus,
        held.tp,
        held.maxInFlight,
        held.constraints,
        held.authority,
        held.url,
    ) == (
        want.engine,
        want.source,
        want.args,
        want.gpus,
        want.tp,
        want.maxInFlight,
        want.constraints,
        want.authority,
        want.url,
    )


def plan(
    desired: Collection[DesiredDeployment],
    live: Collection[Deployment],
    placed: Collection[str],
    *,
    elastic: bool = False,
) -> tuple[list[Action], dict[str, str]]:
    """What to do to make `live` what the plane wants, and the names left alone (why);
    `elastic`: the cluster takes deployments with bounds (`request_for`)."""
    by_name = {d.name: d for d in live}
    actions: list[Action] = []
    conflicts: dict[str, str] = {}
    wanted_ids = {d.id for d in desired}
    wanted_names = {d.name for d in desired}
    for d in desired:
        want = request_for(d, elastic=elastic)
        held = by_name.get(d.name)
        if held is None:
            actions.append(Declare(d.id, want))
        elif held.id != d.id and held.id not in placed:
            conflicts[d.name] = (
                f"a deployment named {d.name!r} was declared in the cluster ({held.id}), "
                f"not by the plane ({d.id}): left alone"
            )
        elif held.id != d.id or not _same_spec(held, want):
            actions.append(Declare(d.id, want))
        elif _wanted_bounds(want) is None and held.replicas != (count := want.replicas or 0):
            actions.append(Scale(d.name, count))  # on load, the count is the cluster's
    for held in live:
        if held.id in placed and held.id not in wanted_ids and held.name not in wanted_names:
            actions.append(Undeploy(held.name))
    return actions, conflicts


class PlaneConverger:
    """An `on_desired` handler: converges the cluster's deployments on each state."""

    def __init__(
        self,
        deployments: Deployments,
        *,
        placed: Callable[[], Collection[str]],
        elastic: Callable[[], bool] = lambda: False,
    ) -> None:
        self._deployments = deployments
        self._placed = placed
        self._elastic = elastic  # every member knows elastic deployments (the feature gate)
        self.conflicts: dict[str, str] = {}  # deployment name -> why it is left alone
        self.applied = 0  # versions made since start
        self.last_error: str | None = None

    async def __call__(self, state: DesiredState) -> None:
        """Converge on `state` (its deployments; the rest is other handlers')."""
        actions, conflicts = plan(
            state.deployments, self._deployments.live(), self._placed(), elastic=self._elastic()
        )
        for name, why in conflicts.items():
            if self.conflicts.get(name) != why:
                log.warning("plane deployment %s: %s", name, why)
        self.conflicts = dict(list(conflicts.items())[:MAX_CONFLICTS])
        self.last_error = None
        for action in actions:
            try:
                if isinstance(action, Declare):
                    self._deployments.declare(action.request, id=action.id)
                elif isinstance(action, Scale):
                    self._deployments.scale(action.name, action.replicas)
                else:
                    self._deployments.undeploy(action.name)
            except DeploymentRefused as exc:  # a plane deployment the cluster cannot take
                self.last_error = str(exc)[:256]
                log.warning("plane deployment not converged: %s", self.last_error)
                continue
            self.applied += 1
            name = action.request.name if isinstance(action, Declare) else action.name
            log.info("plane deployment %s: %s", name, type(action).__name__.lower())

    async def run(
        self,
        held: Callable[[], DesiredState | None],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Converge on the state `held` gives every `RECONVERGE_S`, until cancelled."""
        while True:
            await sleep(RECONVERGE_S)
            state = held()
            if state is not None:
                await self(state)
