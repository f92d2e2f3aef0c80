"""The scale bench's full-agent part (issue 18, item 1): membership at N real agents.

For each N in `--agents`, N real agents (`python -m agent agent run`, simulated GPUs
`h100-80gb-sxm:8`) on 127.0.0.1, formed as the agent tests form them
(`tests/agent/harness.py`: `cluster init` on the first, invite and join over the network for
the others), each home's nvpair.toml setting `[agent] heartbeat_s`. Per N, four lines
prefixed `agents N=..:`:

- formed: from the last joiner up until every member lists N nodes, all reachable
  (`GET /v1/nodes` on each member, ~0.1 s polling);
- heartbeat: after formation and a settle of 3 beats, `bytes_sent` of every TCP socket with
  an end on a member's node port (`ss -tin`, both sockets of each connection) over `--beats`
  beats, per member per beat: the mean over the window, and the median beat (a beat where
  no member renewed its record; each renews an unchanged one every 30 s, `REFRESH_S`, and
  those beats cost more). The node port also carries the anti-entropy digests (every 5 s)
  and the probes, so those are in the figure too; nothing else changes meanwhile;
- new member: one more joins (invite and join as the others did) and starts; from its
  being up until every member lists its record, and until every member lists it reachable;
- killed: that member gets SIGKILL; until every other member lists it unreachable.

    python bench/_scale_agents.py [--agents 4,16] [--heartbeat-s 1.0] [--beats 10]

bench/scale.py runs it too with `--agents`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
from _scale_figures import percentile, wire_bytes, wire_delta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.agent.harness import Node, join, make_node, start_cluster
from tests.reliability.cluster import manager_pid, process_gone

GPUS = "h100-80gb-sxm:8"
POLL_S = 0.1
SETTLE_BEATS = 3
WAIT_S = 120.0  # the most any one condition is waited for before the bench gives up


def per_member_beat(total_bytes: int, members: int, beats: int) -> float:
    """Wire bytes over the window per member per beat. `total_bytes` sums `bytes_sent` of
    both sockets of every connection, so each byte counts once, at its sender: this is what
    one member sends per beat, on average."""
    if members <= 0 or beats <= 0:
        raise ValueError("members and beats must be positive")
    return total_bytes / members / beats


async def views(session: aiohttp.ClientSession, nodes: list[Node]) -> list[dict[str, bool]]:
    """Each member's `GET /v1/nodes` as {nodeId: reachable}; {} for one that did not answer."""

    async def one(node: Node) -> dict[str, bool]:
        try:
            async with session.get(node.api + "/v1/nodes", headers=node.owner) as response:
                if response.status != 200:
                    return {}
                listed = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        return {n["nodeId"]: bool(n["reachable"]) for n in listed}

    return list(await asyncio.gather(*(one(n) for n in nodes)))


async def until(check: Callable[[], Awaitable[bool]], what: str) -> float:
    """Seconds until `check()` holds, polled every POLL_S; RuntimeError after WAIT_S."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > WAIT_S:
            raise RuntimeError(f"not within {WAIT_S:.0f} s: {what}")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - start


def read_ss() -> str:
    done = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=False
    )
    return done.stdout


def make_nodes(root: Path, count: int, heartbeat_s: float) -> list[Node]:
    nodes = []
    for i in range(count):
        node = make_node(root, f"a{i}", GPUS)
        node.extra = ["--log-level", "warn"]  # after the harness's own: the last one counts
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text(f"[agent]\nheartbeat_s = {heartbeat_s}\n")
        nodes.append(node)
    return nodes


async def measure(root: Path, n: int, heartbeat_s: float, beats: int) -> list[str]:
    """The four lines for N agents."""
    nodes = make_nodes(root, n + 1, heartbeat_s)
    members, extra = nodes[:n], nodes[n]
    generator = cast(AsyncGenerator[list[Node], None], start_cluster(members))
    lines: list[str] = []
    async with contextlib.aclosing(generator) as started, aiohttp.ClientSession() as session:
        async for _ in started:  # every member up: the last joiner's clock starts
            try:
                lines = await _scenario(session, members, extra, heartbeat_s, beats)
            finally:
                await _stop(extra)
    return [f"agents N={n}: {line}" for line in lines]


async def _scenario(
    session: aiohttp.ClientSession, members: list[Node], extra: Node, hb: float, beats: int
) -> list[str]:
    n = len(members)
    lines = []
    ids = {await m.node_id() for m in members}

    async def all_list_all() -> bool:
        return all(set(v) == ids and all(v.values()) for v in await views(session, members))

    formed = await until(all_list_all, f"every member lists {n} reachable")
    lines.append(f"formed: every member lists {n} reachable {formed:.2f} s after the last joiner")

    await asyncio.sleep(SETTLE_BEATS * hb)  # a measurement window, not synchronisation
    ports = {m.ports["node"] for m in members}
    per_beat: list[int] = []  # bytes on the node ports in each beat of the window
    reading = wire_bytes(read_ss(), ports)
    start = time.monotonic()
    for beat in range(1, beats + 1):
        await asyncio.sleep(max(0.0, start + beat * hb - time.monotonic()))  # the window
        previous, reading = reading, wire_bytes(read_ss(), ports)
        per_beat.append(wire_delta(previous, reading))
    total = sum(per_beat)
    median = per_member_beat(round(percentile([float(b) for b in per_beat], 0.5)), n, 1)
    lines.append(
        f"heartbeat: {per_member_beat(total, n, beats):,.0f} B per member per beat with nothing "
        f"changing, median beat {median:,.0f} B "
        f"({total:,} B on the node ports over {beats} beats of {hb:g} s)"
    )

    t0 = time.monotonic()
    await join(members[0], extra)
    await extra.start()
    up = time.monotonic() - t0
    new_id = await extra.node_id()
    everyone = [*members, extra]

    async def all_have_record() -> bool:
        return all(new_id in v for v in await views(session, everyone))

    async def all_reach_it() -> bool:
        return all(v.get(new_id, False) for v in await views(session, everyone))

    record = await until(all_have_record, "every member lists the new one's record")
    reachable = record + await until(all_reach_it, "every member lists the new one reachable")
    lines.append(
        f"new member: up {up:.2f} s after its invite; its record at all {n + 1} "
        f"{record:.2f} s after it was up, reachable at all {reachable:.2f} s after"
    )

    assert extra.proc is not None
    child = manager_pid(extra.proc.pid)
    extra.proc.kill()
    await extra.proc.wait()

    async def all_see_it_gone() -> bool:
        return all(not v.get(new_id, True) for v in await views(session, members))

    gone = await until(all_see_it_gone, "every other member lists the killed one unreachable")
    lines.append(f"killed (kill -9): unreachable at all {n} others {gone:.2f} s after")
    if child is not None:  # its orphaned manager exits on its own; no stray process after
        await until(_gone(child), "the killed member's orphaned manager exits")
    return lines


def _gone(pid: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return process_gone(pid)

    return check


async def _stop(node: Node) -> None:
    if node.proc is not None and node.proc.returncode is None:
        await node.stop()


def report(sizes: str, heartbeat_s: float = 1.0, beats: int = 10) -> list[str]:
    """Run each size of `sizes` (comma-separated) in turn, printing its lines as they come."""
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in sizes.split(",") if s.strip()):
            for line in asyncio.run(measure(Path(tmp) / f"agents{n}", n, heartbeat_s, beats)):
                print(line, flush=True)
                lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="16", help="agent counts, comma-separated")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="[agent] heartbeat_s")
    parser.add_argument("--beats", type=int, default=10, help="beats the bytes are read over")
    args: Any = parser.parse_args(argv)
    report(args.agents, args.heartbeat_s, args.beats)


if __name__ == "__main__":
    main()
