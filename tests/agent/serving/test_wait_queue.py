"""The wait queue's async part in memory: a placement that frees slots when the test says,
waiters woken by `poke` in their order, a cancelled head handing its turn on, a wait that
runs out, and the answers a wait that ends without a target gets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from agent.serving.job_errors import JobError
from agent.serving.lifecycle import Fail
from agent.serving.wait_line import Ticket
from agent.serving.wait_queue import WaitQueue, gave_up
from scheduler import Refusal
from tests.fixtures.waiting import eventually


@dataclass
class Slots:
    """A cluster with `free` slots: a placement takes one, or finds it full."""

    free: int = 0
    looks: int = 0
    answer: Refusal = Refusal.QUEUE_FULL

    def place(self) -> list[str] | Refusal:
        self.looks += 1
        if self.free <= 0:
            return self.answer
        self.free -= 1
        return ["target"]


def in_line(entered: list[str] | Refusal | Ticket) -> Ticket:
    assert isinstance(entered, Ticket), entered
    return entered


async def test_waiters_go_in_order_when_slots_free_and_a_cancelled_head_passes_its_turn() -> None:
    slots = Slots(free=1)
    queue: WaitQueue[str] = WaitQueue(length=8, timeout_s=60)
    assert queue.enter("m", slots.place) == ["target"]  # a free slot: placed at once
    tickets = [in_line(queue.enter("m", slots.place)) for _ in range(3)]
    assert slots.looks == 2  # the first found it full; the others did not look: FIFO
    waits = [asyncio.create_task(queue.wait(t, slots.place)) for t in tickets]
    await eventually(lambda: slots.looks == 3, "the head looked once")
    slots.free = 1
    queue.poke()
    assert await waits[0] == ["target"]
    assert not waits[1].done()
    assert not waits[2].done()
    waits[1].cancel()  # the new head hangs up: the next one is the head now
    await asyncio.gather(waits[1], return_exceptions=True)
    slots.free = 1
    queue.poke()
    assert await waits[2] == ["target"]
    assert queue.line.waiting("m") == 0


async def test_a_full_line_refuses_at_once_and_a_wait_runs_out() -> None:
    slots = Slots()
    queue: WaitQueue[str] = WaitQueue(length=1, timeout_s=0.05)
    ticket = in_line(queue.enter("m", slots.place))
    assert queue.enter("m", slots.place) is Refusal.QUEUE_FULL  # the line of one is full
    assert await queue.wait(ticket, slots.place) is Refusal.QUEUE_FULL  # ran out
    assert queue.line.waiting("m") == 0
    # The control: with the line free again, a request can wait.
    in_line(queue.enter("m", slots.place))


async def test_a_model_that_cannot_be_served_ends_the_wait_with_its_refusal() -> None:
    slots = Slots()
    queue: WaitQueue[str] = WaitQueue(length=4, timeout_s=60)
    ticket = in_line(queue.enter("m", slots.place))
    waiting = asyncio.create_task(queue.wait(ticket, slots.place))
    await eventually(lambda: slots.looks == 2, "the head looked")
    slots.answer = Refusal.MODEL_NOT_SERVED  # undeployed meanwhile
    queue.poke()  # records arrived: the head looks again
    assert await waiting is Refusal.MODEL_NOT_SERVED


def test_the_answers_of_a_wait_that_ended_without_a_target() -> None:
    response, outcome = gave_up(Refusal.QUEUE_FULL, "m", 30.0)
    assert (response.status, response.headers["Retry-After"]) == (429, "1")
    assert outcome == Fail(error=JobError.WAIT_TIMED_OUT)
    assert JobError.WAIT_TIMED_OUT.value == "waited too long for capacity"
    response, outcome = gave_up(Refusal.MODEL_NOT_SERVED, "m", 30.0)
    assert response.status == 404
    assert outcome == Fail(error=JobError.NO_ENGINE)


async def test_a_line_starting_is_said_once_per_model_until_it_empties() -> None:
    # What a cold start hangs on (issue 30): the members hear of a new line at once.
    slots = Slots(free=0)
    queue: WaitQueue[str] = WaitQueue(length=8, timeout_s=60)
    started: list[str] = []
    queue.on_start = started.append
    tickets = [in_line(queue.enter(model, slots.place)) for model in ("m", "m", "other")]
    assert started == ["m", "other"]  # once per line, not per waiter
    slots.free = 3
    waits = [asyncio.create_task(queue.wait(t, slots.place)) for t in tickets]
    queue.poke()
    assert await asyncio.gather(*waits) == [["target"]] * 3
    assert queue.line.waiting("m") == 0
    in_line(queue.enter("m", slots.place))  # full again: a new line
    assert started == ["m", "other", "m"]
