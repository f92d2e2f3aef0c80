"""The job lifecycle's table in memory, no agents and no sockets (`agent.serving.lifecycle`):
every path a request's job takes, the records and methods each change announces byte for
byte, every pair the table leaves out refused with the typed error, random event sequences,
and docs/inference.md's table against the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.serving.job_errors import JobError
from agent.serving.jobs import JobBook
from agent.serving.lifecycle import (
    EVENTS,
    SUBMITTED,
    TRANSITIONS,
    Cancel,
    Complete,
    Fail,
    Failover,
    IllegalTransition,
    JobEvent,
    Start,
    step,
)
from workload_manager.workload import Workload, WorkloadState, decode_workload, lifecycle_mismatch

ROOT = Path(__file__).resolve().parents[3]
Q, R = WorkloadState.QUEUED, WorkloadState.RUNNING
C, F, X = WorkloadState.COMPLETED, WorkloadState.FAILED, WorkloadState.CANCELLED

# Seed 002's method for each state (`workload:errored` carries cancelled too: docs/protocol.md).
SEED_METHOD: Final = {
    Q: "workload:submitted",
    R: "workload:started",
    C: "workload:completed",
    F: "workload:errored",
    X: "workload:errored",
}
# One event of each kind, to apply where only its kind matters.
SAMPLE: Final[dict[type[JobEvent], JobEvent]] = {
    Start: Start(scheduled_on="nod_b", engine="vllm"),
    Failover: Failover(scheduled_on="nod_c"),
    Complete: Complete(),
    Fail: Fail(error=JobError.ENGINE_5XX),
    Cancel: Cancel(),
}


def queued() -> Workload:
    """A new job's record as the facade's book builds it, at a fixed instant and run."""
    job = JobBook("nod_a", lambda _method, _record: None).new("m", "unknown", None)
    return msgspec.structs.replace(job.record, runId="r", createdAt=1000)


def test_the_table_is_the_lifecycle_the_facade_runs() -> None:
    # The specification, restated: a queued job starts, fails (waited too long, its model
    # went) or is cancelled (the client hung up while it waited); a running one fails over
    # to a second target, completes, fails or is cancelled; nothing leaves a final state.
    legal = {(s, e): n for s, row in TRANSITIONS.items() for e, n in row.items()}
    assert legal == {
        (Q, Start): R,
        (Q, Fail): F,
        (Q, Cancel): X,
        (R, Failover): R,
        (R, Complete): C,
        (R, Fail): F,
        (R, Cancel): X,
    }
    assert set(TRANSITIONS) == set(WorkloadState)
    assert all(not TRANSITIONS[s] for s in WorkloadState if s.is_terminal)


PATHS: Final[list[tuple[str, list[JobEvent], list[WorkloadState]]]] = [
    ("completed", [SAMPLE[Start], Complete()], [R, C]),
    ("failed running", [SAMPLE[Start], Fail(error=JobError.ENGINE_5XX)], [R, F]),
    ("hung up running", [SAMPLE[Start], Cancel()], [R, X]),
    ("waited too long", [Fail(error=JobError.WAIT_TIMED_OUT)], [F]),
    ("hung up waiting", [Cancel()], [X]),
    ("failover completed", [SAMPLE[Start], SAMPLE[Failover], Complete()], [R, R, C]),
    (
        "failover failed",
        [SAMPLE[Start], SAMPLE[Failover], Fail(error=JobError.MEMBER_UNREACHABLE)],
        [R, R, F],
    ),
]


@pytest.mark.parametrize(("events", "states"), [p[1:] for p in PATHS], ids=[p[0] for p in PATHS])
def test_every_path(events: list[JobEvent], states: list[WorkloadState]) -> None:
    record, sent = queued(), []
    for seq, event in enumerate(events, start=2):
        record, method = step(record, event, seq=seq, now=2000 + seq)
        sent.append((method, record))
    assert [r.state for _, r in sent] == states
    assert [m for m, _ in sent] == [SEED_METHOD[s] for s in states]
    assert all(lifecycle_mismatch(m, r) is None for m, r in sent)  # the relay takes each
    assert [r.seq for _, r in sent] == list(range(2, len(sent) + 2))
    assert record.state.is_terminal
    with pytest.raises(IllegalTransition):  # final: nothing more
        step(record, Cancel(), seq=99, now=3000)


@pytest.mark.parametrize(("events", "states"), [p[1:] for p in PATHS], ids=[p[0] for p in PATHS])
def test_every_path_through_the_book(events: list[JobEvent], states: list[WorkloadState]) -> None:
    sent: list[tuple[str, Workload]] = []
    book = JobBook("nod_a", lambda method, record: sent.append((method, record)))
    job = book.new("m", "unknown", "key-1")
    book.emit(job)
    for event in events:
        book.advance(job, event)
        book.emit(job)
    assert [r.state for _, r in sent] == [Q, *states]
    assert [m for m, _ in sent] == [SEED_METHOD[r.state] for _, r in sent]
    assert all(lifecycle_mismatch(m, r) is None for m, r in sent)  # the relay takes each
    seqs = [r.seq for _, r in sent]
    assert seqs == list(range(1, len(sent) + 1))  # one job: one more per change
    assert {(r.id, r.runId, r.requesterId) for _, r in sent} == {("1", book.run_id, "key-1")}
    assert sent[-1][1].state.is_terminal
    with pytest.raises(IllegalTransition):  # final: nothing more
        book.advance(job, Cancel())


# What each change announces, byte for byte: the records and methods the facade sent before
# the table (other members, the Jobs store and the plane read them).
BYTES: Final[list[tuple[list[JobEvent], list[tuple[str, str]]]]] = [
    (
        [SAMPLE[Start], SAMPLE[Failover], Cancel()],
        [
            (
                "workload:started",
                '"engine":"vllm","runId":"r","state":"running","originatedFrom":"nod_a",'
                '"scheduledOn":"nod_b","createdAt":1000,"startedAt":2001,"completedAt":null,'
                '"error":null,"requesterId":null,"seq":2}',
            ),
            (
                "workload:started",  # the second target; the first start's time and engine
                '"engine":"vllm","runId":"r","state":"running","originatedFrom":"nod_a",'
                '"scheduledOn":"nod_c","createdAt":1000,"startedAt":2001,"completedAt":null,'
                '"error":null,"requesterId":null,"seq":3}',
            ),
            (
                "workload:errored",
                '"engine":"vllm","runId":"r","state":"cancelled","originatedFrom":"nod_a",'
                '"scheduledOn":"nod_c","createdAt":1000,"startedAt":2001,"completedAt":2003,'
                '"error":"cancelled: client disconnected or node drained","requesterId":null,'
                '"seq":4}',
            ),
        ],
    ),
    (
        [SAMPLE[Start], Complete()],
        [
            (
                "workload:started",
                '"engine":"vllm","runId":"r","state":"running","originatedFrom":"nod_a",'
                '"scheduledOn":"nod_b","createdAt":1000,"startedAt":2001,"completedAt":null,'
                '"error":null,"requesterId":null,"seq":2}',
            ),
            (
                "workload:completed",
                '"engine":"vllm","runId":"r","state":"completed","originatedFrom":"nod_a",'
                '"scheduledOn":"nod_b","createdAt":1000,"startedAt":2001,"completedAt":2002,'
                '"error":null,"requesterId":null,"seq":3}',
            ),
        ],
    ),
    (
        [Fail(error=JobError.WAIT_TIMED_OUT)],  # never placed: no scheduledOn, not started
        [
            (
                "workload:errored",
                '"engine":"unknown","runId":"r","state":"failed","originatedFrom":"nod_a",'
                '"createdAt":1000,"startedAt":null,"completedAt":2001,'
                '"error":"waited too long for capacity","requesterId":null,"seq":2}',
            ),
        ],
    ),
]


@pytest.mark.parametrize(("events", "want"), BYTES)
def test_each_change_announces_the_record_it_always_did(
    events: list[JobEvent], want: list[tuple[str, str]]
) -> None:
    record, got = queued(), []
    for n, event in enumerate(events, start=1):
        record, method = step(record, event, seq=n + 1, now=2000 + n)
        got.append((method, msgspec.json.encode(record).decode()))
    assert got == [(m, '{"id":"1","model":"m",' + body) for m, body in want]


ILLEGAL: Final = [(s, e) for s in WorkloadState for e in EVENTS if e not in TRANSITIONS[s]]


@pytest.mark.parametrize(
    ("state", "event"), ILLEGAL, ids=[f"{s.value}-{e.__name__}" for s, e in ILLEGAL]
)
def test_every_pair_the_table_leaves_out_is_refused(
    state: WorkloadState, event: type[JobEvent]
) -> None:
    record = msgspec.structs.replace(queued(), state=state)
    with pytest.raises(IllegalTransition) as refused:
        step(record, SAMPLE[event], seq=2, now=2000)
    assert (refused.value.state, refused.value.event) == (state, event)
    assert str(refused.value) == f"a {state.value} job cannot take {event.__name__}"


def test_the_illegal_pairs_are_the_ones_the_facade_must_never_make() -> None:
    # The control for the test above: it is generated from the table, so it says nothing
    # unless the set it runs over holds the pairs that matter.
    assert {(Q, Complete), (Q, Failover), (R, Start)} <= set(ILLEGAL)
    assert len(ILLEGAL) == len(WorkloadState) * len(EVENTS) - 7


def test_a_refused_event_leaves_the_job_as_it_was() -> None:
    book = JobBook("nod_a", lambda _method, _record: None)
    job = book.new("m", "unknown", None)
    before = job.record
    with pytest.raises(IllegalTransition):
        book.advance(job, Complete())  # never started
    assert (job.record, job.method) == (before, "workload:submitted")
    assert SUBMITTED == "workload:submitted"


def test_every_legal_step_announces_the_seed_method_for_its_state() -> None:
    for state, row in TRANSITIONS.items():
        for event, then in row.items():
            record = msgspec.structs.replace(queued(), state=state)
            new, method = step(record, SAMPLE[event], seq=2, now=2000)
            assert (new.state, method) == (then, SEED_METHOD[then])


@settings(max_examples=300)
@given(st.lists(st.sampled_from(list(SAMPLE.values())), max_size=12))
def test_random_events_meet_the_table_or_its_typed_error(events: list[JobEvent]) -> None:
    record, seq = queued(), 1
    for event in events:
        was = record
        try:
            record, method = step(record, event, seq=seq + 1, now=2000 + seq)
        except IllegalTransition:  # nothing untyped escapes
            assert type(event) not in TRANSITIONS[was.state]
            continue
        assert not was.state.is_terminal  # final states are absorbing
        seq += 1
        assert record.seq == seq
        assert method == SEED_METHOD[record.state]
        assert decode_workload(msgspec.json.encode(record)) == record  # still the seed's
        assert (record.error is None) == (record.state in (Q, R, C))
        assert (record.completedAt is None) == (not record.state.is_terminal)
        if record.state is R:
            assert record.startedAt is not None
            assert record.scheduledOn in ("nod_b", "nod_c")


def doc_table() -> str:
    """The lifecycle as docs/inference.md shows it, made from the code's table."""
    rows = ["| state | event | next state | method |", "|---|---|---|---|"]
    for state, row in TRANSITIONS.items():
        for event, then in row.items():
            cells = (state.value, event.__name__, then.value, SEED_METHOD[then])
            rows.append("| " + " | ".join(f"`{cell}`" for cell in cells) + " |")
    return "\n".join(rows)


def test_the_docs_table_is_the_codes_table() -> None:
    text = (ROOT / "docs" / "inference.md").read_text()
    shown = re.search(r"^\| state \| event \|.*?(?=\n\n)", text, re.M | re.S)
    assert shown is not None, "docs/inference.md has no lifecycle table"
    assert shown.group(0) == doc_table(), f"docs/inference.md should show:\n{doc_table()}"
