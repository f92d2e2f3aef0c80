"""Placement across clusters, pure: which clusters may run a workload, how many of its
replicas each has room for, and the shares (no I/O; `plane.placement_sql` reads the
snapshot and writes the deployments).

Capacity is counted from what the clusters observed: on each reachable, uncordoned node, the
healthy devices of the workload's class that no replica holds (allocations) and that no
deployment placed but not yet running has reserved. A replica's GPUs are on one node; with
`oneDomain`, inside one topology domain that has that many free devices. Declared policy
filters (every policy of the workload, its tenant and the cluster must allow), device quotas
bound (fleet-wide: the project's total for the class, refused past it; per cluster: that
cluster's share), and `plane.apportion` divides the replicas. docs/placement.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .apportion import scale_down, scale_up
from .capacity import ClusterCapacity, NodeDevices, Policy, Quota, Reservation, Snapshot

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


@dataclass(frozen=True, slots=True)
class Decision:
    """The shares per cluster (only those > 0), every cluster's verdict, and the refusal
    when there is one (then `shares` is the current shares, unchanged)."""

    shares: dict[str, int]
    verdicts: list[Verdict]
    refusal: Refusal | None = None
    changed: frozenset[str] = frozenset()  # clusters whose share differs from the current


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
    for policy in ask.policies:
        if (why := cluster.refusal(policy, ask.device_class)) is not None:
            return 0, f"policy {policy.id}", why
    for policy in cluster.policies:
        if (why := cluster.refusal(policy, ask.device_class)) is not None:
            return 0, f"policy {policy.id}", why
    if ask.gpus == 0:
        return ask.replicas, None, None
    if not cluster.healthy.get(ask.device_class):
        return 0, "deviceClass", f"no healthy {ask.device_class} device on a schedulable node"
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


def decide(ask: Ask, snapshot: Snapshot) -> Decision:
    """Place `ask` on `snapshot`: a first placement or a scale change moves only the delta
    between `ask.replicas` and the current shares."""
    current = {cid: n for cid, n in ask.current.items() if n > 0}
    placed = sum(current.values())
    delta = ask.replicas - placed
    quotas = [
        q
        for q in snapshot.quotas
        if q.project_id == ask.project_id and q.device_class == ask.device_class
    ]
    per_cluster = {q.cluster_id: q for q in quotas if q.cluster_id is not None}
    screened: list[tuple[ClusterCapacity, int, str | None, str | None]] = []
    caps: dict[str, int] = {}
    for cluster in snapshot.clusters:
        fit, where, why = _screen(ask, cluster)
        quota = per_cluster.get(cluster.id)
        eligible = why is None
        if eligible and quota is not None and ask.gpus > 0 and delta > 0:
            room = max(0, quota.max_devices - quota.in_use) // ask.gpus
            if room < fit:
                # Capped, or shut out at 0: the verdict names the quota either way.
                fit = room
                where, why = f"quota {quota.id}", _quota_text(quota, ask.gpus)
        if eligible and fit > 0:
            caps[cluster.id] = fit
        screened.append((cluster, fit, where, why))
    refusal: Refusal | None = None
    shares = current
    if delta > 0:
        needed = delta * ask.gpus
        for quota in quotas:
            if quota.cluster_id is None and quota.in_use + needed > quota.max_devices:
                refusal = Refusal("quota", _quota_refusal(quota, ask, needed), quota=quota)
                break
        if refusal is None:
            shares = scale_up(current, delta, caps)
            got = sum(shares.values()) - placed
            if got < delta:
                refusal = Refusal(
                    "capacity", _capacity_refusal(ask, delta, got, screened), fits=got
                )
                shares = current
    elif delta < 0:
        shares = scale_down(current, -delta)
    verdicts = [
        Verdict(c.id, c.name, shares.get(c.id, 0), fit, where, why)
        for c, fit, where, why in screened
    ]
    changed = frozenset(
        cid for cid in set(shares) | set(current) if shares.get(cid, 0) != current.get(cid, 0)
    )
    return Decision(shares=dict(shares), verdicts=verdicts, refusal=refusal, changed=changed)


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
    ask: Ask,
    delta: int,
    got: int,
    screened: list[tuple[ClusterCapacity, int, str | None, str | None]],
) -> str:
    quota_capped = sorted(
        {w.split(" ", 1)[1] for _, _, w, _ in screened if w and w.startswith("quota ")}
    )
    text = (
        f"not enough capacity: {delta} more replica(s) of {ask.gpus} {ask.device_class} "
        f"device(s){' in one topology domain' if ask.one_domain else ''} asked, {got} fit"
    )
    if quota_capped:
        text += f" (per-cluster quota {', '.join(quota_capped)} binds)"
    return text
