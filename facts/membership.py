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
from typing import Any, Final, TypeVar

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs import CertsError
from certs.identity import describe, load_cert, verify_issued_by
from facts.api_keys import ApiKey
from facts.artifacts import Artifact
from facts.deployments import Deployment
from facts.kept import Kept
from facts.record_signing import RecordVerifier
from facts.records import NodeRecord, RecordsPush, Removal
from facts.wire import Speaks
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

    tombstones: tuple[Kept[Removal], ...]  # new removals: record them, unpin those nodes
    pins: tuple[NewPin, ...]  # new members to pin
    offers: tuple[Kept[NodeRecord], ...]  # members' records to offer (newer generation wins)
    refused: tuple[str, ...]  # why a certificate was not pinned, for the log
    deployments: tuple[Kept[Deployment], ...] = ()  # declared, each signed by a member
    api_keys: tuple[Kept[ApiKey], ...] = ()  # API keys, each signed by a member
    speaks: tuple[Kept[Speaks], ...] = ()  # what members speak, each signed by its member
    artifacts: tuple[Kept[Artifact], ...] = ()  # artifacts, each signed by a member


T = TypeVar("T")

_KINDS: Final = (NodeRecord, Removal, Deployment, ApiKey, Speaks, Artifact)
_DECODERS: Final[dict[type, msgspec.json.Decoder[Any]]] = {
    t: msgspec.json.Decoder(t) for t in _KINDS
}
_LISTS: Final[dict[type, msgspec.json.Decoder[Any]]] = {
    NodeRecord: msgspec.json.Decoder(list[NodeRecord]),
    Removal: msgspec.json.Decoder(list[Removal]),
    Deployment: msgspec.json.Decoder(list[Deployment]),
    ApiKey: msgspec.json.Decoder(list[ApiKey]),
    Speaks: msgspec.json.Decoder(list[Speaks]),
    Artifact: msgspec.json.Decoder(list[Artifact]),
}
_WHAT: Final[dict[type, str]] = {
    NodeRecord: "a record",
    Removal: "a removal",
    Deployment: "a deployment",
    ApiKey: "an API key",
    Speaks: "a statement of what a member speaks",
    Artifact: "an artifact",
}


def _decoded(raws: Iterable[msgspec.Raw], kind: type[T], refused: list[str]) -> list[Kept[T]]:
    """Each of `raws` decoded as `kind` and kept with its bytes; one that does not decode
    is refused alone (the reason names the field, never a value)."""
    pieces = [bytes(raw) for raw in raws]  # copies: the push's body is not held with them
    if not pieces:
        return []
    try:  # all at once, in one call into msgspec: what a push from a member holds
        facts = _LISTS[kind].decode(b"[" + b",".join(pieces) + b"]")
        return [Kept(f, p) for f, p in zip(facts, pieces, strict=True)]
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    decoder = _DECODERS[kind]
    kept: list[Kept[T]] = []
    for data in pieces:  # one by one, to refuse only the ones that do not decode
        try:
            kept.append(Kept(decoder.decode(data), data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            refused.append(f"{_WHAT[kind]} that does not decode ({exc})")
    return kept


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
    tombstones: dict[str, Kept[Removal]] = {}
    refused: list[str] = []
    for kept_removal in _decoded(push.removals, Removal, refused):
        removal = kept_removal.fact
        # A removed node keeps its own view; the others stop talking to it.
        if removal.nodeId == self_id or removal.nodeId in tombstones:
            continue
        if is_removed(removal.nodeId):
            continue
        signer = tombstones.get(removal.by)
        signer_removed = signer.fact.removedAt if signer is not None else removed_at(removal.by)
        why = verifier.removal_why_not(removal, ca, removed_at=signer_removed, raw=kept_removal.raw)
        if why is not None:
            refused.append(why)
            continue
        tombstones[removal.nodeId] = kept_removal

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

    def key_for(node_id: str) -> ec.EllipticCurvePublicKey | None:
        new = pins.get(node_id)
        return _ec_key(new.cert) if new is not None else key_of(node_id)

    offers: list[Kept[NodeRecord]] = []
    for kept_record in _decoded(push.records, NodeRecord, refused):
        record = kept_record.fact
        node_id = record.nodeId
        if node_id == self_id or removed(node_id):
            continue
        if node_id not in pins and not is_member(node_id):
            continue
        why = verifier.why_not(record, key_for(node_id), now_ms=now_ms, raw=kept_record.raw)
        if why is not None:
            refused.append(why)
            continue
        offers.append(kept_record)

    speaks: list[Kept[Speaks]] = []
    for kept_speaks in _decoded(push.speaks, Speaks, refused):
        node_id = kept_speaks.fact.nodeId
        if node_id == self_id or removed(node_id):
            continue
        if node_id not in pins and not is_member(node_id):
            continue
        why = verifier.speaks_why_not(kept_speaks.fact, key_for(node_id), raw=kept_speaks.raw)
        if why is not None:
            refused.append(why)
            continue
        speaks.append(kept_speaks)

    def signed(kept: Kept[Deployment] | Kept[ApiKey] | Kept[Artifact], what: str) -> bool:
        statement = kept.fact
        why = verifier.statement_why_not(statement, ca, what, raw=kept.raw)
        signer = tombstones.get(statement.by)
        gone = signer.fact.removedAt if signer is not None else removed_at(statement.by)
        if why is None and gone is not None and statement.updatedAt >= gone:
            why = f"{what} signed by {statement.by} after it was removed"
        if why is not None:
            refused.append(why)
        return why is None

    deployments = [
        d
        for d in _decoded(push.deployments, Deployment, refused)
        if signed(d, f"a deployment of {d.fact.name} (version {d.fact.version})")
    ]
    api_keys = [
        k
        for k in _decoded(push.apiKeys, ApiKey, refused)
        if signed(k, f"an API key {k.fact.name} (version {k.fact.version})")
    ]
    artifacts = [
        a
        for a in _decoded(push.artifacts, Artifact, refused)
        if signed(a, f"an artifact {a.fact.name} (version {a.fact.version})")
    ]
    return PushPlan(
        tuple(tombstones.values()),
        tuple(pins.values()),
        tuple(offers),
        tuple(refused),
        tuple(deployments),
        tuple(api_keys),
        tuple(speaks),
        tuple(artifacts),
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
