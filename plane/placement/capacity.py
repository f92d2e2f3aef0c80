"""What placement reads, as it reads it: declared policies and quotas, and each cluster's
observed capacity (free devices by class, node and topology domain, after allocations and
reservations), with the answers many decisions ask again kept (`ClusterCapacity.fits`,
`ClusterCapacity.refusal`). Pure; `plane.placement.decide` decides over a `Snapshot` of these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["ClusterCapacity", "NodeDevices", "Policy", "Quota", "Reservation", "Snapshot"]


# -- declared: policies and quotas ----------------------------------------------------------


def _names(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset((value,)) if value else frozenset()
    if isinstance(value, list | tuple):
        return frozenset(str(v) for v in value)
    return frozenset()


@dataclass(frozen=True, slots=True)
class Policy:
    """A policy's rules (the shape of `policies.spec`); an empty rule allows anything."""

    id: str
    regions: frozenset[str] = frozenset()
    residency: frozenset[str] = frozenset()
    device_classes: frozenset[str] = frozenset()
    max_cost_per_device_hour: float | None = None
    allow_clusters: frozenset[str] = frozenset()  # ids or names; empty: any
    deny_clusters: frozenset[str] = frozenset()

    @classmethod
    def from_spec(cls, policy_id: str, spec: Mapping[str, Any]) -> Policy:
        """A policy from its stored spec (camelCase keys, as the API takes them)."""
        cost = spec.get("maxCostPerDeviceHour")
        return cls(
            id=policy_id,
            regions=_names(spec.get("regions")),
            residency=_names(spec.get("residency")),
            device_classes=_names(spec.get("deviceClasses")),
            max_cost_per_device_hour=float(cost) if isinstance(cost, int | float) else None,
            allow_clusters=_names(spec.get("allowClusters")),
            deny_clusters=_names(spec.get("denyClusters")),
        )

    def refuses(self, cluster: ClusterCapacity, device_class: str) -> str | None:
        """Why this policy keeps the workload off `cluster` (naming the rule), or None."""
        if cluster.id in self.deny_clusters or cluster.name in self.deny_clusters:
            return f"policy {self.id} denyClusters names it"
        if self.allow_clusters and not (
            cluster.id in self.allow_clusters or cluster.name in self.allow_clusters
        ):
            return f"policy {self.id} allowClusters does not name it"
        if self.regions and cluster.region not in self.regions:
            return f"policy {self.id} regions {sorted(self.regions)} excludes {cluster.region!r}"
        if self.residency and cluster.residency not in self.residency:
            return (
                f"policy {self.id} residency {sorted(self.residency)} "
                f"excludes {cluster.residency!r}"
            )
        if self.device_classes and device_class not in self.device_classes:
            classes = sorted(self.device_classes)
            return f"policy {self.id} deviceClasses {classes} excludes {device_class!r}"
        cost = self.max_cost_per_device_hour
        if cost is not None and cluster.cost_per_device_hour > cost:
            return (
                f"policy {self.id} maxCostPerDeviceHour {cost:g} is below the cluster's "
                f"{cluster.cost_per_device_hour:g}"
            )
        return None


@dataclass(frozen=True, slots=True)
class Quota:
    """A device ceiling of a project for a class, fleet-wide (`cluster_id` None) or for one
    cluster; `in_use`: devices the project's deployments of that class declare in scope."""

    id: str
    project_id: str
    device_class: str
    cluster_id: str | None
    max_devices: int
    in_use: int = 0

    @property
    def scope(self) -> str:
        """`fleet` or the cluster id."""
        return self.cluster_id or "fleet"


# -- observed: capacity ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeDevices:
    """One schedulable node's free devices of one class: each domain's free memories (bytes;
    the key None: devices in no domain)."""

    node_id: str
    domains: Mapping[str | None, Sequence[int]]


class Reservation(NamedTuple):
    """Replicas of a deployment placed on the cluster and not yet running: they will take
    devices, so placement counts them as taken."""

    device_class: str
    gpus: int
    one_domain: bool
    replicas: int


def _take(nodes: list[dict[str | None, list[int]]], gpus: int, one_domain: bool) -> bool:
    """Take `gpus` devices for one reserved replica from the fullest node (or domain)."""
    best: list[int] | None = None
    best_node: dict[str | None, list[int]] | None = None
    for node in nodes:
        if one_domain:
            for key, group in node.items():
                if (
                    key is not None
                    and len(group) >= gpus
                    and (best is None or len(group) > len(best))
                ):
                    best, best_node = group, node
        else:
            total = sum(len(g) for g in node.values())
            if total >= gpus and (
                best_node is None or total > sum(len(g) for g in best_node.values())
            ):
                best_node, best = node, None
    if best_node is None:
        return False
    if best is not None:
        del best[:gpus]
        return True
    left = gpus
    for group in sorted(best_node.values(), key=len, reverse=True):
        n = min(left, len(group))
        del group[:n]
        left -= n
        if not left:
            break
    return True


@dataclass(slots=True)
class ClusterCapacity:
    """One cluster as placement sees it: declared attributes, the policies attached to it,
    and its schedulable nodes' free devices by class (after allocations and reservations).
    `fits()` answers are kept: the snapshot is asked the same question by many decisions."""

    id: str
    name: str
    region: str = ""
    residency: str = ""
    cost_per_device_hour: float = 0.0
    policies: tuple[Policy, ...] = ()
    free: dict[str, list[NodeDevices]] = field(default_factory=dict)  # class -> nodes
    healthy: dict[str, int] = field(default_factory=dict)  # class -> free healthy devices
    _fits: dict[tuple[str, int, bool, int], tuple[int, int]] = field(default_factory=dict)
    _refusals: dict[tuple[str, str], str | None] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        id: str,
        name: str,
        region: str = "",
        residency: str = "",
        cost_per_device_hour: float = 0.0,
        policies: Iterable[Policy] = (),
        devices: Iterable[tuple[str, str, int, str | None]],
        reserved: Iterable[Reservation] = (),
    ) -> ClusterCapacity:
        """From the free devices of its schedulable nodes, as (node id, class, memory,
        domain id) rows, less what `reserved` replicas will take."""
        by_class: dict[str, dict[str, dict[str | None, list[int]]]] = {}
        healthy: dict[str, int] = {}
        for node_id, device_class, memory, domain in devices:
            group = by_class.setdefault(device_class, {}).setdefault(node_id, {})
            group.setdefault(domain, []).append(memory)
            healthy[device_class] = healthy.get(device_class, 0) + 1
        for nodes in by_class.values():
            for groups in nodes.values():
                for memories in groups.values():
                    memories.sort()  # the smallest devices are the ones a reservation takes
        for r in reserved:
            nodes_of = [
                by_class[r.device_class][k] for k in sorted(by_class.get(r.device_class, {}))
            ]
            for _ in range(r.replicas if r.gpus > 0 else 0):
                if not _take(nodes_of, r.gpus, r.one_domain):
                    break
        free = {
            device_class: [
                NodeDevices(node_id, groups) for node_id, groups in sorted(nodes.items())
            ]
            for device_class, nodes in by_class.items()
        }
        return cls(
            id=id,
            name=name,
            region=region,
            residency=residency,
            cost_per_device_hour=cost_per_device_hour,
            policies=tuple(policies),
            free=free,
            healthy=healthy,
        )

    def fits(
        self, device_class: str, gpus: int, one_domain: bool, min_memory: int = 0
    ) -> tuple[int, int]:
        """(replicas of `gpus` devices that fit, the most free devices in one place: a domain
        with `one_domain`, else a node)."""
        key = (device_class, gpus, one_domain, min_memory)
        known = self._fits.get(key)
        if known is None:
            known = self._fits[key] = self._count(device_class, gpus, one_domain, min_memory)
        return known

    def _count(
        self, device_class: str, gpus: int, one_domain: bool, min_memory: int
    ) -> tuple[int, int]:
        replicas = most = 0
        for node in self.free.get(device_class, ()):
            if one_domain:
                for key, memories in node.domains.items():
                    if key is None:
                        continue
                    n = sum(1 for m in memories if m >= min_memory)
                    most = max(most, n)
                    replicas += n // gpus
            else:
                n = sum(1 for ms in node.domains.values() for m in ms if m >= min_memory)
                most = max(most, n)
                replicas += n // gpus
        return replicas, most

    def refusal(self, policy: Policy, device_class: str) -> str | None:
        """`policy.refuses(self, device_class)`, kept."""
        key = (policy.id, device_class)
        if key not in self._refusals:
            self._refusals[key] = policy.refuses(self, device_class)
        return self._refusals[key]


@dataclass(slots=True)
class Snapshot:
    """Every enrolled cluster's capacity, sorted by id, and the quotas that apply."""

    clusters: list[ClusterCapacity]
    quotas: list[Quota] = field(default_factory=list)
    # What `plane.placement.decide.screen` found for each kind of ask, kept for the next one.
    screens: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    _quotas: dict[tuple[str, str], list[Quota]] = field(default_factory=dict)

    def quotas_of(self, project_id: str, device_class: str) -> list[Quota]:
        """The quotas of that project and class, fleet-wide and per cluster."""
        if not self._quotas and self.quotas:
            for q in self.quotas:
                self._quotas.setdefault((q.project_id, q.device_class), []).append(q)
        return self._quotas.get((project_id, device_class), [])
