"""The web page on the local API: its files, its login, its security headers, its stream.

- `GET /ui/`, `GET /ui/<file>` -- the page's files from the package directory `agent/apis/ui/`
  (no listing, nothing outside it, `Cache-Control: no-cache`).
- `POST /v1/ui/link` -- with the local API token only: a one-time login link (`nvpair ui`).
- `GET /ui/login?code=` -- a valid code sets the `nvpair_ui` session cookie (HttpOnly,
  SameSite=Strict, Path=/) and answers 303 to `/ui/`.
- `GET /v1/jobs/stream` -- server-sent events of every job record committed here
  (`agent.apis.job_feed`), resumable with `Last-Event-ID`, a comment every `KEEPALIVE_S`.
- `GET /v1/jobs/counts` -- `{byState, total}` under the Jobs list's filters.
- `GET /v1/usage/series?window=3600|86400` -- `agent.apis.usage_series`.

`UiServer.refusal` is the local API's guard (`agent.apis.local_guard`) with the session cookie
taken into account; without the token or a session, the page's paths answer a small HTML
401 saying to run `nvpair ui`, the API's a JSON one. Every answer carries the headers in
`SECURITY_HEADERS` (and `Cache-Control: no-store` unless it is one of the page's files).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

from agent.apis.answers import error_answer, json_answer
from agent.apis.job_feed import JobFeed, TooManyStreams
from agent.apis.local_guard import holds_token, refusal
from agent.apis.page_session import COOKIE, UiSessions
from agent.apis.usage_series import WINDOWS, usage_series
from agent.metrics.agent import STATES
from agent.serving.usage_store import UsageStore
from broker.errors import StoreUnavailable
from broker.jobs import JobsStore, JobsWriter
from broker.jobs_query import Filters, count_by_state

__all__ = ["KEEPALIVE_S", "SECURITY_HEADERS", "UI_DIR", "UiPorts", "UiServer"]

UI_DIR: Final = Path(__file__).with_name("ui")
KEEPALIVE_S: Final = 15.0
SECURITY_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'"
    ),
    "Referrer-Policy": "no-referrer",
}
_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
    ".woff2": "font/woff2",
}
_NAME: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")
_LOGIN_PAGE: Final = (
    "<!doctype html><html lang=en><meta charset=utf-8><title>nvpair</title>"
    "<p>This page needs a session. Run <code>nvpair ui</code> on this machine and open the "
    "link it prints (<code>nvpair ui --open</code> opens it).</p></html>"
)


@dataclass(frozen=True)
class UiPorts:
    """What the page's routes read besides the Jobs store: the live feed and the usage."""

    feed: JobFeed
    usage: UsageStore

    @classmethod
    def following(cls, store: JobsStore, usage: UsageStore) -> UiPorts:
        """A feed of every record `store` commits from now on, and `usage`."""
        feed = JobFeed()
        store.on_commit = feed.publish
        return cls(feed, usage)


class UiServer:
    """The page's routes, sessions and headers, installed on the local API's app."""

    def __init__(
        self,
        app: web.Application,
        ports: UiPorts | None,
        *,
        store: JobsStore,
        writer: JobsWriter,
        token: str,
    ) -> None:
        self.store, self.writer = store, writer
        self._token = token
        self.sessions = UiSessions()
        app.on_response_prepare.append(_headers)
        app.router.add_get("/ui/", self._index)
        app.router.add_get("/ui/login", self._login)
        app.router.add_get("/ui/{name}", self._file)
        app.router.add_post("/v1/ui/link", self._link)
        app.router.add_get("/v1/jobs/counts", self._counts)
        if ports is not None:
            self.ports = ports
            app.router.add_get("/v1/jobs/stream", self._stream)
            app.router.add_get("/v1/usage/series", self._series)

    def refusal(self, request: web.Request, port: int) -> web.Response | None:
        """The answer refusing `request` (JSON, or HTML on the page's paths), or None."""
        session = self.sessions.valid(request.cookies.get(COOKIE), time.monotonic())
        refused = refusal(
            request.method,
            request.path,
            request.headers,
            has_body=request.body_exists,
            port=port,
            token=self._token,
            session=session,
        )
        if refused is None:
            return None
        status, reason = refused
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status == 401 and request.path.startswith("/ui"):
            return web.Response(
                status=401, text=_LOGIN_PAGE, content_type="text/html", headers=headers
            )
        return error_answer(status, reason, headers)

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return _static("index.html")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        return _static(request.match_info["name"])

    async def _login(self, request: web.Request) -> web.Response:
        session = self.sessions.redeem(request.query.get("code", ""), time.monotonic())
        if session is None:
            return web.Response(status=401, text=_LOGIN_PAGE, content_type="text/html")
        answer = web.Response(status=303, headers={"Location": "/ui/"})
        answer.set_cookie(COOKIE, session, httponly=True, samesite="Strict", path="/")
        return answer

    async def _link(self, request: web.Request) -> web.Response:
        # The token, not a session: a page cannot mint itself more sessions.
        if not holds_token(request.headers, self._token):
            raise web.HTTPForbidden(text="a login link needs the local API token\n")
        code = self.sessions.issue_code(time.monotonic())
        host = request.host
        return json_answer({"url": f"http://{host}/ui/login?code={code}", "expiresS": 120})

    async def _counts(self, request: web.Request) -> web.Response:
        filters = _filters(request)
        try:
            await self.writer.flush()
        except StoreUnavailable as exc:
            raise web.HTTPServiceUnavailable(text=f"{exc}\n") from None
        by_state = await count_by_state(self.store.db, filters)
        return json_answer({"byState": by_state, "total": sum(by_state.values())})

    async def _series(self, request: web.Request) -> web.Response:
        try:
            window = int(request.query.get("window", "3600"))
        except ValueError:
            window = 0
        if window not in WINDOWS:
            raise web.HTTPBadRequest(text=f"window is one of {', '.join(map(str, WINDOWS))}\n")
        body = await usage_series(self.ports.usage, window, now_ms=int(time.time() * 1000))
        return json_answer(body)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        feed = self.ports.feed
        try:
            subscriber = feed.subscribe(request.headers.get("Last-Event-ID"))
        except TooManyStreams as exc:
            raise web.HTTPServiceUnavailable(
                text=f"{exc}\n", headers={"Retry-After": "5"}
            ) from None
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            transport = request.transport
            if transport is not None:  # a client too slow for its queue: cut at once
                subscriber.on_drop = transport.abort
                subscriber.gone = transport.is_closing
            await answer.prepare(request)
            await answer.write(b"retry: 2000\n\n")
            while not subscriber.dropped and not (transport is None or transport.is_closing()):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KEEPALIVE_S):
                        await subscriber.wake.wait()
                frames = subscriber.take()
                await answer.write(b"".join(frames) if frames else b": keep-alive\n\n")
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            feed.unsubscribe(subscriber)
        return answer


def _filters(request: web.Request) -> Filters:
    query = request.query
    state = query.get("state")
    if state is not None and state not in STATES:
        raise web.HTTPBadRequest(text=f"state is one of {', '.join(STATES)}\n")
    return Filters(
        state=state,
        node=query.get("node"),
        model=query.get("model"),
        requester=query.get("requester"),
    )


def _static(name: str) -> web.StreamResponse:
    # One file of agent/apis/ui/ itself, by a plain name: no slash, no `..`, no hidden file.
    kind = _TYPES.get(Path(name).suffix)
    if not _NAME.fullmatch(name) or ".." in name or kind is None:
        raise web.HTTPNotFound(text="no such file of the page\n")
    path = UI_DIR / name
    if not path.is_file():
        raise web.HTTPNotFound(text="no such file of the page\n")
    return web.Response(
        body=path.read_bytes(), headers={"Content-Type": kind, "Cache-Control": "no-cache"}
    )


async def _headers(request: web.Request, response: web.StreamResponse) -> None:
    # Every answer, errors and refusals included (the signal runs for each one prepared).
    response.headers.update(SECURITY_HEADERS)
    response.headers.setdefault("Cache-Control", "no-store")
