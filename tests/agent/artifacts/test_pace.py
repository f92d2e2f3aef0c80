"""The transfer rate bound (`agent.artifacts.pace`), on a clock the test moves: a burst of
one second's worth goes at once, then bytes wait their turn, however many ask at once."""

from __future__ import annotations

import pytest

from agent.artifacts.pace import Pace


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_rate_never_waits() -> None:
    pace = Pace(0, Clock())
    assert [pace.delay(10**9) for _ in range(5)] == [0.0] * 5


def test_a_burst_then_the_rate() -> None:
    clock = Clock()
    pace = Pace(1000, clock)  # 1,000 bytes a second
    assert pace.delay(500) == 0.0
    assert pace.delay(500) == 0.0  # one second's worth at once
    assert pace.delay(1000) == pytest.approx(0.0)  # the timeline is now 1 s ahead: at its bound
    assert pace.delay(1000) == pytest.approx(1.0)
    assert pace.delay(1000) == pytest.approx(2.0)
    # Ten more seconds of requests at once take ten more seconds: the average holds.
    waits = [pace.delay(1000) for _ in range(10)]
    assert waits[-1] == pytest.approx(12.0)


def test_an_idle_pace_does_not_save_up_more_than_its_burst() -> None:
    clock = Clock()
    pace = Pace(1000, clock)
    clock.now += 3600  # idle for an hour
    assert pace.delay(1000) == 0.0
    assert pace.delay(1000) == pytest.approx(0.0)
    assert pace.delay(1000) == pytest.approx(1.0)
