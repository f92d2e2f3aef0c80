"""The model servers this node routes to: probed, listed in the node record, called.

Each configured engine's `/v1/models` is read at start and every `PROBE_S`; an engine that
does not answer is listed as down (no work goes to it) until it answers again. A change is
reported through `on_change`, so members learn of it with the next record push.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import aiohttp

from broker.records import Engine

from .config import EngineSpec

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
    ) -> None:
        self._specs = [EngineSpec(name, kind, url) for name, kind, url in specs]
        self._on_change = on_change
        self.current: list[Engine] = []
        self._probe_session: aiohttp.ClientSession | None = None
        self._call_session: aiohttp.ClientSession | None = None

    async def aclose(self) -> None:
        """Close the HTTP sessions."""
        for session in (self._probe_session, self._call_session):
            if session is not None:
                await session.close()

    async def probe(self) -> None:
        """Ask every engine what it serves, at once; report a change."""
        if self._probe_session is None:
            self._probe_session = aiohttp.ClientSession(timeout=PROBE_TIMEOUT)
        engines = list(await asyncio.gather(*(self._probe_one(s) for s in self._specs)))
        if engines != self.current:
            self.current = engines
            self._on_change()

    async def _probe_one(self, spec: EngineSpec) -> Engine:
        assert self._probe_session is not None
        try:
            async with self._probe_session.get(spec.url + "/v1/models") as response:
                listed = await response.json() if response.status == 200 else {}
            models = [str(m["id"]) for m in listed.get("data", []) if isinstance(m, dict)]
            up = True
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, AttributeError):
            models, up = [], False
        return Engine(
            name=spec.name, kind=spec.kind, url=spec.url, models=models[:MAX_MODELS], up=up
        )

    async def run(self) -> None:
        """Probe every `PROBE_S`, forever."""
        while True:
            await asyncio.sleep(PROBE_S)
            await self.probe()

    def url_for(self, model: str) -> str | None:
        """A local engine that serves `model` and is up."""
        for engine in self.current:
            if model in engine.models and engine.up:
                return engine.url
        return None

    def post(self, url: str, path: str, body: bytes, content_type: str = "application/json") -> Any:
        """POST an inference request (`body` as the client sent it, with `content_type`) to
        a local engine; an aiohttp request context."""
        if self._call_session is None:
            self._call_session = aiohttp.ClientSession(timeout=CALL_TIMEOUT)
        headers = {"Content-Type": content_type}
        return self._call_session.post(url + path, data=body, headers=headers)
