"""Routing on engine load: p99 latency with load-aware routing against round-robin (issue 13).

Three mock-engine replicas of one model, real `python -m agent mock-engine` processes: two
answer a request in about 50 ms with up to 16 at once; the third is slowed down -- 4x fewer
tokens/s and at most 2 requests at once, so it holds a queue (`vllm:num_requests_waiting`)
as soon as it gets its third of the traffic. A steady open-loop load (requests launched at
a fixed rate whatever the answers, 8 tokens each) is routed by:
- baseline: round-robin over the three;
- subject: load-aware -- `agent.engines.load.LoadScraper` reads each engine's `/metrics`
  once a second and `scheduler.rank_replicas` picks a replica per request, with the pending
  count of each replica raised when a request is sent and lowered when it ends.
Routing happens here, client-side, with the same functions the facade will call; the
facade itself is not in the loop. Rounds alternate (A B, B A, ...), each on an engine set
drained of the last round's work. Latency counts from each request's scheduled start, so a
late launch is not hidden. `ratio:` is round-robin p99 / load-aware p99 (goal >= 1.5).

    python bench/routing.py [--rate 40] [--seconds 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
from _interleave import report

# The repository before this directory: bench/scheduler.py would hide the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engines.load import LoadScraper
from scheduler import ReplicaView, ReportedLoad, rank_replicas

MODEL = "bench-model"
FAST = ("--latency-ms", "10", "--tokens-per-s", "200", "--max-concurrency", "16")
SLOW = ("--latency-ms", "10", "--tokens-per-s", "50", "--max-concurrency", "2")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

Router = Callable[[], str]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class LoadAware:
    """The facade's decision, done here: rank on the scraped loads and our pending work."""

    def __init__(self, urls: dict[str, str], scraper: LoadScraper) -> None:
        self.urls = urls
        self.scraper = scraper
        self.pending: Counter[str] = Counter()

    def pick(self) -> str:
        now_ms = time.time() * 1000
        loads = self.scraper.current()
        views = [
            ReplicaView(
                rid,
                node_id="local",
                model=MODEL,
                kind="mock",
                load=ReportedLoad(loads[rid].running, loads[rid].waiting, loads[rid].kv_usage)
                if rid in loads
                else None,
                load_age_ms=now_ms - loads[rid].at_ms if rid in loads else None,
            )
            for rid in self.urls
        ]
        best = rank_replicas(MODEL, views, self.pending).best
        assert best is not None, "no replica ready"
        return best[0]


async def offered_load(
    session: aiohttp.ClientSession,
    urls: dict[str, str],
    pick: Router,
    pending: Counter[str],
    *,
    rate: float,
    seconds: float,
) -> tuple[list[float], Counter[str]]:
    """Launch `rate` requests/s for `seconds`, each to `pick()`; their latencies (s)."""
    latencies: list[float] = []
    sent: Counter[str] = Counter()

    async def one(rid: str, scheduled: float) -> None:
        pending[rid] += 1
        try:
            async with session.post(urls[rid] + "/v1/chat/completions", json=BODY) as r:
                await r.read()
                assert r.status == 200, r.status
        finally:
            pending[rid] -= 1
        latencies.append(time.perf_counter() - scheduled)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        rid = pick()
        sent[rid] += 1
        tasks.append(asyncio.create_task(one(rid, scheduled)))
    await asyncio.gather(*tasks)
    return latencies, sent


async def main_async(args: argparse.Namespace) -> None:
    ports = {"fast-a": free_port(), "fast-b": free_port(), "slow": free_port()}
    urls = {rid: f"http://127.0.0.1:{port}" for rid, port in ports.items()}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent",
            "mock-engine",
            *("--model", MODEL, "--port", str(port)),
            *(SLOW if rid == "slow" else FAST),
            env=dict(os.environ),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for rid, port in ports.items()
    ]
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
            LoadScraper(lambda: urls) as scraper,
        ):
            while len(scraper.current()) < len(urls):  # every engine is up and read
                await scraper.scrape()
                await asyncio.sleep(0.1)
            scraping = asyncio.create_task(scraper.run())
            aware = LoadAware(urls, scraper)
            cycle = itertools.cycle(sorted(urls))
            routers: dict[str, tuple[Router, Counter[str]]] = {
                "round-robin": (lambda: next(cycle), Counter()),
                "load-aware": (aware.pick, aware.pending),
            }
            p99s: dict[str, list[float]] = {name: [] for name in routers}
            p50s: dict[str, list[float]] = {name: [] for name in routers}
            to_slow: dict[str, list[int]] = {name: [] for name in routers}
            await offered_load(session, urls, aware.pick, aware.pending, rate=args.rate, seconds=1)
            for i in range(args.rounds):
                order = list(routers) if i % 2 == 0 else list(routers)[::-1]
                for name in order:
                    pick, pending = routers[name]
                    lat, sent = await offered_load(
                        session, urls, pick, pending, rate=args.rate, seconds=args.seconds
                    )
                    p50s[name].append(percentile(lat, 0.50) * 1000)
                    p99s[name].append(percentile(lat, 0.99) * 1000)
                    to_slow[name].append(sent["slow"])
            scraping.cancel()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
    total = int(args.rate * args.seconds)
    print(f"offered load: {args.rate:g} requests/s for {args.seconds:g} s per round, 8 tokens each")
    for name in routers:
        print(
            f"{name}: p50 median {statistics.median(p50s[name]):.0f} ms, "
            f"p99 median {statistics.median(p99s[name]):.0f} ms "
            f"(p99 rounds: {' '.join(f'{v:.0f}' for v in p99s[name])}); "
            f"sent to the slow replica: {' '.join(map(str, to_slow[name]))} of {total}"
        )
    # report() wants higher-is-better rates: 1/p99 per minute, so its ratio (subject /
    # baseline) is round-robin p99 / load-aware p99.
    report(
        [60_000 / v for v in p99s["round-robin"]],
        [60_000 / v for v in p99s["load-aware"]],
        unit="/min (1 / p99)",
        label="1/p99, round-robin (baseline) vs load-aware (subject):",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
