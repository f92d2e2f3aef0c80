"""Node records and membership, sans-I/O.

Every member publishes a `NodeRecord` about itself: name, addresses and ports, versions,
cordon state, GPUs and topology domains, engines, `updatedAt` and a `generation` that only
rises. Members push their own record to every peer when it changes (and every 30 s), and
exchange only what the other lacks when their digests differ (`record_deltas`), so a
member that one link cannot reach still learns of the others.

`Membership` decides: a record is taken when its generation is higher than the one held and
no tombstone names its node; a member not heard from (directly or through a fresher record)
for `unreachable_after_s` is unreachable, and reachable again when it is heard from.
A tombstone (`nvpair cluster remove`) wins over any record of that node, whatever its
generation. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from facts.api_keys import MAX_KEYS
from facts.artifacts import MAX_ARTIFACTS
from facts.deployments import MAX_DEPLOYMENTS
from facts.inventory import Device, TopologyDomain
from facts.kept import Kept

__all__ = [
    "Holding",
    "Membership",
    "NodeRecord",
    "Part",
    "RecordsPush",
    "Removal",
    "Replica",
    "is_worker",
]

_Name = Annotated[str, Meta(min_length=1, max_length=256)]
_Port = Annotated[int, Meta(ge=0, le=65535)]


class Engine(Struct, kw_only=True, frozen=True):
    """A model server on a node (filled in by the facade issue)."""

    name: _Name
    kind: _Name
    url: Annotated[str, Meta(max_length=2048)]
    models: Annotated[list[_Name], Meta(max_length=4096)] = []
    up: bool = True


class Part(Struct, kw_only=True, frozen=True, array_like=True):
    """One member's share of a spanning replica (issue 32): the member and its GPUs."""

    node: _Name
    devices: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=64)]


class Replica(Struct, kw_only=True, frozen=True):
    """An engine this node runs for a deployment, and the GPUs allocated to it (observed:
    only the node that runs it says so, in its signed record)."""

    id: Annotated[str, Meta(pattern=r"^rep_[0-9a-z]{26}$")]
    deployment: _Name  # its name
    deploymentId: Annotated[str, Meta(max_length=64)]
    spec: Annotated[str, Meta(max_length=64)]  # the digest of the spec it was started with
    allocation: Annotated[str, Meta(max_length=64)] = ""  # alc_ id of its GPUs
    devices: Annotated[list[Annotated[str, Meta(max_length=64)]], Meta(max_length=64)] = []
    port: _Port = 0
    # `fetching`: its weights are being fetched (issue 28), said only once every member
    # knows the word (the `artifacts` feature, facts.wire); before that it is `starting`.
    state: Literal["fetching", "starting", "ready", "failed", "stopping"] = "starting"
    restarts: Annotated[int, Meta(ge=0)] = 0
    engineVersion: Annotated[str, Meta(max_length=64)] = ""
    error: Annotated[str, Meta(max_length=256)] = ""  # why failed / not ready yet; our words
    createdAt: Annotated[int, Meta(ge=0)] = 0  # epoch ms
    running: Annotated[float, Meta(ge=0)] = 0.0  # engine load: requests running
    waiting: Annotated[float, Meta(ge=0)] = 0.0  # requests queued
    kvUsage: Annotated[float, Meta(ge=0)] | None = None  # 0..1, when the engine says
    loadAt: Annotated[int, Meta(ge=0)] = 0  # epoch ms of that reading; 0 never read
    # A part of a replica that spans members (issue 32): the replica's group id and every
    # part in rank order (the head first). Absent on a replica of its own, and until every
    # member knows the fields (`spanning-replicas`, facts.wire), as `artifacts` below.
    group: Annotated[str, Meta(pattern=r"^grp_[0-9a-z]{26}$")] | UnsetType = UNSET
    layout: Annotated[list[Part], Meta(max_length=64)] | UnsetType = UNSET


def is_worker(replica: Replica, node_id: str) -> bool:
    """Whether `replica`, in `node_id`'s record, is a worker part of a spanning replica: it
    serves nothing itself (its head does), and counts as no replica of its own."""
    return (
        isinstance(replica.layout, list)
        and bool(replica.layout)
        and (replica.layout[0].node != node_id)
    )


class Holding(Struct, kw_only=True, frozen=True, array_like=True):
    """An artifact this node holds pieces of (issue 28): resident when it holds them all."""

    digest: Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
    held: Annotated[int, Meta(ge=0)]  # verified pieces
    pieces: Annotated[int, Meta(ge=0)]  # in the artifact

    @property
    def resident(self) -> bool:
        """Whether every piece is held (and the files assembled)."""
        return self.held >= self.pieces


_WaitLine = Annotated[dict[_Name, Annotated[int, Meta(ge=0)]], Meta(max_length=1024)]


class NodeRecord(Struct, kw_only=True, frozen=True):
    """What a member says about itself."""

    nodeId: _Name
    name: _Name
    addresses: Annotated[list[_Name], Meta(max_length=64)]
    managerPort: _Port
    nodePort: _Port
    facadePort: _Port
    version: Annotated[str, Meta(max_length=64)]
    cordoned: bool = False
    queueLimit: Annotated[int, Meta(ge=1)] = 32  # pending jobs beyond which it takes no more
    devices: Annotated[list[Device], Meta(max_length=256)] = []
    domains: Annotated[list[TopologyDomain], Meta(max_length=256)] = []
    engines: Annotated[list[Engine], Meta(max_length=256)] = []
    gpuNote: str | None = None  # why there are no devices, when there are none
    updatedAt: Annotated[int, Meta(ge=0)]  # epoch ms
    generation: Annotated[int, Meta(ge=1)]
    replicas: Annotated[list[Replica], Meta(max_length=64)] = []
    # The artifacts it holds (issue 28). Absent, not empty, until every member knows the
    # field (the `artifacts` feature): a member of 0.1.0 checks a record's signature over
    # its own encoding of the fields it knows, so one more field, even empty, would make it
    # refuse the record.
    artifacts: Annotated[list[Holding], Meta(max_length=MAX_ARTIFACTS)] | UnsetType = UNSET
    # Requests waiting in this member's wait line, per model (issue 30: an elastic
    # deployment scales on what waits anywhere, and from zero). Absent when none wait, and
    # until every member knows the field (the `elastic-deployments` feature), as above.
    waitLine: _WaitLine | UnsetType = UNSET
    # The owner's signature (facts/record_signing.py): base64url ECDSA P-256 over the record
    # with this field empty. Members take a record only when it verifies against its
    # owner's pinned certificate.
    signature: Annotated[str, Meta(max_length=256)] = ""


class Removal(Struct, kw_only=True, frozen=True):
    """A tombstone: this node was removed and stays removed -- a statement signed by the
    member that made it (`facts/record_signing.py`: `by`, its certificate `byCert`, and
    its ECDSA `signature` over the removal with that field empty), so every member can
    check who removed whom, whoever relays it and whatever it pins."""

    nodeId: _Name
    removedAt: Annotated[int, Meta(ge=0)]  # epoch ms
    pin: Annotated[str, Meta(max_length=64)] = ""  # hex SPKI SHA-256 of the removed cert
    by: Annotated[str, Meta(max_length=256)] = ""  # the node id of the remover
    byCert: Annotated[str, Meta(max_length=8192)] = ""  # the remover's certificate (PEM)
    signature: Annotated[str, Meta(max_length=256)] = ""


class RecordsPush(Struct, kw_only=True, frozen=True):
    """Body of `POST /v1/records`: records, tombstones and members' certificates (PEM).

    Certificates let a member that learns of a new node pin it: each must chain to the
    cluster CA, and a tombstoned node is never pinned.

    Records, removals, deployments, API keys and what members speak are signed, and travel
    as the bytes they were signed as (`msgspec.Raw`, `facts.kept`): each is decoded and
    checked on its own (`facts.membership.plan_push`), so one a member cannot take is
    refused alone, and one from a later release, with fields this one does not know, is
    kept and relayed unchanged (docs/upgrade.md).
    """

    records: Annotated[list[msgspec.Raw], Meta(max_length=1024)] = []  # NodeRecord
    removals: Annotated[list[msgspec.Raw], Meta(max_length=1024)] = []  # Removal
    certificates: Annotated[
        list[Annotated[str, Meta(max_length=16384)]], Meta(max_length=1024)
    ] = []
    deployments: Annotated[list[msgspec.Raw], Meta(max_length=MAX_DEPLOYMENTS)] = []
    apiKeys: Annotated[list[msgspec.Raw], Meta(max_length=MAX_KEYS)] = []  # ApiKey
    artifacts: Annotated[list[msgspec.Raw], Meta(max_length=MAX_ARTIFACTS)] = []  # Artifact
    # What members speak (`facts.wire.Speaks`), each signed by its member; a member of
    # 0.1.0 sends none and ignores these.
    speaks: Annotated[list[msgspec.Raw], Meta(max_length=1024)] = []
    # Deltas (docs/protocol.md, "Membership"); a member of the previous version ignores
    # these fields, sends a full push and answers one with its full push.
    digest: Annotated[str, Meta(max_length=64)] = ""  # the sender's holdings digest
    # A sync: the sender's holdings (node id, generation | 0 pinned | -1 removed); it is
    # answered with only what it lacks, and the answerer's own holdings.
    have: Annotated[list[tuple[_Name, int]], Meta(max_length=4096)] | None = None
    delta: bool = False  # only what changed: answered with the digest alone


push_decoder: Final = msgspec.json.Decoder(RecordsPush)


@dataclass
class _Known:
    record: NodeRecord
    raw: bytes  # as signed by its owner (facts.kept)
    heard_at: float


@dataclass
class Membership:
    """The records this node holds, reachability, and tombstones."""

    self_id: str
    unreachable_after_s: float = 6.0
    _known: dict[str, _Known] = field(default_factory=dict)
    _removed: dict[str, Kept[Removal]] = field(default_factory=dict)
    # Counts every change to the records held (one taken, one removed): what is derived from
    # them per request (the members placement sees) is derived again only when it moved.
    version: int = 0

    def offer(self, record: NodeRecord, now: float, raw: bytes | None = None) -> bool:
        """Take a record if it is newer than ours and not tombstoned; returns if taken.
        `raw`: the bytes its owner signed (None: made here, so encoded here)."""
        if record.nodeId in self._removed:
            return False
        held = self._known.get(record.nodeId)
        if held is not None and held.record.generation >= record.generation:
            # The same record relayed again proves nothing about the node being alive.
            return False
        kept = Kept.made(record) if raw is None else Kept(record, raw)
        self._known[record.nodeId] = _Known(record, kept.raw, now)
        self.version += 1
        return True

    def heard_from(self, node_id: str, now: float) -> None:
        """A direct contact from a member: it is reachable now."""
        held = self._known.get(node_id)
        if held is not None:
            held.heard_at = now

    def remove(self, removal: Removal, raw: bytes | None = None) -> bool:
        """Apply a tombstone (`raw`: as its signer signed it); returns if it is new."""
        if removal.nodeId in self._removed:
            return False
        self._removed[removal.nodeId] = Kept.made(removal) if raw is None else Kept(removal, raw)
        self._known.pop(removal.nodeId, None)
        self.version += 1
        return True

    def is_removed(self, node_id: str) -> bool:
        """Whether a tombstone names this node."""
        return node_id in self._removed

    def removed_at(self, node_id: str) -> int | None:
        """When this node was removed (epoch ms), or None."""
        removal = self._removed.get(node_id)
        return None if removal is None else removal.fact.removedAt

    def removals(self) -> list[Removal]:
        """Every tombstone, to pass on."""
        return [kept.fact for _, kept in sorted(self._removed.items())]

    def kept_removals(self) -> list[Kept[Removal]]:
        """Every tombstone as signed, by node id."""
        return [kept for _, kept in sorted(self._removed.items())]

    def kept_records(self) -> list[Kept[NodeRecord]]:
        """Every record held as its owner signed it, by node id."""
        return [Kept(known.record, known.raw) for _, known in sorted(self._known.items())]

    def records(self) -> list[NodeRecord]:
        """Every record held, ours included."""
        return [known.record for _, known in sorted(self._known.items())]

    def record(self, node_id: str) -> NodeRecord | None:
        """The record of one node, if held."""
        known = self._known.get(node_id)
        return known.record if known else None

    def reachable(self, node_id: str, now: float) -> bool:
        """Whether the node was heard from recently (this node always is)."""
        if node_id == self.self_id:
            return True
        known = self._known.get(node_id)
        return known is not None and now - known.heard_at <= self.unreachable_after_s

    def peers(self) -> list[NodeRecord]:
        """Every other member's record."""
        return [r for r in self.records() if r.nodeId != self.self_id]
