"""The wait line's decisions with a fake clock: bounded per model, first in first out, only
the head is placed, a later request never overtakes, a wait runs out at its deadline."""

from __future__ import annotations

import pytest

from agent.serving.wait_line import ABANDONED_S, RECHECK_S, Ticket, Turn, WaitLine
from tests.fixtures.clock import FakeClock


def join(line: WaitLine, model: str, now: float) -> Ticket:
    ticket = line.join(model, now)
    assert ticket is not None, f"{model} refused"
    return ticket


def test_a_line_is_bounded_per_model_and_zero_turns_waiting_off() -> None:
    clock = FakeClock()
    line = WaitLine(2, 10.0)
    join(line, "m", clock())
    join(line, "m", clock())
    assert line.join("m", clock()) is None  # full: the third is refused at once
    join(line, "other", clock())  # each model has its own line
    assert (line.waiting("m"), line.waiting("other"), line.waiting("none")) == (2, 1, 0)
    assert WaitLine(0, 10.0).join("m", clock()) is None
    few = WaitLine(5, 10.0, max_models=2)
    join(few, "a", 0)
    join(few, "b", 0)
    assert few.join("c", 0) is None  # lines are keyed by client input: bounded too
    join(few, "a", 0)  # the control: a model that has a line still joins
    with pytest.raises(ValueError, match="wait line"):
        WaitLine(-1, 1.0)


def test_only_the_head_goes_and_the_next_one_is_named_when_it_leaves() -> None:
    clock = FakeClock()
    line = WaitLine(8, 10.0)
    first, second, third = (join(line, "m", clock()) for _ in range(3))
    assert [line.is_head(t) for t in (first, second, third)] == [True, False, False]
    # A later request that finds a slot does not go before the head.
    assert line.turn(second, clock(), placed=True) is Turn.WAIT
    assert line.turn(first, clock(), placed=False) is Turn.WAIT
    assert line.turn(first, clock(), placed=True) is Turn.GO
    assert line.leave(first) is second  # the new head: it looks next
    assert line.leave(third) is None  # not the head: nobody new to wake
    assert line.leave(third) is None  # leaving twice is harmless
    assert line.heads(clock()) == [second]
    assert line.leave(second) is None
    assert line.waiting("m") == 0
    assert line.heads(clock()) == []


def test_the_order_of_going_is_the_order_of_joining() -> None:
    clock = FakeClock()
    line = WaitLine(64, 10.0)
    tickets = [join(line, "m", clock()) for _ in range(12)]
    gone = []
    while line.waiting("m"):
        # Every ticket looks, the latest first; only the head may go each round.
        for ticket in reversed(tickets):
            if line.turn(ticket, clock(), placed=True) is Turn.GO:
                gone.append(ticket.number)
                line.leave(ticket)
                break
    assert gone == [t.number for t in tickets]


def test_a_wait_runs_out_at_its_deadline_and_the_head_rechecks() -> None:
    clock = FakeClock()
    line = WaitLine(4, 30.0)
    head = join(line, "m", clock())
    clock.now += 10
    behind = join(line, "m", clock())
    assert line.wake_at(head, clock()) == clock() + RECHECK_S  # the backstop
    assert line.wake_at(behind, clock()) == behind.deadline  # not the head: till then
    clock.now += 20 - 0.001
    assert line.turn(head, clock(), placed=False) is Turn.WAIT
    clock.now += 0.001
    assert line.turn(head, clock(), placed=False) is Turn.TIMED_OUT
    assert line.turn(behind, clock(), placed=False) is Turn.WAIT  # 20 s in: 10 s to go
    assert line.wake_at(head, clock()) == head.deadline


def test_an_abandoned_head_does_not_hold_up_the_line() -> None:
    clock = FakeClock()
    line = WaitLine(4, 5.0)
    dead = join(line, "m", clock())  # its handler died before it waited: nobody removes it
    clock.now += 4
    alive = join(line, "m", clock())
    assert line.heads(clock()) == [dead]  # the control: within its time it is the head
    clock.now += 2 + ABANDONED_S  # dead: past its deadline by more; alive: not yet
    assert line.heads(clock()) == [alive]
    assert line.is_head(alive)


def test_a_wait_may_be_given_its_own_timeout_longer_than_the_lines() -> None:
    clock = FakeClock()
    line = WaitLine(4, 5.0)
    plain = join(line, "m", clock())
    cold = line.join("m", clock(), timeout_s=60.0)  # a cold start of a slow engine
    assert cold is not None
    assert (plain.timeout_s, cold.timeout_s) == (5.0, 60.0)
    clock.now += 5
    assert line.turn(plain, clock(), placed=False) is Turn.TIMED_OUT  # the control
    assert line.turn(cold, clock(), placed=False) is Turn.WAIT
    line.leave(plain)
    clock.now += 54.999
    assert line.turn(cold, clock(), placed=False) is Turn.WAIT
    assert line.heads(clock()) == [cold]  # not abandoned: within its own time
    clock.now += 0.001
    assert line.turn(cold, clock(), placed=False) is Turn.TIMED_OUT
