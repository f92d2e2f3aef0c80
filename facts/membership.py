"""Membership and pin policy, sans-I/O: what a records push changes, decided in one place.

`plan_push()` takes a push from a member and what this node holds (who is pinned, who is
tombstoned, the cluster CA) and returns a `PushPlan`: the new tombstones (each signed by a
member of the cluster; a removed member is unpinned), the certificates of new members to
pin (each must chain to the CA, and a tombstoned node is never pinned), and the records to
offer to `Membership` (only pinned members' records, and never one about this node: only a
node speaks for itself). The agent carries the plan out; `manager_peers()` says which peers
the workload manager should relay to, so the caller can tell whether they changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs import CertsError
from certs.identity import describe, load_cert, verify_issued_by
from facts.api_keys import ApiKey
from facts.deployments import Deployment
from facts.record_signing import RecordVerifier
from facts.records import NodeRecord, RecordsPush, Removal
from workload_manager.manager import Peer

__all__ = ["NewPin", "PushPlan", "manager_peers", "plan_push"]


@dataclass(frozen=True, slots=True)
class NewPin:
    """A new member's certificate, checked against the cluster CA, to pin."""

    node_id: str
    name: str
    cert: x509.Certificate


@dataclass(frozen=True, slots=True)
class PushPlan:
    """What one records push changes here."""

    tombstones: tuple[Removal, ...]  # new removals: record them, unpin those nodes
    pins: tuple[NewPin, ...]  # new members to pin
    offers: tuple[NodeRecord, ...]  # members' records to offer (newer generation wins)
    refused: tuple[str, ...]  # why a certificate was not pinned, for the log
    deployments: tuple[Deployment, ...] = ()  # declared deployments, each signed by a member
    api_keys: tuple[ApiKey, ...] = ()  # API keys, each signed by a member


def plan_push(
    push: RecordsPush,
    *,
    self_id: str,
    ca: x509.Certificate,
    is_member: Callable[[str], bool],
    is_removed: Callable[[str], bool],
    key_of: Callable[[str], ec.EllipticCurvePublicKey | None],
    verifier: RecordVerifier,
    now_ms: int,
    removed_at: Callable[[str], int | None] = lambda _: None,
) -> PushPlan:
    """Decide what `push` changes; pure but for the verifier's cache (time and files stay
    with the caller). A record is offered only when its owner signed it (`key_of` gives a
    pinned member's key; a member pinned by this push is checked against its certificate)
    and its generation is not from the future. A removal is taken only when a member of
    the cluster signed it (`removed_at` says when a signer was itself removed, if it was)."""
    tombstones: dict[str, Removal] = {}
    refused: list[str] = []
    for removal in push.removals:
        # A removed node keeps its own view; the others stop talking to it.
        if removal.nodeId == self_id or removal.nodeId in tombstones:
            continue
        if is_removed(removal.nodeId):
            continue
        signer = tombstones.get(removal.by)
        signer_removed = signer.removedAt if signer is not None else removed_at(removal.by)
        why = verifier.removal_why_not(removal, ca, removed_at=signer_removed)
        if why is not None:
            refused.append(why)
            continue
        tombstones[removal.nodeId] = removal

    def removed(node_id: str) -> bool:
        return node_id in tombstones or is_removed(node_id)

    pins: dict[str, NewPin] = {}
    for pem in push.certificates:
        try:
            cert = load_cert(pem.encode())
            info = describe(cert)
        except (ValueError, CertsError):
            refused.append("a certificate that is not a node certificate")
            continue
        if info.node_id in pins or is_member(info.node_id) or removed(info.node_id):
            continue
        if info.node_id == self_id:
            continue
        if not verify_issued_by(cert, ca):
            refused.append(f"a certificate for {info.node_id} not signed by our CA")
            continue
        pins[info.node_id] = NewPin(info.node_id, info.name, cert)

    offers: list[NodeRecord] = []
    for record in push.records:
        node_id = record.nodeId
        if node_id == self_id or removed(node_id):
            continue
        new = pins.get(node_id)
        if new is None and not is_member(node_id):
            continue
        key = _ec_key(new.cert) if new is not None else key_of(node_id)
        why = verifier.why_not(record, key, now_ms=now_ms)
        if why is not None:
            refused.append(why)
            continue
        offers.append(record)

    def signed(statement: Deployment | ApiKey, what: str) -> bool:
        why = verifier.statement_why_not(statement, ca, what)
        signer = tombstones.get(statement.by)
        gone = signer.removedAt if signer is not None else removed_at(statement.by)
        if why is None and gone is not None and statement.updatedAt >= gone:
            why = f"{what} signed by {statement.by} after it was removed"
        if why is not None:
            refused.append(why)
        return why is None

    deployments = [
        d for d in push.deployments if signed(d, f"a deployment of {d.name} (version {d.version})")
    ]
    api_keys = [k for k in push.apiKeys if signed(k, f"an API key {k.name} (version {k.version})")]
    return PushPlan(
        tuple(tombstones.values()),
        tuple(pins.values()),
        tuple(offers),
        tuple(refused),
        tuple(deployments),
        tuple(api_keys),
    )


def _ec_key(cert: x509.Certificate) -> ec.EllipticCurvePublicKey | None:
    key = cert.public_key()
    return key if isinstance(key, ec.EllipticCurvePublicKey) else None


def manager_peers(records: Iterable[NodeRecord], is_member: Callable[[str], bool]) -> list[Peer]:
    """The workload manager's peers: every pinned member with an address."""
    return [
        Peer(nodeId=r.nodeId, host=r.addresses[0], port=r.managerPort)
        for r in records
        if r.addresses and is_member(r.nodeId)
    ]
