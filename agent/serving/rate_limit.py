"""Requests and tokens per minute, per key, across the cluster -- approximately. Sans-I/O:
time is passed in.

**Per-member shares.** No count crosses the network: each member admits, per key, its share
of the key's limit, `limit / members` (the members it holds as reachable, itself
included; at least one request a minute), in a sliding window of the last 60 s counted in
one-second buckets. With requests spread over the members, the cluster admits about the
limit a minute: within one share per change of membership during the minute, and the
window is 59-60 s long, so never more than about 2% over. Traffic that enters on fewer
members than are alive gets less: a client that sends everything to one of three members
gets a third of its limit -- spread clients over members (a load balancer, or a list of
facades) to use all of it.

Requests are counted when admitted; tokens when the engine reports them, after the request
(`record_tokens`): a request is admitted while the tokens of the last minute are under the
share, so one request can overshoot the token limit by its own tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["KeyLimiter", "Limited", "Window"]

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

    def record_tokens(self, name: str, tokens: int, now: float) -> None:
        """Count the tokens the engine reported for one of key `name`'s requests."""
        if tokens > 0:
            self._of(name, now).tokens.add(now, tokens)
