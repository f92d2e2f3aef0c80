"""Requests and tokens per minute, per key: the windows that count them. Sans-I/O: time
is passed in.

A sliding window of the last 60 s counted in one-second buckets (`Window`), per key
(`KeyLimiter`), used two ways (`agent.serving.cluster_limits` says when):

- **At the key's holder** (`grant`): the one member that holds a key's cluster-wide count
  grants requests out of the whole limit, to itself and to the members that ask, and
  sums the tokens they report.
- **As a share** (`admit` with `share`): a member that cannot reach the holder, or a
  cluster not yet all on a release that knows holders, admits its share of the limit alone.

Requests are counted when admitted; tokens when the engine reports them, after the request
(`record_tokens`): a request is admitted while the tokens of the last minute are under the
share, so one request can overshoot the token limit by its own tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["Grant", "KeyLimiter", "Limited", "Window"]

WINDOW_S: Final = 60
MAX_TRACKED: Final = 4096  # keys with counts held; empty windows go first when full


class Window:
    """Counts of the last `WINDOW_S` seconds, in one-second buckets (at most 60 held)."""

    __slots__ = ("_buckets", "_total")

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first
        self._total = 0

    def _expire(self, now: float) -> int:
        second = math.floor(now)
        while self._buckets and self._buckets[0][0] <= second - WINDOW_S:
            self._total -= self._buckets.popleft()[1]
        return second

    def total(self, now: float) -> int:
        """The count of the last minute."""
        self._expire(now)
        return self._total

    def add(self, now: float, count: int) -> None:
        """Count `count` at `now`."""
        second = self._expire(now)
        if self._buckets and self._buckets[-1][0] >= second:
            self._buckets[-1][1] += count  # a clock that stepped back counts in the last one
        else:
            self._buckets.append([second, count])
        self._total += count

    def wait_s(self, now: float, most: int) -> int:
        """Whole seconds until the count is at most `most` (at least 1)."""
        self._expire(now)
        left = self._total
        for second, count in self._buckets:
            left -= count
            if left <= most:
                return max(1, math.ceil(second + WINDOW_S - now))
        return 1


@dataclass(frozen=True, slots=True)
class Limited:
    """A request refused for a key's limit: which one, and when to try again."""

    kind: Literal["requests", "tokens"]
    retry_after_s: int
    allowed: float  # this member's share of the limit


@dataclass(frozen=True, slots=True)
class Grant:
    """What a key's holder grants: requests that may be admitted (each already counted in
    its window), the key's tokens in the last minute cluster-wide, and when to ask again
    when it grants none."""

    granted: int
    tokens: int
    retry_after_s: int = 0


class _Counts:
    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = Window()
        self.tokens = Window()


class KeyLimiter:
    """Every key's windows on this member (bounded by `MAX_TRACKED` keys)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}

    def _of(self, name: str, now: float) -> _Counts:
        counts = self._counts.get(name)
        if counts is None:
            if len(self._counts) >= MAX_TRACKED:
                self._forget_idle(now)
            counts = self._counts[name] = _Counts()
        return counts

    def _forget_idle(self, now: float) -> None:
        idle = [
            n
            for n, c in self._counts.items()
            if not c.requests.total(now) and not c.tokens.total(now)
        ]
        for name in idle or list(self._counts)[: len(self._counts) // 2]:
            del self._counts[name]

    def admit(self, name: str, *, rpm: int, tpm: int, share: float, now: float) -> Limited | None:
        """Admit one request of key `name` (counted) or say why not (nothing counted).
        `share` is this member's part of the limits (1 / members alive)."""
        if not rpm and not tpm:
            return None
        counts = self._of(name, now)
        if tpm:
            allowed = max(1.0, tpm * share)
            most = math.ceil(allowed) - 1  # admitted while under the share
            if counts.tokens.total(now) > most:
                return Limited("tokens", counts.tokens.wait_s(now, most), allowed)
        if rpm:
            allowed = max(1.0, rpm * share)
            most = math.floor(allowed) - 1  # admitted while this one still fits
            if counts.requests.total(now) > most:
                return Limited("requests", counts.requests.wait_s(now, most), allowed)
            counts.requests.add(now, 1)
        return None

    def grant(self, name: str, *, rpm: int, tpm: int, want: int, tokens: int, now: float) -> Grant:
        """At the key's holder: count `tokens` reported, then grant up to `want` requests
        within the limits (counted as admitted now)."""
        counts = self._of(name, now)
        if tokens > 0:
            counts.tokens.add(now, tokens)
        used = counts.tokens.total(now)
        if tpm and used >= tpm:
            return Grant(0, used, counts.tokens.wait_s(now, tpm - 1))
        granted = max(0, want)
        if rpm:
            granted = min(granted, rpm - counts.requests.total(now))
            if granted <= 0:
                return Grant(0, used, counts.requests.wait_s(now, rpm - 1))
            counts.requests.add(now, granted)
        return Grant(granted, used)

    def tokens(self, name: str, now: float) -> int:
        """The key's tokens counted here in the last minute."""
        counts = self._counts.get(name)
        return counts.tokens.total(now) if counts is not None else 0

    def record_tokens(self, name: str, tokens: int, now: float) -> None:
        """Count the tokens the engine reported for one of key `name`'s requests."""
        if tokens > 0:
            self._of(name, now).tokens.add(now, tokens)
