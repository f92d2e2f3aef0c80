"""This member's requests per replica, now and as of a load report's reading (fake clock)."""

from __future__ import annotations

from agent.serving.in_flight import KEEP_MS, InFlight
from tests.fixtures.clock import FakeClock


def test_the_count_now_and_as_of_a_report() -> None:
    clock = FakeClock()
    pending = InFlight(clock)
    assert pending.then("r", 500) == 0  # nothing ever sent
    for _ in range(4):
        pending.add("r", 1)
    clock.now += 1.0  # a report is read here: 4 of ours in it
    clock.now += 0.1
    for _ in range(3):
        pending.add("r", -1)
    clock.now += 0.15
    assert pending["r"] == 1
    assert pending.then("r", 250) == 4  # as of the report, a quarter second ago
    assert pending.then("r", 1500) == 0  # before any was sent
    assert pending.then("r", 0) == 1
    pending.add("r", -5)  # more ends than starts (a bug elsewhere) never goes below zero
    assert pending["r"] == 0
    assert pending.get("other", 0) == 0


def test_old_changes_are_forgotten_but_the_count_then_is_kept() -> None:
    clock = FakeClock()
    pending = InFlight(clock)
    pending.add("r", 1)
    pending.add("r", 1)
    clock.now += 2 * KEEP_MS / 1000
    pending.add("r", -1)
    # The two starts are past the window; the count they left is still known.
    assert pending.then("r", KEEP_MS) == 2
    assert pending.then("r", 0) == 1
