"""Who is reachable, decided SWIM style, sans-I/O: bounded probes instead of every member
heartbeating every other.

Each beat a member probes `probes_per_beat` peers, round-robin over a list shuffled anew
each round, with a small ping (`Ping`: its holdings digest, its incarnation, a few rumors).
A peer that answers is alive. One that does not is probed indirectly: up to `helpers`
other alive members are asked to ping it (`PingReq`); if none reaches it, it is suspected,
and `suspect_s` later, with no contact in between, it is dead -- unreachable -- and the
verdict, with the incarnation it was taken at, spreads as a `Rumor` piggybacked on pings
(and, by the agent, sent to every peer at once). A live peer that hears it is suspected
refutes it by raising its incarnation, and any member that hears from it directly (a ping
it sends, an answer to one) holds it alive again. A restarted member starts with a higher
incarnation (the wall clock), so old verdicts about it are ignored.

`Prober` takes time and randomness from the caller; it does no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Final

from msgspec import Meta, Struct

__all__ = ["Ping", "PingReq", "PingReqAnswer", "Prober", "Rumor", "State"]

MAX_RUMORS: Final = 64  # rumors held to pass on; the oldest go first
RUMORS_PER_MESSAGE: Final = 8  # a ping's bytes do not grow with the cluster

_Id = Annotated[str, Meta(min_length=1, max_length=256)]
_Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class Rumor(Struct, kw_only=True, frozen=True):
    """A verdict about a member at one of its incarnations: alive, or not reached."""

    nodeId: _Id
    incarnation: _Count
    alive: bool


class Ping(Struct, kw_only=True, frozen=True):
    """Body of `POST /v1/members/ping` and its answer: the sender's holdings digest (so a
    difference starts a records exchange), its incarnation, rumors to pass on."""

    digest: Annotated[str, Meta(max_length=64)] = ""
    incarnation: _Count = 0
    rumors: Annotated[list[Rumor], Meta(max_length=RUMORS_PER_MESSAGE)] = []


class PingReq(Struct, kw_only=True, frozen=True):
    """Body of `POST /v1/members/ping-req`: please ping `target` for me."""

    target: _Id


class PingReqAnswer(Struct, kw_only=True, frozen=True):
    """Whether the helper reached the target, and the incarnation it answered with."""

    reached: bool
    incarnation: _Count = 0


class State(Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"  # still listed reachable: not reached, not yet given up on
    DEAD = "dead"  # unreachable


@dataclass
class _Peer:
    incarnation: int = 0
    state: State = State.ALIVE
    since: float = 0.0  # when it became suspect


@dataclass
class _Telling:
    rumor: Rumor
    left: int  # how many more messages carry it


@dataclass
class Prober:
    """Probe targets, verdicts and rumors of one member."""

    self_id: str
    incarnation: int
    rng: random.Random
    probes_per_beat: int = 2
    helpers: int = 3
    suspect_s: float = 2.0
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _round: list[str] = field(default_factory=list)
    _rumors: dict[str, _Telling] = field(default_factory=dict)

    # -- the peers --------------------------------------------------------------------------

    def set_peers(self, node_ids: Iterable[str]) -> None:
        """The members to watch (every other pinned member with a record); a new one is
        alive until a probe says otherwise, one that is gone is forgotten."""
        wanted = {n for n in node_ids if n != self.self_id}
        for gone in set(self._peers) - wanted:
            del self._peers[gone]
            self._rumors.pop(gone, None)
        for new in wanted - set(self._peers):
            self._peers[new] = _Peer()

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._peers

    def state(self, node_id: str) -> State | None:
        peer = self._peers.get(node_id)
        return None if peer is None else peer.state

    def reachable(self, node_id: str) -> bool:
        """Alive or suspect: not (yet) given up on."""
        peer = self._peers.get(node_id)
        return node_id == self.self_id or (peer is not None and peer.state is not State.DEAD)

    def targets(self) -> list[str]:
        """This beat's probes: the next few of a shuffled round over every peer (the dead
        ones too, so a member that comes back is seen)."""
        picked: list[str] = []
        want = min(self.probes_per_beat, len(self._peers))
        while len(picked) < want:
            if not self._round:
                self._round = sorted(self._peers)
                self.rng.shuffle(self._round)
            node_id = self._round.pop()
            if node_id in self._peers and node_id not in picked:
                picked.append(node_id)
        return picked

    def helpers_for(self, node_id: str) -> list[str]:
        """Up to `helpers` alive members, other than `node_id`, to ask for an indirect probe."""
        alive = sorted(n for n, p in self._peers.items() if n != node_id and p.state is State.ALIVE)
        return self.rng.sample(alive, min(self.helpers, len(alive)))

    # -- what is learnt ---------------------------------------------------------------------

    def contact(self, node_id: str, incarnation: int | None, now: float) -> None:
        """Direct evidence: it answered us or called us. Alive, at its incarnation."""
        peer = self._peers.get(node_id)
        if peer is None:
            return
        if incarnation is not None and incarnation > peer.incarnation:
            peer.incarnation = incarnation
        if peer.state is not State.ALIVE:
            peer.state = State.ALIVE
            self._tell(Rumor(nodeId=node_id, incarnation=peer.incarnation, alive=True))

    def unreached(self, node_id: str, now: float) -> None:
        """Neither our probe nor any helper's reached it: suspect it (once)."""
        peer = self._peers.get(node_id)
        if peer is not None and peer.state is State.ALIVE:
            peer.state = State.SUSPECT
            peer.since = now

    def tick(self, now: float) -> list[str]:
        """Suspects not heard from for `suspect_s` are dead; returns those, newly dead."""
        dead: list[str] = []
        for node_id, peer in sorted(self._peers.items()):
            if peer.state is State.SUSPECT and now - peer.since >= self.suspect_s:
                peer.state = State.DEAD
                self._tell(Rumor(nodeId=node_id, incarnation=peer.incarnation, alive=False))
                dead.append(node_id)
        return dead

    def hear(self, rumors: Iterable[Rumor], now: float) -> None:
        """Rumors from a member. One that we are dead is refuted with a higher incarnation;
        one that a peer is dead counts at its incarnation or later (at an older one, we probe it
        next); one that it is alive counts only at a later incarnation (it refuted)."""
        for rumor in rumors:
            if rumor.nodeId == self.self_id:
                if not rumor.alive and rumor.incarnation >= self.incarnation:
                    self.incarnation = rumor.incarnation + 1
                    self._tell(Rumor(nodeId=self.self_id, incarnation=self.incarnation, alive=True))
                continue
            peer = self._peers.get(rumor.nodeId)
            if peer is None:
                continue
            if rumor.incarnation < peer.incarnation:
                # Taken by a member that never heard its latest incarnation: not proof,
                # but a hint -- it is the next one we probe ourselves.
                hinted = self._round[-self.probes_per_beat :]
                if not rumor.alive and peer.state is State.ALIVE and rumor.nodeId not in hinted:
                    self._round.append(rumor.nodeId)  # once: the round stays bounded
                continue
            if not rumor.alive and peer.state is not State.DEAD:
                peer.incarnation = rumor.incarnation
                peer.state = State.DEAD
                self._tell(rumor)
            elif rumor.alive and rumor.incarnation > peer.incarnation:
                peer.incarnation = rumor.incarnation
                peer.state = State.ALIVE
                self._tell(rumor)

    # -- what is told -----------------------------------------------------------------------

    def _tell(self, rumor: Rumor) -> None:
        # Each rumor rides on about 3 log2(N) messages, as SWIM's dissemination does.
        left = 3 * math.ceil(math.log2(len(self._peers) + 2))
        self._rumors.pop(rumor.nodeId, None)
        self._rumors[rumor.nodeId] = _Telling(rumor, left)
        while len(self._rumors) > MAX_RUMORS:
            del self._rumors[next(iter(self._rumors))]

    def rumors(self) -> list[Rumor]:
        """The rumors for one outgoing message (at most `RUMORS_PER_MESSAGE`)."""
        out: list[Rumor] = []
        for node_id, telling in list(self._rumors.items())[:RUMORS_PER_MESSAGE]:
            out.append(telling.rumor)
            telling.left -= 1
            if telling.left <= 0:
                del self._rumors[node_id]
        return out
