"""The wait line's decisions, sans-I/O: who waits, who goes next, who has waited too long.

A request that finds every eligible target at its queue limit joins its model's line on
this member instead of being refused (issue 15, item 4). Each model has its own bounded
FIFO: a request joins at the tail (or is refused when `length` already wait), only the head
may try to be placed, and a request that arrives while others of its model wait joins
behind them even when a slot is free -- so a later request never overtakes an earlier one
for the same model on this member. A request that waited `timeout_s` leaves, timed out.

Time is passed in (`now`, monotonic seconds), so tests drive it with a fake clock; the
async part (`agent.serving.wait_queue`) sleeps and wakes.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_MODELS", "RECHECK_S", "Ticket", "Turn", "WaitLine"]

MAX_MODELS: Final = 1024  # models with someone waiting at once (the map is keyed by input)
RECHECK_S: Final = 1.0  # the head looks again this often without a wake-up (a backstop)
ABANDONED_S: Final = 5.0  # a head this far past its deadline is gone: dropped


@dataclass(eq=False, slots=True)
class Ticket:
    """One waiting request: its place in its model's line and when it gives up."""

    number: int
    model: str
    deadline: float  # monotonic seconds
    timeout_s: float  # how long it may wait in all


class Turn(enum.Enum):
    """What a waiting request does after a look at the cluster."""

    GO = "go"  # it was the head and a target (or a final refusal) came: it leaves and runs
    WAIT = "wait"  # it stays in line
    TIMED_OUT = "timed out"  # it waited `timeout_s`: it leaves, refused


class WaitLine:
    """Per-model FIFOs of waiting requests, each at most `length` long."""

    def __init__(self, length: int, timeout_s: float, *, max_models: int = MAX_MODELS) -> None:
        if length < 0 or not timeout_s > 0:
            raise ValueError(f"a wait line of {length} for {timeout_s}s")
        self.length = length
        self.timeout_s = timeout_s
        self._max_models = max_models
        self._lines: dict[str, deque[Ticket]] = {}
        self._numbers = itertools.count(1)

    def waiting(self, model: str) -> int:
        """How many requests for `model` wait here."""
        line = self._lines.get(model)
        return len(line) if line else 0

    def lengths(self) -> dict[str, int]:
        """How many requests wait, per model with a line (for `/metrics`)."""
        return {model: len(line) for model, line in self._lines.items()}

    def join(self, model: str, now: float, timeout_s: float | None = None) -> Ticket | None:
        """A place at the tail of `model`'s line, or None when the line is full (or too many
        models already have one). It waits `timeout_s` at most (default: the line's)."""
        line = self._lines.get(model)
        if line is None:
            if self.length == 0 or len(self._lines) >= self._max_models:
                return None
            line = self._lines[model] = deque()
        if len(line) >= self.length:
            return None
        waits = self.timeout_s if timeout_s is None else timeout_s
        ticket = Ticket(next(self._numbers), model, now + waits, waits)
        line.append(ticket)
        return ticket

    def is_head(self, ticket: Ticket) -> bool:
        """Whether `ticket` is first in its model's line: only the head tries to be placed."""
        line = self._lines.get(ticket.model)
        return line is not None and len(line) > 0 and line[0] is ticket

    def __bool__(self) -> bool:
        """Whether any request waits (the common case on the hot path: none)."""
        return bool(self._lines)

    def heads(self, now: float) -> list[Ticket]:
        """The first ticket of every line. A head past its deadline by more than
        `ABANDONED_S` is dropped first: its request would have left by itself (a handler
        that died between joining and waiting), and it must not hold up the line."""
        for model, line in list(self._lines.items()):
            while line and line[0].deadline + ABANDONED_S < now:
                line.popleft()
            if not line:
                del self._lines[model]
        return [line[0] for line in self._lines.values()]

    def turn(self, ticket: Ticket, now: float, *, placed: bool) -> Turn:
        """Decide after a look: `placed` says the head found a target (or a final answer).
        A ticket that goes or times out is still in line until `leave`."""
        if placed and self.is_head(ticket):
            return Turn.GO
        if now >= ticket.deadline:
            return Turn.TIMED_OUT
        return Turn.WAIT

    def wake_at(self, ticket: Ticket, now: float) -> float:
        """When to look again if nothing wakes `ticket` first: its deadline, and for the head
        `RECHECK_S` from now at the latest."""
        if self.is_head(ticket):
            return min(ticket.deadline, now + RECHECK_S)
        return ticket.deadline

    def leave(self, ticket: Ticket) -> Ticket | None:
        """Take `ticket` out of its line (placed, timed out or cancelled); the new head when
        it was the head -- the request that should look next."""
        line = self._lines.get(ticket.model)
        if not line or ticket not in line:
            return None
        was_head = line[0] is ticket
        line.remove(ticket)
        if not line:
            del self._lines[ticket.model]
            return None
        return line[0] if was_head else None
