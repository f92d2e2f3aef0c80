"""The inference facade: requests/s and added latency, local and forwarded (issue 6).

Two agents (real `python -m agent agent run` processes, paired over the network). A has
two mock engines: `local-model` answers a request in 20 ms (a short completion), and
`instant-model` answers at once; B's engine serves `remote-model`, also in 20 ms. Paired
rounds, in alternating order, of N non-streaming chat requests with 8 in flight:
- baseline: straight to the engine;
- subject: through A's facade to the same engine (placed by the scheduler, three job
  events each), or forwarded to B over the node API.
The first `ratio:` is local facade / direct with the 20 ms engine. The instant engine's
block shows the facade's bare overhead: on two cores the client, the facade (one HTTP
exchange in, one out) and the engine share the CPU, so no Python proxy reaches more than
about half of an engine that does nothing. Each block prints the added latency too.

    python bench/facade.py [--requests 600] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from _interleave import report

IN_FLIGHT = 8


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def run(*args: str, env: dict[str, str], wait: bool = True) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    if wait:
        await proc.wait()
    return proc


async def rate(
    session: aiohttp.ClientSession, url: str, model: str, count: int
) -> tuple[float, list[float]]:
    """Requests/s and each request's latency."""
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
    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return count / (time.perf_counter() - start), latencies


def added(base: list[float], subject: list[float]) -> str:
    b, s = sorted(base), sorted(subject)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(len(values) * q))] * 1000

    p50, p99 = pct(s, 0.5) - pct(b, 0.5), pct(s, 0.99) - pct(b, 0.99)
    return (
        f"added latency p50 {p50:.2f} ms, p99 {p99:.2f} ms "
        f"(direct p50 {pct(b, 0.5):.2f} ms, p99 {pct(b, 0.99):.2f} ms)"
    )


async def main_async(args: argparse.Namespace, root: Path) -> None:
    engine_ports = {"a": free_port(), "instant": free_port(), "b": free_port()}
    engines = (
        ("a", "local-model", "20"),
        ("instant", "instant-model", "0"),
        ("b", "remote-model", "20"),
    )
    procs = [
        await run(
            "mock-engine",
            *("--port", str(engine_ports[key]), "--model", model, "--latency-ms", latency),
            env=dict(os.environ),
            wait=False,
        )
        for key, model, latency in engines
    ]
    ports = {name: {k: free_port() for k in ("manager", "node", "api", "facade")} for name in "ab"}
    envs = {
        name: {**os.environ, "NVPAIR_HOME": str(root / name), "NVPAIR_BIND": "127.0.0.1"}
        for name in "ab"
    }

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
            *(
                ["--engine", f"vllm=http://127.0.0.1:{engine_ports['instant']}"]
                if name == "a"
                else []
            ),
            "--manager-port",
            str(p["manager"]),
            "--node-port",
            str(p["node"]),
            "--api-port",
            str(p["api"]),
            "--facade-port",
            str(p["facade"]),
        ]

    try:
        await run("cluster", "init", "--name", "bench", env=envs["a"])
        procs.append(await run(*agent_args("a"), env=envs["a"], wait=False))
        await asyncio.sleep(3)
        invite = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent",
            "cluster",
            "invite",
            env=envs["a"],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        token = (await invite.communicate())[0].decode().strip()
        await run("cluster", "join", f"127.0.0.1:{ports['a']['node']}", token, env=envs["b"])
        procs.append(await run(*agent_args("b"), env=envs["b"], wait=False))
        facade = f"http://127.0.0.1:{ports['a']['facade']}/v1/chat/completions"

        def direct(port: str) -> str:
            return f"http://127.0.0.1:{engine_ports[port]}/v1/chat/completions"

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=IN_FLIGHT * 2)
        ) as session:
            for _ in range(100):  # until A's facade knows every engine
                async with session.get(f"http://127.0.0.1:{ports['a']['facade']}/v1/models") as r:
                    models = await r.text()
                if "remote-model" in models and "instant-model" in models:
                    break
                await asyncio.sleep(0.2)
            blocks = (
                ("local, 20 ms engine", "local-model", direct("a"), "local-model"),
                ("forwarded, 20 ms engine", "remote-model", direct("a"), "local-model"),
                ("local, instant engine", "instant-model", direct("instant"), "instant-model"),
            )
            for _, model, base_url, base_model in blocks:  # warm up
                await rate(session, base_url, base_model, 50)
                await rate(session, facade, model, 50)
            for label, model, base_url, base_model in blocks:
                base_rates: list[float] = []
                subject_rates: list[float] = []
                base_lat: list[float] = []
                subject_lat: list[float] = []
                for i in range(args.rounds):
                    order = [("base", base_url, base_model), ("subject", facade, model)]
                    for which, url, name in order if i % 2 == 0 else order[::-1]:
                        value, lat = await rate(session, url, name, args.requests)
                        (base_rates if which == "base" else subject_rates).append(value)
                        (base_lat if which == "base" else subject_lat).extend(lat)
                print(f"{label}: {added(base_lat, subject_lat)}")
                report(
                    base_rates,
                    subject_rates,
                    unit="requests/s",
                    label=f"{label} non-streaming, facade vs direct:",
                )
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    main()
