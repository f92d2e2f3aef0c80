"""Converging deployments to replicas: what this node starts and stops. Pure.

Every member runs `reconcile()` over the same kind of view -- the declared deployments and
what every reachable member reports of its GPUs and replicas -- and carries out only the part
that concerns its own GPUs. A GPU is committed only by the node that owns it (the one
writer), so two members can never put one GPU under two replicas; what they can do, while
their views differ, is start a replica each for the same slot. Both rules below are
deterministic over the view, so once the views agree the cluster agrees:

- **Missing replicas** are placed one at a time on the free GPUs (healthy, of the class asked
  for, with the memory asked for, not held by any replica): on each eligible node the
  tightest group that fits (a topology domain when the deployment asks for one, the node's
  free GPUs otherwise), nodes holding fewer replicas of the deployment first (so a node's
  loss takes as few as possible), then nodes that already hold the deployment's weights (an
  artifact: a preference, not a filter -- a node without them fetches them first), then the
  tighter fit, then the node id. A placement that lands on this node is a `Start`.
- **Surplus replicas** (more live ones than declared: a race, or a member back from a
  partition with its replicas still running) are cut to the declared number keeping ready
  ones first, then starting, then fetching, then failed, then the oldest, then by id; a
  node stops its own replicas outside that set.
  A replica of another version of the deployment's spec, or of a deployment no longer
  declared, is stopped by its node.

Scaling changes only the delta: a replica that is live and current is never touched while
it is within the declared number.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "Gpu",
    "Host",
    "Plan",
    "Running",
    "Start",
    "Want",
    "admissible",
    "reconcile",
    "why_not_on",
]

# A failed replica counts towards the declared number: its node keeps it (and its GPUs), and
# shows why, until it retries it -- a deployment that cannot start must not take GPU after
# GPU across the cluster. Surplus cuts take failed ones first.
LIVE: Final = frozenset({"fetching", "starting", "ready", "failed"})


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU as placement sees it."""

    id: str
    device_class: str
    memory: int  # bytes in all
    healthy: bool
    domain: str


@dataclass(frozen=True, slots=True)
class Running:
    """A replica as the node that runs it reports it."""

    id: str
    deployment: str  # the deployment's name
    deployment_id: str
    spec: str  # the digest of the spec it was started with
    devices: tuple[str, ...]
    state: str  # fetching, starting, ready, failed, stopping
    created_at: int  # epoch ms


@dataclass(frozen=True, slots=True)
class Host:
    """A member as placement sees it."""

    node_id: str
    name: str = ""
    reachable: bool = True
    cordoned: bool = False
    gpus: tuple[Gpu, ...] = ()
    replicas: tuple[Running, ...] = ()
    holds: frozenset[str] = frozenset()  # the artifacts (digests) resident on it


@dataclass(frozen=True, slots=True)
class Want:
    """A managed deployment, as placement sees it."""

    name: str
    id: str
    spec: str
    replicas: int
    gpus: int = 1
    node: str = ""  # a node id or name to stay on; "" anywhere
    device_class: str = ""
    one_domain: bool = False
    min_memory: int = 0
    artifact: str = ""  # the digest of the weights it loads; "" none


@dataclass(frozen=True, slots=True)
class Start:
    """A replica to start: on `node_id`, on those GPUs."""

    deployment: str
    deployment_id: str
    node_id: str
    devices: tuple[str, ...]


@dataclass
class Plan:
    """What this node does now, and what the others are expected to do."""

    start: list[Start] = field(default_factory=list)  # this node's
    stop: list[tuple[str, str]] = field(default_factory=list)  # (replica id, why), ours
    elsewhere: list[Start] = field(default_factory=list)  # placements other nodes carry out
    unplaced: list[tuple[str, str]] = field(default_factory=list)  # (deployment, why)


def reconcile(self_id: str, wants: Sequence[Want], hosts: Sequence[Host]) -> Plan:
    """This node's part in converging `wants` over `hosts` (this node among them)."""
    plan = Plan()
    reachable = sorted((h for h in hosts if h.reachable or h.node_id == self_id), key=_key)
    used: dict[str, set[str]] = {h.node_id: _held(h) for h in reachable}
    declared = {w.name: w for w in wants}
    mine = next((h for h in reachable if h.node_id == self_id), None)
    if mine is not None:
        for replica in mine.replicas:
            want = declared.get(replica.deployment)
            if want is None:
                plan.stop.append((replica.id, "its deployment is no longer declared"))
            elif (replica.deployment_id, replica.spec) != (want.id, want.spec):
                plan.stop.append((replica.id, "its deployment has changed"))
    for want in sorted(wants, key=lambda w: w.name):
        live = [
            (host.node_id, r)
            for host in reachable
            for r in host.replicas
            if r.deployment == want.name
            and (r.deployment_id, r.spec) == (want.id, want.spec)
            and r.state in LIVE
        ]
        if len(live) > want.replicas:
            keep = sorted(live, key=lambda nr: (_rank(nr[1].state), nr[1].created_at, nr[1].id))
            for node_id, replica in keep[want.replicas :]:
                if node_id == self_id:
                    plan.stop.append((replica.id, f"more than the {want.replicas} declared"))
            continue
        count = Counter(node_id for node_id, _ in live)
        for _ in range(want.replicas - len(live)):
            placed = _place(want, reachable, used, count)
            if isinstance(placed, str):
                plan.unplaced.append((want.name, placed))
                break
            count[placed.node_id] += 1
            used[placed.node_id].update(placed.devices)
            (plan.start if placed.node_id == self_id else plan.elsewhere).append(placed)
    return plan


def why_not_on(want: Want, host: Host) -> str | None:
    """Why a replica of `want` cannot go on `host` now (None: it can): `nvpair explain`."""
    found = _fit(want, host, _held(host))
    return found if isinstance(found, str) else None


def admissible(start: Start, mine: Iterable[Running]) -> bool:
    """Whether this node may commit `start`'s GPUs: none is held by one of its replicas. The
    node that owns a GPU is the only one that commits it, and it checks here against what it
    runs, not against the view the plan was made from -- so no GPU is ever under two
    replicas, however stale that view was."""
    held = {d for r in mine for d in r.devices}
    return held.isdisjoint(start.devices)


def _rank(state: str) -> int:
    return {"ready": 0, "starting": 1, "fetching": 2}.get(state, 3)


def _key(host: Host) -> str:
    return host.node_id


def _held(host: Host) -> set[str]:
    # Every replica's GPUs are held, a failed one's too: it is kept, and shown, until its
    # deployment changes or goes (a crash loop must not take GPU after GPU).
    return {d for r in host.replicas for d in r.devices}


def _place(
    want: Want, hosts: Iterable[Host], used: dict[str, set[str]], count: Counter[str]
) -> Start | str:
    best: tuple[tuple[int, bool, int, str], Start] | None = None
    reasons: list[str] = []
    for host in hosts:
        found = _fit(want, host, used[host.node_id])
        if isinstance(found, str):
            reasons.append(f"{host.name or host.node_id}: {found}")
            continue
        leftover, devices = found
        fetches = bool(want.artifact) and want.artifact not in host.holds
        rank = (count[host.node_id], fetches, leftover, host.node_id)
        if best is None or rank < best[0]:
            best = (rank, Start(want.name, want.id, host.node_id, devices))
    if best is None:
        return "; ".join(reasons) if reasons else "no member to place it on"
    return best[1]


def _fit(want: Want, host: Host, used: set[str]) -> tuple[int, tuple[str, ...]] | str:
    """(GPUs left over in the group, the GPUs) of the tightest fit on `host`, or why none."""
    if not host.reachable:
        return "unreachable"
    if host.cordoned:
        return "cordoned"
    if want.node and want.node not in (host.node_id, host.name):
        return f"the deployment is constrained to {want.node}"
    if want.gpus == 0:
        return (0, ())
    free = [
        g
        for g in host.gpus
        if g.healthy
        and g.id not in used
        and (not want.device_class or g.device_class == want.device_class)
        and g.memory >= want.min_memory
    ]
    if len(free) < want.gpus:
        what = f"{want.device_class} " if want.device_class else ""
        memory = f" with {want.min_memory // 2**30} GiB" if want.min_memory else ""
        return f"{len(free)} free healthy {what}GPU(s){memory}, {want.gpus} needed"
    groups: dict[str, list[Gpu]] = {}
    for gpu in free:
        groups.setdefault(gpu.domain if want.one_domain else "", []).append(gpu)
    fitting = [(len(g) - want.gpus, key, g) for key, g in groups.items() if len(g) >= want.gpus]
    if not fitting:
        most = max(len(g) for g in groups.values())
        return f"no topology domain with {want.gpus} free GPUs (at most {most} in one)"
    leftover, _, group = min(fitting, key=lambda f: (f[0], f[1]))
    chosen = sorted(group, key=lambda g: g.id)[: want.gpus]
    return (leftover, tuple(g.id for g in chosen))
