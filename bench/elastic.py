"""Elastic deployments against fixed ones on a trace of bursts and idle spells, through real
agents (issue 30, item 6).

Setup: three real agents (`python -m agent agent run`, simulated GPUs `l4:2` each: six GPUs)
formed as the agent tests form them (`tests/agent/harness.py`), the wait line's timeout
raised to 120 s (`[agent] wait_timeout_s`) for cold starts. Three models, each a
deployment of one-GPU mock engines (`python -m agent.mock mock-engine`) whose port opens
`--startup-s` after their process started (as a real engine's does once it has imported
itself and loaded its weights: that is the cold-start delay the goal is measured against;
the prefix model off), answer after `--latency-ms`, and take `MAX_IN_FLIGHT` requests at once.

- **fixed**: each model at its max, two replicas, all day (what an owner without scaling
  runs so the 10:00 burst is served).
- **elastic**: each model `--min-replicas 0 --max-replicas 2`, one replica's worth of
  waiting before another (`--target-waiting 0`), `--scale-down-after 5s --idle-to-zero
  8s` (minutes in production; seconds here so a run is short).

The trace, drawn from `--seed`: `--period` seconds; each model has one burst of
`--burst` seconds at `--rate` requests a second (Poisson arrivals), starting at a third of
the period apart, so the bursts overlap in part and every model is idle most of the
time. Each request enters at a member drawn at random, through the `openai`-shaped chat
route, one token.

Rounds: each round runs the same trace against both modes, in an order that alternates
(fixed, elastic; elastic, fixed; ...). A run deploys its three deployments, waits until the
fixed ones are ready (the elastic ones start at zero), plays the trace, then undeploys
and waits until every replica is gone. GPU-seconds: every 0.5 s the replicas the members'
records list (any state: a starting replica holds its GPU), times their GPUs, summed
over the run from the first request to the last answer.

Printed per mode (medians over rounds, each round in brackets): requests failed (not 200),
p50 and p99 latency (from sending to the whole answer, cold starts included), GPU-seconds
held. Then `ratio:` = fixed GPU-seconds / elastic GPU-seconds, the median of the per-round
ratios (goal >= 2, with elastic p99 within the cold-start delay plus 20 % of it).

    python bench/elastic.py [--seed N] [--rounds K] [--period 60] [--burst 12] [--rate 6]
        [--startup-s 4] [--latency-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import aiohttp

# The repository before this directory: bench/scheduler.py would hide the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netkit.processes import alive
from tests.agent.deploy_harness import formed, post
from tests.agent.harness import Node, engine_pids, eventually, make_node, start_cluster
from tests.workload_manager.cluster_harness import engine_ports

MODELS: Final = ("m0", "m1", "m2")
GPUS: Final = "l4:2"  # per member
MAX_REPLICAS: Final = 2
MAX_IN_FLIGHT: Final = 4
SAMPLE_S: Final = 0.5
WAIT_S: Final = 180.0
MODES: Final = ("fixed", "elastic")


@dataclass
class Run:
    """One mode's run of the trace."""

    mode: str
    latencies: list[float]
    failed: int
    gpu_s: float

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def draw_trace(seed: int, period: float, burst: float, rate: float) -> list[tuple[float, str]]:
    """(when, model) of every request: one Poisson burst per model, a third apart."""
    rng = random.Random(seed)
    arrivals = []
    for i, model in enumerate(MODELS):
        at = i * period / 3
        while True:
            at += rng.expovariate(rate)
            if at > i * period / 3 + burst:
                break
            arrivals.append((at, model))
    return sorted(arrivals)


def member_nodes(root: Path) -> list[Node]:
    nodes = []
    for name in ("a", "b", "c"):
        node = make_node(root, name, GPUS)
        node.extra = ["--log-level", "warn"]
        node.home.mkdir(parents=True)
        low, high = engine_ports()
        (node.home / "nvpair.toml").write_text(
            f"[agent]\nheartbeat_s = 0.5\nwait_timeout_s = 120\n"
            f'[engines]\nport_range = "{low}-{high}"\n'
        )
        (node.home / "nvpair.toml").chmod(0o600)
        nodes.append(node)
    return nodes


@contextlib.asynccontextmanager
async def started(root: Path) -> AsyncIterator[list[Node]]:
    """The members started and formed; every agent and engine gone at the end."""
    nodes = member_nodes(root)
    generator = cast(AsyncGenerator[list[Node], None], start_cluster(nodes))
    try:
        async with contextlib.aclosing(generator) as cluster:
            async for _ in cluster:
                await eventually(lambda: formed(nodes), "every member lists all", within_s=WAIT_S)
                yield nodes
                break
    finally:
        for proc in [n.proc for n in nodes if n.proc is not None and n.proc.returncode is None]:
            proc.kill()
            await proc.wait()
        pids = [pid for n in nodes for pid in engine_pids(n.home).values()]
        with contextlib.suppress(AssertionError):
            await eventually(lambda: not any(alive(p) for p in pids), "the engines gone")


def deployment(model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": model, "engine": "mock", "source": model, "gpus": 1,
        "maxInFlight": MAX_IN_FLIGHT,
        "args": ["--startup-s", str(args.startup_s), "--latency-ms", str(args.latency_ms)],
    }  # fmt: skip
    if mode == "fixed":
        return body | {"replicas": MAX_REPLICAS}
    return body | {
        "minReplicas": 0, "maxReplicas": MAX_REPLICAS, "targetWaiting": 0,
        "scaleDownAfterS": 5, "idleToZeroS": 8,
    }  # fmt: skip


async def held(nodes: list[Node]) -> int:
    """GPUs held by replicas now, as a member's records list them (any state)."""
    replicas = await nodes[0].get("/v1/replicas")
    return sum(len(r.get("devices", [])) or 1 for r in replicas if r["deployment"] in MODELS)


async def all_ready(nodes: list[Node], count: int) -> bool:
    replicas = [r for r in await nodes[0].get("/v1/replicas") if r["deployment"] in MODELS]
    return len(replicas) == count and all(r["state"] == "ready" for r in replicas)


async def run_once(
    nodes: list[Node], mode: str, trace: list[tuple[float, str]], args: argparse.Namespace
) -> Run:
    for model in MODELS:
        status, text = await post(nodes[0], "/v1/deployments", deployment(model, mode, args))
        assert status == 201, text
    if mode == "fixed":
        await eventually(
            lambda: all_ready(nodes, MAX_REPLICAS * len(MODELS)), "fixed ready", within_s=WAIT_S
        )
    else:  # at zero, listed: every member must hold the deployments before the trace

        async def listed() -> bool:
            async with aiohttp.ClientSession() as session:
                for node in nodes:
                    url = f"http://127.0.0.1:{node.ports['facade']}/v1/models"
                    async with session.get(url) as response:
                        ids = {m["id"] for m in (await response.json())["data"]}
                    if not set(MODELS) <= ids:
                        return False
            return True

        await eventually(listed, "every member lists the elastic models", within_s=WAIT_S)
    rng = random.Random(args.seed)
    latencies: list[float] = []
    failed = 0
    gpu_s = 0.0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal gpu_s
        while not done.is_set():
            gpu_s += await held(nodes) * SAMPLE_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), SAMPLE_S)  # a period, not a sync

    async def one(session: aiohttp.ClientSession, at: float, model: str, start: float) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        node = rng.choice(nodes)
        url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        sent = time.monotonic()
        try:
            async with session.post(url, json=body) as response:
                answer = await response.read()
                ok = response.status == 200
                why = f"{response.status} {answer[:160].decode(errors='replace')}"
        except aiohttp.ClientError as exc:
            ok, why = False, repr(exc)
        latencies.append(time.monotonic() - sent)
        failed += 0 if ok else 1
        if not ok:  # what it was told, to stderr: the figures stay the last lines
            print(f"    {model} at {node.name}: {why}", file=sys.stderr)

    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        sampler = asyncio.create_task(sample())
        start = time.monotonic()
        await asyncio.gather(*(one(session, at, model, start) for at, model in trace))
        done.set()
        await sampler
    for model in MODELS:
        code, _, err = await nodes[0].cli("undeploy", model)
        assert code == 0, err

    async def gone() -> bool:
        return await held(nodes) == 0

    await eventually(gone, "every replica gone", within_s=WAIT_S)
    return Run(mode, latencies, failed, gpu_s)


async def main_async(args: argparse.Namespace) -> None:
    trace = draw_trace(args.seed, args.period, args.burst, args.rate)
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    print(
        f"setup: 3 members x {GPUS}, 3 models of 1-GPU mock replicas (startup "
        f"{args.startup_s:g} s, {args.latency_ms:g} ms an answer, {MAX_IN_FLIGHT} at once); "
        f"trace: {len(trace)} requests over {args.period:g} s, a {args.burst:g} s burst at "
        f"{args.rate:g}/s per model, a third of the period apart"
    )
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        async with started(Path(tmp)) as nodes:
            for i in range(args.rounds):
                order = MODES if i % 2 == 0 else MODES[::-1]
                for mode in order:
                    run = await run_once(nodes, mode, trace, args)
                    runs[mode].append(run)
                    print(
                        f"  round {i} {mode:7}: failed {run.failed}, p50 {run.pct(0.5):.2f} s, "
                        f"p99 {run.pct(0.99):.2f} s, GPU-s {run.gpu_s:.0f}",
                        flush=True,
                    )
    for mode in MODES:
        rs = runs[mode]
        print(
            f"{mode:7}: failed {statistics.median(r.failed for r in rs):g} "
            f"{[r.failed for r in rs]}, p50 {statistics.median(r.pct(0.5) for r in rs):.2f} s, "
            f"p99 {statistics.median(r.pct(0.99) for r in rs):.2f} s "
            f"{[round(r.pct(0.99), 2) for r in rs]}, GPU-s "
            f"{statistics.median(r.gpu_s for r in rs):.0f} {[round(r.gpu_s) for r in rs]}"
        )
    ratios = [f.gpu_s / e.gpu_s for f, e in zip(runs["fixed"], runs["elastic"], strict=True)]
    bound = args.startup_s * 1.2
    print(
        f"goal: elastic p99 within the cold start plus 20 % ({bound:.2f} s); "
        f"per-round ratios: {' '.join(f'{r:.2f}' for r in ratios)}"
    )
    print(f"ratio: {statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--period", type=float, default=60.0, help="seconds of trace")
    parser.add_argument("--burst", type=float, default=12.0, help="seconds of each burst")
    parser.add_argument("--rate", type=float, default=6.0, help="requests a second in a burst")
    parser.add_argument("--startup-s", type=float, default=4.0, help="an engine's load time")
    parser.add_argument("--latency-ms", type=float, default=200.0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
