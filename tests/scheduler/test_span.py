"""Replicas that span members (`scheduler.reconcile`, issue 32): a 2 x 4-GPU replica lands
on two members of 8 H100s each and never on a member with 2 free; placement is all or
nothing; a member whose view lagged joins the layout the others started; a failed part, an
unreachable member or a partner that never joins stops the whole replica; surplus replicas
are cut as groups. A property test: any interleaving of declarations, partial gossip, plans
carried out late, parts failing and member restarts never puts one GPU under two replicas,
and once the members talk again no partial replica holds a GPU and each deployment has
exactly its declared replicas."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.reconcile import (
    Gpu,
    Host,
    Part,
    Plan,
    Running,
    Start,
    Want,
    admissible,
    reconcile,
    seal,
)

GIB = 2**30
JOIN = 30_000  # longer than one round of the property test's convergence (12 steps of 1 s)


def h100s(node: str, count: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(f"{node}-g{i}", "h100", 80 * GIB, True, f"{node}-nvl") for i in range(count))


def part_of(start: Start, rid: str, state: str = "starting", at: int = 0) -> Running:
    """The part `start` makes; a head's names its group (here after its replica id)."""
    return Running(
        rid, start.deployment, start.deployment_id, "s1", start.devices, state, at,
        group=start.group or (f"grp_{rid}" if start.layout else ""), layout=start.layout,
    )  # fmt: skip


def busy(node: str, devices: tuple[str, ...]) -> Running:
    return Running(f"rep_{node}_busy", "other", "dep_other", "s9", devices, "ready", 0)


BIG = Want("big", "dep_big", "s1", replicas=1, gpus=4, one_domain=True, nodes=2)


def test_a_two_by_four_replica_lands_on_two_h100_members_never_on_one_with_two_free() -> None:
    a = Host("nod_a", "a", gpus=h100s("a", 8))
    b = Host("nod_b", "b", gpus=h100s("b", 8))
    six = tuple(f"c-g{i}" for i in range(6))
    c = Host("nod_c", "c", gpus=h100s("c", 8), replicas=(busy("c", six),))
    for me in ("nod_a", "nod_b", "nod_c"):
        plan = reconcile(me, [BIG], [c, a, b])
        placed = plan.start + plan.elsewhere
        assert sorted(s.node_id for s in placed) == ["nod_a", "nod_b"]
        assert all(len(s.devices) == 4 for s in placed)
        assert [p.node_id for p in placed[0].layout] == ["nod_a", "nod_b"]  # the head first
        assert {s.rank for s in placed} == {0, 1}
        # The head's member starts it, naming it; b joins once it sees the head's part.
        assert [(s.node_id, s.group) for s in plan.start] == (
            [("nod_a", "")] if me == "nod_a" else []
        )
    # With b down to 2 free, two members do not have room: nothing is placed anywhere.
    b2 = Host("nod_b", "b", gpus=b.gpus, replicas=(busy("b", tuple(f"b-g{i}" for i in range(6))),))
    plan = reconcile("nod_a", [BIG], [a, b2, c])
    assert (plan.start, plan.elsewhere) == ([], [])
    ((name, why),) = plan.unplaced
    assert name == "big"
    assert "spans 2 members" in why
    assert "1 have it" in why
    assert "b: 2 free healthy GPU(s), 4 needed" in why


def converge(wants: list[Want], hosts: list[Host], now: list[int], rounds: int = 20) -> list[Host]:
    """Every member reconciles over the same view and carries out its part; parts become
    ready; until nothing changes. `now` is the clock (ms), moved a second a round."""
    made = 0
    for _ in range(rounds):
        now[0] += 1_000
        changed = False
        nxt = []
        for host in hosts:
            plan = reconcile(host.node_id, wants, hosts, now_ms=now[0], join_ms=JOIN)
            gone = {rid for rid, _ in plan.stop}
            mine = [r for r in host.replicas if r.id not in gone]
            for start in plan.start:
                assert admissible(start, mine)
                made += 1
                mine.append(part_of(start, f"rep_{made}", "ready", now[0]))
            changed |= tuple(mine) != host.replicas
            nxt.append(
                Host(host.node_id, host.name, host.reachable, host.cordoned, host.gpus, tuple(mine))
            )
        hosts = nxt
        if not changed:
            return hosts
    raise AssertionError("did not converge")


def groups(hosts: list[Host]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for h in hosts:
        for r in h.replicas:
            out.setdefault(r.group, set()).add(h.node_id)
    return out


def test_every_member_starts_its_part_and_the_parts_make_one_replica() -> None:
    hosts = [Host(n, gpus=h100s(n, 4)) for n in ("nod_a", "nod_b", "nod_c")]
    want = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=3)
    hosts = converge([want], hosts, [0])
    (members,) = groups(hosts).values()
    assert members == {"nod_a", "nod_b", "nod_c"}
    # Scaled to two: a second replica of three parts fits (2 + 2 GPUs on each member).
    hosts = converge([Want("m", "dep_m", "s1", replicas=2, gpus=2, nodes=3)], hosts, [10_000])
    assert sorted(map(len, groups(hosts).values())) == [3, 3]
    # Back to one: the younger group goes whole, the other stays untouched.
    before = groups(hosts)
    hosts = converge([want], hosts, [20_000])
    assert len(groups(hosts)) == 1
    assert set(groups(hosts)) <= set(before)


def lagging_start() -> tuple[Start, Host, Host]:
    a = Host("nod_a", gpus=h100s("a", 4))
    b = Host("nod_b", gpus=h100s("b", 4))
    want = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=2)
    (head,) = reconcile("nod_a", [want], [a, b]).start
    return (
        Start(head.deployment, head.deployment_id, "nod_a", head.devices, "grp_h", head.layout),
        a,
        b,
    )


def test_a_member_whose_view_lagged_joins_the_layout_started_before() -> None:
    head, a, b = lagging_start()
    started = Host("nod_a", gpus=a.gpus, replicas=(part_of(head, "rep_h", at=1_000),))
    # b sees a's part naming it: it joins, on the GPUs the layout names.
    want = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=2)
    plan = reconcile("nod_b", [want], [started, b], now_ms=2_000)
    (join,) = plan.start
    assert (join.group, join.layout, join.rank) == (head.group, head.layout, 1)
    assert join.devices == head.layout[1].devices
    assert plan.elsewhere == []  # no second replica while the first one is forming
    # a waits for it within JOIN_MS, and stops its part after.
    early = reconcile("nod_a", [want], [started, b], now_ms=1_000 + JOIN - 1, join_ms=JOIN)
    assert early.stop == []
    (stop,) = reconcile("nod_a", [want], [started, b], now_ms=1_000 + JOIN, join_ms=JOIN).stop
    assert stop[0] == "rep_h"
    assert "did not join" in stop[1]
    # A member whose GPUs the layout names are taken there does not join: it cannot.
    taken = Host("nod_b", gpus=b.gpus, replicas=(busy("b", head.layout[1].devices),))
    plan = reconcile("nod_b", [want], [started, taken], now_ms=2_000)
    assert plan.start == []


def test_the_heads_member_never_rejoins_its_group_the_replica_is_placed_anew() -> None:
    head, a, b = lagging_start()
    want = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=2)
    worker = Start("m", "dep_m", "nod_b", head.layout[1].devices, head.group, head.layout)
    b_up = Host("nod_b", gpus=b.gpus, replicas=(part_of(worker, "rep_w", "ready", 1_000),))
    # a's head went (an agent restarted, say): a does not start a part of that group, and
    # places nothing beside it while it stands.
    plan = reconcile("nod_a", [want], [a, b_up], now_ms=2_000)
    assert (plan.start, plan.elsewhere) == ([], [])
    # b, which saw it whole, stops its part; then the replica is placed anew.
    plan = reconcile("nod_b", [want], [a, b_up], now_ms=2_000, sealed={head.group})
    assert [rid for rid, _ in plan.stop] == ["rep_w"]
    (fresh,) = reconcile("nod_a", [want], [a, b], now_ms=3_000).start
    assert fresh.group == ""  # a new group, named by its head


def test_a_failed_part_or_an_unreachable_member_stops_the_whole_replica() -> None:
    head, a, b = lagging_start()
    want = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=2)
    worker = Start("m", "dep_m", "nod_b", head.layout[1].devices, head.group, head.layout)
    a_up = Host("nod_a", gpus=a.gpus, replicas=(part_of(head, "rep_h", "ready", 1_000),))
    b_failed = Host("nod_b", gpus=b.gpus, replicas=(part_of(worker, "rep_w", "failed", 1_000),))
    for me, rid in (("nod_a", "rep_h"), ("nod_b", "rep_w")):
        plan = reconcile(me, [want], [a_up, b_failed], now_ms=2_000)
        assert [s for s, _ in plan.stop] == [rid]
        assert "failed; restarting the whole replica" in plan.stop[0][1]
        assert plan.start == plan.elsewhere == []  # placed anew once the parts are gone
    b_gone = Host("nod_b", reachable=False, gpus=b.gpus)
    plan = reconcile("nod_a", [want], [a_up, b_gone], now_ms=2_000)
    gone = "its part on nod_b is unreachable; restarting the whole replica"
    assert plan.stop == [("rep_h", gone)]
    # Parts that disagree on the layout (a bug, a forged record) are no replica either.
    alone = (Part("nod_b", worker.devices),)
    odd = Start("m", "dep_m", "nod_b", worker.devices, worker.group, alone)
    b_odd = Host("nod_b", gpus=b.gpus, replicas=(part_of(odd, "rep_w", "ready", 1_000),))
    plan = reconcile("nod_a", [want], [a_up, b_odd], now_ms=2_000)
    assert [s for s, _ in plan.stop] == ["rep_h"]


def test_surplus_groups_are_cut_whole_keeping_the_ready_one() -> None:
    hosts = [Host(n, gpus=h100s(n, 4)) for n in ("nod_a", "nod_b")]
    two = Want("m", "dep_m", "s1", replicas=2, gpus=2, nodes=2)
    hosts = converge([two], hosts, [0])
    young = sorted(groups(hosts))[-1]  # either one: it is made the one still starting
    # one group's parts still starting: that one is cut, on both members
    hosts = [
        Host(h.node_id, gpus=h.gpus, replicas=tuple(
            Running(r.id, r.deployment, r.deployment_id, r.spec, r.devices,
                    "starting" if r.group == young else "ready", r.created_at, r.group, r.layout)
            for r in h.replicas
        ))
        for h in hosts
    ]  # fmt: skip
    one = Want("m", "dep_m", "s1", replicas=1, gpus=2, nodes=2)
    for h in hosts:
        plan = reconcile(h.node_id, [one], hosts, now_ms=100_000)
        (cut,) = plan.stop
        assert next(r for r in h.replicas if r.id == cut[0]).group == young
        assert cut[1].startswith("more than")


# -- the property test -----------------------------------------------------------------------

NODES = ("nod_a", "nod_b", "nod_c")


@dataclass
class Member:
    host: Host
    wants: dict[str, Want] = field(default_factory=dict)  # what it heard declared
    replicas: dict[str, Running] = field(default_factory=dict)  # what it runs: the truth
    seen: dict[str, tuple[Running, ...]] = field(default_factory=dict)
    plans: list[Plan] = field(default_factory=list)
    made: int = 0
    sealed: set[str] = field(default_factory=set)


def declared(name: str, n: int) -> Want:
    if name == "wide":  # two members, two GPUs on each
        return Want("wide", "dep_wide", "s1", replicas=n % 3, gpus=2, nodes=2)
    # At most one: with two wide replicas, 10 of the 12 GPUs, a layout always fits.
    return Want("solo", "dep_solo", "s1", replicas=n % 2, gpus=1)


def plan_for(members: list[Member], me: Member, now: int) -> None:
    hosts = [
        Host(
            m.host.node_id,
            gpus=m.host.gpus,
            replicas=tuple(m.replicas.values()) if m is me else me.seen[m.host.node_id],
        )
        for m in members
        if m is me or m.host.node_id in me.seen
    ]
    me.sealed = seal(me.sealed, hosts)
    me.plans.append(
        reconcile(
            me.host.node_id, list(me.wants.values()), hosts,
            now_ms=now, join_ms=JOIN, sealed=me.sealed,
        )
    )  # fmt: skip


def carry_out(me: Member, now: int) -> None:
    for plan in me.plans:
        for rid, _ in plan.stop:
            me.replicas.pop(rid, None)
        for start in plan.start:
            if admissible(start, me.replicas.values()):
                me.made += 1
                rid = f"rep_{me.host.node_id}_{me.made}"
                me.replicas[rid] = part_of(start, rid, "starting", now)
    me.plans = []


def step(members: list[Member], action: tuple[str, int, int, int], now: list[int]) -> None:
    kind, i, j, n = action
    me = members[i]
    now[0] += 1_000
    if kind == "declare":  # every member hears it at once: the signed set is tested elsewhere
        want = declared(("wide", "solo")[j % 2], n)
        for m in members:
            m.wants[want.name] = want
    elif kind == "gossip":
        members[j].seen[me.host.node_id] = tuple(me.replicas.values())
    elif kind == "reconcile":
        plan_for(members, me, now[0])
        carry_out(me, now[0])
    elif kind == "plan":
        plan_for(members, me, now[0])
    elif kind == "carry-out":
        carry_out(me, now[0])
    elif kind == "ready":
        me.replicas = {k: _with(r, "ready") for k, r in me.replicas.items()}
    elif kind == "fail" and me.replicas:  # one part's engine dies for good
        rid = sorted(me.replicas)[n % len(me.replicas)]
        me.replicas[rid] = _with(me.replicas[rid], "failed")
    elif kind == "restart":
        me.seen, me.plans, me.sealed = {}, [], set()
        if n % 2:
            me.replicas = {}


def _with(r: Running, state: str) -> Running:
    return Running(
        r.id, r.deployment, r.deployment_id, r.spec, r.devices, state, r.created_at,
        r.group, r.layout,
    )  # fmt: skip


def partial(members: list[Member]) -> bool:
    """Whether a part of a spanning replica runs without every partner its layout names."""
    where: dict[str, set[str]] = {}
    for m in members:
        for r in m.replicas.values():
            where.setdefault(r.group, set()).add(m.host.node_id)
    return any(
        r.group and where[r.group] != {p.node_id for p in r.layout}
        for m in members
        for r in m.replicas.values()
    )


def no_gpu_twice(members: list[Member]) -> None:
    for m in members:
        devices = [d for r in m.replicas.values() for d in r.devices]
        assert len(devices) == len(set(devices)), m.host.node_id
        assert set(devices) <= {g.id for g in m.host.gpus}


actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["declare", "gossip", "reconcile", "plan", "carry-out", "ready", "fail", "restart"]
        ),
        st.integers(0, 2),
        st.integers(0, 2),
        st.integers(0, 7),
    ),
    max_size=50,
)


@settings(max_examples=120, deadline=None)
@given(actions)
def test_any_interleaving_never_double_books_and_leaves_no_partial_replica(
    script: list[tuple[str, int, int, int]],
) -> None:
    members = [Member(Host(n, gpus=h100s(n[-1], 4))) for n in NODES]
    now = [0]
    for action in script:
        step(members, action, now)
        no_gpu_twice(members)
    for _ in range(30):  # the members talk again, until nothing changes
        before = [dict(m.replicas) for m in members]
        for i in range(3):
            for j in range(3):
                if i != j:
                    step(members, ("gossip", i, j, 0), now)
        for i in range(3):
            step(members, ("reconcile", i, 0, 0), now)
            no_gpu_twice(members)
        for i in range(3):
            step(members, ("ready", i, 0, 0), now)
        # Settled: a round changed nothing, and no part waits for a partner (one that never
        # comes is stopped after JOIN: a round without a change may fall before that).
        if [m.replicas for m in members] == before and not partial(members):
            break
    else:
        raise AssertionError("did not converge")
    parts = [(m.host.node_id, r) for m in members for r in m.replicas.values()]
    for want in members[0].wants.values():
        mine = [(node, r) for node, r in parts if r.deployment == want.name]
        if want.nodes == 1:
            assert len(mine) == want.replicas, want
            continue
        by_group: dict[str, set[str]] = {}
        for node, r in mine:
            by_group.setdefault(r.group, set()).add(node)
            assert r.layout
            assert {p.node_id for p in r.layout} == {n for n, x in mine if x.group == r.group}
        assert len(by_group) == want.replicas, want
        assert all(len(nodes) == 2 for nodes in by_group.values())
    assert {r.deployment for _, r in parts} <= set(members[0].wants)
