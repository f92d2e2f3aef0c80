"""What the mock engine does beyond OpenAI's routes, as the real engines do it.

- `--api-key KEY` (or `$NVPAIR_MOCK_API_KEY`): every route but `/health` answers 401 without
  `Authorization: Bearer KEY`, in OpenAI's shape, as vLLM started with `--api-key` does.
- The request's `X-Request-Id` names the completion (`chatcmpl-ID`, as vLLM does) and comes
  back as a header, with an `openai-processing-ms` one.
- `--flavour ollama` adds Ollama's own routes: `GET /api/version`, `GET /api/ps` (every
  model it serves, as loaded) and `GET /api/tags`.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from workload_manager import VERSION

__all__ = ["FLAVOURS", "KEY_ENV", "add_flavour", "completion_id", "middlewares"]

FLAVOURS: Final = ("openai", "ollama")
KEY_ENV: Final = "NVPAIR_MOCK_API_KEY"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN: Final = frozenset({"/health"})
_STARTED: Final = web.RequestKey("mock_started", float)


def completion_id(request: web.Request, count: int) -> str:
    """`chatcmpl-ID` for a request that says its id, else `mock-N`."""
    given = request.headers.get("X-Request-Id", "")
    return f"chatcmpl-{given[:128]}" if given else f"mock-{count}"


def middlewares(api_key: str) -> list[Middleware]:
    """The key check, when there is a key."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: _Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if request.path not in _OPEN and not hmac.compare_digest(given, expected):
            error = {
                "message": "Incorrect API key provided.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            return web.json_response({"error": error}, status=401)
        return await handler(request)

    return [timed, guard] if api_key else [timed]


async def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the request's id and the time taken on every answer."""
    given = request.headers.get("X-Request-Id")
    if given:
        response.headers["X-Request-Id"] = given[:128]
    taken_ms = (time.monotonic() - request.get(_STARTED, time.monotonic())) * 1000
    response.headers["openai-processing-ms"] = str(int(taken_ms))


@web.middleware
async def timed(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """When the request came in, for `openai-processing-ms`."""
    request[_STARTED] = time.monotonic()
    return await handler(request)


def add_flavour(app: web.Application, flavour: str, models: Sequence[str]) -> None:
    """`/health` always; Ollama's own routes for `flavour` "ollama"."""
    app.on_response_prepare.append(stamp)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    if flavour != "ollama":
        return

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": f"0.0.0-nvpair-mock-{VERSION}"})

    def listed() -> list[dict[str, object]]:
        return [
            {"name": m, "model": m, "size": 1, "digest": "0" * 64, "details": {"format": "gguf"}}
            for m in models
        ]

    async def ps(_: web.Request) -> web.Response:
        return web.json_response({"models": [{**m, "size_vram": 0} for m in listed()]})

    async def tags(_: web.Request) -> web.Response:
        return web.json_response({"models": listed()})

    app.router.add_get("/api/version", version)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/tags", tags)
