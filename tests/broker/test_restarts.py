"""When the supervisor restarts the manager: backoff, crash loops, a fresh count after a
healthy run (no clock but the one passed in)."""

from __future__ import annotations

from broker.restarts import CRASH_LOOP_EXITS, CRASH_WINDOW_S, RestartPolicy, RestartStep


def test_backoff_doubles_to_the_cap_and_five_quick_exits_are_a_crash_loop() -> None:
    policy = RestartPolicy(base_s=0.5, cap_s=3.0)
    steps = [policy.exited(started=t, now=t + 0.1) for t in range(CRASH_LOOP_EXITS + 1)]
    assert [s.delay_s for s in steps] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [s.crash_loop for s in steps] == [False] * (CRASH_LOOP_EXITS - 1) + [True, True]


def test_exits_spread_over_more_than_the_window_are_no_loop() -> None:
    policy = RestartPolicy()
    gap = CRASH_WINDOW_S / 2
    steps = [policy.exited(started=i * gap, now=i * gap + 1) for i in range(8)]
    assert not any(step.crash_loop for step in steps)
    assert max(step.delay_s for step in steps) <= 1.0  # at most two exits in any window


def test_a_child_that_ran_healthy_restarts_at_once() -> None:
    policy = RestartPolicy(base_s=0.5)
    for t in range(3):
        policy.exited(started=t, now=t + 0.1)
    assert policy.exited(started=3, now=3 + CRASH_WINDOW_S + 1) == RestartStep(0.5, False)
