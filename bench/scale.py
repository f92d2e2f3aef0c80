"""The relay at 4..64 members: what one event costs the cluster, measured on loopback.

For each N in `--sizes`, N real `python -m workload_manager` processes on 127.0.0.1, each
with its own identity from one cluster CA, all pinned and peers of each other (the full
mesh the agent sets up). This process plays every member's broker, minimally: it answers
`workloads:snapshot` with an empty view and notes when each broker is told an upsert. Local
events enter at `--origins` members in turn, `--rate` events/s in all, for `--seconds`; the
window closes when every member's broker has been told every event and no outbox holds
one (the duplicates relayed after the last first-seen count too). Per N it prints:

- link deliveries per event: the managers' own `received_remote` counters summed over
  members (every event a manager got from a peer, first seen or duplicate), with the
  first-seen count (`accepted`) and the events peers acknowledged (outbox `sent`);
- bytes on the wire per event: `bytes_sent` of every TCP socket with an end on a member's
  port (`ss -tin`: TLS records, HTTP and TCP payload both ways, not headers of TCP/IP);
- CPU seconds per 1,000 events: utime + stime of the member processes (/proc/PID/stat);
- p50 / p99 / max from an event's entry at its origin to the last member's broker being told
  (`workloads:upsert` read on the manager's stdout: the manager reports no receipt time of
  its own, so the broker's side it stands in for is where receipt is observed);
- the members' CPU, in cores, over `--idle-seconds` of quiet between the warm-up and the
  window (what the mesh costs with no events);
- RSS and open descriptors per manager at the end of the window.

Each size runs each relay of `--relays` in turn (STYLE.md's interleaving): `flood`, the
relay before issue 18 (every member relays a first-seen event to every peer but its sender
and origin, about (N-1)² deliveries), and `ring`, today's (the origin sends to every peer, a
member forwards a first-seen event to one ring successor, about 2(N-1)). A final
`ratio: X.XX` is flood's deliveries per event over ring's at the largest N both ran at
(subject over baseline, higher is better; with one relay only, its deliveries per event
over N, about 2 for ring).

With `--agents 4,16`, before `ratio:`, the full agents' membership at those counts
(formation, heartbeat bytes per member per beat, a new member, a killed one):
bench/_scale_agents.py, which runs by itself too.

    python bench/scale.py [--sizes 4,16,32,64] [--rate 20] [--seconds 10] [--origins 4]
                          [--idle-seconds 3] [--sample-seconds 30] [--hold-seconds 0]
                          [--agents 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _idle_watch import watch
from _scale_figures import (
    DELIVERIES,
    FIRST_SEEN,
    SizeFigures,
    counter_delta,
    cpu_ticks,
    outbox_delta,
    ratio,
    rss_kib,
    wire_bytes,
    wire_delta,
)

from certs import ClusterDir
from certs.identity import load_cert

TICK_S = os.sysconf("SC_CLK_TCK")
SETTLE_S = 60.0  # the most the window waits, after the last event, for every member told


def free_port(taken: set[int]) -> int:
    """A port below the kernel's ephemeral range (so no outgoing connection takes it before
    the manager binds it), free now and not handed out before in this run."""
    for _ in range(1000):
        port = random.randrange(20_000, 32_000)
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


def event_frame(origin: str, wid: str) -> bytes:
    """One submitted event, about 300 bytes, as the facade would enter it."""
    record = {
        "id": wid,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "engine": "vllm",
        "runId": f"{origin[:12]}-scale",
        "state": "queued",
        "originatedFrom": origin,
        "createdAt": int(time.time() * 1000),
        "requesterId": "team-search",
        "seq": 1,
    }
    params = {"workloadInfo": record}
    return json.dumps({"jsonrpc": "2.0", "method": "workload:submitted", "params": params}).encode()


class Member:
    """A manager process whose broker side this process plays."""

    def __init__(self, name: str, cluster: ClusterDir, port: int, relay: str = "ring") -> None:
        self.name = name  # prefixes the ids of the events entered here
        self.relay = relay  # NVPAIR_WM_RELAY: ring (the relay now) or flood (the one before)
        self.cluster = cluster
        self.port = port
        self.arrivals: dict[bytes, float] = {}  # workload id -> when this broker was told
        self.proc: asyncio.subprocess.Process
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        node_id = cluster.node_id()
        assert node_id is not None
        self.node_id = node_id

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "workload_manager", "--cluster-dir", str(self.cluster.path),
            "--port", str(self.port), "--log-level", "warn",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=16 * 1024 * 1024,
            env={**os.environ, "NVPAIR_WM_BIND": "127.0.0.1", "NVPAIR_WM_RELAY": self.relay},
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read())
        await self.request("manager:status")  # answered once the channel is up

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            if b'"workloads:upsert"' in line:
                start = line.index(b'"id":"') + 6
                self.arrivals.setdefault(line[start : line.index(b'"', start)], time.monotonic())
                continue
            frame = json.loads(line)
            if frame.get("method") == "workloads:snapshot":
                reply = {"jsonrpc": "2.0", "result": {}, "id": frame["id"]}
                self.send(json.dumps(reply).encode())
            elif frame.get("id") in self._pending:
                self._pending.pop(frame["id"]).set_result(frame)

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")

    async def request(self, method: str, params: Any = None) -> Any:
        self._next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": self._next_id}
        if params is not None:
            message["params"] = params
        self.send(json.dumps(message).encode())
        reply = await asyncio.wait_for(future, 120)
        assert "result" in reply, reply
        return reply["result"]

    async def set_peers(self, peers: list[Member]) -> None:
        listed = [{"nodeId": p.node_id, "host": "127.0.0.1", "port": p.port} for p in peers]
        await self.request("peers:set", {"peers": listed})

    def cpu_ticks(self) -> int:
        return cpu_ticks(Path(f"/proc/{self.proc.pid}/stat").read_text())

    def rss_mib(self) -> float:
        return rss_kib(Path(f"/proc/{self.proc.pid}/status").read_text()) / 1024

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def make_cluster(root: Path, count: int, relay: str = "ring") -> list[Member]:
    """One CA on m0, every member issued from it, every member pinned everywhere."""
    first = ClusterDir(root / "m0")
    first.init("scale", "m0", ["127.0.0.1"])
    for i in range(1, count):
        first.issue(f"m{i}", root / f"m{i}", ["127.0.0.1"])
    pems = [load_cert(pem) for pem in first.pins.pems()]
    for i in range(1, count):
        pins = ClusterDir(root / f"m{i}").pins
        for cert in pems:
            pins.pin(cert)
    taken: set[int] = set()
    return [
        Member(f"m{i}", ClusterDir(root / f"m{i}"), free_port(taken), relay) for i in range(count)
    ]


def read_ss() -> str:
    done = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=False
    )
    return done.stdout


async def until_told(members: list[Member], wids: list[bytes], within_s: float) -> bool:
    """Until every member's broker was told every one of `wids` (bar its own); False when
    `within_s` passed first."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(sum(w in m.arrivals for w in wids) >= len(wids) - _own(m, wids) for m in members):
            return True
        await asyncio.sleep(0.05)
    return False


async def drained(members: list[Member], deadline: float) -> list[Any]:
    """Every member's `manager:status` once no outbox holds an event (or at `deadline`)."""
    while True:
        statuses = await asyncio.gather(*(m.request("manager:status") for m in members))
        queued = sum(int(p["queued"]) for s in statuses for p in s.get("broadcast", []))
        if queued == 0 or time.monotonic() >= deadline:
            return list(statuses)
        await asyncio.sleep(0.2)


def _own(member: Member, wids: list[bytes]) -> int:
    # An origin's broker entered its own events; its manager does not tell it them again.
    prefix = f"{member.name}-".encode()
    return sum(w.startswith(prefix) for w in wids)


async def measure(args: argparse.Namespace, root: Path, n: int, relay: str = "ring") -> SizeFigures:
    members = make_cluster(root, n, relay)
    await asyncio.gather(*(m.start() for m in members))
    try:
        await asyncio.gather(*(m.set_peers([p for p in members if p is not m]) for m in members))
        origins = members[: min(args.origins, n)]
        warm = [f"{o.name}-warm".encode() for o in origins]
        for origin, warm_id in zip(origins, warm, strict=True):
            origin.send(event_frame(origin.node_id, warm_id.decode()))
        # Connections and catch-up done before the window opens.
        if not await until_told(members, warm, 120):
            raise RuntimeError(f"N={n}: the warm-up events did not reach every member in 120 s")
        ports = {m.port for m in members}
        idle_cores, _ = await watch(members, args.idle_seconds, args.sample_seconds, read_ss)
        before = await asyncio.gather(*(m.request("manager:status") for m in members))
        ticks_before = [m.cpu_ticks() for m in members]
        wire_before = wire_bytes(read_ss(), ports)
        total = max(1, round(args.rate * args.seconds))
        sent: dict[bytes, tuple[Member, float]] = {}
        start = time.monotonic()
        for i in range(total):
            delay = start + i / args.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            origin = origins[i % len(origins)]
            name = f"{origin.name}-{i}"
            sent[name.encode()] = (origin, time.monotonic())
            origin.send(event_frame(origin.node_id, name))
        offered = total / max(time.monotonic() - start, 1e-9)
        await until_told(members, list(sent), SETTLE_S)
        # Every broker told is not every relay done: the duplicates still queued for peers
        # count too, so the readings wait for the outboxes to drain.
        after = await drained(members, time.monotonic() + SETTLE_S)
        window_s = time.monotonic() - start
        ticks_after = [m.cpu_ticks() for m in members]
        wire_after = wire_bytes(read_ss(), ports)
        if args.hold_seconds > 0:  # the readings over time after the window (item 4)
            await watch(members, args.hold_seconds, args.sample_seconds, read_ss, label="hold")
        spreads: list[float] = []
        missing = 0
        for wid, (origin, at) in sent.items():
            told = [m.arrivals.get(wid) for m in members if m is not origin]
            missing += sum(t is None for t in told)
            if told and None not in told:  # an event some member lacks counts as missing
                spreads.append((max(t for t in told if t is not None) - at) * 1000)
        return SizeFigures(
            members=n,
            relay=relay,
            events=total,
            offered_rate=offered,
            deliveries=counter_delta(before, after, DELIVERIES),
            first_seen=counter_delta(before, after, FIRST_SEEN),
            outbox_sent=outbox_delta(before, after),
            retried=outbox_delta(before, after, "retried"),
            wire_bytes=wire_delta(wire_before, wire_after),
            cpu_s=(sum(ticks_after) - sum(ticks_before)) / TICK_S,
            window_s=window_s,
            idle_cores=idle_cores,
            spreads_ms=spreads,
            missing=missing,
            rss_mib=[m.rss_mib() for m in members],
            fds=[m.fds() for m in members],
        )
    finally:
        await asyncio.gather(*(m.stop() for m in members))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,32,64", help="member counts, comma-separated")
    parser.add_argument("--rate", type=float, default=20.0, help="events/s offered in all")
    parser.add_argument("--seconds", type=float, default=10.0, help="per size")
    parser.add_argument("--origins", type=int, default=4, help="members events enter at")
    parser.add_argument(
        "--idle-seconds", type=float, default=3.0, help="quiet spell measured before the window"
    )
    parser.add_argument(
        "--relays",
        default="flood,ring",
        help="relays run per size, in turn (NVPAIR_WM_RELAY): flood (before), ring (now)",
    )
    parser.add_argument(
        "--sample-seconds", type=float, default=30.0, help="idle and hold readings this often"
    )
    parser.add_argument(
        "--hold-seconds", type=float, default=0.0, help="quiet spell sampled after the window"
    )
    parser.add_argument("--agents", default="0", help="full agents too (bench/_scale_agents.py)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    relays = [r.strip() for r in args.relays.split(",") if r.strip()]
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            for relay in relays:  # interleaved: both relays at each size, on the same machine
                result = asyncio.run(measure(args, Path(tmp) / f"n{n}-{relay}", n, relay))
                print(result.line(), flush=True)
                figures.append(result)
    if args.agents != "0":  # the full-agent part: membership at these agent counts
        from _scale_agents import report as agents_report

        agents_report(args.agents)
    print(f"ratio: {ratio(figures):.2f}")


if __name__ == "__main__":
    main()
