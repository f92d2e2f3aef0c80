"""The inference facade's cost: added latency and throughput against an instant engine.

Two agents (real `python -m agent agent run` processes, paired over the network), each with
a mock engine that answers at once (`--latency-ms 0`): A's serves `local-model`, B's
`remote-model`. Measured the way LLM gateways are compared (Bifrost, Portkey, LiteLLM):
non-streaming chat requests on 127.0.0.1, the same request straight to the engine
(baseline) and through A's facade (subject: placed by the scheduler, three job events,
relayed to every member), in paired rounds of alternating order.

- sequential, local: one request at a time; the added latency is the median over rounds of
  (facade p50 - direct p50), and p99 likewise;
- sequential, forwarded: through A to B's engine over the node API (mTLS), against B's
  engine direct;
- 16 in flight, local: requests/s through the facade / requests/s direct -- the last line,
  `ratio:`. On two cores the client, the facade and the engine share the CPU; a byte pipe
  (`_byte_pipe.py`: no HTTP parsed, nothing scheduled or recorded) is measured in the same
  rounds as the ceiling any proxy process reaches here, and the facade against it.

With `--tracing`, a third agent T (a cluster of its own, A's engine) traces every request
(`[tracing]`, sampling all) to an OTLP/HTTP sink (`_otlp_sink.py`), and T's facade is
measured against A's in the same rounds: the added latency of sequential requests, and the
throughput with 16 in flight -- then the last line, `ratio:`, is traced / untraced -- with
how many spans T exported and dropped.

With `--old PATH` (a checkout of the code before a change, e.g. `git worktree add PATH REV`),
a second pair of agents runs that code (`PYTHONPATH=PATH`, started in PATH) beside A and B,
with the same engines, and every figure is printed for it too, measured in the same rounds:
the same bench on the code before the change, on the same machine at the same time.

    python bench/facade.py [--requests 400] [--rounds 7] [--tracing] [--old PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from _interleave import report

IN_FLIGHT = 16  # the throughput block


async def pair(
    first: str,
    second: str,
    ports: dict[str, dict[str, int]],
    envs: dict[str, dict[str, str]],
    cwd: dict[str, str | None],
    agent_args: Callable[[str], list[str]],
) -> list[asyncio.subprocess.Process]:
    """A cluster of two agents: `first` makes it, `second` joins it over the network."""
    await run("cluster", "init", "--name", f"bench-{first}", env=envs[first], cwd=cwd[first])
    procs = [await run(*agent_args(first), env=envs[first], wait=False, cwd=cwd[first])]
    await asyncio.sleep(3)
    invite = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        "cluster",
        "invite",
        env=envs[first],
        cwd=cwd[first],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    token = (await invite.communicate())[0].decode().strip()
    address = f"127.0.0.1:{ports[first]['node']}"
    await run("cluster", "join", address, token, env=envs[second], cwd=cwd[second])
    procs.append(await run(*agent_args(second), env=envs[second], wait=False, cwd=cwd[second]))
    return procs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def run(
    *args: str, env: dict[str, str], wait: bool = True, cwd: str | None = None
) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    if wait:
        await proc.wait()
    return proc


async def rate(
    session: aiohttp.ClientSession, url: str, model: str, count: int, in_flight: int
) -> tuple[float, list[float]]:
    """Requests/s with `in_flight` at a time, and each request's latency."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    remaining = count
    latencies: list[float] = []

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            async with session.post(url, json=body) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - start), latencies


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of the whole machine since boot, every CPU (`/proc/stat`)."""
    first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, first[1:9])
    every = user + nice + system + idle + iowait + irq + softirq + steal
    return every - idle - iowait, every


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values`, in ms."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


async def sequential(
    session: aiohttp.ClientSession,
    label: str,
    direct: tuple[str, str],
    subjects: dict[str, tuple[str, str]],
    args: argparse.Namespace,
) -> None:
    """Paired rounds one request at a time, every subject beside the same baseline, the
    order turning each round; prints each subject's added p50 and p99 (medians of the
    per-round differences) with the direct figures."""
    added50: dict[str, list[float]] = {name: [] for name in subjects}
    added99: dict[str, list[float]] = {name: [] for name in subjects}
    direct50: list[float] = []
    sides = [("base", direct), *subjects.items()]
    for i in range(args.rounds):
        lat: dict[str, list[float]] = {}
        turn = i % len(sides)
        for which, (url, model) in sides[turn:] + sides[:turn]:
            lat[which] = (await rate(session, url, model, args.requests, 1))[1]
        for name in subjects:
            added50[name].append(pct(lat[name], 0.5) - pct(lat["base"], 0.5))
            added99[name].append(pct(lat[name], 0.99) - pct(lat["base"], 0.99))
        direct50.append(pct(lat["base"], 0.5))
    for name in subjects:
        print(
            f"{label}{'' if name == 'subject' else f' [{name}]'}: added latency p50 "
            f"{statistics.median(added50[name]):.2f} ms, p99 "
            f"{statistics.median(added99[name]):.2f} ms (direct p50 "
            f"{statistics.median(direct50):.2f} ms; per-round added p50: "
            f"{' '.join(f'{a:.2f}' for a in added50[name])})"
        )


async def main_async(args: argparse.Namespace, root: Path) -> None:
    engine_ports = {"a": free_port(), "b": free_port()}
    engines = (("a", "local-model", "0"), ("b", "remote-model", "0"))
    procs = [
        await run(
            "mock-engine",
            *("--port", str(engine_ports[key]), "--model", model, "--latency-ms", latency),
            env=dict(os.environ),
            wait=False,
        )
        for key, model, latency in engines
    ]

    def agent_args(name: str) -> list[str]:
        p = ports[name]
        return [
            "agent",
            "run",
            "--name",
            name,
            "--log-level",
            "warn",
            "--simulate-gpus",
            "l4:2",
            "--engine",
            f"vllm=http://127.0.0.1:{engine_ports[name]}",
            "--manager-port",
            str(p["manager"]),
            "--node-port",
            str(p["node"]),
            "--api-port",
            str(p["api"]),
            "--facade-port",
            str(p["facade"]),
        ]

    pipe_port = free_port()
    procs.append(
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).with_name("_byte_pipe.py")),
            *(str(engine_ports["a"]), str(pipe_port)),
        )
    )
    names = "ab" + ("t" if args.tracing else "") + ("op" if args.old else "")
    ports = {name: {k: free_port() for k in ("manager", "node", "api", "facade")} for name in names}
    envs = {
        name: {**os.environ, "NVPAIR_HOME": str(root / name), "NVPAIR_BIND": "127.0.0.1"}
        for name in names
    }
    engine_ports["t"] = engine_ports["a"]  # T calls A's engine
    engine_ports["o"], engine_ports["p"] = engine_ports["a"], engine_ports["b"]  # O, P: old A, B
    cwd: dict[str, str | None] = dict.fromkeys(names)
    for name in "op" if args.old else "":
        envs[name]["PYTHONPATH"] = args.old  # the old code, ahead of the installed
        cwd[name] = args.old  # `-m` puts the working directory first
    if args.tracing:
        sink = free_port()
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).with_name("_otlp_sink.py")), str(sink)
            )
        )
        (root / "t").mkdir(mode=0o700)
        (root / "t" / "nvpair.toml").write_text(
            f'[tracing]\notlp_endpoint = "http://127.0.0.1:{sink}/v1/traces"\n'
        )
    try:
        for first, second in ("ab", "op") if args.old else ("ab",):
            procs += await pair(first, second, ports, envs, cwd, agent_args)
        facade = f"http://127.0.0.1:{ports['a']['facade']}/v1/chat/completions"
        old = f"http://127.0.0.1:{ports['o']['facade']}/v1/chat/completions" if args.old else ""
        traced = ""
        if args.tracing:
            traced = f"http://127.0.0.1:{ports['t']['facade']}/v1/chat/completions"
            await run("cluster", "init", "--name", "traced", env=envs["t"])
            procs.append(await run(*agent_args("t"), env=envs["t"], wait=False))

        def direct(port: str) -> str:
            return f"http://127.0.0.1:{engine_ports[port]}/v1/chat/completions"

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=IN_FLIGHT * 2)
        ) as session:
            for _ in range(100):  # until A's facade knows every engine (and T's its one)
                async with session.get(f"http://127.0.0.1:{ports['a']['facade']}/v1/models") as r:
                    models = await r.text()
                if args.tracing:
                    try:
                        async with session.get(traced.replace("chat/completions", "models")) as r:
                            ready_t = "local-model" in await r.text()
                    except aiohttp.ClientError:  # T is still starting
                        ready_t = False
                    models += "" if ready_t else "T-not-ready"
                if args.old:
                    try:
                        async with session.get(old.replace("chat/completions", "models")) as r:
                            text = await r.text()
                        ready_o = "remote-model" in text and "local-model" in text
                    except aiohttp.ClientError:  # O is still starting
                        ready_o = False
                    models += "" if ready_o else "O-not-ready"
                ready = "remote-model" in models and "local-model" in models
                if ready and "-not-ready" not in models:
                    break
                await asyncio.sleep(0.2)
            warm: tuple[tuple[str, str], ...] = (
                (direct("a"), "local-model"),
                (direct("b"), "remote-model"),
            )
            if args.tracing:
                warm += ((traced, "local-model"),)
            if args.old:
                warm += ((old, "local-model"), (old, "remote-model"))
            for url, model in (*warm, (facade, "local-model"), (facade, "remote-model")):
                await rate(session, url, model, 100, 4)
            for label, engine, model in (
                ("sequential, local", "a", "local-model"),
                ("sequential, forwarded", "b", "remote-model"),
            ):
                subjects = {"subject": (facade, model)}
                if args.old:
                    subjects["old code"] = (old, model)
                await sequential(session, label, (direct(engine), model), subjects, args)
            if args.tracing:
                await sequential(
                    session,
                    "sequential, local, traced (T) vs untraced (A)",
                    (facade, "local-model"),
                    {"subject": (traced, "local-model")},
                    args,
                )
            pipe = f"http://127.0.0.1:{pipe_port}/v1/chat/completions"
            rates: dict[str, list[float]] = {
                "base": [], "subject": [], "pipe": [], "traced": [], "old": []
            }  # fmt: skip
            sides = [("base", direct("a")), ("subject", facade), ("pipe", pipe)]
            sides += [("traced", traced)] if args.tracing else []
            sides += [("old", old)] if args.old else []
            # The whole machine's CPU over each side's measurements (every process: client,
            # agents, managers, engine), to tell a proxy that waits from one that works.
            busy = dict.fromkeys(rates, 0)
            ticks = dict.fromkeys(rates, 0)
            for i in range(args.rounds):
                turn = i % len(sides)
                for which, url in sides[turn:] + sides[:turn]:  # each first in turn
                    before = machine_ticks()
                    value, _ = await rate(session, url, "local-model", args.requests, IN_FLIGHT)
                    after = machine_ticks()
                    rates[which].append(value)
                    busy[which] += after[0] - before[0]
                    ticks[which] += after[1] - before[1]
            tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
            cpu = {
                which: (
                    busy[which] * tick_us / (args.requests * args.rounds),
                    busy[which] / ticks[which],
                )
                for which, _ in sides
                if ticks[which]
            }
            if {"base", "pipe", "subject"} <= cpu.keys():
                print(
                    f"{IN_FLIGHT} in flight: the whole machine's CPU a request (/proc/stat, every "
                    f"process): direct {cpu['base'][0]:.0f} us ({cpu['base'][1]:.0%} busy), "
                    f"byte pipe {cpu['pipe'][0]:.0f} us ({cpu['pipe'][1]:.0%}), facade "
                    f"{cpu['subject'][0]:.0f} us ({cpu['subject'][1]:.0%}); with every core busy "
                    f"the facade would reach {cpu['base'][0] / cpu['subject'][0]:.2f} of direct"
                )
            ceiling = statistics.median(
                p / b for b, p in zip(rates["base"], rates["pipe"], strict=True)
            )
            print(
                f"{IN_FLIGHT} in flight: a byte pipe (no HTTP parsed, nothing recorded) reaches "
                f"{ceiling:.2f} of direct -- the ceiling for any proxy process on this machine"
            )
            # The facade against that ceiling, round by round: both proxies share the rounds'
            # kernel placement, which moves the direct baseline by up to half.
            of_pipe = [s / p for p, s in zip(rates["pipe"], rates["subject"], strict=True)]
            print(
                f"{IN_FLIGHT} in flight: facade / byte pipe, per round: "
                f"{' '.join(f'{r:.2f}' for r in of_pipe)}, median {statistics.median(of_pipe):.2f}"
            )
            if args.tracing:
                async with session.get(f"http://127.0.0.1:{ports['t']['api']}/metrics") as r:
                    spans = [
                        line
                        for line in (await r.text()).splitlines()
                        if line.startswith("nvpair_trace_spans")
                    ]
                print("T's spans: " + "; ".join(spans))
                facade_direct = statistics.median(
                    s / b for b, s in zip(rates["base"], rates["subject"], strict=True)
                )
                print(f"{IN_FLIGHT} in flight, local: facade / direct {facade_direct:.2f}")
                report(
                    rates["subject"],
                    rates["traced"],
                    unit="requests/s",
                    label=f"{IN_FLIGHT} in flight, local, traced facade (T) vs untraced (A):",
                )
                return
            base_rates, subject_rates = rates["base"], rates["subject"]
            if args.old:
                old_ratios = [o / b for b, o in zip(base_rates, rates["old"], strict=True)]
                print(
                    f"{IN_FLIGHT} in flight, local, instant engine [old code]: "
                    f"{statistics.median(rates['old']):,.0f} requests/s, "
                    f"{statistics.median(old_ratios):.2f} of direct "
                    f"(per-round: {' '.join(f'{r:.2f}' for r in old_ratios)})"
                )
            report(
                base_rates,
                subject_rates,
                unit="requests/s",
                label=f"{IN_FLIGHT} in flight, local, instant engine, facade vs direct:",
            )
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tracing", action="store_true", help="trace every request (OTLP)")
    parser.add_argument("--old", metavar="PATH", help="a checkout of the code before a change")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
