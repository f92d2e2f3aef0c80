"""What version of its engine a replica runs, asked once it is ready, the way each engine
says it: vLLM and the mock engine `GET /version` (`{"version"}`), SGLang
`GET /get_server_info` (`version`), llama.cpp `GET /props` (`build_info`), Ollama
`GET /api/version` (`version`). An engine that
does not say is left unknown ("")."""

from __future__ import annotations

from typing import Final

import aiohttp

__all__ = ["ask_version"]

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
