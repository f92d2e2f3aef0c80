"""This node's side of membership: carrying out what `facts.membership` decides.

`Members` holds the node records (`facts.records.Membership`), applies records pushes
(tombstones unpin, new members' certificates are pinned, members' records offered), answers
with this node's own push, and tells the workload manager whenever its peers change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
from cryptography import x509

from agent.cluster.api_keys import ApiKeys
from agent.cluster.deployments import Deployments
from certs import ClusterDir, PinRefused
from certs.pins import Member
from facts.membership import manager_peers, plan_push
from facts.probing import Prober
from facts.record_deltas import digest, holdings, lacking
from facts.record_signing import RecordVerifier
from facts.records import Membership, NodeRecord, RecordsPush, Removal
from workload_manager.manager import Peer

__all__ = ["SEEDS_FILE", "Members", "read_seeds", "remover"]

log = logging.getLogger(__name__)

SEEDS_FILE: Final = "seeds.json"
_encode: Final = msgspec.json.Encoder().encode
_decode_removal: Final = msgspec.json.Decoder(
    Removal
).decode  # in NVPAIR_HOME: the records learnt when joining


def remover(statement: str) -> str | None:
    """Who signed a tombstone's removal (its `by`), or None when it does not say."""
    try:
        return _decode_removal(statement).by or None
    except msgspec.DecodeError:
        return None


def read_seeds(path: Path) -> list[NodeRecord]:
    """The records `nvpair cluster join` saved, so a new member knows where its peers are
    before any of them has pushed; a missing or unreadable file is no seeds."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=list[NodeRecord])
    except FileNotFoundError:
        return []
    except (OSError, msgspec.DecodeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return []


class Members:
    """Records, reachability, pins and tombstones of this node's cluster."""

    def __init__(
        self,
        cluster: ClusterDir,
        *,
        self_id: str,
        ca: x509.Certificate,
        unreachable_after_s: float,
        set_peers: Callable[[Sequence[Peer]], None],
        sign: Callable[[Removal], Removal],
        deployments: Deployments | None = None,
        api_keys: ApiKeys | None = None,
        on_records: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.self_id = self_id
        self._cluster = cluster
        self._ca = ca
        self._set_peers = set_peers
        self._sign = sign  # a removal as this node's signed statement
        self.deployments = deployments
        self.api_keys = api_keys
        self._on_records = on_records  # after records were offered or merged
        self._clock = clock
        self.membership = Membership(self_id, unreachable_after_s=unreachable_after_s)
        # Reachability of the members it watches (agent/cluster/probes.py); others by `heard_at`.
        self.prober: Prober | None = None
        self.verifier = RecordVerifier()  # records refused: `verifier.refused`
        # Removals are durable: the tombstones under removed/ are loaded and pushed again, so
        # a member that was down during a removal learns it after any restart of the others.
        for member in cluster.pins.members():
            if member.removed is not None:
                self.membership.remove(self._loaded(member.node_id, member))

    # -- reads ------------------------------------------------------------------------------

    def _loaded(self, node_id: str, member: Member) -> Removal:
        """A tombstone's removal as its remover signed it; one written before removals were
        signed (or damaged) this node signs itself -- any member may remove."""
        try:
            removal = _decode_removal(member.statement)
            if removal.nodeId == node_id:
                return removal
        except msgspec.DecodeError:
            pass
        assert member.removed is not None  # a tombstone's member
        removed_at = int(member.removed.timestamp() * 1000)
        return self._sign(Removal(nodeId=node_id, removedAt=removed_at, pin=member.pin))

    def is_member(self, node_id: str) -> bool:
        """Whether `node_id` is pinned here (this node always is)."""
        return node_id == self.self_id or self._cluster.pins.is_member(node_id)

    def records(self) -> list[NodeRecord]:
        """Every record held, ours included."""
        return self.membership.records()

    def record(self, node_id: str) -> NodeRecord | None:
        """One member's record."""
        return self.membership.record(node_id)

    def reachable(self, node_id: str, now: float) -> bool:
        """Whether the member is reachable: the probes' verdict (facts/probing.py) for the
        members they watch, else whether it was heard from recently."""
        if self.prober is not None and node_id in self.prober:
            return self.prober.reachable(node_id)
        return self.membership.reachable(node_id, now)

    def peers(self) -> list[NodeRecord]:
        """Every other pinned member's record."""
        return [r for r in self.membership.peers() if self._cluster.pins.is_member(r.nodeId)]

    def reachable_peers(self) -> list[str]:
        """The node ids of the other pinned members heard from recently."""
        now = self._clock()
        return [r.nodeId for r in self.peers() if self.reachable(r.nodeId, now)]

    def alive(self) -> int:
        """How many members are alive: this node and the others heard from recently."""
        return 1 + len(self.reachable_peers())

    def manager_peers(self) -> list[Peer]:
        """The workload manager's peers."""
        return manager_peers(self.membership.peers(), self._cluster.pins.is_member)

    def nodes(self) -> list[dict[str, Any]]:
        """Every member's record with its reachability (for the local API)."""
        now = self._clock()
        return [
            {**msgspec.to_builtins(r), "reachable": self.reachable(r.nodeId, now)}
            for r in self.membership.records()
        ]

    def push_body(self) -> RecordsPush:
        """What this node tells a member: records, tombstones, members' certificates."""
        return RecordsPush(
            records=self.membership.records(),
            removals=self.membership.removals(),
            certificates=[pem.decode() for pem in self._cluster.pins.pems()],
            deployments=self.deployments.all() if self.deployments is not None else [],
            apiKeys=self.api_keys.all() if self.api_keys is not None else [],
        )

    def holdings(self) -> dict[str, int]:
        """Node id -> generation held (0 pinned without a record, -1 removed)."""
        pinned = [m.node_id for m in self._cluster.pins.members() if m.removed is None]
        return holdings(self.membership.records(), pinned, self.membership.removals())

    def digest(self) -> str:
        """The digest of what this node holds, which probes compare."""
        return digest(
            self.holdings(),
            self.deployments.all() if self.deployments is not None else (),
            self.api_keys.all() if self.api_keys is not None else (),
        )

    def sync_request(self) -> RecordsPush:
        """A sync: our holdings, so the member answers with only what we lack."""
        return RecordsPush(have=sorted(self.holdings().items()), digest=self.digest())

    def delta_for(self, theirs: dict[str, int] | None, *, statements: bool) -> RecordsPush:
        """What a member holding `theirs` lacks (None: not known, so our own record alone,
        and every certificate); deployments and API keys when `statements`."""
        mine = self.holdings()
        if theirs is None:
            newer, unknown, removed = {self.self_id}, set(mine), set(mine)
        else:
            newer, unknown, removed = lacking(mine, theirs)
        pems = self._cluster.pins.pems_of(unknown) if unknown else []
        return RecordsPush(
            records=[r for r in self.membership.records() if r.nodeId in newer],
            removals=[r for r in self.membership.removals() if r.nodeId in removed],
            certificates=[pem.decode() for pem in pems],
            deployments=self.deployments.all() if statements and self.deployments else [],
            apiKeys=self.api_keys.all() if statements and self.api_keys else [],
            digest=self.digest(),
            delta=True,
        )

    # -- changes ----------------------------------------------------------------------------

    def offer(self, records: Iterable[NodeRecord]) -> None:
        """Take records this node vouches for itself (its own, the seeds it joined with)."""
        now = self._clock()
        for record in records:
            self.membership.offer(record, now)
        self._on_records()

    def heard_from(self, node_id: str) -> None:
        """A direct contact: the member is reachable now."""
        self.membership.heard_from(node_id, self._clock())
        if self.prober is not None:
            self.prober.contact(node_id, None, self._clock())

    def on_push(self, push: RecordsPush, sender: str) -> RecordsPush:
        """A member pushed its view (node API): merge it and answer -- a delta with our
        digest, a sync with what it lacks and our holdings, a full push (a member of the
        previous version) with our full push."""
        self.merge(push)
        self.heard_from(sender)
        if push.delta:
            return RecordsPush(digest=self.digest())
        if push.have is not None:
            answer = self.delta_for(dict(push.have), statements=True)
            return RecordsPush(
                records=answer.records,
                removals=answer.removals,
                certificates=answer.certificates,
                deployments=answer.deployments,
                apiKeys=answer.apiKeys,
                digest=answer.digest,
                have=sorted(self.holdings().items()),
            )
        return self.push_body()

    def merge(self, push: RecordsPush) -> None:
        """Carry out what `plan_push` decides for `push`."""
        before = self.manager_peers()
        plan = plan_push(
            push,
            self_id=self.self_id,
            ca=self._ca,
            is_member=self._cluster.pins.is_member,
            is_removed=self.membership.is_removed,
            removed_at=self.membership.removed_at,
            key_of=self._cluster.pins.public_key_of,
            verifier=self.verifier,
            now_ms=int(time.time() * 1000),  # generations are wall-clock ms
        )
        self._tombstone(plan.tombstones)
        if self.deployments is not None and plan.deployments:
            self.deployments.merge(plan.deployments)
        if self.api_keys is not None and plan.api_keys:
            self.api_keys.merge(plan.api_keys)
        for pin in plan.pins:
            try:
                self._cluster.pins.pin(pin.cert, ca=self._ca)
                log.info("pinned new member %s (%s)", pin.node_id, pin.name)
            except PinRefused as exc:
                log.info("not pinning %s: %s", pin.node_id, exc)
        for reason in plan.refused:
            log.warning("ignoring %s", reason)
        self.offer(r for r in plan.offers if self._cluster.pins.is_member(r.nodeId))
        if self.manager_peers() != before:
            self._set_peers(self.manager_peers())

    def remove(self, node_id: str) -> None:
        """`nvpair cluster remove`: tombstone, unpin here; members learn with the push."""
        if node_id == self.self_id:
            raise PinRefused("a node cannot remove itself; run the removal on another member")
        before = self.manager_peers()
        known = {m.node_id: m for m in self._cluster.pins.members()}.get(node_id)
        removal = Removal(
            nodeId=node_id,
            removedAt=int(time.time() * 1000),
            pin=known.pin if known is not None else "",
        )
        self._tombstone([self._sign(removal)])
        if self.manager_peers() != before:
            self._set_peers(self.manager_peers())

    def _tombstone(self, removals: Iterable[Removal]) -> None:
        # Written down before anything else: a removal this node took is never forgotten,
        # whether or not it ever pinned the removed node.
        for removal in removals:
            node_id = removal.nodeId
            held = self.membership.record(node_id)
            if not self.membership.remove(removal):
                continue
            statement = _encode(removal).decode()
            if self._cluster.pins.is_member(node_id):
                self._cluster.pins.unpin(node_id, statement=statement)
                log.info("member %s removed (by %s)", node_id, removal.by or "an older member")
            elif not self._cluster.pins.is_removed(node_id):
                self._cluster.pins.tombstone(
                    node_id,
                    name=held.name if held is not None else "",
                    pin=removal.pin,
                    at=removal.removedAt / 1000,
                    statement=statement,
                )
                log.info("%s was removed (by %s)", node_id, removal.by or "an older member")
