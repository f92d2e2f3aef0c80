"""Who the local API answers: its owner, holding the token, from a page of its own or none.

Loopback alone is no boundary: any local user can reach 127.0.0.1, and so can any web page
the owner opens (a form or `text/plain` POST needs no CORS preflight; DNS rebinding makes a
foreign name resolve to 127.0.0.1). So every request is decided by `refusal()`, in order:

1. `Host` must be this listener's own (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`):
   a rebound name (`evil.example:PORT`) is a 403, whatever else the request holds.
2. An `Origin`, when sent, must be the API's own (`http://` + one of those hosts); any other
   page -- `null` included -- is a 403. Browsers send `Origin` on every cross-site POST.
3. Every route but `/healthz`, `/metrics` and `/ui/login` needs `Authorization: Bearer
   <token>`, the token in `NVPAIR_HOME/local-api.token` (0600, so only the owner can read
   it), or the web page's session cookie (`agent.apis.page_session`): 401 otherwise. A POST that
   carries only the cookie also needs an `Origin`, the API's own: a browser sends it.
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

__all__ = ["OPEN_PATHS", "TOKEN_FILE", "holds_token", "issue_token", "read_token", "refusal"]

TOKEN_FILE: Final = "local-api.token"
# No token: probes, scrapers, and the page's login (its one-time code is its credential).
OPEN_PATHS: Final = frozenset({"/healthz", "/metrics", "/ui/login"})
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
    session: bool = False,
) -> tuple[int, str] | None:
    """(status, reason) when the request must not be served, None when it may be;
    `session`: the request holds a live session cookie of the web page."""
    hosts = {f"{name}:{port}" for name in _LOOPBACK_NAMES}
    host = headers.get("Host", "").lower()
    if host not in hosts:
        return 403, f"Host {host!r} is not this agent's local API (127.0.0.1:{port})"
    origin = headers.get("Origin")
    if origin is not None and origin.lower() not in {f"http://{h}" for h in hosts}:
        return 403, f"requests from the page at {origin!r} are refused"
    bearer = _holds(headers.get("Authorization", ""), token)
    if path not in OPEN_PATHS and not bearer and not session:
        return 401, (
            "the local API needs `Authorization: Bearer <token>`, the token in "
            f"$NVPAIR_HOME/{TOKEN_FILE}"
        )
    if method not in ("GET", "HEAD") and not bearer and session and origin is None:
        return 403, "a state-changing call from the page needs its Origin"
    json_body = _media_type(headers.get("Content-Type", "")) == "application/json"
    if method == "POST" and has_body and not json_body:
        return 415, "a POST body must be application/json"
    return None


def holds_token(headers: Mapping[str, str], token: str) -> bool:
    """Whether the request carries the local API token (not merely a session)."""
    return _holds(headers.get("Authorization", ""), token)


def _holds(authorization: str, token: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    # Constant time on bytes: a header with non-ASCII text compares as unequal, never raises.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), token.encode()
    )


def _media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()
