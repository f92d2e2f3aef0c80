"""The only words a job's `error` may hold: a small closed vocabulary.

A job's record travels to every member, into `jobs.db`, the logs and the plane. An engine's
own error text may quote the prompt (and an engine that echoes the request puts it in every
field: `message`, `type`, `code`, the body), so nothing an engine says is copied into a job:
the facade names what happened with one of these phrases, chosen from the status class or
the exception's type. The client still receives the engine's answer unchanged.
"""

from __future__ import annotations

import enum

import aiohttp

__all__ = ["JobError", "for_exception", "for_status"]


class JobError(enum.Enum):
    """Why a job did not complete; the value is what its record's `error` says."""

    ENGINE_4XX = "engine returned HTTP 4xx"
    ENGINE_5XX = "engine returned HTTP 5xx"
    ENGINE_TIMED_OUT = "engine timed out"
    ENGINE_REFUSED = "engine connection refused"
    ENGINE_CLOSED = "engine closed the connection"
    ENGINE_UNREACHABLE = "engine unreachable"  # any other failure to talk to it
    NO_ENGINE = "no engine here serves the model"
    MEMBER_UNREACHABLE = "member unreachable"
    WAIT_TIMED_OUT = "waited too long for capacity"  # in the wait line (agent/wait_queue.py)
    CANCELLED = "cancelled: client disconnected or node drained"
    INTERNAL = "internal error"


def for_status(status: int) -> JobError:
    """The error of a job whose engine answered `status` (400 or above)."""
    return JobError.ENGINE_4XX if status < 500 else JobError.ENGINE_5XX


def for_exception(exc: BaseException, *, local: bool) -> JobError:
    """The error of a job whose call failed with `exc`: on a local engine, or on the member
    it was forwarded to (`local` False), where only "member unreachable" is known here."""
    if not local:
        return JobError.MEMBER_UNREACHABLE
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return JobError.ENGINE_TIMED_OUT
    if isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, aiohttp.ClientConnectorError)
        and isinstance(exc.os_error, ConnectionRefusedError)
    ):
        return JobError.ENGINE_REFUSED
    closed = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionResetError)
    if isinstance(exc, closed):
        return JobError.ENGINE_CLOSED
    return JobError.ENGINE_UNREACHABLE
