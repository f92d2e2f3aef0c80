"""API keys' limits held cluster-wide (`agent.serving.cluster_limits`, issue 29, item 4):
three members' limit parts wired to each other in memory (the holder's answer is what the
node API serves), with a fake clock: the limit holds whichever members take the traffic,
leases are asked once for many waiting requests, tokens reach the holder and close the key
everywhere, a member cut off from the holder admits its share alone and says so, and a
cluster with a 0.1.0 member keeps 0.1.0's shares."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from agent.core.errors import MemberRefused, MemberUnreachable
from agent.serving.cluster_limits import ALONE_S, ClusterLimits
from agent.serving.rate_limit import KeyLimiter
from facts.key_limits import KeyAsk, LeaseAnswer, LeaseAsk, holder_of

IDS = ["nod_a", "nod_b", "nod_c"]
KEY = "batch"


class Clock:
    def __init__(self) -> None:
        self.at = 1000.0

    def __call__(self) -> float:
        return self.at


class Mesh:
    """Three members; `cut` holds the members whose calls fail (a partition)."""

    def __init__(self, rpm: int = 60, tpm: int = 0, *, enabled: bool = True) -> None:
        self.clock = Clock()
        self.cut: set[str] = set()
        self.refusing: set[str] = set()  # members that answer an error status (starting)
        self.reach: dict[str, list[str]] = {}  # member -> the members it reaches (all)
        self.calls = 0
        self.limits = (rpm, tpm)
        self.members = {
            node: ClusterLimits(
                self_id=node,
                limiter=KeyLimiter(),
                limits_of=lambda name: self.limits if name == KEY else None,
                holders=self.reach_of(node),
                members=lambda: 3,
                members_alive=lambda: 3,
                enabled=lambda: enabled,
                ask=self.ask,
                clock=self.clock,
            )
            for node in IDS
        }
        self.holder = holder_of(KEY, IDS)
        self.others = [n for n in IDS if n != self.holder]

    def reach_of(self, node: str) -> Callable[[], list[str]]:
        return lambda: self.reach.get(node, IDS)

    async def ask(self, node: str, ask: LeaseAsk) -> LeaseAnswer:
        self.calls += 1
        await asyncio.sleep(0)  # a call takes a turn of the loop, as a real one does
        if node in self.cut:
            raise MemberUnreachable(f"{node}: cut off")
        if node in self.refusing:
            raise MemberRefused(node, 503, "this member holds no key limits")
        return self.members[node].answer(ask)

    async def send(self, nodes: list[str], count: int) -> int:
        """`count` requests of the key, entering `nodes` in turn, all at once: how many
        were admitted."""
        rpm, tpm = self.limits
        turns = itertools.cycle(nodes)
        answers = await asyncio.gather(
            *(self.members[next(turns)].admit(KEY, rpm, tpm) for _ in range(count))
        )
        return sum(1 for a in answers if a is None)


async def test_the_limit_holds_when_all_traffic_enters_one_member() -> None:
    mesh = Mesh(rpm=60)
    assert await mesh.send([mesh.others[0]], 200) == 60  # not a third: the key's limit
    assert mesh.calls <= 60  # leases: a few requests a call, never one call per request
    refused = await mesh.members[mesh.others[0]].admit(KEY, 60, 0)
    assert refused is not None
    assert refused.kind == "requests"
    assert 1 <= refused.retry_after_s <= 60
    assert refused.allowed == 60  # the whole limit: this member did not admit alone
    # A minute later the window has moved on.
    mesh.clock.at += 61
    assert await mesh.send([mesh.others[0]], 10) == 10


async def test_the_limit_holds_when_traffic_is_spread_and_on_the_holder() -> None:
    spread = Mesh(rpm=60)
    admitted = await spread.send(IDS, 200)
    chunk = max(1, 60 // 12)  # a quarter of the limit over three members
    assert 60 - 2 * chunk <= admitted <= 60  # leases granted and not used yet: under
    held = Mesh(rpm=60)
    assert await held.send([held.holder], 200) == 60
    assert held.calls == 0  # the holder counts its own alone


async def test_waiting_requests_share_one_call_for_a_lease() -> None:
    mesh = Mesh(rpm=6000)
    assert await mesh.send([mesh.others[0]], 40) == 40
    # 6000 / 12 = 500, capped at 64 a lease: one call, and a refill in the background.
    assert mesh.calls <= 2


async def test_tokens_reach_the_holder_and_close_the_key_everywhere() -> None:
    mesh = Mesh(rpm=0, tpm=1000)
    one, other = (mesh.members[n] for n in mesh.others)
    assert await one.admit(KEY, 0, 1000) is None
    one.record_tokens(KEY, 1200)  # one long answer
    assert await other.admit(KEY, 0, 1000) is None  # not reported yet: the control
    await one.flush()  # reported to the holder
    await other.flush()  # the cluster's count comes back
    refused = await other.admit(KEY, 0, 1000)
    assert refused is not None
    assert refused.kind == "tokens"
    assert mesh.calls == 2  # the reports alone: a key without rpm takes no leases
    assert await mesh.members[mesh.holder].admit(KEY, 0, 1000) is not None
    mesh.clock.at += 61
    await other.flush()
    assert await other.admit(KEY, 0, 1000) is None


async def test_a_member_cut_off_from_the_holder_admits_its_share_and_says_so() -> None:
    mesh = Mesh(rpm=60)
    cut_off = mesh.members[mesh.others[0]]
    mesh.cut.add(mesh.holder)
    assert not cut_off.alone()
    assert await mesh.send([mesh.others[0]], 100) == 20  # 60 / 3 members: its share
    assert cut_off.alone()
    refused = await cut_off.admit(KEY, 60, 0)
    assert refused is not None
    assert refused.allowed == 20  # the 429 names the share
    # The holder, meanwhile, admits out of the whole limit, less nothing it granted.
    assert await mesh.send([mesh.holder], 100) == 60
    # Healed: after ALONE_S the member asks the holder again, and the holder's count rules.
    mesh.cut.clear()
    mesh.clock.at += ALONE_S + 1
    assert await cut_off.admit(KEY, 60, 0) is not None  # the holder's minute is full
    assert not cut_off.alone()


async def test_a_holder_answering_an_error_status_is_one_that_did_not_answer() -> None:
    mesh = Mesh(rpm=60)
    member = mesh.members[mesh.others[0]]
    mesh.refusing.add(mesh.holder)  # its lease route not up yet: 503
    # Not an error out of admit (a 500 to the client): its share, alone, and it says so.
    assert await mesh.send([mesh.others[0]], 100) == 20
    assert member.alone()
    member.record_tokens(KEY, 10)
    await member.flush()  # a report refused is kept for the next holder that answers
    mesh.refusing.clear()
    mesh.clock.at += ALONE_S + 1
    assert await member.admit(KEY, 60, 0) is None  # the holder answers: its count rules
    assert not member.alone()


async def test_the_small_side_of_a_partition_admits_shares_and_the_large_side_the_limit() -> None:
    mesh = Mesh(rpm=60)
    alone, *rest = IDS
    mesh.reach = {alone: [alone], **dict.fromkeys(rest, rest)}  # {a} | {b, c}
    mesh.cut = {alone}
    # The small side reaches 1 of 3: its share, and it says so -- without asking anyone.
    assert await mesh.send([alone], 100) == 20
    assert mesh.calls == 0
    assert mesh.members[alone].alone()
    # The large side picks a holder among the two it reaches: the whole limit, once.
    assert await mesh.send(rest, 100) == 60
    assert not any(mesh.members[n].alone() for n in rest)
    # Healed: every member reaches every other, the small side asks the holder again.
    mesh.reach, mesh.cut = {}, set()
    mesh.clock.at += 61
    assert await mesh.send([alone], 10) == 10
    assert not mesh.members[alone].alone()


async def test_a_cluster_with_a_0_1_0_member_keeps_its_shares() -> None:
    mesh = Mesh(rpm=60, enabled=False)
    assert await mesh.send([mesh.others[0]], 200) == 20  # limit / members alive
    assert mesh.calls == 0


async def test_a_key_the_holder_does_not_know_yet_is_admitted_by_share() -> None:
    mesh = Mesh(rpm=60)
    holder = mesh.members[mesh.holder]
    unknown = holder.answer(LeaseAsk([KeyAsk("nobody", 5, 0)]))
    assert [(g.name, g.known, g.granted) for g in unknown.keys] == [("nobody", False, 0)]
    # A member whose new key has not reached the holder yet admits its share meanwhile.
    mesh.limits = (60, 0)
    knows = {mesh.others[0]}

    def limits_at(node: str) -> Callable[[str], tuple[int, int] | None]:
        return lambda name: mesh.limits if node in knows else None

    for node, member in mesh.members.items():
        member._limits_of = limits_at(node)
    assert await mesh.send([mesh.others[0]], 100) == 20
    assert not mesh.members[mesh.others[0]].alone()  # not cut off: the holder answered
