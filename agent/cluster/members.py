"""This node's side of membership: carrying out what `facts.membership` decides.

`Members` holds the node records (`facts.records.Membership`), applies records pushes
(tombstones unpin, new members' certificates are pinned, members' records offered), answers
with this node's own push, and tells the workload manager whenever its peers change.

It also holds what every member speaks (`facts.wire`): the cluster's wire version and its
feature gate follow from it, and a member whose wire range does not overlap this one's is
refused (`Incompatible`): its pushes are answered with why, nothing it signed is taken, and
its record is kept only to be shown -- never placed on, never routed to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
from cryptography import x509

from agent.cluster.api_keys import ApiKeys
from agent.cluster.artifacts import Artifacts
from agent.cluster.deployments import Deployments
from agent.core.errors import AgentError
from certs import ClusterDir, PinRefused
from certs.pins import Member
from facts import wire
from facts.kept import Kept, raws
from facts.membership import PushPlan, manager_peers, plan_push
from facts.probing import Prober
from facts.record_deltas import digest, holdings, lacking
from facts.record_signing import RecordVerifier, Statement
from facts.records import Membership, NodeRecord, RecordsPush, Removal
from workload_manager.manager import Peer

__all__ = ["SEEDS_FILE", "Incompatible", "Members", "read_seeds", "remover"]

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Statement)

SEEDS_FILE: Final = "seeds.json"
_encode: Final = msgspec.json.Encoder().encode
_decode_record: Final = msgspec.json.Decoder(NodeRecord).decode
_decode_removal: Final = msgspec.json.Decoder(
    Removal
).decode  # in NVPAIR_HOME: the records learnt when joining


class Incompatible(AgentError):
    """A member whose wire range does not overlap this one's: the message names both
    releases (`facts.wire.refusal`)."""


def remover(statement: str) -> str | None:
    """Who signed a tombstone's removal (its `by`), or None when it does not say."""
    try:
        return _decode_removal(statement).by or None
    except msgspec.DecodeError:
        return None


def read_seeds(path: Path) -> list[Kept[NodeRecord]]:
    """The records `nvpair cluster join` saved (as their owners signed them), so a new
    member knows where its peers are before any of them has pushed; a missing or
    unreadable file is no seeds."""
    try:
        pieces = msgspec.json.decode(path.read_bytes(), type=list[msgspec.Raw])
        return [Kept(_decode_record(p), bytes(p)) for p in pieces]
    except FileNotFoundError:
        return []
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
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
        speaks: Kept[wire.Speaks] | None = None,
        artifacts: Artifacts | None = None,
    ) -> None:
        self.artifacts = artifacts
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
        # What each member speaks, as it signed it (this node's own included): the wire
        # version the cluster speaks and who is too far apart to work with follow from it.
        self._speaks: dict[str, Kept[wire.Speaks]] = {}
        self._speaks_version = 0  # counts changes to `_speaks`, as `Membership.version` does
        # `working_records()` as last derived, and the versions it was derived at.
        self._working: tuple[tuple[int, int], list[NodeRecord]] | None = None
        self.refused_pushes: dict[str, str] = {}  # member -> why its last push was refused
        self.refused_by: dict[str, str] = {}  # member -> why it refused our last push
        self.mine = wire.Range(wire.RELEASE, wire.WIRE_MIN, wire.WIRE_MAX)
        if speaks is not None:
            self._speaks[self_id] = speaks
            self.mine = wire.of(speaks.fact)
        # Removals are durable: the tombstones under removed/ are loaded and pushed again, so
        # a member that was down during a removal learns it after any restart of the others.
        for member in cluster.pins.members():
            if member.removed is not None:
                kept = self._loaded(member.node_id, member)
                self.membership.remove(kept.fact, kept.raw)

    # -- reads ------------------------------------------------------------------------------

    def _loaded(self, node_id: str, member: Member) -> Kept[Removal]:
        """A tombstone's removal as its remover signed it; one written before removals were
        signed (or damaged) this node signs itself -- any member may remove."""
        try:
            raw = member.statement.encode()
            removal = _decode_removal(raw)
            if removal.nodeId == node_id:
                return Kept(removal, raw)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeEncodeError):
            pass
        assert member.removed is not None  # a tombstone's member
        removed_at = int(member.removed.timestamp() * 1000)
        return Kept.made(self._sign(Removal(nodeId=node_id, removedAt=removed_at, pin=member.pin)))

    # -- releases -----------------------------------------------------------------------------

    def range_of(self, node_id: str) -> wire.Range:
        """What `node_id` speaks: its statement's range, or wire 1 alone when it sent none
        (a release before 0.2.0) or its record names another release than its statement
        (it was rolled back to a release that sends none: the statement is stale)."""
        held = self._speaks.get(node_id)
        record = self.membership.record(node_id)
        return wire.of(held.fact if held is not None else None, record.version if record else None)

    def refusal(self, node_id: str) -> str | None:
        """Why this node does not work with `node_id` (their wire ranges do not overlap),
        naming both releases; None when it does."""
        if node_id == self.self_id:
            return None
        return wire.refusal(self.mine, self.range_of(node_id), who=node_id)

    def works_with(self, node_id: str) -> bool:
        """Whether `node_id`'s wire range overlaps this node's."""
        return self.refusal(node_id) is None

    def gate(self) -> wire.Gate:
        """The cluster's wire version and which features it turns on (`facts.wire.gate`),
        from every member whose record this node holds."""
        return wire.gate(
            {r.nodeId: self.range_of(r.nodeId) for r in self.records()}, mine=self.mine
        )

    def status(self) -> dict[str, Any]:
        """`nvpair cluster status`: this member's release and range, the cluster's wire
        version, which features it turns on, who holds the rest back, who is refused."""
        gate = self.gate()
        members = [
            {
                "nodeId": r.nodeId,
                "name": r.name,
                "release": r.version,
                "wire": [self.range_of(r.nodeId).low, self.range_of(r.nodeId).high],
            }
            for r in self.records()
        ]
        return {
            "release": self.mine.release,
            "wire": [self.mine.low, self.mine.high],
            "clusterWire": gate.wire,
            "features": {
                "on": list(gate.on),
                "off": list(gate.off),
                "needs": {f: wire.FEATURES[f] for f in (*gate.on, *gate.off)},
            },
            "heldBackBy": [
                {"nodeId": n, "release": r.release, "wire": [r.low, r.high]}
                for n, r in gate.held_back_by
            ],
            "refused": [{"nodeId": n, "why": why} for n, why in sorted(self._refused().items())],
            "members": members,
        }

    def _refused(self) -> dict[str, str]:
        """Member -> why this node does not work with it: its range, a push it refused
        from it, or one of ours it refused."""
        refused = {**self.refused_by, **self.refused_pushes}
        for record in self.records():
            why = self.refusal(record.nodeId)
            if why is not None:
                refused[record.nodeId] = why
        return refused

    def working_records(self) -> list[NodeRecord]:
        """The records of the members this node works with: what placement and routing
        see (a member too far apart is shown, never used).

        Every request placed asks for them, so they are derived again only when a record or
        a wire statement changed, and the list is shared: callers do not change it."""
        versions = (self.membership.version, self._speaks_version)
        working = self._working
        if working is None or working[0] != versions:
            records = [r for r in self.membership.records() if self.works_with(r.nodeId)]
            working = self._working = (versions, records)
        return working[1]

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

    def reachable_peers_working(self) -> list[str]:
        """The reachable peers this node works with (their wire ranges overlap)."""
        return [n for n in self.reachable_peers() if self.works_with(n)]

    def alive(self) -> int:
        """How many members are alive: this node and the others heard from recently."""
        return 1 + len(self.reachable_peers())

    def manager_peers(self) -> list[Peer]:
        """The workload manager's peers."""
        return manager_peers(self.membership.peers(), self._cluster.pins.is_member)

    def nodes(self) -> list[dict[str, Any]]:
        """Every member's record with its reachability (for the local API)."""
        now = self._clock()
        rows = []
        for r in self.membership.records():
            speaks = self.range_of(r.nodeId)
            rows.append(
                {
                    **msgspec.to_builtins(r),
                    "reachable": self.reachable(r.nodeId, now),
                    "release": r.version,  # what its record says it runs
                    "wire": [speaks.low, speaks.high],
                    "refused": self.refusal(r.nodeId),
                }
            )
        return rows

    def _artifacts(self) -> list[msgspec.Raw]:
        return raws(self.artifacts.held.kept()) if self.artifacts is not None else []

    def _speaks_of(self, node_ids: Iterable[str]) -> list[msgspec.Raw]:
        return raws(self._speaks[n] for n in sorted(set(node_ids)) if n in self._speaks)

    def push_body(self) -> RecordsPush:
        """What this node tells a member: records, tombstones, members' certificates, what
        members speak."""
        return RecordsPush(
            records=raws(self.membership.kept_records()),
            removals=raws(self.membership.kept_removals()),
            certificates=[pem.decode() for pem in self._cluster.pins.pems()],
            deployments=raws(self.deployments.held.kept()) if self.deployments else [],
            apiKeys=raws(self.api_keys.held.kept()) if self.api_keys else [],
            speaks=self._speaks_of(self._speaks),
            artifacts=self._artifacts(),
        )

    def holdings(self) -> dict[str, int]:
        """Node id -> generation held (0 pinned without a record, -1 removed)."""
        pinned = [m.node_id for m in self._cluster.pins.members() if m.removed is None]
        return holdings(self.membership.records(), pinned, self.membership.removals())

    def digest(self) -> str:
        """The digest of what this node holds, which probes compare."""
        # Artifacts count only once every member keeps them (`facts.wire`, "artifacts"):
        # a member of 0.1.0 holds none, and its digest would differ from ours for ever.
        counted = self.artifacts is not None and self.gate().allows("artifacts")
        return digest(
            self.holdings(),
            self.deployments.all() if self.deployments is not None else (),
            self.api_keys.all() if self.api_keys is not None else (),
            self.artifacts.all() if counted and self.artifacts is not None else (),
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
            records=raws(k for k in self.membership.kept_records() if k.fact.nodeId in newer),
            removals=raws(k for k in self.membership.kept_removals() if k.fact.nodeId in removed),
            certificates=[pem.decode() for pem in pems],
            deployments=raws(self.deployments.held.kept())
            if statements and self.deployments
            else [],
            apiKeys=raws(self.api_keys.held.kept()) if statements and self.api_keys else [],
            artifacts=self._artifacts() if statements else [],
            speaks=self._speaks_of(newer | {self.self_id}),
            digest=self.digest(),
            delta=True,
        )

    def sent_in_delta(self, theirs: dict[str, int]) -> dict[str, int]:
        """What `delta_for(theirs)` carries, as holdings: the generations of the records in
        it, -1 for its removals."""
        mine = self.holdings()
        newer, _, removed = lacking(mine, theirs)
        return {n: mine[n] for n in newer} | dict.fromkeys(removed, -1)

    # -- changes ----------------------------------------------------------------------------

    def offer(self, records: Iterable[NodeRecord | Kept[NodeRecord]]) -> None:
        """Take records this node vouches for itself (its own, the seeds it joined with)."""
        now = self._clock()
        for record in records:
            if isinstance(record, Kept):
                self.membership.offer(record.fact, now, record.raw)
            else:
                self.membership.offer(record, now)
        self._on_records()

    def heard_from(self, node_id: str) -> None:
        """A direct contact: the member is reachable now (and took what we sent)."""
        self.refused_by.pop(node_id, None)
        self.membership.heard_from(node_id, self._clock())
        if self.prober is not None:
            self.prober.contact(node_id, None, self._clock())

    def on_push(self, push: RecordsPush, sender: str) -> RecordsPush:
        """A member pushed its view (node API): merge it and answer -- a delta with our
        digest, a sync with what it lacks and our holdings, a full push (a member of the
        previous version) with our full push. A member this node does not work with (their
        wire ranges do not overlap) is refused (`Incompatible`) and nothing it sent taken."""
        plan = self._plan(push)
        theirs = next((k for k in plan.speaks if k.fact.nodeId == sender), None)
        mine_of_them = wire.of(theirs.fact) if theirs is not None else self.range_of(sender)
        why = wire.refusal(self.mine, mine_of_them, who=sender)
        if why is not None:
            self._take_speaks(k for k in plan.speaks if k.fact.nodeId == sender)
            if self.refused_pushes.get(sender) != why:
                log.warning("refused a push from %s: %s", sender, why)
            self.refused_pushes[sender] = why  # one per pinned member: bounded
            raise Incompatible(why)
        self.refused_pushes.pop(sender, None)
        self._apply(plan)
        self.heard_from(sender)
        if push.delta:
            return RecordsPush(digest=self.digest())
        if push.have is not None:
            answer = self.delta_for(dict(push.have), statements=True)
            return msgspec.structs.replace(
                answer, delta=False, have=sorted(self.holdings().items())
            )
        return self.push_body()

    def merge(self, push: RecordsPush) -> None:
        """Carry out what `plan_push` decides for `push`."""
        self._apply(self._plan(push))

    def _plan(self, push: RecordsPush) -> PushPlan:
        return plan_push(
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

    def _take_speaks(self, offered: Iterable[Kept[wire.Speaks]]) -> None:
        for kept in offered:
            held = self._speaks.get(kept.fact.nodeId)
            if held is None or kept.fact.at > held.fact.at:
                self._speaks[kept.fact.nodeId] = kept
                self._speaks_version += 1
                log.info("%s speaks %s", kept.fact.nodeId, wire.describe(wire.of(kept.fact)))

    def _workable(self, offered: Iterable[Kept[S]], refused: list[str]) -> list[Kept[S]]:
        """The statements signed by members this node works with; the others refused."""
        taken = []
        for kept in offered:
            why = self.refusal(kept.fact.by)
            if why is None:
                taken.append(kept)
            else:
                refused.append(f"a statement signed by {kept.fact.by}: {why}")
        return taken

    def _apply(self, plan: PushPlan) -> None:
        before = self.manager_peers()
        self._take_speaks(plan.speaks)
        refused: list[str] = []
        tombstones = self._workable(plan.tombstones, refused)
        deployments = self._workable(plan.deployments, refused)
        api_keys = self._workable(plan.api_keys, refused)
        artifacts = self._workable(plan.artifacts, refused)
        self._tombstone(tombstones)
        if self.deployments is not None and deployments:
            self.deployments.merge(deployments)
        if self.api_keys is not None and api_keys:
            self.api_keys.merge(api_keys)
        if self.artifacts is not None and artifacts:
            self.artifacts.merge(artifacts)
        for pin in plan.pins:
            try:
                self._cluster.pins.pin(pin.cert, ca=self._ca)
                log.info("pinned new member %s (%s)", pin.node_id, pin.name)
            except PinRefused as exc:
                log.info("not pinning %s: %s", pin.node_id, exc)
        for reason in (*plan.refused, *refused):
            log.warning("ignoring %s", reason)
        now = self._clock()
        for kept in plan.offers:
            if self._cluster.pins.is_member(kept.fact.nodeId):
                self.membership.offer(kept.fact, now, kept.raw)
        self._on_records()
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
        self._tombstone([Kept.made(self._sign(removal))])
        if self.manager_peers() != before:
            self._set_peers(self.manager_peers())

    def _tombstone(self, removals: Iterable[Kept[Removal]]) -> None:
        # Written down before anything else: a removal this node took is never forgotten,
        # whether or not it ever pinned the removed node.
        for kept in removals:
            removal = kept.fact
            node_id = removal.nodeId
            held = self.membership.record(node_id)
            if not self.membership.remove(removal, kept.raw):
                continue
            statement = kept.raw.decode()
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
