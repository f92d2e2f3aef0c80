"""How each kind of engine says it is up and what it serves.

OpenAI-compatible servers (vLLM, SGLang, llama.cpp, the mock engine) are up when
`GET /v1/models` answers, and serve what it lists. Ollama is up when `GET /api/version`
answers (`{"version": "0.5.7"}`), serves the models `GET /v1/models` lists (every model it
has pulled, by name: `llama3.2:1b`), and holds loaded in memory those `GET /api/ps` lists
(`{"models": [{"name": ..., "model": ...}]}`) -- a request for a model it holds answers at
once, one for a model it must load first waits for the load. A 401 or 403 means the engine
wants credentials it did not get: reported as such (`Probed.refused`), never as serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

__all__ = ["Probed", "model_ids", "probe", "ready_path"]

_READY: Final = {"ollama": "/api/version"}
_REFUSED: Final = frozenset({401, 403})
MAX_LISTED: Final = 4096


@dataclass(frozen=True, slots=True)
class Probed:
    """What one probe found: up, the models served, those loaded, a refusal's status."""

    up: bool
    models: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    refused: int = 0  # 401/403: the engine wants credentials


def ready_path(kind: str) -> str:
    """The path that answers 200 once an engine of `kind` serves."""
    return _READY.get(kind, "/v1/models")


async def probe(session: aiohttp.ClientSession, url: str, kind: str) -> Probed:
    """Ask the engine at `url`; aiohttp and JSON errors propagate (the engine is down)."""
    base = url.rstrip("/")
    if kind == "ollama":
        status, _ = await _get(session, base + "/api/version")
        if status != 200:
            return Probed(up=False, refused=status if status in _REFUSED else 0)
        _, listed = await _get(session, base + "/v1/models")
        _, running = await _get(session, base + "/api/ps")
        loaded = [
            str(m.get("model") or m.get("name"))
            for m in _items(running, "models")
            if m.get("model") or m.get("name")
        ]
        return Probed(up=True, models=model_ids(listed), loaded=loaded[:MAX_LISTED])
    status, listed = await _get(session, base + "/v1/models")
    if status in _REFUSED:
        return Probed(up=False, refused=status)
    if status != 200:  # an error answer lists nothing: down, not "serving no model"
        return Probed(up=False)
    return Probed(up=True, models=model_ids(listed))


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url, allow_redirects=False) as response:
        if response.status != 200:
            return response.status, {}
        return 200, await response.json(content_type=None)


def _items(body: Any, key: str) -> list[dict[str, Any]]:
    items = body.get(key) if isinstance(body, dict) else None
    return [m for m in items[:MAX_LISTED] if isinstance(m, dict)] if isinstance(items, list) else []


def model_ids(listed: Any) -> list[str]:
    """The model ids in a `GET /v1/models` answer (`{"data": [{"id": ...}]}`), decoded."""
    return [str(m["id"]) for m in _items(listed, "data") if "id" in m][:MAX_LISTED]
