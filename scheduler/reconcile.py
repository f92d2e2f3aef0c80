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

**Spanning replicas** (issue 32: a deployment with `nodes` > 1) are one replica made of
`nodes` parts, each on its own member with `gpus` GPUs there (the one-domain rule per member),
the first part the head. They follow the same rules with a group in place of a replica:

- **All or nothing.** A missing replica is placed only where all its parts fit: the first
  `nodes` members in the order above that each have room. The first of them, the head's
  member, starts its part under a fresh group id (the caller names it: `Start.group` is ""),
  with the layout -- which member, which GPUs, in rank order -- in its record.
- **Joining.** A worker's member named in a live group's layout that runs no part of it
  starts its part on the GPUs the layout names, when they are free there (`admissible`):
  the workers follow the head's plan, whatever their own view would have placed. The head's
  member never joins: a head part that went takes its replica with it. The GPUs a live group
  names on a member count as taken there until that member's part is up or the group is gone.
- **Whole or restarted.** A group one of whose parts failed, whose layout names a member
  that is not reachable, whose parts disagree on the layout, or that a member has seen whole
  (`seal`, kept by the caller) and now misses a part of, is broken:
  every member stops its parts of it at once, and the replica is placed anew -- a member
  whose part died never joins its old group again. A part whose partner has not
  joined within `JOIN_MS` of the part's start (the member's own clock) is stopped too -- so
  after convergence no partial replica holds a GPU.
- **Surplus** groups are cut as replicas are: whole ones kept first, then by their parts'
  states, then the oldest, then by group id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "JOIN_MS",
    "Gpu",
    "Host",
    "Part",
    "Plan",
    "Running",
    "Start",
    "Want",
    "admissible",
    "reconcile",
    "seal",
    "why_not_on",
]

# A failed replica counts towards the declared number: its node keeps it (and its GPUs), and
# shows why, until it retries it -- a deployment that cannot start must not take GPU after
# GPU across the cluster. Surplus cuts take failed ones first.
LIVE: Final = frozenset({"fetching", "starting", "ready", "failed"})
# A part of a spanning replica whose partners have not all joined this long after it started
# is stopped (its member's own clock): the layout it was started for did not happen.
JOIN_MS: Final = 20_000


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU as placement sees it."""

    id: str
    device_class: str
    memory: int  # bytes in all
    healthy: bool
    domain: str


@dataclass(frozen=True, slots=True)
class Part:
    """One member's share of a spanning replica: the member and its GPUs there."""

    node_id: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Running:
    """A replica as the node that runs it reports it (a part of one, when `group` is set)."""

    id: str
    deployment: str  # the deployment's name
    deployment_id: str
    spec: str  # the digest of the spec it was started with
    devices: tuple[str, ...]
    state: str  # fetching, starting, ready, failed, stopping
    created_at: int  # epoch ms
    group: str = ""  # the spanning replica it is a part of; "" a replica of its own
    layout: tuple[Part, ...] = ()  # that replica's parts in rank order (the head first)


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
    nodes: int = 1  # members one replica spans (`gpus` on each)


@dataclass(frozen=True, slots=True)
class Start:
    """A replica to start: on `node_id`, on those GPUs (a part of a spanning one when
    `group` is set: `layout` holds every part, in rank order)."""

    deployment: str
    deployment_id: str
    node_id: str
    devices: tuple[str, ...]
    group: str = ""
    layout: tuple[Part, ...] = ()

    @property
    def rank(self) -> int:
        """Its place in the layout: 0 the head (and a replica of its own)."""
        return next((i for i, p in enumerate(self.layout) if p.node_id == self.node_id), 0)


@dataclass
class Plan:
    """What this node does now, and what the others are expected to do."""

    start: list[Start] = field(default_factory=list)  # this node's
    stop: list[tuple[str, str]] = field(default_factory=list)  # (replica id, why), ours
    elsewhere: list[Start] = field(default_factory=list)  # placements other nodes carry out
    unplaced: list[tuple[str, str]] = field(default_factory=list)  # (deployment, why)


def reconcile(
    self_id: str,
    wants: Sequence[Want],
    hosts: Sequence[Host],
    *,
    now_ms: int = 0,
    join_ms: int = JOIN_MS,
    sealed: Collection[str] = frozenset(),
) -> Plan:
    """This node's part in converging `wants` over `hosts` (this node among them); `now_ms`
    is this node's clock, for its parts that wait for their partners (`JOIN_MS`); `sealed`
    the spanning replicas this node has seen whole (`seal`): a part missing from one
    of those is lost, not late."""
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
        if want.nodes > 1:
            _spanning(plan, self_id, want, reachable, used, now_ms, join_ms, sealed)
            continue
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
    fitting, reasons = _fitting(want, hosts, used, count)
    if not fitting:
        return "; ".join(reasons) if reasons else "no member to place it on"
    _, node_id, devices = min(fitting)
    return Start(want.name, want.id, node_id, devices)


def _fitting(
    want: Want, hosts: Iterable[Host], used: dict[str, set[str]], count: Counter[str]
) -> tuple[list[tuple[tuple[int, bool, int, str], str, tuple[str, ...]]], list[str]]:
    """Each member with room for a replica (or a part) -- its rank (fewer of the deployment
    there first, then holding its weights, then the tighter fit, then the node id), id and
    GPUs -- and why each other has none."""
    fitting = []
    reasons: list[str] = []
    for host in hosts:
        found = _fit(want, host, used[host.node_id])
        if isinstance(found, str):
            reasons.append(f"{host.name or host.node_id}: {found}")
            continue
        leftover, devices = found
        fetches = bool(want.artifact) and want.artifact not in host.holds
        fitting.append(
            ((count[host.node_id], fetches, leftover, host.node_id), host.node_id, devices)
        )
    return fitting, reasons


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


# -- spanning replicas (issue 32) ----------------------------------------------------------------


def _spanning(
    plan: Plan,
    self_id: str,
    want: Want,
    reachable: Sequence[Host],
    used: dict[str, set[str]],
    now_ms: int,
    join_ms: int,
    sealed: Collection[str],
) -> None:
    """`reconcile` for a deployment whose replicas span `want.nodes` members."""
    groups: dict[str, dict[str, Running]] = {}
    for host in reachable:
        for r in host.replicas:
            if (
                r.deployment == want.name
                and (r.deployment_id, r.spec) == (want.id, want.spec)
                and r.state in LIVE
            ):
                # A part without a group (a bug, a forged record) is a group of its own: broken.
                groups.setdefault(r.group or r.id, {})[host.node_id] = r
    present = {h.node_id for h in reachable}
    me = next((h for h in reachable if h.node_id == self_id), Host(self_id))
    free_here = {g.id for g in me.gpus if g.healthy} - _held(me)  # where a part may join
    kept: list[tuple[tuple[int, int, int, str], str, tuple[Part, ...]]] = []
    breaking = 0
    for gid, parts in groups.items():
        layout = _layout_of(parts)
        why = _broken(gid, parts, layout, present, want.nodes)
        if why is not None:
            mine = parts.get(self_id)
            if mine is not None:
                plan.stop.append((mine.id, why))
            breaking += 1  # placed again once its parts are gone, not beside them
            continue
        missing = [p.node_id for p in layout if p.node_id not in parts]
        mine = parts.get(self_id)
        if missing and gid in sealed:  # it was whole: a part is lost, not late
            if mine is not None:
                why = f"its part on {missing[0]} is gone; restarting the whole replica"
                plan.stop.append((mine.id, why))
            breaking += 1
            continue
        if missing and mine is not None and now_ms - mine.created_at >= join_ms:
            plan.stop.append((mine.id, f"its part on {missing[0]} did not join; placing it anew"))
            breaking += 1
            continue
        states = [_rank(r.state) for r in parts.values()]
        oldest = min(r.created_at for r in parts.values())
        kept.append(((len(missing), max(states), oldest, gid), gid, layout))
        for part in layout:  # its GPUs are its, on members that have not joined yet too
            if part.node_id in used:
                used[part.node_id].update(part.devices)
    kept.sort()
    for _, gid, _layout in kept[want.replicas :]:
        mine = groups[gid].get(self_id)
        if mine is not None:
            plan.stop.append((mine.id, f"more than the {want.replicas} declared"))
    count: Counter[str] = Counter()
    for _, gid, layout in kept[: want.replicas]:
        count.update(p.node_id for p in layout)
        # Workers join; a head never does: its member starts a group, and a head part that
        # went (its engine, its agent) takes the replica with it.
        joining = next((p for p in layout[1:] if p.node_id == self_id), None)
        if joining is not None and self_id not in groups[gid] and set(joining.devices) <= free_here:
            plan.start.append(
                Start(want.name, want.id, self_id, joining.devices, group=gid, layout=layout)
            )
    for _ in range(want.replicas - len(kept) - breaking):
        placed = _place_span(want, reachable, used, count)
        if isinstance(placed, str):
            plan.unplaced.append((want.name, placed))
            break
        for part in placed:
            count[part.node_id] += 1
            used[part.node_id].update(part.devices)
            # The head's member starts it, naming it (`group` ""); the others join it when
            # they see it in the head's record.
            start = Start(want.name, want.id, part.node_id, part.devices, layout=placed)
            (plan.start if part.node_id == self_id == placed[0].node_id else plan.elsewhere).append(
                start
            )


def seal(sealed: Collection[str], hosts: Iterable[Host]) -> set[str]:
    """`sealed` brought up to date with `hosts`: the spanning replicas seen whole (every part
    of its layout runs) are added -- from then on a part that goes is lost, not late -- and
    those of which no part runs any more are forgotten."""
    parts: dict[str, set[str]] = {}
    layouts: dict[str, set[str]] = {}
    for host in hosts:
        for r in host.replicas:
            if r.group and r.state in LIVE:
                parts.setdefault(r.group, set()).add(host.node_id)
                layouts.setdefault(r.group, {p.node_id for p in r.layout})
    whole = {gid for gid, nodes in parts.items() if nodes == layouts[gid]}
    return {gid for gid in {*sealed, *whole} if gid in parts}


def _layout_of(parts: dict[str, Running]) -> tuple[Part, ...]:
    # The head's word when it runs; the first part's otherwise (all started from one plan).
    first = sorted(parts.values(), key=lambda r: r.id)
    for r in first:
        if r.layout and parts.get(r.layout[0].node_id) is r:
            return r.layout
    return first[0].layout


def _broken(
    gid: str, parts: dict[str, Running], layout: tuple[Part, ...], present: set[str], nodes: int
) -> str | None:
    """Why the group is no whole replica and never will be (None: it is, or may become one)."""
    if len(layout) != nodes or len({p.node_id for p in layout}) != nodes:
        return f"its replica {gid} does not have {nodes} parts on {nodes} members"
    where = {p.node_id: p.devices for p in layout}
    for node_id, r in parts.items():
        if r.layout != layout or where.get(node_id) != r.devices:
            return f"the parts of its replica {gid} disagree on where they run"
        if r.state == "failed":
            return f"its part on {node_id} failed; restarting the whole replica"
    for part in layout:
        if part.node_id not in present:
            return f"its part on {part.node_id} is unreachable; restarting the whole replica"
    return None


def _place_span(
    want: Want, hosts: Iterable[Host], used: dict[str, set[str]], count: Counter[str]
) -> tuple[Part, ...] | str:
    """The layout of one more spanning replica: the first `want.nodes` members in the order
    single replicas are placed in, each with room for its part; or why there are not enough."""
    fitting, reasons = _fitting(want, hosts, used, count)
    if len(fitting) < want.nodes:
        need = f"{want.nodes} members with room for a part ({want.gpus} GPU(s) each)"
        why = f"; {'; '.join(reasons)}" if reasons else ""
        return f"a replica spans {need}, {len(fitting)} have it{why}"
    return tuple(Part(node_id, devices) for _, node_id, devices in sorted(fitting)[: want.nodes])
