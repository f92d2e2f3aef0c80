"""Placement across clusters, pure: which clusters may run a workload, how many of its
replicas each has room for, and the shares (no I/O; `plane.placement.sql` reads the
snapshot and writes the deployments).

Capacity is counted from what the clusters observed: on each reachable, uncordoned node, the
healthy devices of the workload's class that no replica holds (allocations) and that no
deployment placed but not yet running has reserved. A replica's GPUs are on one node; with
`oneDomain`, inside one topology domain that has that many free devices. Declared policy
filters (every policy of the workload, its tenant and the cluster must allow), device quotas
bound (fleet-wide: the project's total for the class, refused past it; per cluster: that
cluster's share), and `plane.placement.apportion` divides the replicas. docs/placement.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from plane.placement.apportion import scale_down, scale_up
from plane.placement.capacity import (
    ClusterCapacity,
    NodeDevices,
    Policy,
    Quota,
    Reservation,
    Snapshot,
)

__all__ = [
    "Ask",
    "ClusterCapacity",
    "Decision",
    "NodeDevices",
    "Policy",
    "Quota",
    "Refusal",
    "Reservation",
    "Snapshot",
    "Verdict",
    "decide",
    "screen",
]


# -- the decision ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """What placement is asked for one workload: the total replicas it should run, what a
    replica needs, where it may go, and the shares it has now (`current`)."""

    workload_id: str
    project_id: str
    replicas: int
    device_class: str
    gpus: int = 1
    one_domain: bool = False
    min_memory: int = 0
    regions: frozenset[str] = frozenset()  # constraints.regions; empty: any
    clusters: frozenset[str] = frozenset()  # constraints.clusters (ids or names); empty: any
    policies: tuple[Policy, ...] = ()  # the workload's and its tenant's
    current: Mapping[str, int] = field(default_factory=dict)


class Verdict(NamedTuple):
    """One cluster in a decision: its share, the replicas it had room for beyond what it
    runs or reserved, and why it was refused (None: eligible) -- `field` names what refused
    it (a constraint, a policy, deviceClass, oneDomain, a quota)."""

    cluster_id: str
    name: str
    share: int
    available: int
    field: str | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the ask cannot be placed (HTTP 409): `kind` is `quota` or `capacity`."""

    kind: str
    message: str
    quota: Quota | None = None
    fits: int = 0


Screened = tuple[ClusterCapacity, int, str | None, str | None]  # cluster, fit, field, reason
_UNBOUNDED: Final = 1024  # replicas a cluster has room for when a replica needs no GPU
_MAX_SCREENS: Final = 4096  # screens a snapshot keeps (one per distinct kind of ask)


@dataclass(frozen=True, slots=True)
class Decision:
    """The shares per cluster (only those > 0), the refusal when there is one (then `shares`
    is the current shares, unchanged), and every cluster's verdict (built when asked)."""

    shares: dict[str, int]
    refusal: Refusal | None = None
    changed: frozenset[str] = frozenset()  # clusters whose share differs from the current
    screened: Sequence[Screened] = ()
    capped: Mapping[str, tuple[int, str, str]] = field(default_factory=dict)  # by quotas

    @property
    def verdicts(self) -> list[Verdict]:
        """Every cluster, in id order: its share, room and why it was refused or capped."""
        out = []
        for c, fit, where, why in self.screened:
            if c.id in self.capped:
                fit, where, why = self.capped[c.id]
            out.append(Verdict(c.id, c.name, self.shares.get(c.id, 0), fit, where, why))
        return out


def _screen(ask: Ask, cluster: ClusterCapacity) -> tuple[int, str | None, str | None]:
    """(replicas that fit, refusing field, reason) for one cluster."""
    if ask.clusters and cluster.id not in ask.clusters and cluster.name not in ask.clusters:
        return 0, "constraints.clusters", "not among the workload's clusters"
    if ask.regions and cluster.region not in ask.regions:
        return (
            0,
            "constraints.regions",
            f"region {cluster.region!r} is not among {sorted(ask.regions)}",
        )
    if ask.gpus > 0 and ask.device_class not in cluster.healthy:
        return (
            0,
            "deviceClass",
            f"no free healthy {ask.device_class} device on a reachable, uncordoned node",
        )
    for policy in ask.policies:
        if (why := cluster.refusal(policy, ask.device_class)) is not None:
            return 0, f"policy {policy.id}", why
    for policy in cluster.policies:
        if (why := cluster.refusal(policy, ask.device_class)) is not None:
            return 0, f"policy {policy.id}", why
    if ask.gpus == 0:
        return _UNBOUNDED, None, None
    fit, most = cluster.fits(ask.device_class, ask.gpus, ask.one_domain, ask.min_memory)
    if fit == 0:
        if ask.one_domain:
            return (
                0,
                "constraints.oneDomain",
                (
                    f"no topology domain has {ask.gpus} free {ask.device_class} devices "
                    f"(the most in one: {most})"
                ),
            )
        return (
            0,
            "serving.gpus",
            (f"no node has {ask.gpus} free {ask.device_class} devices (the most on one: {most})"),
        )
    return fit, None, None


def screen(ask: Ask, snapshot: Snapshot) -> tuple[list[Screened], dict[str, int]]:
    """Every cluster screened for `ask` (constraints, policies, class, fit) and the room of
    the eligible ones; kept in the snapshot for asks of the same kind (the same class, shape,
    constraints and policies), since nothing here depends on the replicas or the quotas."""
    key = (
        ask.device_class, ask.gpus, ask.one_domain, ask.min_memory, ask.regions, ask.clusters,
        tuple(p.id for p in ask.policies),
    )  # fmt: skip
    known = snapshot.screens.get(key)
    if known is None:
        screened: list[Screened] = []
        room: dict[str, int] = {}
        for cluster in snapshot.clusters:
            fit, where, why = _screen(ask, cluster)
            if why is None:
                room[cluster.id] = fit
            screened.append((cluster, fit, where, why))
        if len(snapshot.screens) >= _MAX_SCREENS:
            snapshot.screens.clear()
        known = snapshot.screens[key] = (screened, room)
    return known


def decide(ask: Ask, snapshot: Snapshot) -> Decision:
    """Place `ask` on `snapshot`: a first placement or a scale change moves only the delta
    between `ask.replicas` and the current shares."""
    current = {cid: n for cid, n in ask.current.items() if n > 0}
    placed = sum(current.values())
    delta = ask.replicas - placed
    screened, room = screen(ask, snapshot)
    quotas = snapshot.quotas_of(ask.project_id, ask.device_class)
    capped: dict[str, tuple[int, str, str]] = {}
    refusal: Refusal | None = None
    shares = current
    if delta > 0 and ask.gpus > 0:
        caps = room
        for quota in quotas:
            fit = room.get(quota.cluster_id or "", 0)
            if quota.cluster_id is None or fit == 0:
                continue
            left = max(0, quota.max_devices - quota.in_use) // ask.gpus
            if left < fit:  # this cluster's share is held to what its quota leaves
                if caps is room:
                    caps = dict(room)
                caps[quota.cluster_id] = left
                capped[quota.cluster_id] = (left, f"quota {quota.id}", _quota_text(quota, ask.gpus))
        needed = delta * ask.gpus
        for quota in quotas:
            if quota.cluster_id is None and quota.in_use + needed > quota.max_devices:
                refusal = Refusal("quota", _quota_refusal(quota, ask, needed), quota=quota)
                break
        if refusal is None:
            shares = scale_up(current, delta, caps)
            got = sum(shares.values()) - placed
            if got < delta:
                refusal = Refusal("capacity", _capacity_refusal(ask, delta, got, capped), fits=got)
                shares = current
    elif delta > 0:
        shares = scale_up(current, delta, room)
    elif delta < 0:
        shares = scale_down(current, -delta)
    changed = frozenset(
        cid for cid in set(shares) | set(current) if shares.get(cid, 0) != current.get(cid, 0)
    )
    return Decision(dict(shares), refusal, changed, screened, capped)


def _quota_text(quota: Quota, gpus: int) -> str:
    return (
        f"quota {quota.id} ({quota.device_class}, scope {quota.scope}) has "
        f"{max(0, quota.max_devices - quota.in_use)} of {quota.max_devices} devices left, "
        f"a replica needs {gpus}"
    )


def _quota_refusal(quota: Quota, ask: Ask, needed: int) -> str:
    return (
        f"quota {quota.id} of project {quota.project_id} for {quota.device_class} "
        f"(scope {quota.scope}) would be exceeded: limit {quota.max_devices}, in use "
        f"{quota.in_use}, asked {needed}"
    )


def _capacity_refusal(
    ask: Ask, delta: int, got: int, capped: Mapping[str, tuple[int, str, str]]
) -> str:
    quota_capped = sorted({where.split(" ", 1)[1] for _, where, _ in capped.values()})
    text = (
        f"not enough capacity: {delta} more replica(s) of {ask.gpus} {ask.device_class} "
        f"device(s){' in one topology domain' if ask.one_domain else ''} asked, {got} fit"
    )
    if quota_capped:
        text += f" (per-cluster quota {', '.join(quota_capped)} binds)"
    return text
