"""Broker records and deployments as `scheduler.reconcile` sees them."""

from __future__ import annotations

from msgspec import UnsetType

from facts.deployments import Deployment, spec_digest
from facts.records import NodeRecord, Replica
from scheduler.reconcile import Gpu, Running, Want

__all__ = ["gpu_of", "holds_of", "running_of", "want_of"]


def gpu_of(dev_id: str, cls: str, memory: int, health: str, domain: str | None) -> Gpu:
    return Gpu(dev_id, cls, memory, health == "ok", domain or "")


def running_of(r: Replica) -> Running:
    return Running(
        r.id, r.deployment, r.deploymentId, r.spec, tuple(r.devices), r.state, r.createdAt
    )


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
    )


def holds_of(record: NodeRecord) -> frozenset[str]:
    """The artifacts resident on the node whose record this is (none said: none)."""
    if isinstance(record.artifacts, UnsetType):
        return frozenset()
    return frozenset(h.digest for h in record.artifacts if h.resident)
