"""Peak memory and open descriptors of every agent and workload manager of a fault cluster,
sampled from /proc while a scenario runs: the long tier's figures, and the soak's evidence
that nothing grows."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .cluster import Member, manager_pid

__all__ = ["Sample", "Usage", "sampling"]

INTERVAL_S: Final = 0.5


@dataclass(frozen=True)
class Sample:
    """One process at one moment."""

    at: float  # loop time
    rss_kib: int
    fds: int


@dataclass
class Usage:
    """Every sample, per process ("a agent", "a manager" ...)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def peak_rss_mib(self) -> dict[str, float]:
        return {name: max(s.rss_kib for s in got) / 1024 for name, got in self.samples.items()}

    def peak_fds(self) -> dict[str, int]:
        return {name: max(s.fds for s in got) for name, got in self.samples.items()}

    def line(self) -> str:
        """`peak RSS / fds` per process kind, worst member first, for a figures line."""
        parts = []
        for kind in ("agent", "manager"):
            rss = [v for k, v in self.peak_rss_mib().items() if k.endswith(kind)]
            fds = [v for k, v in self.peak_fds().items() if k.endswith(kind)]
            if rss:
                parts.append(f"{kind} peak RSS {max(rss):.0f} MiB, fds {max(fds)}")
        return "; ".join(parts) or "no samples"


def read(pid: int) -> tuple[int, int] | None:
    """(resident KiB, open descriptors) of `pid`, or None when it is gone."""
    base = Path("/proc") / str(pid)
    try:
        status = (base / "status").read_text()
        fds = len(os.listdir(base / "fd"))
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]), fds
    return None  # a zombie has no VmRSS


@contextlib.asynccontextmanager
async def sampling(members: list[Member], interval_s: float = INTERVAL_S) -> AsyncIterator[Usage]:
    """Sample every running agent and manager every `interval_s` while the block runs."""
    usage = Usage()
    loop = asyncio.get_running_loop()

    def take() -> None:
        for member in members:
            proc = member.node.proc
            if proc is None or proc.returncode is not None:
                continue
            for kind, pid in (("agent", proc.pid), ("manager", manager_pid(proc.pid))):
                got = read(pid) if pid is not None else None
                if got is not None:
                    usage.samples.setdefault(f"{member.name} {kind}", []).append(
                        Sample(loop.time(), *got)
                    )

    async def run() -> None:
        while True:
            take()
            await asyncio.sleep(interval_s)  # the sampling period, not a wait for a result

    task = asyncio.create_task(run())
    try:
        yield usage
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        take()
