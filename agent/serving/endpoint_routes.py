"""The facade's endpoint routing table: which deployment serves a request whose model is an
endpoint's public name (issue 16, item 5).

The table is the `routes` of the last `DesiredState` the plane sent (`update`, an
`on_desired` handler), kept until the next one: routing goes on through a plane outage. An
agent with no plane holds an empty table and routes nothing through it.

A request is matched by its Host (port stripped, case-insensitive) against the tenants'
hosts: the route of the tenant on that host, else the route of a tenant that has no host.
A weighted endpoint picks by smooth weighted round-robin (nginx's: deterministic, exact over
each cycle of the weights' sum); a failover endpoint picks the first target by order that is
up. Up: for a target in this cluster, a ready replica of its deployment in the members'
records (`ready_here`); for another cluster's, the plane's `ready`, a URL to forward to, and
no forward failure from here in the last `DOWN_S`.

Pure: time is passed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from plane.desired.state import DesiredState, Route, RouteTarget
from scheduler.replicas import READY, ReplicaView

__all__ = [
    "DOWN_S",
    "MAX_CANDIDATES",
    "EndpointRoutes",
    "Pick",
    "endpoint_models",
    "ready_in",
    "request_host",
]

log = logging.getLogger(__name__)

DOWN_S: Final = 5.0  # a target another cluster failed to take is skipped this long
MAX_CANDIDATES: Final = 3  # targets one request tries, best first


@dataclass(frozen=True, slots=True)
class Pick:
    """A target to send the request to: here (by its deployment name) or forwarded."""

    route: Route
    target: RouteTarget
    local: bool


def request_host(host: str) -> str:
    """The host a request arrived on, as tenants' hosts are matched: lowercase, without the
    port (`[::1]:8080` -> `[::1]`) or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        host = host[: end + 1] if end > 0 else host
    else:
        name, colon, port = host.rpartition(":")
        if colon and port.isdigit() and ":" not in name:
            host = name
    return host.rstrip(".")


class _Weighted:
    """Smooth weighted round-robin over one endpoint's targets (by their place in its list):
    each pick adds every live target's weight to its score and takes the highest, which
    then gives back the sum -- over a cycle of that sum each is picked exactly its weight
    times, spread out rather than in runs."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: dict[int, int] = {}

    def pick(self, targets: list[tuple[int, RouteTarget]]) -> RouteTarget | None:
        total = sum(t.weight for _, t in targets)
        if total <= 0:
            return None
        best = -1
        for index, target in targets:
            score = self.current[index] = self.current.get(index, 0) + target.weight
            if best < 0 or score > self.current[best]:
                best = index
        self.current[best] -= total
        return next(t for i, t in targets if i == best)


class EndpointRoutes:
    """The routing table: `update` replaces it, `pick` resolves (host, model), `failed`
    marks another cluster's target down for `DOWN_S`."""

    def __init__(
        self,
        *,
        ready_here: Callable[[str], bool] = lambda _name: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ready_here = ready_here  # a ready replica of this deployment name in the cluster
        self._clock = clock
        self.cluster = ""  # this cluster's id, from the desired state
        self.generation = -1  # of the desired state the table came from; -1: none yet
        self._by_host: dict[tuple[str, str], Route] = {}
        self._any_host: dict[str, Route] = {}
        self._wrr: dict[str, _Weighted] = {}  # endpoint id -> its round-robin state
        self._down: dict[str, float] = {}  # deployment id -> until when it is skipped

    def __len__(self) -> int:
        return len(self._by_host) + len(self._any_host)

    async def update(self, state: DesiredState) -> None:
        """The `on_desired` handler: take the state's routes as the table."""
        self.replace(state)

    def replace(self, state: DesiredState) -> None:
        """Take `state.routes` as the table. Routes are indexed by (host, model) and by model
        for tenants without a host; of two routes under one key, the first (by tenant, then
        endpoint id) is kept. An endpoint whose targets or weights changed starts a new
        round-robin cycle; one unchanged keeps its place in the cycle."""
        by_host: dict[tuple[str, str], Route] = {}
        any_host: dict[str, Route] = {}
        for route in sorted(state.routes, key=lambda r: (r.tenant, r.endpoint)):
            host = request_host(route.host) if route.host else ""
            if host:
                by_host.setdefault((host, route.model), route)
            else:
                any_host.setdefault(route.model, route)
        old = {r.endpoint: r for r in self._routes()}
        kept: dict[str, _Weighted] = {}
        deployments: set[str] = set()
        for route in [*by_host.values(), *any_host.values()]:
            deployments.update(t.deployment for t in route.targets)
            before = old.get(route.endpoint)
            wrr = self._wrr.get(route.endpoint)
            if wrr is not None and before is not None and _weights(before) == _weights(route):
                kept[route.endpoint] = wrr
        self._by_host, self._any_host, self._wrr = by_host, any_host, kept
        # Down marks of targets no longer listed go: the map stays within the table's size.
        self._down = {d: until for d, until in self._down.items() if d in deployments}
        self.cluster, self.generation = state.cluster, state.generation

    def _routes(self) -> Iterable[Route]:
        yield from self._by_host.values()
        yield from self._any_host.values()

    def route(self, host: str, model: str) -> Route | None:
        """The endpoint a request for `model` on `host` names, or None."""
        if not self._by_host and not self._any_host:
            return None
        found = self._by_host.get((request_host(host), model)) if self._by_host else None
        return found if found is not None else self._any_host.get(model)

    def models(self, host: str) -> list[str]:
        """The public names a request on `host` can use (for `/v1/models`)."""
        wanted = request_host(host)
        names = {m for (h, m) in self._by_host if h == wanted}
        names.update(self._any_host)
        return sorted(names)

    def pick(self, host: str, model: str) -> list[Pick] | None:
        """The targets to try for a request, best first (at most `MAX_CANDIDATES`); None when
        `model` is no endpoint here; [] when the endpoint has no target to send it to."""
        route = self.route(host, model)
        if route is None:
            return None
        now = self._clock()
        up = [(i, t) for i, t in enumerate(route.targets) if self._is_up(t, now)]
        if route.mode == "failover":
            ordered = [t for _, t in sorted(up, key=lambda it: (it[1].order, it[0]))]
        else:
            live = [(i, t) for i, t in up if t.weight > 0]
            first = self._wrr.setdefault(route.endpoint, _Weighted()).pick(live)
            rest = sorted((t for _, t in live if t is not first), key=lambda t: -t.weight)
            ordered = [first, *rest] if first is not None else []
        return [Pick(route, t, t.cluster == self.cluster) for t in ordered[:MAX_CANDIDATES]]

    def _is_up(self, target: RouteTarget, now: float) -> bool:
        if target.cluster == self.cluster:
            return self._ready_here(target.name)
        if not target.ready or not target.urls:
            return False
        until = self._down.get(target.deployment)
        return until is None or until <= now

    def failed(self, target: RouteTarget) -> None:
        """A forward to `target` failed before any byte reached the client: skip it for
        `DOWN_S` (a failover endpoint moves on to its next target)."""
        self._down[target.deployment] = self._clock() + DOWN_S


def _weights(route: Route) -> tuple[tuple[str, int], ...]:
    return tuple((t.deployment, t.weight) for t in route.targets)


def ready_in(replicas: Iterable[ReplicaView], name: str) -> bool:
    """Whether the members' records show a ready replica of deployment `name` on a reachable
    member: what makes a target in this cluster up."""
    return any(r.model == name and r.state == READY and r.reachable for r in replicas)


def endpoint_models(
    names: Iterable[str], served: list[dict[str, object]]
) -> list[dict[str, object]]:
    """`/v1/models` entries of the endpoint names not listed already (a deployment's name
    wins: the entry that says where it runs)."""
    listed = {entry["id"] for entry in served}
    return [
        {"id": name, "object": "model", "created": 0, "owned_by": "nvpair", "nodes": []}
        for name in names
        if name not in listed
    ]
