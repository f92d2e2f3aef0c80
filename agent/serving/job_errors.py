"""The only words a job's `error` may hold: a small closed vocabulary.

A job's record travels to every member, into `jobs.db`, the logs and the plane. An engine's
own error text may quote the prompt (and an engine that echoes the request puts it in every
field: `message`, `type`, `code`, the body), so nothing an engine says is copied into a job:
the facade names what happened with one of these phrases, chosen from the status class or
the exception's type (`agent.serving.relay.for_exception`: this module is pure). The client
still receives the engine's answer unchanged.
"""

from __future__ import annotations

import enum

__all__ = ["JobError", "for_status"]


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
    # in the wait line (agent/serving/wait_queue.py)
    WAIT_TIMED_OUT = "waited too long for capacity"
    CANCELLED = "cancelled: client disconnected or node drained"
    INTERNAL = "internal error"


def for_status(status: int) -> JobError:
    """The error of a job whose engine answered `status` (400 or above)."""
    return JobError.ENGINE_4XX if status < 500 else JobError.ENGINE_5XX
