"""`start_runner`, for real on 127.0.0.1: the app answers on the port it returns, and a port in
use is the bind's OSError with the runner already cleaned up (nothing left for the caller)."""

from __future__ import annotations

import errno

import aiohttp
import pytest
from aiohttp import web

from netkit.sites import start_runner


async def _hello(request: web.Request) -> web.Response:
    return web.Response(text="hello")


def _app(cleaned: list[str], name: str) -> web.Application:
    app = web.Application()
    app.router.add_get("/", _hello)

    async def cleanup(app: web.Application) -> None:
        cleaned.append(name)

    app.on_cleanup.append(cleanup)
    return app


async def test_the_app_answers_on_the_port_returned_and_a_port_in_use_is_cleaned_up() -> None:
    cleaned: list[str] = []
    runner, port = await start_runner(_app(cleaned, "first"), "127.0.0.1", 0)
    try:
        assert port > 0
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as answer,
        ):
            assert (answer.status, await answer.text()) == (200, "hello")
        with pytest.raises(OSError, match="already in use") as taken:
            await start_runner(_app(cleaned, "second"), "127.0.0.1", port)
        assert taken.value.errno == errno.EADDRINUSE
        assert cleaned == ["second"]  # the failed one only: the first still serves
    finally:
        await runner.cleanup()
    assert cleaned == ["second", "first"]
