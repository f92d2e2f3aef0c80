"""`broker.event_hold`: a job's events held a moment, the latest going out alone.

Against a real loop's timers: a job that ends within the hold is one event with its final
record, whenever it started; one that lives longer is announced in each state it is in when
a hold ends; a newer
record is never replaced by an older one; nothing waits past the bound of jobs held.
"""

from __future__ import annotations

import asyncio

from broker.event_hold import EventHold
from tests.fixtures.records import CREATED_AT_MS, workload
from tests.fixtures.waiting import eventually
from workload_manager.workload import Workload

STARTED = {"startedAt": CREATED_AT_MS + 5, "scheduledOn": "nod_b"}
COMPLETED = {**STARTED, "completedAt": CREATED_AT_MS + 9}


def sent_by(hold_s: float, max_held: int = 100) -> tuple[EventHold, list[tuple[str, Workload]]]:
    sent: list[tuple[str, Workload]] = []
    return EventHold(lambda m, r: sent.append((m, r)), hold_s=hold_s, max_held=max_held), sent


async def test_a_job_that_ends_within_the_hold_goes_out_once_as_it_ended() -> None:
    hold, sent = sent_by(0.05)
    hold.put("workload:submitted", workload("1", 1))
    hold.put("workload:started", workload("1", 2, **STARTED))
    hold.put("workload:completed", workload("1", 3, **COMPLETED))
    hold.put("workload:submitted", workload("2", 1))  # another job: its own slot
    assert sent == []  # held
    await eventually(lambda: bool(sent), "the hold ends")
    assert [(m, r.id, r.seq) for m, r in sent] == [
        ("workload:completed", "1", 3),
        ("workload:submitted", "2", 1),
    ]
    final = sent[0][1]
    # Its queued and running spells are in the record it ended with.
    assert (final.createdAt, final.startedAt, final.completedAt, final.scheduledOn) == (
        CREATED_AT_MS,
        CREATED_AT_MS + 5,
        CREATED_AT_MS + 9,
        "nod_b",
    )
    assert hold.replaced == 2
    assert len(hold) == 0


async def test_a_longer_job_is_announced_in_each_state_a_hold_ends_in() -> None:
    hold, sent = sent_by(0.01)
    hold.put("workload:submitted", workload("1", 1))
    await eventually(lambda: len(sent) == 1, "the queued record")
    hold.put("workload:started", workload("1", 2, **STARTED))
    await eventually(lambda: len(sent) == 2, "the running record")
    hold.put("workload:completed", workload("1", 3, **COMPLETED))
    await eventually(lambda: len(sent) == 3, "the final record")
    assert [m for m, _ in sent] == ["workload:submitted", "workload:started", "workload:completed"]
    assert hold.replaced == 0


async def test_a_job_that_starts_as_another_ones_hold_ends_keeps_its_own_hold() -> None:
    # Each job's hold runs from its own first event: a job that starts late in another's hold
    # is not sent with it (then cut in two: queued now, completed later) but ends in one event.
    hold, sent = sent_by(0.5)
    hold.put("workload:submitted", workload("1", 1))
    await asyncio.sleep(0.3)  # time passing, not a wait for an event: job 2 starts late
    hold.put("workload:submitted", workload("2", 1))
    await eventually(lambda: bool(sent), "job 1's hold ends")
    assert [r.id for _, r in sent] == ["1"]  # job 2's hold has not ended with it
    hold.put("workload:completed", workload("2", 3, **COMPLETED))
    await eventually(lambda: len(sent) == 2, "job 2's hold ends")  # the control: it arrives
    assert [(m, r.id, r.seq) for m, r in sent] == [
        ("workload:submitted", "1", 1),
        ("workload:completed", "2", 3),
    ]


async def test_an_older_record_never_replaces_a_newer_one() -> None:
    hold, sent = sent_by(10.0)
    hold.put("workload:completed", workload("1", 3, **COMPLETED))
    hold.put("workload:started", workload("1", 2, **STARTED))  # late, older
    hold.flush()
    assert [(m, r.seq) for m, r in sent] == [("workload:completed", 3)]


async def test_flush_sends_at_once_and_the_timer_then_sends_nothing_twice() -> None:
    hold, sent = sent_by(0.01)
    hold.put("workload:submitted", workload("1", 1))
    hold.flush()  # what a removal or a request does before its own frame
    assert [r.id for _, r in sent] == ["1"]
    hold.put("workload:submitted", workload("2", 1))  # control: a new hold still ends
    await eventually(lambda: len(sent) == 2, "the next hold")
    await asyncio.sleep(0.03)  # past the first timer's time: it was cancelled, not re-fired
    assert [r.id for _, r in sent] == ["1", "2"]


async def test_more_jobs_than_the_bound_go_out_at_once() -> None:
    hold, sent = sent_by(10.0, max_held=3)
    hold.put("workload:submitted", workload("1", 1))
    hold.put("workload:submitted", workload("2", 1))
    assert sent == []
    hold.put("workload:submitted", workload("3", 1))
    assert [r.id for _, r in sent] == ["1", "2", "3"]  # not after ten seconds
    assert len(hold) == 0
