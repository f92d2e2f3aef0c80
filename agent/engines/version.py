"""What version of its engine a replica runs, asked once it is ready, the way each engine
says it: vLLM and the mock engine `GET /version` (`{"version"}`), SGLang
`GET /get_server_info` (`version`), llama.cpp `GET /props` (`build_info`), Ollama
`GET /api/version` (`version`). An engine that
does not say is left unknown ("")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

import aiohttp

from agent.engines.auth import EngineAuth
from agent.engines.proc_state import ReplicaState, ReplicaStatus

__all__ = ["EngineVersions", "ask_version"]

_WHERE: Final = {
    "sglang": ("/get_server_info", "version"),
    "llamacpp": ("/props", "build_info"),
    "ollama": ("/api/version", "version"),
}
_DEFAULT: Final = ("/version", "version")
_TIMEOUT: Final = aiohttp.ClientTimeout(total=2)


async def ask_version(session: aiohttp.ClientSession, url: str, kind: str) -> str:
    """The engine's version at `url`, or "" when it does not say (bounded, never raises)."""
    path, field = _WHERE.get(kind, _DEFAULT)
    try:
        async with session.get(url.rstrip("/") + path, timeout=_TIMEOUT) as response:
            if response.status != 200:
                return ""
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return ""
    value = body.get(field) if isinstance(body, dict) else None
    return str(value)[:64] if isinstance(value, str | int | float) else ""


class EngineVersions:
    """Each ready replica's engine version, asked once it is ready (again after a restart),
    with the engine's credentials."""

    def __init__(self, auth: EngineAuth) -> None:
        self._auth = auth
        self._known: dict[str, str] = {}  # replica id -> version

    def get(self, replica_id: str) -> str:
        """The version the replica's engine said ("" unknown)."""
        return self._known.get(replica_id, "")

    async def refresh(self, replicas: Iterable[ReplicaStatus]) -> bool:
        """Ask the ready replicas not asked yet; forget the others. Whether any was asked."""
        ready = {s.replica_id: s for s in replicas if s.state is ReplicaState.READY}
        self._known = {rid: v for rid, v in self._known.items() if rid in ready}
        unknown = [s for rid, s in ready.items() if rid not in self._known]
        if not unknown:
            return False
        async with aiohttp.ClientSession(middlewares=(self._auth.middleware,)) as session:
            found = await asyncio.gather(*(ask_version(session, s.url, s.kind) for s in unknown))
        self._known.update({s.replica_id: v for s, v in zip(unknown, found, strict=True)})
        return True
