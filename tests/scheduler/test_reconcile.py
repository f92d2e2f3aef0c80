"""Converging deployments to replicas (`scheduler.reconcile`): placement on the issue's three
nodes, the surplus and staleness rules, and a property test -- any interleaving of
declarations, scale changes, partial gossip and member restarts at several members never
commits one GPU to two replicas, and once the members talk again they converge to one view
with exactly the declared replicas."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from facts.deployments import Deployment, DeploymentSet
from scheduler.reconcile import (
    Gpu,
    Host,
    Plan,
    Running,
    Start,
    Want,
    admissible,
    reconcile,
    why_not_on,
)

GIB = 2**30


def gpus(node: str, *domains: int, cls: str = "h100-80gb-sxm", memory: int = 80) -> tuple[Gpu, ...]:
    out = []
    for d, count in enumerate(domains):
        out += [
            Gpu(f"{node}-g{d}{i}", cls, memory * GIB, True, f"{node}-d{d}") for i in range(count)
        ]
    return tuple(out)


BIG = Host("nod_a", "big", gpus=gpus("a", 8))  # 8 x h100 in one NVLink domain
SPLIT = Host("nod_b", "split", gpus=gpus("b", 2, 2))  # 4 in two domains
SMALL = Host("nod_c", "small", gpus=gpus("c", 2, cls="l4", memory=24))


def converge(wants: list[Want], hosts: list[Host], rounds: int = 10) -> list[Host]:
    """Every member reconciles over the same view and carries out its part, until nothing
    changes; each replica then becomes ready."""
    for _ in range(rounds):
        changed = False
        nxt = []
        for host in hosts:
            plan = reconcile(host.node_id, wants, hosts)
            mine = [r for r in host.replicas if r.id not in {i for i, _ in plan.stop}]
            for n, start in enumerate(plan.start):
                assert admissible(start, mine)
                mine.append(_running(start, f"rep_{host.node_id}_{len(mine)}_{n}", "ready"))
            changed |= tuple(mine) != host.replicas
            nxt.append(
                Host(host.node_id, host.name, host.reachable, host.cordoned, host.gpus, tuple(mine))
            )
        hosts = nxt
        if not changed:
            return hosts
    raise AssertionError("did not converge")


def _running(start: Start, rid: str, state: str, spec: str = "s1", at: int = 0) -> Running:
    return Running(rid, start.deployment, start.deployment_id, spec, start.devices, state, at)


def test_three_replicas_of_two_gpus_land_on_distinct_gpus() -> None:
    want = Want("llama", "dep_1", "s1", replicas=3, gpus=2)
    hosts = converge([want], [BIG, SPLIT, SMALL])
    placed = [d for h in hosts for r in h.replicas for d in r.devices]
    assert len([r for h in hosts for r in h.replicas]) == 3
    assert len(placed) == len(set(placed)) == 6
    # spread: a member's loss takes as few replicas as possible
    assert sorted(len(h.replicas) for h in hosts) == [1, 1, 1]


def test_a_tp4_one_domain_deployment_never_lands_on_the_split_node() -> None:
    want = Want("big", "dep_2", "s1", replicas=2, gpus=4, one_domain=True)
    hosts = converge([want], [BIG, SPLIT, SMALL])
    by_node = {h.node_id: len(h.replicas) for h in hosts}
    assert by_node == {"nod_a": 2, "nod_b": 0, "nod_c": 0}
    assert why_not_on(want, SPLIT) == "no topology domain with 4 free GPUs (at most 2 in one)"
    # The control: without the one-domain constraint the split node would take one.
    loose = Want("big", "dep_2", "s1", replicas=1, gpus=4)
    assert why_not_on(loose, SPLIT) is None
    # A third does not fit anywhere: reported, with every node's reason.
    three = Want("big", "dep_2", "s1", replicas=3, gpus=4, one_domain=True)
    plan = reconcile("nod_a", [three], hosts)
    assert plan.start == []
    assert plan.unplaced[0][0] == "big"
    assert "split: no topology domain with 4 free GPUs" in plan.unplaced[0][1]


def test_constraints_class_node_memory() -> None:
    l4 = Want("small", "dep_3", "s1", replicas=1, gpus=1, device_class="l4")
    assert {h.node_id: len(h.replicas) for h in converge([l4], [BIG, SPLIT, SMALL])}["nod_c"] == 1
    pinned = Want("p", "dep_4", "s1", replicas=2, gpus=1, node="split")
    assert (
        sum(
            len(h.replicas) for h in converge([pinned], [BIG, SPLIT, SMALL]) if h.node_id == "nod_b"
        )
        == 2
    )
    heavy = Want("h", "dep_5", "s1", replicas=1, gpus=1, min_memory=40 * GIB, device_class="l4")
    assert why_not_on(heavy, SMALL) == "0 free healthy l4 GPU(s) with 40 GiB, 1 needed"
    cordoned = Host("nod_b", "split", cordoned=True, gpus=SPLIT.gpus)
    assert why_not_on(pinned, cordoned) == "cordoned"


def test_surplus_keeps_ready_then_oldest_and_scaling_touches_only_the_delta() -> None:
    want = Want("m", "dep_6", "s1", replicas=3, gpus=1)
    hosts = converge([want], [BIG, SPLIT, SMALL])
    before = {r.id for h in hosts for r in h.replicas}
    down = converge([Want("m", "dep_6", "s1", replicas=2, gpus=1)], hosts)
    after = {r.id for h in down for r in h.replicas}
    assert len(after) == 2
    assert after < before  # two kept, none restarted
    up = converge([Want("m", "dep_6", "s1", replicas=4, gpus=1)], down)
    assert after < {r.id for h in up for r in h.replicas}
    # A starting replica is cut before a ready one, whatever its age.
    a = Running("rep_x", "m", "dep_6", "s1", ("a-g00",), "starting", 0)
    b = Running("rep_y", "m", "dep_6", "s1", ("a-g01",), "ready", 5)
    host = Host("nod_a", gpus=BIG.gpus, replicas=(a, b))
    plan = reconcile("nod_a", [Want("m", "dep_6", "s1", replicas=1)], [host])
    assert [rid for rid, _ in plan.stop] == ["rep_x"]


def test_a_changed_or_removed_deployment_stops_its_replicas() -> None:
    old = Running("rep_o", "m", "dep_6", "s1", ("a-g00",), "ready", 0)
    gone = Running("rep_g", "gone", "dep_7", "s1", ("a-g01",), "ready", 0)
    host = Host("nod_a", gpus=BIG.gpus, replicas=(old, gone))
    plan = reconcile("nod_a", [Want("m", "dep_6", "s2", replicas=1)], [host])
    assert dict(plan.stop) == {
        "rep_o": "its deployment has changed",
        "rep_g": "its deployment is no longer declared",
    }
    # its replacement is placed on other GPUs than the old one still holds
    assert plan.start[0].devices != old.devices


def test_a_stale_plan_cannot_double_book() -> None:
    start = Start("m", "dep_6", "nod_a", ("a-g00", "a-g01"))
    holder = Running("rep_h", "other", "dep_8", "s1", ("a-g01",), "starting", 0)
    assert not admissible(start, [holder])
    assert admissible(start, [])


# -- the property test -----------------------------------------------------------------------

NODES = [BIG, SPLIT, SMALL]
NAMES = ["alpha", "beta"]


@dataclass
class Member:
    host: Host
    declared: DeploymentSet = field(default_factory=DeploymentSet)
    replicas: dict[str, Running] = field(default_factory=dict)  # what it runs: the truth
    seen: dict[str, tuple[Running, ...]] = field(default_factory=dict)  # others, as last heard
    plans: list[Plan] = field(default_factory=list)  # made, not yet carried out
    made: int = 0


def wants_of(member: Member) -> list[Want]:
    return [
        Want(d.name, d.id, "s1", replicas=d.replicas, gpus=d.gpus) for d in member.declared.live()
    ]


def step(members: list[Member], action: tuple[str, int, int, int], clock: list[int]) -> None:
    kind, i, j, n = action
    me = members[i]
    clock[0] += 1
    if kind == "declare":  # declare, scale or undeploy `NAMES[j % 2]` at member i
        name = NAMES[j % 2]
        me.declared.offer(
            Deployment(
                id=f"dep_{'0' * 25}{j % 2}",
                name=name,
                engine="mock",
                gpus=1 + n % 2,
                replicas=n % 4,
                deleted=n == 7,
                version=me.declared.next_version(name),
                updatedAt=clock[0],
                by=me.host.node_id,
            )
        )
    elif kind == "gossip":  # j hears from i
        other = members[j]
        for d in me.declared.all():
            other.declared.offer(d)
        other.seen[me.host.node_id] = tuple(me.replicas.values())
    elif kind == "reconcile":
        plan_for(members, me)
        carry_out(me, clock)
    elif kind == "plan":  # a plan made now, carried out later (starting is asynchronous)
        plan_for(members, me)
    elif kind == "carry-out":
        carry_out(me, clock)
    elif kind == "ready":
        me.replicas = {k: _ready(r) for k, r in me.replicas.items()}
    elif kind == "restart":  # forgets what it heard and planned; keeps its engines, or not
        me.seen = {}
        me.plans = []
        if n % 2:
            me.replicas = {}


def plan_for(members: list[Member], me: Member) -> None:
    hosts = [
        Host(
            m.host.node_id,
            m.host.name,
            gpus=m.host.gpus,
            replicas=tuple(m.replicas.values()) if m is me else me.seen[m.host.node_id],
        )
        for m in members
        if m is me or m.host.node_id in me.seen
    ]
    me.plans.append(reconcile(me.host.node_id, wants_of(me), hosts))


def carry_out(me: Member, clock: list[int]) -> None:
    for plan in me.plans:
        for rid, _ in plan.stop:
            me.replicas.pop(rid, None)
        for start in plan.start:
            if admissible(start, me.replicas.values()):
                me.made += 1
                rid = f"rep_{me.host.node_id}_{me.made}"
                me.replicas[rid] = _running(start, rid, "starting", at=clock[0])
    me.plans = []


def _ready(r: Running) -> Running:
    return Running(r.id, r.deployment, r.deployment_id, r.spec, r.devices, "ready", r.created_at)


def no_gpu_twice(members: list[Member]) -> None:
    for m in members:
        devices = [d for r in m.replicas.values() for d in r.devices]
        assert len(devices) == len(set(devices)), m.host.node_id
        assert set(devices) <= {g.id for g in m.host.gpus}  # only its own GPUs


actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["declare", "gossip", "reconcile", "plan", "carry-out", "ready", "restart"]
        ),
        st.integers(0, 2),
        st.integers(0, 2),
        st.integers(0, 7),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(actions)
def test_any_interleaving_never_double_books_and_converges(
    script: list[tuple[str, int, int, int]],
) -> None:
    members = [Member(h) for h in NODES]
    clock = [0]
    for action in script:
        step(members, action, clock)
        no_gpu_twice(members)
    # The members talk again: full gossip, reconcile, ready, until nothing changes.
    for _ in range(12):
        before = [dict(m.replicas) for m in members]
        for i in range(3):
            for j in range(3):
                if i != j:
                    step(members, ("gossip", i, j, 0), clock)
        for i in range(3):
            step(members, ("reconcile", i, 0, 0), clock)
            no_gpu_twice(members)
        for i in range(3):
            step(members, ("ready", i, 0, 0), clock)
        if [m.replicas for m in members] == before:
            break
    else:
        raise AssertionError("did not converge")
    for i in range(3):  # one more exchange so every view holds the fixpoint
        for j in range(3):
            if i != j:
                step(members, ("gossip", i, j, 0), clock)
    views = {msgspec.json.encode(m.declared.all()) for m in members}
    assert len(views) == 1  # one version of every deployment everywhere
    for want in wants_of(members[0]):
        live = [r for m in members for r in m.replicas.values() if r.deployment == want.name]
        assert len(live) == want.replicas, want  # capacity always suffices here
    declared = {d.name for d in members[0].declared.live()}
    assert {r.deployment for m in members for r in m.replicas.values()} <= declared


def test_a_failed_replica_counts_so_a_broken_deployment_does_not_spread() -> None:
    failed = Running("rep_f", "m", "dep_9", "s1", ("a-g00",), "failed", 0)
    host = Host("nod_a", gpus=BIG.gpus, replicas=(failed,))
    plan = reconcile("nod_a", [Want("m", "dep_9", "s1", replicas=1)], [host, SPLIT])
    assert (plan.start, plan.elsewhere, plan.stop) == ([], [], [])  # not placed again
    # ... and it is the first cut when there are too many
    ready = Running("rep_r", "m", "dep_9", "s1", ("a-g01",), "ready", 5)
    host = Host("nod_a", gpus=BIG.gpus, replicas=(failed, ready))
    plan = reconcile("nod_a", [Want("m", "dep_9", "s1", replicas=1)], [host])
    assert [rid for rid, _ in plan.stop] == ["rep_f"]


# -- weights (issue 28): holders preferred, not required ----------------------------------------

DIGEST = "sha256:" + "ab" * 32


def test_a_member_that_holds_the_weights_is_preferred() -> None:
    want = Want("llama", "dep_1", "s1", replicas=1, gpus=2, artifact=DIGEST)
    # Without weights anywhere, the tighter fit (split: 2 GPUs left over against 6) wins.
    plain = reconcile("nod_a", [want], [BIG, SPLIT])
    assert [s.node_id for s in plain.start + plain.elsewhere] == ["nod_b"]
    holder = Host(BIG.node_id, BIG.name, gpus=BIG.gpus, holds=frozenset({DIGEST}))
    plan = reconcile("nod_a", [want], [holder, SPLIT])
    assert [s.node_id for s in plan.start] == ["nod_a"]
    # Another artifact held there does not count.
    other = Host(BIG.node_id, BIG.name, gpus=BIG.gpus, holds=frozenset({"sha256:" + "cd" * 32}))
    plan = reconcile("nod_a", [want], [other, SPLIT])
    assert [s.node_id for s in plan.elsewhere] == ["nod_b"]


def test_a_holder_without_room_leaves_the_replica_to_one_that_fetches() -> None:
    want = Want("llama", "dep_1", "s1", replicas=1, gpus=4, artifact=DIGEST)
    holder = Host(SMALL.node_id, SMALL.name, gpus=SMALL.gpus, holds=frozenset({DIGEST}))
    plan = reconcile("nod_a", [want], [BIG, holder])
    assert [s.node_id for s in plan.start] == ["nod_a"]  # a score, not a filter


def test_a_fetching_replica_counts_as_placed() -> None:
    want = Want("llama", "dep_1", "s1", replicas=1, gpus=2, artifact=DIGEST)
    start = Start("llama", "dep_1", "nod_a", ("a-g00", "a-g01"))
    fetching = Host(
        BIG.node_id, BIG.name, gpus=BIG.gpus, replicas=(_running(start, "rep_1", "fetching"),)
    )
    plan = reconcile("nod_b", [want], [fetching, SPLIT])
    assert (plan.start, plan.elsewhere, plan.unplaced) == ([], [], [])
    # Two replicas where one is declared: the ready one is kept, the fetching one cut.
    ready = _running(Start("llama", "dep_1", "nod_b", ("b-g00", "b-g01")), "rep_2", "ready")
    split = Host(SPLIT.node_id, SPLIT.name, gpus=SPLIT.gpus, replicas=(ready,))
    plan = reconcile("nod_a", [want], [fetching, split])
    assert [rid for rid, _ in plan.stop] == ["rep_1"]
