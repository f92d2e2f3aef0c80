"""A request's identity end to end, and which answer headers reach the client.

The facade takes the client's `X-Request-Id` (or mints one, `req_` + this process's ULID +
a counter: unique across restarts and members, and a counter is cheap) when a request
comes in; the engine receives it -- across the node API too, when the request is forwarded
-- and the client gets it back on the answer, so one id finds the request in the client's
logs, the engine's and ours (and, with tracing on, the calls carry the trace's context too).
It travels in a context variable set for the request's handler
task: the calls to the engine and to the member that runs it are made in that task, so
neither the routing code between them nor its signatures need to carry it.

The engine's answer headers are passed back through an allow-list of those clients read
(`X-Request-Id`, `openai-*` such as `openai-processing-ms`, `x-ratelimit-*`, `Retry-After`);
hop-by-hop headers and everything else stay behind.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Final

from aiohttp import web
from ulid import ULID

from netkit import tracing
from netkit.lean_http import LeanRequest

__all__ = [
    "HEADER",
    "current",
    "identify",
    "log_fields",
    "middleware",
    "outgoing",
    "passed_back",
    "stamp",
    "stamp_into",
    "working_on",
]

HEADER: Final = "X-Request-Id"
MAX_PASSED: Final = 32  # answer headers passed back, at most
MAX_VALUE: Final = 1024
_ID: Final = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_PASSED: Final = ("x-request-id", "retry-after")
_PASSED_PREFIXES: Final = ("openai-", "x-ratelimit-")
_KEY: Final = web.RequestKey("nvpair_request_id", str)

_minted = itertools.count(1)
_mint_prefix = ""


def _new_prefix() -> None:
    """This process's own prefix of minted ids: a process forked from one that had it
    (a server that forks agents) must not mint the ids its parent or siblings do."""
    global _mint_prefix, _minted
    _mint_prefix, _minted = f"req_{ULID()}-", itertools.count(1)


_new_prefix()
os.register_at_fork(after_in_child=_new_prefix)

_current: contextvars.ContextVar[str] = contextvars.ContextVar("nvpair_request_id", default="")
_job: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar(
    "nvpair_job", default=("", "")
)


def identify(request: web.Request | LeanRequest) -> str:
    """Take the request's `X-Request-Id` (a well-formed one) or mint one; from here on the
    handler's calls carry it (`outgoing`) and its answer says it (`stamp`)."""
    given = request.headers.get(HEADER, "")
    request_id = given if _ID.fullmatch(given) else f"{_mint_prefix}{next(_minted)}"
    request[_KEY] = request_id
    _current.set(request_id)
    return request_id


def current() -> str:
    """The id of the request this task handles ("" outside one)."""
    return _current.get()


def working_on(run_id: str, job_id: str) -> None:
    """The job the current request became: its log lines name it (`RUN_ID/ID`)."""
    _job.set((run_id, job_id))


def log_fields() -> dict[str, str]:
    """What a log line written now says of its request (netkit.logs): ids only."""
    run_id, job_id = _job.get()
    return {"request_id": _current.get(), "job_id": f"{run_id}/{job_id}" if run_id else ""}


def outgoing() -> dict[str, str]:
    """The headers a call made for this request carries: its id and, when tracing is on,
    the W3C trace context of the span the call is made in (netkit.tracing)."""
    request_id = _current.get()
    headers = {HEADER: request_id} if request_id else {}
    if tracing.on():
        headers.update(tracing.injected())
    return headers


def passed_back(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The engine's answer headers (its `(name, value)` items) a client may see (bounded)."""
    out: dict[str, str] = {}
    for name, value in headers:
        lowered = name.lower()
        wanted = lowered in _PASSED or lowered.startswith(_PASSED_PREFIXES)
        if wanted and len(value) <= MAX_VALUE and len(out) < MAX_PASSED:
            out[name] = value
    return out


async def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every answer to an identified request says its id."""
    request_id = request.get(_KEY)
    if request_id:
        response.headers[HEADER] = request_id


def stamp_into(request: LeanRequest, headers: MutableMapping[str, str]) -> None:
    """`stamp` for the facade's lean server (`netkit.lean_http`), as each answer's head is
    written."""
    request_id = request.get(_KEY)
    if request_id:
        headers[HEADER] = request_id


@web.middleware
async def middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Identify every request before its handler runs."""
    identify(request)
    return await handler(request)
