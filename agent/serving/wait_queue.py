"""Wait instead of refusing (issue 15, item 4): the async part of the wait line.

`enter` is the facade's placement: it places the request at once, or -- when every
eligible target is at its queue limit (`Refusal.QUEUE_FULL`), or others of its model
already wait here -- gives it a place in line (`agent.serving.wait_line`), or refuses it with 429
when the line is full. A request in line is a `queued` job; `wait` returns its targets once
it is the head and something fits, or `Refusal.QUEUE_FULL` once it waited `wait_timeout_s`
(the job then fails, `waited too long for capacity`, and the client gets 429). A client
that hangs up while waiting cancels its handler, so it leaves the line and its job ends
`cancelled`.

The head looks again whenever capacity may have freed: one of this member's requests
finished (`poke`), records arrived from a member (their replicas' load reports: `after`
wraps the push handler), the pending work of other members was re-read (`poke`), and at
least every `RECHECK_S` as a backstop. When the head goes, the next head looks at once:
the head that went has counted its request against its target by then (the facade counts
it before its first await), so two waiters never take the same slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from aiohttp import web

from agent.serving.job_errors import JobError
from agent.serving.lifecycle import Fail
from agent.serving.openai_errors import openai_error
from agent.serving.relay import refused
from agent.serving.wait_line import Ticket, Turn, WaitLine
from scheduler import Refusal

__all__ = ["WAIT_QUEUE", "WAIT_TIMEOUT_S", "WaitQueue", "gave_up"]

WAIT_QUEUE: Final = 64  # requests per model waiting on one member (`wait_queue`)
WAIT_TIMEOUT_S: Final = 30.0  # how long one waits at most (`wait_timeout_s`)

T = TypeVar("T")


class WaitQueue(Generic[T]):
    """This member's wait lines; `T` is a placement target."""

    def __init__(
        self,
        *,
        length: int = WAIT_QUEUE,
        timeout_s: float = WAIT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.line = WaitLine(length, timeout_s)
        self._clock = clock
        self._wakes: dict[Ticket, asyncio.Event] = {}
        # Called with the model when its line here starts (its first waiter): a line for a
        # deployment at zero is a cold start the members should hear of now, not next beat.
        self.on_start: Callable[[str], object] = lambda model: None

    def enter(
        self,
        model: str,
        place: Callable[[], list[T] | Refusal],
        timeout_s: Callable[[], float | None] = lambda: None,
    ) -> list[T] | Refusal | Ticket:
        """Targets now, a refusal now (no job: `QUEUE_FULL` when the line is full too), or a
        place in line (the request becomes a queued job and calls `wait`), for what
        `timeout_s` says when it joins (None: the line's own) at most."""
        if self.line:  # someone waits somewhere (the hot path: nobody)
            self.line.heads(self._clock())  # drops abandoned heads first
        if not self.line.waiting(model):
            placed = place()
            if placed is not Refusal.QUEUE_FULL:
                return placed
        started = not self.line.waiting(model)
        ticket = self.line.join(model, self._clock(), timeout_s())
        if ticket is None:
            return Refusal.QUEUE_FULL
        if started:
            self.on_start(model)
        return ticket

    async def wait(
        self, entered: list[T] | Ticket, place: Callable[[], list[T] | Refusal]
    ) -> list[T] | Refusal:
        """The targets of a request `enter` let in: at once, or when its turn comes; or the
        refusal that ends its wait (`QUEUE_FULL`: it waited too long)."""
        if not isinstance(entered, Ticket):
            return entered
        ticket, line = entered, self.line
        wake = self._wakes[ticket] = asyncio.Event()
        try:
            while True:
                placed = place() if line.is_head(ticket) else Refusal.QUEUE_FULL
                now = self._clock()
                turn = line.turn(ticket, now, placed=placed is not Refusal.QUEUE_FULL)
                if turn is Turn.GO:
                    return placed
                if turn is Turn.TIMED_OUT:
                    return Refusal.QUEUE_FULL
                wake.clear()
                try:
                    async with asyncio.timeout(line.wake_at(ticket, now) - now):
                        await wake.wait()
                except TimeoutError:
                    pass
        finally:
            del self._wakes[ticket]
            self._wake(line.leave(ticket))  # the next head looks at once

    def poke(self) -> None:
        """Capacity may have freed somewhere: every line's head looks again."""
        if not self.line:
            return
        for head in self.line.heads(self._clock()):
            self._wake(head)

    def _wake(self, ticket: Ticket | None) -> None:
        wake = self._wakes.get(ticket) if ticket is not None else None
        if wake is not None:
            wake.set()


def gave_up(refusal: Refusal, model: str, timeout_s: float) -> tuple[web.Response, Fail]:
    """The answer and the event that ends the job of a request whose wait ended without a
    target: it waited too long (429, `Retry-After`), or its model can no longer be served."""
    if refusal is not Refusal.QUEUE_FULL:
        return refused(refusal, model), Fail(error=JobError.NO_ENGINE)
    message = f"every member serving this model stayed busy for {timeout_s:g}s"
    response = openai_error(429, message, "rate_limit_error")
    response.headers["Retry-After"] = "1"
    return response, Fail(error=JobError.WAIT_TIMED_OUT)
