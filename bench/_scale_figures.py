"""The scale bench's arithmetic, without I/O: percentiles, counter deltas, /proc and `ss`.

bench/scale.py gathers raw readings (each manager's `manager:status` counters before and
after the window, /proc/PID/stat, `ss -tin` lines) and this module turns them into the
figures it prints, so they can be checked without starting a process.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The relay counters that count link deliveries: every event a manager got from a peer,
# first seen or not (`received_remote` = accepted + duplicates + stale + ... for records).
DELIVERIES = "received_remote"
FIRST_SEEN = "accepted"


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (`fraction` in [0, 1]) of `values`; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def counter_delta(
    before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]], name: str
) -> int:
    """Sum over members of `counters[name]` after minus before (statuses in member order)."""
    return sum(
        int(a["counters"][name]) - int(b["counters"][name])
        for b, a in zip(before, after, strict=True)
    )


def outbox_delta(
    before: Iterable[Mapping[str, Any]], after: Iterable[Mapping[str, Any]], name: str = "sent"
) -> int:
    """Sum over members and their peers of one outbox counter (`broadcast[].sent`: events
    acknowledged; `retried`: batches that failed and go again)."""

    def total(statuses: Iterable[Mapping[str, Any]]) -> int:
        return sum(int(peer[name]) for s in statuses for peer in s.get("broadcast", []))

    return total(after) - total(before)


def cpu_ticks(stat_line: str) -> int:
    """utime + stime (clock ticks) from one /proc/PID/stat line. The command name in
    parentheses may hold spaces, so fields are counted from its closing parenthesis."""
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    # Fields 14 and 15 of proc(5), counted from 1 with pid and comm as 1 and 2.
    return int(fields[11]) + int(fields[12])


def rss_kib(status_text: str) -> int:
    """VmRSS in KiB from /proc/PID/status; 0 when the process has none (a zombie)."""
    match = re.search(r"^VmRSS:\s+(\d+) kB", status_text, re.MULTILINE)
    return int(match.group(1)) if match else 0


_ENDPOINT = re.compile(r"\S+:(\d+)\s+\S+:(\d+)\s*$")
_BYTES_SENT = re.compile(r"\bbytes_sent:(\d+)")


def wire_bytes(ss_output: str, ports: set[int]) -> dict[tuple[int, int], int]:
    """From `ss -tinH` output: bytes sent on each TCP socket with an end on one of `ports`,
    keyed by (local port, peer port). Both sockets of a connection are listed, so the sum is
    the bytes both ways."""
    sockets: dict[tuple[int, int], int] = {}
    key: tuple[int, int] | None = None
    for line in ss_output.splitlines():
        if not line.startswith((" ", "\t")):
            head = _ENDPOINT.search(line)
            key = None
            if head is not None:
                local, peer = int(head.group(1)), int(head.group(2))
                if local in ports or peer in ports:
                    key = (local, peer)
                    sockets[key] = 0
        elif key is not None:
            sent = _BYTES_SENT.search(line)
            if sent is not None:
                sockets[key] = int(sent.group(1))
    return sockets


def wire_delta(before: Mapping[tuple[int, int], int], after: Mapping[tuple[int, int], int]) -> int:
    """Bytes sent over the window: a socket open at both readings counts its growth, a new
    one all it sent; one closed in between is lost (aiohttp keeps them pooled, so few are)."""
    return sum(
        sent - before.get(key, 0) for key, sent in after.items() if sent >= before.get(key, 0)
    )


@dataclass(frozen=True, slots=True)
class SizeFigures:
    """One line of the bench: the figures for one member count."""

    members: int
    relay: str  # NVPAIR_WM_RELAY of the run: ring or flood
    events: int
    offered_rate: float
    deliveries: int
    first_seen: int
    outbox_sent: int
    retried: int  # batches sent again after a failure (a timeout on a busy machine)
    wire_bytes: int
    cpu_s: float
    window_s: float  # first event entered to outboxes drained (or the wait given up)
    idle_cores: float  # CPU of the members over a quiet spell before the window, in cores
    spreads_ms: list[float]  # per event: origin to the last member's broker
    missing: int  # (event, member) pairs never told within the wait
    rss_mib: list[float]
    fds: list[int]

    @property
    def deliveries_per_event(self) -> float:
        return self.deliveries / self.events if self.events else math.nan

    def line(self) -> str:
        """The summary line printed for this size."""
        n, per = self.members, self.events or 1
        spreads = self.spreads_ms
        return (
            f"N={n} {self.relay}: {self.events} events at {self.offered_rate:.0f}/s; "
            f"deliveries/event {self.deliveries_per_event:.1f} "
            f"((N-1)^2={(n - 1) ** 2}, accepted {self.first_seen / per:.1f}, "
            f"acked {self.outbox_sent / per:.1f}, batches retried {self.retried}); "
            f"wire {self.wire_bytes / per:,.0f} B/event; "
            f"cpu {1000 * self.cpu_s / per:.2f} s/1k events "
            f"({self.cpu_s / max(self.window_s, 1e-9):.2f} cores over {self.window_s:.1f} s, "
            f"idle before {self.idle_cores:.2f}); "
            f"origin->last p50 {percentile(spreads, 0.5):.0f} ms "
            f"p99 {percentile(spreads, 0.99):.0f} ms max {max(spreads, default=math.nan):.0f} ms"
            f"{f' ({self.missing} never told)' if self.missing else ''}; "
            f"rss/manager {_range(self.rss_mib, '.0f')} MiB; "
            f"fds/manager {_range([float(f) for f in self.fds], '.0f')}"
        )


def _range(values: list[float], spec: str) -> str:
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    mid = percentile(values, 0.5)
    return f"{format(low, spec)}..{format(high, spec)} (median {format(mid, spec)})"


def ratio(figures: list[SizeFigures]) -> float:
    """Flood's deliveries per event over ring's at the largest N both ran at (higher is
    better); with one relay only, its deliveries per event over N."""
    by = {(f.members, f.relay): f.deliveries_per_event for f in figures}
    both = [n for n, relay in by if relay == "ring" and (n, "flood") in by]
    if both:
        n = max(both)
        return by[(n, "flood")] / max(by[(n, "ring")], 1e-9)
    largest = max(figures, key=lambda f: f.members)
    return largest.deliveries_per_event / largest.members
