"""One peer's outbox: coalescing, removal, batches, acknowledgement and backoff."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from netkit.backoff import Backoff
from workload_manager.outbox import Outbox
from workload_manager.relay import Event, RelayCore
from workload_manager.workload import Workload, WorkloadRemoval, WorkloadState

STATES = [WorkloadState.QUEUED, WorkloadState.RUNNING, WorkloadState.COMPLETED]


def rec(wid: str, seq: int, run: str = "r") -> Workload:
    return Workload(
        id=wid,
        model="m",
        engine="e",
        runId=run,
        state=STATES[min(seq, 3) - 1],
        originatedFrom="nod_a",
        createdAt=0,
        seq=seq,
    )


def ids(batch: list[Event] | None) -> list[str]:
    return [event.id for event in batch or [] if isinstance(event, Workload)]


def test_latest_seq_wins_and_keeps_its_turn() -> None:
    box = Outbox()
    box.add(rec("1", 1))
    box.add(rec("2", 1))
    box.add(rec("1", 2))
    box.add(rec("1", 1))  # stale: ignored
    assert box.depth == 2
    assert box.next_batch(0) == [rec("1", 2), rec("2", 1)]
    assert box.counters.coalesced == 2


def test_removal_supersedes_pending_records_of_every_run() -> None:
    box = Outbox()
    box.add(rec("1", 1, run="r1"))
    box.add(rec("1", 2, run="r2"))
    box.add(rec("2", 1))
    box.add(WorkloadRemoval(workloadId="1", originatedFrom="nod_a"))
    box.add(rec("1", 3, run="r1"))  # a late record after the removal is moot
    assert box.next_batch(0) == [
        rec("2", 1),
        WorkloadRemoval(workloadId="1", originatedFrom="nod_a"),
    ]


def test_batches_are_bounded_and_one_is_in_flight_at_a_time() -> None:
    box = Outbox(max_batch=3)
    for i in range(7):
        box.add(rec(str(i), 1))
    first = box.next_batch(0)
    assert first is not None
    assert len(first) == 3
    assert box.next_batch(0) is None  # still in flight
    box.ack()
    assert box.counters.sent == 3
    assert ids(box.next_batch(0)) == ["3", "4", "5"]


def test_failure_puts_the_batch_back_unless_something_newer_came() -> None:
    box = Outbox(backoff=Backoff(base_s=1.0, cap_s=8.0), draw=lambda: 1.0)
    box.add(rec("1", 1))
    box.add(rec("2", 1))
    assert box.next_batch(0) == [rec("1", 1), rec("2", 1)]
    box.add(rec("2", 2))  # arrives while the batch is in flight
    retry_at = box.fail(10.0, "HTTP 503")
    assert retry_at == 12.0  # full jitter with draw=1.0: base * 2**1
    assert box.next_batch(11.0) is None  # backing off
    assert box.next_batch(12.0) == [rec("1", 1), rec("2", 2)]
    assert box.counters.retried == 1
    assert box.counters.last_error == "HTTP 503"


def test_backoff_grows_to_the_cap_and_resets_on_success() -> None:
    box = Outbox(backoff=Backoff(base_s=0.5, cap_s=4.0), draw=lambda: 1.0)
    box.add(rec("1", 1))
    delays = []
    for _ in range(5):
        assert box.next_batch(1e9) is not None
        delays.append(box.fail(0.0, "down"))
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert box.next_batch(1e9) is not None
    box.ack()
    assert box.failures == 0
    assert box.retry_at() == 0.0


def test_resume_ends_the_backoff_at_once() -> None:
    box = Outbox(backoff=Backoff(base_s=10.0, cap_s=30.0), draw=lambda: 1.0)
    box.add(rec("1", 1))
    assert box.resume() is False  # nothing to end: a healthy peer
    for _ in range(3):
        assert box.next_batch(1e9) is not None
        box.fail(100.0, "down")
    assert box.next_batch(101.0) is None  # backing off until 130
    assert box.resume() is True  # the peer announced itself
    assert ids(box.next_batch(101.0)) == ["1"]
    box.fail(101.0, "down again")
    assert box.retry_at() == 101.0 + 20.0  # a first failure again, not a fourth


def test_malformed_verdict_drops_the_batch() -> None:
    box = Outbox()
    box.add(rec("1", 1))
    box.next_batch(0)
    box.fail(0.0, "HTTP 400", retry=False)
    assert box.depth == 0
    assert box.counters.dropped == 1


def test_the_cap_drops_the_oldest() -> None:
    box = Outbox(max_pending=3)
    for i in range(5):
        box.add(rec(str(i), 1))
    assert ids(box.next_batch(0)) == ["2", "3", "4"]
    assert box.counters.dropped == 2


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[str, int]]:
    ops: list[tuple[str, int]] = []
    for _ in range(draw(st.integers(1, 60))):
        ops.append(draw(st.sampled_from([("add", 0), ("send", 0), ("ack", 0), ("fail", 0)])))
        if ops[-1][0] == "add":
            ops[-1] = ("add", draw(st.integers(0, 4)))
    return ops


@settings(max_examples=300)
@given(scripts())
def test_a_peer_sees_seq_only_rise_and_ends_with_the_latest(script: list[tuple[str, int]]) -> None:
    box = Outbox(max_batch=3, backoff=Backoff(base_s=0.0, cap_s=0.0))
    seqs = dict.fromkeys(map(str, range(5)), 0)
    delivered: dict[str, int] = {}
    in_flight: list[Event] | None = None
    for op, wid in script:
        if op == "add":
            seqs[str(wid)] += 1
            box.add(rec(str(wid), seqs[str(wid)]))
        elif op == "send" and in_flight is None:
            in_flight = box.next_batch(0)
        elif op == "ack" and in_flight is not None:
            box.ack()
            for event in in_flight:
                assert isinstance(event, Workload)
                assert event.seq > delivered.get(event.id, 0), "a peer saw seq go back"
                delivered[event.id] = event.seq
            in_flight = None
        elif op == "fail" and in_flight is not None:
            box.fail(0.0, "x")
            in_flight = None
    if in_flight is not None:
        box.fail(0.0, "x")
    while (batch := box.next_batch(0)) is not None:
        box.ack()
        for event in batch:
            assert isinstance(event, Workload)
            assert event.seq > delivered.get(event.id, 0)
            delivered[event.id] = event.seq
    assert delivered == {wid: seq for wid, seq in seqs.items() if seq}


@st.composite
def scripts_with_removals(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """Records (two runs of three ids) and removals, sent, acknowledged or failed."""
    ops = st.sampled_from(["add", "add", "add", "remove", "send", "ack", "fail"])
    return [
        (draw(ops), draw(st.sampled_from("xyz")), draw(st.sampled_from(["r1", "r2"])))
        for _ in range(draw(st.integers(1, 80)))
    ]


@settings(max_examples=300)
@given(scripts_with_removals(), st.integers(1, 4))
def test_what_a_peer_ends_with_is_what_every_event_in_order_makes(
    script: list[tuple[str, str, str]], max_batch: int
) -> None:
    # Coalescing, a removal making records moot, batches that fail and go back: whatever
    # happened, a peer's relay fed what the outbox delivered holds what one fed every event
    # in the order they were queued holds; and a record queued while a removal of its
    # workload waited to be sent (not in flight: it may yet fail) is never sent (it is moot).
    box = Outbox(max_batch=max_batch, backoff=Backoff(base_s=0.0, cap_s=0.0))
    every, peer = RelayCore(), RelayCore()
    seqs: dict[tuple[str, str], int] = {}
    removal_waits: set[str] = set()  # ids with a removal in the outbox, not in flight
    moot: set[tuple[str, str, int]] = set()
    in_flight = False

    def queue(event: Event) -> None:
        box.add(event)
        every.receive_remote(event, "nod_origin", now=0)

    def removed_in_flight() -> set[str]:
        return {e.workloadId for e in box._in_flight or [] if isinstance(e, WorkloadRemoval)}

    def delivered() -> None:
        for event in box._in_flight or []:
            if isinstance(event, Workload):
                assert (event.runId, event.id, event.seq) not in moot, "a moot record went"
            peer.receive_remote(event, "nod_origin", now=0)
        box.ack()

    for op, wid, run in script:
        if op == "add":
            seq = seqs[run, wid] = seqs.get((run, wid), 0) + 1
            if wid in removal_waits:
                moot.add((run, wid, seq))
            queue(rec(wid, seq, run=run))
        elif op == "remove":
            removal_waits.add(wid)
            queue(WorkloadRemoval(workloadId=wid, originatedFrom="nod_a"))
        elif op == "send" and not in_flight:
            in_flight = box.next_batch(0) is not None
            removal_waits -= removed_in_flight()
        elif op == "ack" and in_flight:
            delivered()
            in_flight = False
        elif op == "fail" and in_flight:
            removal_waits |= removed_in_flight()  # back in the outbox
            box.fail(0.0, "x")
            in_flight = False
    if in_flight:
        box.fail(0.0, "x")
    while box.next_batch(0) is not None:
        delivered()
    for run in ("r1", "r2"):
        for wid in "xyz":
            assert peer.latest(run, wid) == every.latest(run, wid), (run, wid)
