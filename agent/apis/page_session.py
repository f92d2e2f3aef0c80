"""The web page's session: one-time login codes and the session ids they turn into.

`nvpair ui` asks the running agent (with the local API token) for a code; the link it prints
carries it (`/ui/login?code=CODE`). A code is random, works once and for `CODE_TTL_S`; at
most `MAX_CODES` are outstanding (the oldest is dropped). Redeemed, it becomes a session id,
sent back as the `nvpair_ui` cookie, valid until `IDLE_S` without a request; at most
`MAX_SESSIONS` live (the least recently used goes). Everything is in memory: an agent
restart ends every session. Ids are compared in constant time; none is ever logged.

No I/O here, and time is passed in (`now`, monotonic seconds), so tests use a fake clock.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from typing import Final

__all__ = ["CODE_TTL_S", "COOKIE", "IDLE_S", "MAX_CODES", "MAX_SESSIONS", "UiSessions"]

COOKIE: Final = "nvpair_ui"
CODE_TTL_S: Final = 120.0
IDLE_S: Final = 12 * 3600.0
MAX_CODES: Final = 8
MAX_SESSIONS: Final = 64
_MAX_ID: Final = 100  # longer input is no id of ours: refused before comparing


def _find(held: OrderedDict[str, float], given: str) -> str | None:
    # Constant time per held id (bounded: at most MAX_SESSIONS), so the answer's timing does
    # not say how much of an id was right; a dict lookup would hash the guess, and that is
    # fine too, but this keeps the rule one for codes and sessions alike.
    if not given or len(given) > _MAX_ID:
        return None
    wanted = given.encode("utf-8", "surrogateescape")
    found = None
    for key in held:
        if hmac.compare_digest(key.encode(), wanted):
            found = key
    return found


class UiSessions:
    """Outstanding codes and live sessions, bounded both."""

    def __init__(self) -> None:
        self._codes: OrderedDict[str, float] = OrderedDict()  # code -> expires at
        self._sessions: OrderedDict[str, float] = OrderedDict()  # id -> last used

    def issue_code(self, now: float) -> str:
        """A fresh one-time code, valid for `CODE_TTL_S`."""
        self._expire(now)
        code = secrets.token_urlsafe(24)
        self._codes[code] = now + CODE_TTL_S
        while len(self._codes) > MAX_CODES:
            self._codes.popitem(last=False)
        return code

    def redeem(self, code: str, now: float) -> str | None:
        """The new session id for a valid code (which is then spent), or None."""
        self._expire(now)
        found = _find(self._codes, code)
        if found is None:
            return None
        del self._codes[found]
        session = secrets.token_urlsafe(32)
        self._sessions[session] = now
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def valid(self, session: str | None, now: float) -> bool:
        """Whether `session` is a live session id; using it keeps it alive."""
        if session is None:
            return False
        self._expire(now)
        found = _find(self._sessions, session)
        if found is None:
            return False
        self._sessions[found] = now
        self._sessions.move_to_end(found)
        return True

    @property
    def counts(self) -> tuple[int, int]:
        """(outstanding codes, live sessions)."""
        return len(self._codes), len(self._sessions)

    def _expire(self, now: float) -> None:
        for code in [c for c, until in self._codes.items() if until <= now]:
            del self._codes[code]
        # Least recently used first: the expired ones are at the front.
        while self._sessions:
            oldest, used = next(iter(self._sessions.items()))
            if now - used < IDLE_S:
                break
            del self._sessions[oldest]
