"""Owned background tasks that say when they die.

Every background task in these packages runs inside a task group held by its owner (the
Jobs writer, the supervisor, the stdio channel) and is wrapped in `reporting()`: a task that
raises has its traceback logged under the part's name, and the owner learns of it through
`on_failure(part, exc)` -- so the agent's `/healthz` can name the part -- instead of the
error tearing down the owner's task group or vanishing into an unretrieved task exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["FailureHandler", "describe", "reporting"]

log = logging.getLogger(__name__)

FailureHandler = Callable[[str, BaseException], object]


def describe(exc: BaseException) -> str:
    """One line for a health report: the error's type and message, bounded."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text.splitlines()[0][:300] if text else type(exc).__name__


async def reporting(
    part: str, work: Awaitable[object], on_failure: FailureHandler | None = None
) -> None:
    """Await `work`; if it raises, log the traceback naming `part` and call `on_failure`.

    Cancellation passes through: it is how an owner stops its tasks, not a failure.
    """
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s failed", part)
        if on_failure is not None:
            try:
                on_failure(part, exc)
            except Exception:
                log.exception("reporting the failure of %s failed", part)
