"""Engine credentials and identity (issue 15, items 5 and 6), in memory and against the mock
engine as a real server on 127.0.0.1: a keyed engine is probed, scraped, asked its version
and called with its key, and reported as refusing without it; the answer headers a client
reads pass, hop-by-hop ones do not; an Ollama is probed the way Ollama answers."""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from agent.config import ConfigError, load_config
from agent.core.request_identity import current, identify, outgoing, passed_back
from agent.engines.auth import EngineAuth, EngineCredentials, credentials_from
from agent.engines.kinds import ready_path
from agent.engines.load import LoadScraper
from agent.engines.registry import Engines
from agent.engines.version import ask_version
from agent.mock.engine import MockEngine

KEY = "sk-engine-secret-0123456789"


@pytest_asyncio.fixture
async def keyed() -> AsyncIterator[MockEngine]:
    engine = MockEngine(model="keyed", api_key=KEY)
    await engine.start()
    yield engine
    await engine.aclose()


def test_credentials_refuse_headers_a_proxy_owns_and_never_show_the_key() -> None:
    creds = EngineCredentials(KEY, (("X-Tenant", "lab"),))
    assert creds.as_headers() == {"X-Tenant": "lab", "Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(creds)
    assert "lab" not in repr(creds)
    for name, value in [("Authorization", "x"), ("Connection", "x"), ("Bad Name", "x")]:
        with pytest.raises(ValueError, match="not a header name"):
            EngineCredentials("", ((name, value),))
    with pytest.raises(ValueError, match="control characters"):
        EngineCredentials("", (("X-Tenant", "a\r\nInjected: 1"),))


def test_a_key_file_others_can_read_is_refused_and_one_only_its_owner_reads_is_used(
    tmp_path: Path,
) -> None:
    (tmp_path / "engine.key").write_text(KEY + "\n")
    os.chmod(tmp_path / "engine.key", 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        credentials_from(tmp_path, "engine.key", {})
    os.chmod(tmp_path / "engine.key", 0o600)
    found = credentials_from(tmp_path, "engine.key", {})
    assert found is not None
    assert found.api_key == KEY


def test_the_engines_table_names_a_key_file_and_headers(tmp_path: Path) -> None:
    (tmp_path / "engine.key").write_text(KEY)
    os.chmod(tmp_path / "engine.key", 0o600)
    (tmp_path / "nvpair.toml").write_text(
        '[[agent.engines]]\nkind = "vllm"\nurl = "http://127.0.0.1:8000/"\n'
        'api_key_file = "engine.key"\nheaders = { X-Tenant = "lab" }\n'
    )
    config = load_config(tmp_path, {})
    (url, creds), = config.engine_credentials  # fmt: skip
    assert url == "http://127.0.0.1:8000"
    assert creds.api_key == KEY
    assert KEY not in repr(config)
    (tmp_path / "nvpair.toml").write_text(
        '[[agent.engines]]\nkind = "vllm"\nurl = "http://127.0.0.1:8000"\napi_key_file = "none"\n'
    )
    with pytest.raises(ConfigError, match=r"agent.engines\[0\]: api_key_file"):
        load_config(tmp_path, {})


def test_a_well_formed_request_id_is_kept_and_any_other_replaced() -> None:
    contextvars.copy_context().run(_identify_some)  # the id stays in that context


def _identify_some() -> None:
    given = make_mocked_request("POST", "/", headers={"X-Request-Id": "trace-1/a:b"})
    assert identify(given) == "trace-1/a:b"
    assert outgoing() == {"X-Request-Id": "trace-1/a:b"}
    for bad in ("two words", "x" * 129, "", "a\u00e9"):
        minted = identify(make_mocked_request("POST", "/", headers={"X-Request-Id": bad}))
        assert minted.startswith("req_")
        assert current() == minted


def test_only_the_answer_headers_clients_read_pass() -> None:
    engine = CIMultiDict(
        {
            "X-Request-Id": "abc",
            "openai-processing-ms": "12",
            "x-ratelimit-remaining-requests": "9",
            "Retry-After": "3",
            "Connection": "keep-alive",
            "Transfer-Encoding": "chunked",
            "Content-Encoding": "gzip",
            "Set-Cookie": "s=1",
            "Server": "uvicorn",
        }
    )
    assert passed_back(engine.items()) == {
        "X-Request-Id": "abc",
        "openai-processing-ms": "12",
        "x-ratelimit-remaining-requests": "9",
        "Retry-After": "3",
    }


async def test_a_keyed_engine_without_its_key_is_refusing_not_serving(
    keyed: MockEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engines = Engines([("vllm-0", "vllm", keyed.url)])
    try:
        with caplog.at_level(logging.INFO):
            await engines.probe()
        (engine,) = engines.current
        assert not engine.up
        assert engine.models == []
        assert engines.url_for("keyed") is None
        assert "refuses the probe with 401" in caplog.text
        async with engines.post(keyed.url, "/v1/completions", b'{"model":"keyed"}') as reply:
            assert reply.status == 401
            assert (await reply.json())["error"]["code"] == "invalid_api_key"
    finally:
        await engines.aclose()


async def test_with_its_key_every_call_to_the_engine_carries_it(
    keyed: MockEngine, caplog: pytest.LogCaptureFixture
) -> None:
    auth = EngineAuth([(keyed.url, EngineCredentials(KEY))])
    engines = Engines([("vllm-0", "vllm", keyed.url)], auth=auth)
    scraper = LoadScraper(lambda: {"r": keyed.url}, auth=auth)
    try:
        with caplog.at_level(logging.DEBUG):
            await engines.probe()
            await scraper.scrape()
        (engine,) = engines.current
        assert engine.up
        assert engine.models == ["keyed"]
        async with engines.post(keyed.url, "/v1/completions", b'{"model":"keyed"}') as reply:
            assert reply.status == 200
        assert "r" in scraper.current(), scraper.failures
        async with aiohttp.ClientSession(middlewares=(auth.middleware,)) as session:
            assert (await ask_version(session, keyed.url, "vllm")).startswith("nvpair-mock")
        assert KEY not in caplog.text
    finally:
        await engines.aclose()
        await scraper.aclose()
    # The control: the same scrape without the key fails, and says why.
    async with LoadScraper(lambda: {"r": keyed.url}) as bare:
        await bare.scrape()
        assert bare.failures["r"] == "/metrics answered 401"


async def test_an_ollama_is_up_by_its_version_and_says_what_it_holds_loaded() -> None:
    ollama = MockEngine(model="llama3.2:1b,qwen3:0.6b", flavour="ollama")
    plain = MockEngine(model="plain")
    await ollama.start()
    await plain.start()
    engines = Engines([("o", "ollama", ollama.url), ("p", "ollama", plain.url)])
    try:
        await engines.probe()
        by_name = {e.name: e for e in engines.current}
        assert by_name["o"].up
        assert by_name["o"].models == ["llama3.2:1b", "qwen3:0.6b"]
        assert engines.loaded["o"] == ["llama3.2:1b", "qwen3:0.6b"]
        assert not by_name["p"].up  # no /api/version: not an Ollama that serves
        async with aiohttp.ClientSession() as session:
            assert (await ask_version(session, ollama.url, "ollama")).startswith("0.0.0")
        assert ready_path("ollama") == "/api/version"
        assert ready_path("vllm") == "/v1/models"
    finally:
        await engines.aclose()
        await ollama.aclose()
        await plain.aclose()


async def test_an_engine_whose_probe_fails_stays_listed_down_not_unknown() -> None:
    """A probe that fails (the engine restarting, a timeout on a busy machine) keeps what
    the engine serves, marked down: its requests get 503 (try again), not 404 (no such
    model). One that answers again is up again; one never seen up lists nothing."""
    engine = MockEngine(model="m")
    await engine.start()
    engines = Engines([("e", "vllm", engine.url)])
    try:
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], True)]
        await engine.aclose()  # it goes away
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], False)]
        assert engines.url_for("m") is None  # no work goes to it meanwhile
        engine = MockEngine(model="m", port=int(engine.url.rsplit(":", 1)[1]))
        await engine.start()
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], True)]
    finally:
        await engines.aclose()
        await engine.aclose()
    never = Engines([("x", "vllm", "http://127.0.0.1:9")])  # nothing listens there
    try:
        await never.probe()
        assert [(e.models, e.up) for e in never.current] == [([], False)]
    finally:
        await never.aclose()


async def test_an_engine_answering_an_error_to_its_probe_stays_listed_down() -> None:
    """An engine that answers `/v1/models` with an error (a 503 while it reloads, a 500)
    lists nothing that answer: it is down with what it served, not up serving nothing --
    which made its model vanish from the cluster (404) until the next probe."""
    failing = False

    async def models(request: web.Request) -> web.Response:
        if failing:
            return web.Response(status=503, text="reloading")
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engines = Engines([("e", "vllm", f"http://127.0.0.1:{port}")])
    try:
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], True)]  # the control
        failing = True
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], False)]
        failing = False
        await engines.probe()
        assert [(e.models, e.up) for e in engines.current] == [(["m"], True)]
    finally:
        await engines.aclose()
        await runner.cleanup()
