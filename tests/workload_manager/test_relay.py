"""The relay core: dedup by (runId, id, seq), tombstones, routing, bounded memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from workload_manager.relay import (
    DeliverToBroker,
    Drop,
    DropReason,
    Event,
    RelayCore,
    SendToPeers,
)
from workload_manager.workload import (
    METHOD_FOR_STATE,
    Workload,
    WorkloadRemoval,
    WorkloadState,
    lifecycle_mismatch,
)

ORIGIN = "nod_origin"
STATES_BY_SEQ = [WorkloadState.QUEUED, WorkloadState.RUNNING, WorkloadState.COMPLETED]
METHOD = {
    WorkloadState.QUEUED: "workload:submitted",
    WorkloadState.RUNNING: "workload:started",
    WorkloadState.COMPLETED: "workload:completed",
    WorkloadState.FAILED: "workload:errored",
    WorkloadState.CANCELLED: "workload:errored",
}


def event(
    seq: int,
    *,
    wid: str = "1",
    run: str = "run-a",
    origin: str = ORIGIN,
    state: WorkloadState | None = None,
) -> Workload:
    state = state or STATES_BY_SEQ[min(seq, 3) - 1]
    return Workload(
        id=wid,
        model="m",
        engine="vllm",
        runId=run,
        state=state,
        originatedFrom=origin,
        createdAt=1,
        seq=seq,
    )


def test_method_and_state_must_agree() -> None:
    assert (
        lifecycle_mismatch("workload:started", event(1))
        == "workload:started carries state running, not queued"
    )
    assert lifecycle_mismatch("workload:errored", event(3, state=WorkloadState.CANCELLED)) is None
    assert lifecycle_mismatch("workload:errored", event(3, state=WorkloadState.FAILED)) is None
    assert (
        lifecycle_mismatch("workload:bogus", event(1))
        == "'workload:bogus' is not a lifecycle method"
    )
    for state, method in METHOD.items():
        assert METHOD_FOR_STATE[state] == method


def test_first_seen_remote_event_goes_to_broker_and_on_to_other_peers() -> None:
    relay = RelayCore()
    ev = event(1)
    actions = relay.receive_remote(ev, "nod_b", now=0)
    assert actions == (DeliverToBroker(ev), SendToPeers(ev, ("nod_b", ORIGIN)))
    assert relay.receive_remote(ev, "nod_c", now=0) == (Drop(DropReason.DUPLICATE),)


def test_local_events_go_to_peers_not_back_to_broker() -> None:
    relay = RelayCore()
    ev = event(1)
    assert relay.receive_local(ev, now=0) == (SendToPeers(ev, ()),)
    # our own event relayed back by a peer is a duplicate, not news for our broker
    assert relay.receive_remote(ev, "nod_b", now=0) == (Drop(DropReason.DUPLICATE),)


def test_stale_event_is_dropped() -> None:
    relay = RelayCore()
    relay.receive_remote(event(2), "nod_b", now=0)
    assert relay.receive_remote(event(1), "nod_b", now=0) == (Drop(DropReason.STALE),)
    assert relay.counters.stale == 1


def test_same_id_in_a_new_run_is_a_new_workload() -> None:
    relay = RelayCore()
    relay.receive_remote(event(3, run="run-a"), "nod_b", now=0)
    actions = relay.receive_remote(event(1, run="run-b"), "nod_b", now=0)
    assert isinstance(actions[0], DeliverToBroker)


def test_removal_removes_every_run_under_the_pair_and_holds_it_down() -> None:
    relay = RelayCore()
    relay.receive_remote(event(1, run="run-a"), "nod_b", now=0)
    relay.receive_remote(event(1, run="run-b"), "nod_b", now=0)
    removal = WorkloadRemoval(workloadId="1", originatedFrom=ORIGIN)
    assert isinstance(relay.receive_remote(removal, "nod_b", now=1)[0], DeliverToBroker)
    assert relay.live_count == 0
    for run in ("run-a", "run-b"):
        assert relay.receive_remote(event(2, run=run), "nod_c", now=2) == (
            Drop(DropReason.REMOVED),
        )
    assert relay.receive_remote(removal, "nod_c", now=2) == (Drop(DropReason.DUPLICATE),)


def test_removal_that_overtakes_the_events_still_holds_them_down() -> None:
    relay = RelayCore()
    assert isinstance(
        relay.receive_remote(
            WorkloadRemoval(workloadId="1", originatedFrom=ORIGIN), "nod_b", now=0
        )[0],
        DeliverToBroker,
    )
    assert relay.receive_remote(event(1), "nod_c", now=1) == (Drop(DropReason.REMOVED),)
    assert relay.receive_remote(event(2), "nod_c", now=1) == (Drop(DropReason.REMOVED),)
    assert relay.is_removed(ORIGIN, "1")


def test_a_reused_id_is_held_down_while_the_tombstone_lives_then_accepted() -> None:
    # The removal names no runId, so it covers every run of the id from that origin: the
    # same answer on every member whatever the order (docs/protocol.md, "Removal").
    relay = RelayCore(retention_s=10)
    relay.receive_remote(event(1, run="run-a"), "nod_b", now=0)
    relay.receive_remote(WorkloadRemoval(workloadId="1", originatedFrom=ORIGIN), "nod_b", now=0)
    assert relay.receive_remote(event(1, run="run-b"), "nod_b", now=5) == (
        Drop(DropReason.REMOVED),
    )
    relay.prune(now=11)
    assert isinstance(
        relay.receive_remote(event(1, run="run-b"), "nod_b", now=11)[0], DeliverToBroker
    )


def test_removal_by_another_origin_does_not_touch_ours() -> None:
    relay = RelayCore()
    relay.receive_remote(event(1), "nod_b", now=0)
    relay.receive_remote(
        WorkloadRemoval(workloadId="1", originatedFrom="nod_other"), "nod_b", now=0
    )
    assert relay.latest("run-a", "1") is not None


def test_retention_prunes_finished_and_tombstones_but_not_live() -> None:
    relay = RelayCore(retention_s=10)
    relay.receive_remote(event(1, wid="live"), "nod_b", now=0)
    relay.receive_remote(event(3, wid="done"), "nod_b", now=0)
    relay.receive_remote(event(1, wid="gone"), "nod_b", now=0)
    relay.receive_remote(WorkloadRemoval(workloadId="gone", originatedFrom=ORIGIN), "nod_b", now=5)
    assert relay.prune(now=9) == 0
    assert relay.prune(now=10.5) == 1  # "done" finished at 0
    assert relay.latest("run-a", "live") is not None
    assert relay.is_removed(ORIGIN, "gone")
    assert relay.prune(now=16) == 1  # the tombstone of "gone", removed at 5
    assert not relay.is_removed(ORIGIN, "gone")
    assert relay.live_count == 1


def test_finished_workload_that_moves_on_is_not_pruned_by_its_old_finish_time() -> None:
    relay = RelayCore(retention_s=10)
    relay.receive_remote(event(3), "nod_b", now=0)
    relay.receive_remote(event(4, state=WorkloadState.RUNNING), "nod_b", now=1)
    assert relay.prune(now=100) == 0


def test_cap_evicts_finished_first() -> None:
    relay = RelayCore(max_workloads=3)
    relay.receive_remote(event(1, wid="a"), "nod_b", now=0)
    relay.receive_remote(event(3, wid="b"), "nod_b", now=0)
    relay.receive_remote(event(1, wid="c"), "nod_b", now=0)
    relay.receive_remote(event(1, wid="d"), "nod_b", now=0)
    assert relay.live_count == 3
    assert relay.latest("run-a", "b") is None
    assert relay.counters.evicted == 1
    relay.receive_remote(event(1, wid="e"), "nod_b", now=0)
    assert relay.latest("run-a", "a") is None  # no finished left: the oldest goes


# -- properties ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    events: list[Event]
    deliveries: list[tuple[int, str]]  # (index into events, sender)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    events: list[Event] = []
    for wid in draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True)):
        for run in draw(st.lists(st.sampled_from(["r1", "r2"]), min_size=1, unique=True)):
            last = draw(st.integers(min_value=1, max_value=5))
            events.extend(event(seq, wid=wid, run=run) for seq in range(1, last + 1))
        if draw(st.booleans()):
            events.append(WorkloadRemoval(workloadId=wid, originatedFrom=ORIGIN))
    # Duplicated, reordered and replayed: each event delivered 1-3 times, shuffled.
    deliveries = [
        (i, sender)
        for i in range(len(events))
        for sender in draw(
            st.lists(st.sampled_from(["nod_b", "nod_c", "nod_d"]), min_size=1, max_size=3)
        )
    ]
    return Plan(events, draw(st.permutations(deliveries)))


@settings(max_examples=150)
@given(plans())
def test_dedup_delivers_each_event_at_most_once_and_never_resurrects(plan: Plan) -> None:
    relay = RelayCore()
    delivered: list[Any] = []
    removed: set[str] = set()
    for index, sender in plan.deliveries:
        ev = plan.events[index]
        actions = relay.receive_remote(ev, sender, now=0)
        if not isinstance(actions[0], DeliverToBroker):
            continue
        if isinstance(ev, Workload):
            w = ev
            key = (w.runId, w.id, w.seq)
            assert key not in delivered, "delivered twice"
            assert w.id not in removed, "resurrected a removed workload"
            # seq only ever rises per (runId, id)
            assert all(not (k[:2] == key[:2] and k[2] >= key[2]) for k in delivered)
            delivered.append(key)
        else:
            assert ev.workloadId not in removed, "removal delivered twice"
            removed.add(ev.workloadId)
    # Whatever arrived last, a removed workload holds no record.
    for wid in removed:
        for run in ("r1", "r2"):
            assert relay.latest(run, wid) is None


@given(plans())
def test_order_of_delivery_does_not_change_the_final_view(plan: Plan) -> None:
    # Two nodes that get the same events in different orders end with the same view.
    forward, backward = RelayCore(), RelayCore()
    for index, sender in plan.deliveries:
        forward.receive_remote(plan.events[index], sender, now=0)
    for index, sender in reversed(plan.deliveries):
        backward.receive_remote(plan.events[index], sender, now=0)
    for ev in plan.events:
        if isinstance(ev, Workload):
            w = ev
            assert forward.latest(w.runId, w.id) == backward.latest(w.runId, w.id)
    assert forward.live_count == backward.live_count


def test_cap_evicts_the_oldest_live_record_skipping_forgotten_ones() -> None:
    relay = RelayCore(max_workloads=3)
    for wid in "abc":
        relay.receive_remote(event(1, wid=wid), "nod_b", now=0)
    relay.receive_remote(WorkloadRemoval(workloadId="a", originatedFrom=ORIGIN), "nod_b", now=0)
    relay.receive_remote(event(1, wid="d"), "nod_b", now=0)
    relay.receive_remote(event(1, wid="e"), "nod_b", now=0)  # over the cap: b goes, not a
    assert [w for w in "bcde" if relay.latest("run-a", w) is not None] == ["c", "d", "e"]
    for i in range(5000):  # churn far past the cap stays correct
        relay.receive_remote(event(1, wid=f"x{i}"), "nod_b", now=0)
    assert relay.live_count == 3
    assert [relay.latest("run-a", f"x{i}") is not None for i in (4997, 4998, 4999)] == [True] * 3


def test_a_peers_event_claiming_this_node_as_origin_is_dropped_and_counted() -> None:
    relay = RelayCore()
    relay.own_id = ORIGIN
    removal = WorkloadRemoval(workloadId="1", originatedFrom=ORIGIN)
    for forged in (event(1), removal):
        assert relay.receive_remote(forged, "nod_peer", 0.0) == (Drop(DropReason.OWN_ORIGIN),)
    assert relay.counters.own_origin == 2
    assert relay.live_count == 0
    assert relay.tombstone_count == 0
    # The controls: our own broker's event is ours to send; a peer's own event is taken.
    assert relay.receive_local(event(1), 0.0) == (SendToPeers(event(1), ()),)
    theirs = event(1, wid="2", origin="nod_peer")
    assert type(relay.receive_remote(theirs, "nod_peer", 0.0)[0]) is DeliverToBroker
    assert relay.counters.own_origin == 2


ORIGINS = ["nod_a", "nod_b"]
RUNS = ["r1", "r2", "r3", "r4"]


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """Records over two origins, four runs and three ids, some claiming another origin for a
    key another origin holds (a forgery), and removals, in any order."""
    made: list[Event] = []
    for _ in range(draw(st.integers(min_value=1, max_value=60))):
        origin = draw(st.sampled_from(ORIGINS))
        wid = draw(st.sampled_from("xyz"))
        if draw(st.integers(min_value=0, max_value=5)) == 0:
            made.append(WorkloadRemoval(workloadId=wid, originatedFrom=origin))
        else:
            seq = draw(st.integers(min_value=1, max_value=5))
            made.append(event(seq, wid=wid, run=draw(st.sampled_from(RUNS)), origin=origin))
    return made


@settings(max_examples=300)
@given(
    histories(),
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=1, max_value=3),
    st.sampled_from(ORIGINS),
    st.sampled_from("xyz"),
)
def test_a_removal_takes_exactly_its_origins_records_whatever_came_before(
    history: list[Event], cap: int, probe_max: int, origin: str, wid: str
) -> None:
    # Whatever the relay took, evicted (a small cap) and removed before, removing
    # (origin, id) leaves no record of that origin and id, and every other record as it was,
    # whether it looks under each run of the origin or, past `probe_max` runs, in the
    # origin's index by id; and what it keeps for removals holds only what it still holds.
    relay = RelayCore(max_workloads=cap, probe_max=probe_max)
    for ev in history:
        relay.receive_remote(ev, "nod_peer", now=0)
    keys = [(run, w) for run in RUNS for w in "xyz"]
    before = {key: relay.latest(*key) for key in keys}
    relay.receive_remote(WorkloadRemoval(workloadId=wid, originatedFrom=origin), "nod_c", now=0)
    for key, held in before.items():
        if held is not None and held.originatedFrom == origin and held.id == wid:
            assert relay.latest(*key) is None, f"{key} of {origin} survived its removal"
        else:
            assert relay.latest(*key) == held, f"{key} changed by another's removal"
    counted: dict[str, dict[str, int]] = {}
    by_id: dict[str, dict[str, set[str]]] = {}
    for key in keys:
        held = relay.latest(*key)
        if held is not None:
            runs = counted.setdefault(held.originatedFrom, {})
            runs[held.runId] = runs.get(held.runId, 0) + 1
            by_id.setdefault(held.originatedFrom, {}).setdefault(held.id, set()).add(held.runId)
    assert relay._runs == counted
    for indexed, index in relay._by_id.items():
        assert {i: set(runs) for i, runs in index.items()} == by_id[indexed]


class CountingDict(dict[Any, Any]):
    """The relay's records, counting lookups and whole passes."""

    gets = 0
    passes = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)

    def values(self) -> Any:
        self.passes += 1
        return super().values()


def test_made_up_runids_do_not_make_each_removal_look_under_every_run() -> None:
    # A member that gives each record a runId of its own would make a removal that looks
    # up its id under every run of the origin cost one lookup per record. Past `probe_max`
    # runs the origin is indexed by id, once: removals then cost a lookup or two.
    relay = RelayCore(probe_max=64)
    for i in range(5000):
        relay.receive_remote(event(1, wid=f"w{i}", run=f"run-{i}", origin="nod_x"), "nod_p", 0)
    for i in range(3):  # the control: an origin of three runs
        relay.receive_remote(event(1, wid="w", run=f"run-{i}", origin="nod_y"), "nod_p", 0)
    relay._latest = counting = CountingDict(relay._latest)
    relay.receive_remote(WorkloadRemoval(workloadId="w17", originatedFrom="nod_x"), "nod_p", 0)
    assert relay.latest("run-17", "w17") is None
    assert counting.passes == 1  # the index made, once
    counting.gets = 0
    relay.receive_remote(WorkloadRemoval(workloadId="w18", originatedFrom="nod_x"), "nod_p", 0)
    assert (counting.passes, counting.gets) == (1, 1)
    assert relay.latest("run-18", "w18") is None
    counting.gets = 0
    relay.receive_remote(WorkloadRemoval(workloadId="w", originatedFrom="nod_y"), "nod_p", 0)
    assert (counting.passes, counting.gets) == (1, 3)  # one per run of the origin, no index
    assert all(relay.latest(f"run-{i}", "w") is None for i in range(3))
