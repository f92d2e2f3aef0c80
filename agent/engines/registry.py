"""The model servers this node routes to: probed, listed in the node record, called.

Each configured engine's `/v1/models` is read at start and every `PROBE_S` (an Ollama is
ready when `/api/version` answers, and `/api/ps` says which models it holds loaded); an
engine that does not answer, or refuses the probe with 401/403 (its API key is missing or
wrong: said once in the log), is listed as down (no work goes to it) until it answers again.
A change is reported through `on_change`, so members learn of it with the next record push.
Every call carries the engine's credentials (`EngineAuth`) and the request's id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import aiohttp

from agent.core.request_identity import outgoing
from agent.engines import kinds as engine_kinds
from agent.engines.auth import EngineAuth
from agent.engines.client import EngineHttp
from agent.engines.config import EngineSpec
from facts.records import Engine

__all__ = ["Engines"]

log = logging.getLogger(__name__)

PROBE_S: Final = 5.0
PROBE_TIMEOUT: Final = aiohttp.ClientTimeout(total=5)
# Inference: no total timeout (a generation may be long), but connect and between-chunk ones.
CALL_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300)
MAX_MODELS: Final = 4096


class Engines:
    """This node's engines: `probe()`, `run()` (probe forever), `url_for()`, `post()`."""

    def __init__(
        self,
        specs: Sequence[tuple[str, str, str]],
        *,
        on_change: Callable[[], None] = lambda: None,
        auth: EngineAuth | None = None,
    ) -> None:
        self._specs = [EngineSpec(name, kind, url) for name, kind, url in specs]
        self._on_change = on_change
        self.auth = auth or EngineAuth()
        self.current: list[Engine] = []
        self.loaded: dict[str, list[str]] = {}  # engine name -> models it holds loaded
        self.refused: dict[str, int] = {}  # engine name -> the status it refused the probe with
        self._probe_session: aiohttp.ClientSession | None = None
        self._call_session: aiohttp.ClientSession | None = None  # https engines only
        self._http = EngineHttp()

    async def aclose(self) -> None:
        """Close the HTTP sessions."""
        for session in (self._probe_session, self._call_session):
            if session is not None:
                await session.close()
        await self._http.aclose()

    async def probe(self) -> None:
        """Ask every engine what it serves, at once; report a change."""
        if self._probe_session is None:
            self._probe_session = aiohttp.ClientSession(
                timeout=PROBE_TIMEOUT, middlewares=(self.auth.middleware,)
            )
        engines = list(await asyncio.gather(*(self._probe_one(s) for s in self._specs)))
        if engines != self.current:
            self.current = engines
            self._on_change()

    async def _probe_one(self, spec: EngineSpec) -> Engine:
        assert self._probe_session is not None
        try:
            probed = await engine_kinds.probe(self._probe_session, spec.url, spec.kind)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, AttributeError):
            probed = engine_kinds.Probed(up=False)
        self._note_refusal(spec, probed.refused)
        models, up = probed.models, probed.up
        if not up and not models and not probed.refused:
            # A probe that failed (a timeout on a busy machine, an engine restarting) says
            # nothing of what it serves: its models stay listed, down -- a request finds
            # the engine down (503, try again) rather than no such model (404).
            before = next((e for e in self.current if e.name == spec.name), None)
            models = list(before.models) if before is not None else []
        self.loaded[spec.name] = probed.loaded[:MAX_MODELS]
        return Engine(
            name=spec.name, kind=spec.kind, url=spec.url, models=models[:MAX_MODELS], up=up
        )

    def _note_refusal(self, spec: EngineSpec, status: int) -> None:
        # Said once when it starts (and when it ends), never the key itself.
        if status and self.refused.get(spec.name) != status:
            log.warning(
                "engine %s (%s) refuses the probe with %d: its API key is missing or wrong "
                "(api_key_file in its [[agent.engines]] table); no work goes to it",
                spec.name,
                spec.url,
                status,
            )
            self.refused[spec.name] = status
        elif not status and self.refused.pop(spec.name, 0):
            log.info("engine %s accepts the probe again", spec.name)

    async def run(self) -> None:
        """Probe every `PROBE_S`, forever."""
        while True:
            await asyncio.sleep(PROBE_S)
            await self.probe()

    def url_for(self, model: str) -> str | None:
        """A local engine that serves `model` and is up; one that holds it loaded first."""
        serving = [e for e in self.current if model in e.models and e.up]
        loaded = [e for e in serving if model in self.loaded.get(e.name, ())]
        return (loaded or serving)[0].url if serving else None

    def post(self, url: str, path: str, body: bytes, content_type: str = "application/json") -> Any:
        """POST an inference request (`body` as the client sent it, with `content_type`) to
        a local engine; a request context whose answer reads as aiohttp's does."""
        headers = {"Content-Type": content_type, **outgoing()}
        if url.startswith("http://"):  # the hot path: agent.engines.client, kept-alive
            return self._http.post(url, path, body, {**headers, **self.auth.headers_for(url)})
        if self._call_session is None:
            self._call_session = aiohttp.ClientSession(
                timeout=CALL_TIMEOUT, middlewares=(self.auth.middleware,)
            )
        return self._call_session.post(url + path, data=body, headers=headers)
