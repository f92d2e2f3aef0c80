"""The scale bench's readings over a quiet spell: CPU, memory, descriptors and connections
sampled every `every` seconds, so a spell shows whether they stay flat (issue 18, item 4).

`watch()` does the sampling on the members bench/scale.py started; `IdleSample.line()` is
the arithmetic, without I/O, that tests check on known readings.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from _scale_figures import _range, wire_bytes


class Watched(Protocol):
    """What the bench's `Member` offers to be watched."""

    port: int

    def cpu_ticks(self) -> int: ...
    def rss_mib(self) -> float: ...
    def fds(self) -> int: ...


@dataclass(frozen=True, slots=True)
class IdleSample:
    """One reading, `at_s` into the spell, of the members over the `span_s` before it."""

    members: int
    at_s: float
    span_s: float
    cpu_s: float  # summed over members, over span_s
    rss_mib: list[float]
    fds: list[int]
    connections: int  # established TCP connections with an end on a member's port

    @property
    def cores(self) -> float:
        return self.cpu_s / max(self.span_s, 1e-9)

    def line(self, label: str = "idle") -> str:
        return (
            f"  N={self.members} {label} +{self.at_s:.0f}s: cpu {self.cores:.3f} cores "
            f"over {self.span_s:.0f} s; rss/manager {_range(self.rss_mib, '.0f')} MiB; "
            f"fds/manager {_range([float(f) for f in self.fds], '.0f')}; "
            f"connections {self.connections} "
            f"({self.connections / max(self.members, 1):.1f}/manager)"
        )


def connections(ss_output: str, ports: set[int]) -> int:
    """Established connections with an end on `ports`: sockets between two members show
    twice in `ss` (one per end), so this counts each socket whose *peer* is a member port
    -- the client end of every member-to-member connection."""
    return sum(1 for _, peer in wire_bytes(ss_output, ports) if peer in ports)


async def watch(
    members: Sequence[Watched],
    seconds: float,
    every: float,
    read_ss: Callable[[], str],
    *,
    label: str = "idle",
) -> tuple[float, list[IdleSample]]:
    """Sample `members` every `every` s for `seconds`, printing each sample as it is taken;
    returns the cores over the whole spell and the samples."""
    tick_s = os.sysconf("SC_CLK_TCK")
    ports = {m.port for m in members}
    start = time.monotonic()
    first = last = sum(m.cpu_ticks() for m in members)
    last_at = start
    samples: list[IdleSample] = []
    for k in range(1, max(1, math.ceil(seconds / every - 1e-9)) + 1):
        # At fixed marks from the start, so a late wake-up shortens the next span instead
        # of adding a sliver of a sample at the end.
        await asyncio.sleep(max(0.0, start + min(k * every, seconds) - time.monotonic()))
        now = time.monotonic()
        ticks = sum(m.cpu_ticks() for m in members)
        sample = IdleSample(
            members=len(members),
            at_s=now - start,
            span_s=now - last_at,
            cpu_s=(ticks - last) / tick_s,
            rss_mib=[m.rss_mib() for m in members],
            fds=[m.fds() for m in members],
            connections=connections(read_ss(), ports),
        )
        if every < seconds:
            print(sample.line(label), flush=True)
        samples.append(sample)
        last, last_at = ticks, now
    total_s = max(time.monotonic() - start, 1e-9)
    return (sum(m.cpu_ticks() for m in members) - first) / tick_s / total_s, samples
