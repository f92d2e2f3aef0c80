"""Broker records and deployments as `scheduler.reconcile` sees them."""

from __future__ import annotations

from msgspec import UnsetType

from facts.deployments import Deployment, spec_digest
from facts.records import NodeRecord, Part, Replica
from scheduler import reconcile
from scheduler.reconcile import Gpu, Running, Want

__all__ = ["gpu_of", "holds_of", "layout_of", "parts_of", "running_of", "want_of"]


def gpu_of(dev_id: str, cls: str, memory: int, health: str, domain: str | None) -> Gpu:
    return Gpu(dev_id, cls, memory, health == "ok", domain or "")


def running_of(r: Replica) -> Running:
    return Running(
        r.id,
        r.deployment,
        r.deploymentId,
        r.spec,
        tuple(r.devices),
        r.state,
        r.createdAt,
        group=r.group if isinstance(r.group, str) else "",
        layout=layout_of(r.layout) if isinstance(r.layout, list) else (),
    )


def layout_of(parts: list[Part]) -> tuple[reconcile.Part, ...]:
    """A record's layout as placement sees it."""
    return tuple(reconcile.Part(p.node, tuple(p.devices)) for p in parts)


def parts_of(layout: tuple[reconcile.Part, ...]) -> list[Part]:
    """A layout as a record says it."""
    return [Part(node=p.node_id, devices=list(p.devices)) for p in layout]


def want_of(d: Deployment) -> Want:
    c = d.constraints
    return Want(
        d.name,
        d.id,
        spec_digest(d),
        replicas=d.replicas,
        gpus=d.gpus,
        node=c.node,
        device_class=c.deviceClass,
        one_domain=c.oneDomain,
        min_memory=c.minMemory,
        artifact=d.weights,
        nodes=d.span,
    )


def holds_of(record: NodeRecord) -> frozenset[str]:
    """The artifacts resident on the node whose record this is (none said: none)."""
    if isinstance(record.artifacts, UnsetType):
        return frozenset()
    return frozenset(h.digest for h in record.artifacts if h.resident)
