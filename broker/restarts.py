"""When to restart the workload manager child, sans-I/O.

Exponential backoff (0.5 s doubling to 30 s) over the exits within the last minute; five
exits within a minute is a crash loop, reported rather than hidden. A child that ran
healthy for longer than the window starts the count again. Time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

__all__ = ["CRASH_LOOP_EXITS", "CRASH_WINDOW_S", "RestartPolicy", "RestartStep"]

CRASH_WINDOW_S: Final = 60.0
CRASH_LOOP_EXITS: Final = 5


@dataclass(frozen=True, slots=True)
class RestartStep:
    """What to do after an exit: wait `delay_s`, then start again; `crash_loop` says so."""

    delay_s: float
    crash_loop: bool


class RestartPolicy:
    """Remembers recent exits and decides the delay before the next start."""

    def __init__(self, *, base_s: float = 0.5, cap_s: float = 30.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._exits: deque[float] = deque(maxlen=CRASH_LOOP_EXITS)

    def exited(self, *, started: float, now: float) -> RestartStep:
        """The child started at `started` exited at `now`: how long until the next start."""
        self._exits.append(now)
        crash_loop = len(self._exits) == CRASH_LOOP_EXITS and now - self._exits[0] < CRASH_WINDOW_S
        if now - started > CRASH_WINDOW_S:
            failures = 0  # it ran healthy for a while: this exit is not part of a loop
        else:
            failures = sum(1 for t in self._exits if now - t < CRASH_WINDOW_S)
        delay = min(self.cap_s, self.base_s * 2 ** max(0, failures - 1))
        return RestartStep(delay, crash_loop)
