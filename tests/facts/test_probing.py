"""The probing core (facts/probing.py) in memory: N members on a fake clock, pings that
either arrive or do not. What a beat costs when nothing changes, how soon a stopped member
is unreachable everywhere, and that a false verdict is refuted."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from facts.probing import Ping, PingReq, PingReqAnswer, Prober, Rumor, State
from facts.record_deltas import REMOVED, digest, lacking

BEAT_S = 2.0  # the default heartbeat
DIGEST = digest({"nod_x": 1})


class Cluster:
    """N probers and the links between them; `down` members answer nothing."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.ids = [f"nod_{i:03d}" for i in range(n)]
        self.probers = {
            i: Prober(i, 1_000, random.Random(rng.random()), suspect_s=BEAT_S) for i in self.ids
        }
        for prober in self.probers.values():
            prober.set_peers(self.ids)
        self.down: set[str] = set()
        self.bytes: dict[str, int] = dict.fromkeys(self.ids, 0)

    def _ping(self, sender: str, target: str, now: float, body: bytes = b"") -> bool:
        me = self.probers[sender]
        body = body or msgspec.json.encode(
            Ping(digest=DIGEST, incarnation=me.incarnation, rumors=me.rumors())
        )
        self.bytes[sender] += len(body)
        if target in self.down:
            return False
        ping = msgspec.json.decode(body, type=Ping)
        there = self.probers[target]
        there.contact(sender, ping.incarnation, now)
        there.hear(ping.rumors, now)
        ack = msgspec.json.encode(
            Ping(digest=DIGEST, incarnation=there.incarnation, rumors=there.rumors())
        )
        self.bytes[sender] += len(ack)
        answer = msgspec.json.decode(ack, type=Ping)
        me.contact(target, answer.incarnation, now)
        me.hear(answer.rumors, now)
        return True

    def beat(self, now: float) -> None:
        for node_id in self.ids:
            if node_id in self.down:
                continue
            prober = self.probers[node_id]
            for target in prober.targets():
                if self._ping(node_id, target, now):
                    continue
                reached = False
                for helper in prober.helpers_for(target):
                    request = msgspec.json.encode(PingReq(target=target))
                    self.bytes[node_id] += len(request)
                    if helper in self.down:
                        continue
                    reached = self._ping(helper, target, now) or reached
                    self.bytes[node_id] += len(msgspec.json.encode(PingReqAnswer(reached=reached)))
                if reached:
                    prober.contact(target, None, now)
                else:
                    prober.unreached(target, now)
            if prober.tick(now):  # the verdict to every member it holds alive, at once
                body = msgspec.json.encode(
                    Ping(digest=DIGEST, incarnation=prober.incarnation, rumors=prober.rumors())
                )
                for other in self.ids:
                    if other != node_id and prober.reachable(other):
                        self._ping(node_id, other, now, body)

    def everyone_says(self, node_id: str, reachable: bool) -> bool:
        return all(
            p.reachable(node_id) is reachable
            for i, p in self.probers.items()
            if i != node_id and i not in self.down
        )


def test_a_quiet_beat_costs_a_member_the_same_bytes_at_4_and_32_members() -> None:
    per_beat: dict[int, float] = {}
    for n in (4, 32):
        cluster = Cluster(n)
        for beat in range(20):
            cluster.beat(beat * BEAT_S)
        per_beat[n] = sum(cluster.bytes.values()) / n / 20
    print(f"bytes per member per quiet beat: {per_beat}")
    assert per_beat[32] == pytest.approx(per_beat[4], rel=0.05)
    assert per_beat[32] < 400  # two pings and their answers, a digest and no rumors


@pytest.mark.parametrize("seed", range(5))
def test_a_stopped_member_is_unreachable_everywhere_within_10s_at_64(seed: int) -> None:
    cluster = Cluster(64, seed)
    for beat in range(3):
        cluster.beat(beat * BEAT_S)
    victim = cluster.ids[seed]
    cluster.down.add(victim)
    stopped = 3 * BEAT_S
    now = stopped
    while not cluster.everyone_says(victim, False):
        assert now - stopped <= 10, "a stopped member is unreachable everywhere within 10 s"
        cluster.beat(now)
        now += BEAT_S
    # The control: every other member stays reachable for everyone.
    assert all(cluster.everyone_says(i, True) for i in cluster.ids if i != victim)
    # It comes back (a restart: a higher incarnation) and is reachable again in a few beats.
    cluster.down.discard(victim)
    cluster.probers[victim] = Prober(victim, 2_000, random.Random(seed), suspect_s=BEAT_S)
    cluster.probers[victim].set_peers(cluster.ids)
    back = now
    while not cluster.everyone_says(victim, True):
        assert now - back <= 5 * BEAT_S
        cluster.beat(now)
        now += BEAT_S


def test_a_live_member_refutes_a_verdict_about_it() -> None:
    a = Prober("nod_a", 5, random.Random(1))
    b = Prober("nod_b", 7, random.Random(2))
    a.set_peers(["nod_b"])
    b.set_peers(["nod_a"])
    a.contact("nod_b", 7, 0.0)  # a has heard b at incarnation 7
    a.unreached("nod_b", 0.0)
    assert a.reachable("nod_b")  # suspect is still listed reachable
    assert a.tick(10.0) == ["nod_b"]
    assert not a.reachable("nod_b")
    b.hear(a.rumors(), 10.0)  # b hears it is thought dead at incarnation 7
    assert b.incarnation == 8
    a.hear(b.rumors(), 11.0)
    assert a.state("nod_b") is State.ALIVE
    # An old verdict (the incarnation it refuted) changes nothing any more.
    a.hear([Rumor(nodeId="nod_b", incarnation=7, alive=False)], 12.0)
    assert a.reachable("nod_b")
    # Nor does one at an older incarnation than a knows, but a probes b next.
    for _ in range(100):  # heard again and again, it is probed next once
        a.hear([Rumor(nodeId="nod_b", incarnation=0, alive=False)], 12.0)
    assert len(a._round) <= 2
    assert a.reachable("nod_b")
    assert a.targets() == ["nod_b"]
    # The control: a verdict at its current incarnation does count.
    a.hear([Rumor(nodeId="nod_b", incarnation=8, alive=False)], 13.0)
    assert not a.reachable("nod_b")


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=70), st.integers(min_value=1, max_value=5))
def test_every_peer_is_probed_once_a_round(n: int, k: int) -> None:
    prober = Prober("nod_self", 1, random.Random(n), probes_per_beat=k)
    peers = [f"nod_{i}" for i in range(n)]
    prober.set_peers(["nod_self", *peers])
    seen: list[str] = []
    for _ in range(-(-n // k)):
        targets = prober.targets()
        assert len(targets) == min(k, n)
        assert len(set(targets)) == len(targets)
        seen += targets
    assert set(seen) == set(peers)
    # Rumors per message are bounded whatever happens.
    for peer in peers:
        prober.unreached(peer, 0.0)
    prober.tick(100.0)
    assert len(prober.rumors()) <= 8


def test_digests_agree_on_equal_holdings_and_deltas_name_what_lacks() -> None:
    mine = {"nod_a": 5, "nod_b": 3, "nod_c": 0, "nod_d": REMOVED}
    assert digest(mine) == digest(dict(reversed(mine.items())))
    assert digest(mine) != digest({**mine, "nod_a": 6})
    newer, unknown, removed = lacking(mine, {"nod_a": 5, "nod_b": 2})
    assert (newer, unknown, removed) == ({"nod_b"}, {"nod_c"}, {"nod_d"})
    assert lacking(mine, mine) == (set(), set(), set())
    # A tombstone there wins over our record.
    assert lacking({"nod_a": 9}, {"nod_a": REMOVED}) == (set(), set(), set())
