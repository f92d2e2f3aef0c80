"""Who the local API answers: its owner, holding the token, from a page of its own or none.

Loopback alone is no boundary: any local user can reach 127.0.0.1, and so can any web page
the owner opens (a form or `text/plain` POST needs no CORS preflight; DNS rebinding makes a
foreign name resolve to 127.0.0.1). So every request is decided by `refusal()`, in order:

1. `Host` must be this listener's own (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`):
   a rebound name (`evil.example:PORT`) is a 403, whatever else the request holds.
2. An `Origin`, when sent, must be the API's own (`http://` + one of those hosts); any other
   page -- `null` included -- is a 403. Browsers send `Origin` on every cross-site POST.
3. Every route but `/healthz` and `/metrics` needs `Authorization: Bearer <token>`, the token
   in `NVPAIR_HOME/local-api.token` (0600, so only the owner can read it): 401 otherwise.
4. A POST body must be `application/json` (415): no form or `text/plain` body gets through.
   A POST with no body at all (`curl -X POST`) carries nothing to mistake: it passes.

The token is fresh from `secrets` at every start (`issue_token`), written before the API
listens, so a copy taken earlier dies with the agent that issued it. The CLI reads it
(`read_token`). No I/O framework here: the local API's middleware carries the answer out.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from certs import write_atomic

__all__ = ["OPEN_PATHS", "TOKEN_FILE", "issue_token", "read_token", "refusal"]

TOKEN_FILE: Final = "local-api.token"
OPEN_PATHS: Final = frozenset({"/healthz", "/metrics"})  # no token: probes and scrapers
_LOOPBACK_NAMES: Final = ("127.0.0.1", "localhost", "[::1]")


def issue_token(home: Path) -> str:
    """A fresh random token, written to `home/local-api.token` (0600 whatever the umask)."""
    token = secrets.token_urlsafe(32)
    write_atomic(home / TOKEN_FILE, token.encode() + b"\n", mode=0o600)
    return token


def read_token(home: Path) -> str:
    """The running agent's token from `home` (`OSError` when it cannot be read)."""
    return (home / TOKEN_FILE).read_text().strip()


def refusal(
    method: str,
    path: str,
    headers: Mapping[str, str],
    *,
    has_body: bool,
    port: int,
    token: str,
) -> tuple[int, str] | None:
    """(status, reason) when the request must not be served, None when it may be."""
    hosts = {f"{name}:{port}" for name in _LOOPBACK_NAMES}
    host = headers.get("Host", "").lower()
    if host not in hosts:
        return 403, f"Host {host!r} is not this agent's local API (127.0.0.1:{port})"
    origin = headers.get("Origin")
    if origin is not None and origin.lower() not in {f"http://{h}" for h in hosts}:
        return 403, f"requests from the page at {origin!r} are refused"
    if path not in OPEN_PATHS and not _holds(headers.get("Authorization", ""), token):
        return 401, (
            "the local API needs `Authorization: Bearer <token>`, the token in "
            f"$NVPAIR_HOME/{TOKEN_FILE}"
        )
    json_body = _media_type(headers.get("Content-Type", "")) == "application/json"
    if method == "POST" and has_body and not json_body:
        return 415, "a POST body must be application/json"
    return None


def _holds(authorization: str, token: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    # Constant time on bytes: a header with non-ASCII text compares as unequal, never raises.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), token.encode()
    )


def _media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()
