"""Engine credentials: the API key and extra headers this node calls each engine with.

An engine started with an API key (vLLM, SGLang and llama.cpp `--api-key`, the mock engine
too) answers 401 to a call without it. `EngineAuth` holds, per engine base URL, the headers
to add -- `Authorization: Bearer KEY` and any extra ones the operator configured -- and adds
them as an aiohttp client middleware, so every call this node makes to that engine carries
them: the model probe, the load scrape, the version question and the requests it runs. The
node that runs an engine is the only one that knows its key: a request placed elsewhere is
forwarded here over the node API, and this node adds the key on its way to the engine.

A key is read from a file (`[[agent.engines]] api_key_file`, readable by its owner only) or
generated per managed replica; it is never in a node or deployment record, a log line, an
event or `/v1/replicas`, and `EngineCredentials` hides it from `repr()`.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Final

from msgspec import Meta, Struct
from yarl import URL

from agent.core.home import shared_file_problem

if TYPE_CHECKING:  # the middleware's types only: the config (and so every CLI call) reads
    # this module, and needs no HTTP client (aiohttp: 0.2 s of a 0.4 s CLI start)
    from aiohttp import ClientHandlerType, ClientRequest, ClientResponse

__all__ = [
    "EngineAuth",
    "EngineCredentials",
    "EngineTable",
    "credentials_by_url",
    "credentials_from",
    "new_engine_key",
]

MAX_HEADERS: Final = 32
MAX_KEY_CHARS: Final = 4096
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
# Headers a proxy owns: set for the connection or computed from the body, never configured.
_RESERVED: Final = frozenset(
    h.lower()
    for h in (
        "Authorization", "Host", "Content-Length", "Content-Type", "Transfer-Encoding",
        "Connection", "Keep-Alive", "TE", "Trailer", "Upgrade", "Proxy-Authorization",
        "Proxy-Connection", "X-Request-Id",
    )
)  # fmt: skip


_Text = Annotated[str, Meta(min_length=1, max_length=256)]


class EngineTable(Struct, forbid_unknown_fields=True, frozen=True):
    """One `[[agent.engines]]` table as written (agent/config.py)."""

    kind: _Text
    url: Annotated[str, Meta(min_length=1, max_length=2048)]
    name: _Text | None = None
    api_key_file: _Text | None = None  # relative to NVPAIR_HOME
    headers: Annotated[dict[_Text, Annotated[str, Meta(max_length=1024)]], Meta(max_length=32)] = {}


@dataclass(frozen=True, slots=True)
class EngineCredentials:
    """What one engine is called with. Its `repr` shows no value."""

    api_key: str = field(default="", repr=False)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if len(self.api_key) > MAX_KEY_CHARS or _unsafe(self.api_key):
            raise ValueError(f"an engine API key is 1 to {MAX_KEY_CHARS} printable characters")
        if len(self.headers) > MAX_HEADERS:
            raise ValueError(f"at most {MAX_HEADERS} extra engine headers")
        for name, value in self.headers:
            if not _TOKEN.fullmatch(name) or name.lower() in _RESERVED:
                raise ValueError(
                    f"engine header {name[:80]!r} is not a header name one may set "
                    "(Authorization comes from api_key_file; hop-by-hop headers are the proxy's)"
                )
            if _unsafe(value):
                raise ValueError(f"engine header {name}: the value has control characters")

    def as_headers(self) -> dict[str, str]:
        """The headers every call to the engine carries."""
        out = dict(self.headers)
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out


def _unsafe(text: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def credentials_from(
    home: Path, api_key_file: str | None, headers: Mapping[str, str]
) -> EngineCredentials | None:
    """The credentials an `[[agent.engines]]` table names (None: none); ValueError saying
    why not. `api_key_file` is relative to NVPAIR_HOME, readable by its owner only."""
    key = ""
    if api_key_file is not None:
        path = home / api_key_file
        try:
            problem = shared_file_problem(path, holds_secret="an engine API key")
            key = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"api_key_file {path}: {exc.__class__.__name__}") from None
        if problem is not None:
            raise ValueError(problem)
        if not key:
            raise ValueError(f"api_key_file {path} is empty")
    if not key and not headers:
        return None
    return EngineCredentials(key, tuple(headers.items()))


def credentials_by_url(
    home: Path, tables: Iterable[str | EngineTable]
) -> tuple[tuple[str, EngineCredentials], ...]:
    """(engine base URL, credentials) for every table that names some; ValueError if bad."""
    out = []
    for n, table in enumerate(tables):
        if isinstance(table, str):
            continue  # --engine KIND=URL: no credentials (a table gives them)
        try:
            found = credentials_from(home, table.api_key_file, table.headers)
        except ValueError as exc:
            raise ValueError(f"agent.engines[{n}]: {exc}") from None
        if found is not None:
            out.append((table.url.rstrip("/"), found))
    return tuple(out)


def new_engine_key() -> str:
    """A fresh key for a managed replica's engine."""
    return "sk-nvpair-" + secrets.token_urlsafe(32)


_NONE: Final[Mapping[str, str]] = MappingProxyType({})


@functools.lru_cache(maxsize=256)  # a few engines' URLs, asked per request
def _origin(url: str | URL) -> str:
    parsed = url if isinstance(url, URL) else URL(url)
    return f"{parsed.scheme}://{parsed.host}:{parsed.port}"


class EngineAuth:
    """Engine base URL -> the headers calls to it carry; `middleware` adds them.

    Keyed by origin (scheme, host, port): every path of one engine gets the same headers.
    """

    def __init__(self, credentials: Iterable[tuple[str, EngineCredentials]] = ()) -> None:
        self._by_origin: dict[str, dict[str, str]] = {}
        self._managed: dict[str, dict[str, str]] = {}  # managed replicas' keys, by origin
        for url, creds in credentials:
            self.set(url, creds)

    def set(self, url: str, credentials: EngineCredentials | None) -> None:
        """Call the engine at `url` with `credentials` from now on (None: with none)."""
        if credentials is None:
            self._by_origin.pop(_origin(url), None)
        else:
            self._by_origin[_origin(url)] = credentials.as_headers()

    def add_managed(self, url: str, key: str) -> None:
        """A managed replica's engine at `url` takes `key` (from its launch on)."""
        self._managed[_origin(url)] = {"Authorization": f"Bearer {key}"}

    def set_managed(self, keys: Mapping[str, str]) -> None:
        """Every managed replica's key (url -> key); the replicas not in `keys` are gone."""
        self._managed = {_origin(u): {"Authorization": f"Bearer {k}"} for u, k in keys.items()}

    def headers_for(self, url: str | URL) -> Mapping[str, str]:
        """The headers a call to `url` carries."""
        if not self._by_origin and not self._managed:
            return _NONE  # no engine here has a key: nothing to parse the URL for
        origin = _origin(url)
        return self._by_origin.get(origin) or self._managed.get(origin, {})

    async def middleware(
        self, request: ClientRequest, handler: ClientHandlerType
    ) -> ClientResponse:
        """An aiohttp client middleware: the engine's headers on every request to it."""
        if self._by_origin or self._managed:
            for name, value in self.headers_for(request.url).items():
                request.headers[name] = value
        return await handler(request)
