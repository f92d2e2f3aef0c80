"""`nvpair demo`: three agents on 127.0.0.1 with simulated GPUs, running mock engines.

It starts three agents (each with its own NVPAIR_HOME under a temporary directory, its own
ports and its own engine port range), pairs them with `cluster init` / `invite` / `join`
over the network, declares deployments with `nvpair deploy` (engine `mock`: the agents
launch the engines on the GPUs placement chose), waits for every replica to be ready in
every member's view, sends a burst of requests through different members, and prints the
Jobs list as every member sees it, side by side. Ctrl-C stops everything (`--once` stops
after printing, for scripts and tests): agents leave their engines running when they stop
(the next agent adopts them), so the demo undeploys first and waits for the engines to go,
and kills any that are left, by the pids in their `proc.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from agent.apis.local_guard import read_token
from netkit.ports import bindable

__all__ = ["add_command"]

Member = tuple[str, str, str, Path]  # name, facade URL, local API URL, NVPAIR_HOME
Agent = tuple[str, asyncio.subprocess.Process, Path]  # name, its process, its log

NODES = (("gpu-a", "h100-80gb-sxm:8"), ("gpu-b", "l40s:4"), ("gpu-c", "l4:2"))
# `nvpair deploy` arguments: name, then flags; the mock engine's own flags after `--`.
DEPLOYMENTS = (
    ("llama-3-8b", "--replicas", "3", "--", "--latency-ms", "50"),
    ("qwen-2-7b", "--gpus", "2", "--one-domain", "--device-class", "l40s"),
    ("mistral-7b", "--device-class", "l4", "--", "--fail-rate", "0.1"),
)
REPLICAS = 5  # what DEPLOYMENTS add up to
PORT_BAND = 100  # per agent: its four listeners, then its engines' range
AGENT_PORTS = ("manager", "node", "api", "facade")


def add_command(commands: Any) -> None:
    """Register `nvpair demo`."""
    demo = commands.add_parser("demo", help="three agents on this machine, paired, under load")
    demo.add_argument("--requests", type=int, default=30, help="requests in the burst")
    demo.add_argument("--once", action="store_true", help="stop after printing the Jobs lists")
    demo.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo(args.requests, args.once))
    except KeyboardInterrupt:
        return 0


def _free_ports(low: int, high: int, count: int) -> list[int]:
    """The first `count` ports in [low, high) nothing listens on or is bound to now."""
    found = list(itertools.islice((p for p in range(low, high) if bindable(p)), count))
    if len(found) < count:
        raise RuntimeError(f"no {count} free ports in {low}-{high - 1}")
    return found


def say(text: str) -> None:
    print(text, flush=True)


async def _demo(requests: int, once: bool) -> int:
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory(prefix="nvpair-demo-") as tmp:
        root = Path(tmp)
        try:
            facades = await _start(root, procs)
            await _deploy(facades)
            await _burst(facades, requests)
            await _show(facades)
            if not once:
                say(f"\nThe cluster keeps running: NVPAIR_HOME={root}/gpu-a nvpair jobs")
                say("  (or nvpair replicas, nvpair explain llama-3-8b, nvpair logs REPLICA)")
                say("Press Ctrl-C to stop.")
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                loop.add_signal_handler(signal.SIGINT, stop.set)
                loop.add_signal_handler(signal.SIGTERM, stop.set)
                await stop.wait()
        finally:
            say("stopping…")
            await _stop_engines(root)
            for proc in reversed(procs):
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.wait_for(proc.wait(), 15)
    return 0


async def _spawn(args: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", *args, env=env, stdout=out, stderr=out
        )


async def _cli(args: list[str], env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"nvpair {' '.join(args[:2])} failed: {err.decode().strip()}")
    return out.decode().strip()


async def _start(root: Path, procs: list[asyncio.subprocess.Process]) -> list[Member]:
    """Agents up and paired; returns (name, facade URL, API URL, home) per node."""
    nodes = []
    # Every port below the kernel's ephemeral ones (32768 up on Linux), where no outgoing
    # connection takes one between our probe and the agent's bind, and below the bands the
    # test suite hands out (20000-32000).
    base = random.randrange(10000, 18000 - PORT_BAND * len(NODES), PORT_BAND)
    for n, (name, gpus) in enumerate(NODES):
        env = {**os.environ, "NVPAIR_HOME": str(root / name), "NVPAIR_BIND": "127.0.0.1"}
        (root / name).mkdir(mode=0o700)
        band = base + n * PORT_BAND
        ports = dict(zip(AGENT_PORTS, _free_ports(band, band + PORT_BAND // 2, 4), strict=True))
        low, high = band + PORT_BAND // 2, band + PORT_BAND - 1  # a taken one is skipped anyway
        (root / name / "nvpair.toml").write_text(
            f'[engines]\nport_range = "{low}-{high}"\nstop_grace_s = 5.0\n'
        )
        nodes.append((name, gpus, env, ports))
    watch: list[Agent] = []
    async with aiohttp.ClientSession() as session:
        for n, (name, gpus, env, ports) in enumerate(nodes):
            if n == 0:
                await _cli(["cluster", "init", "--name", "demo", "--node-name", name], env)
                say(f"{name}: created the cluster CA")
            else:
                token = await _cli(["cluster", "invite"], nodes[0][2])
                await _cli(
                    ["cluster", "join", f"127.0.0.1:{nodes[0][3]['node']}", token, "--name", name],
                    env,
                )
                say(f"{name}: joined over the network with a one-time invite")
            args = ["agent", "run", "--name", name, "--simulate-gpus", gpus]
            for key, port in ports.items():
                args += [f"--{key}-port", str(port)]
            procs.append(await _spawn(args, env, root / f"{name}.log"))
            watch.append((name, procs[-1], root / f"{name}.log"))
            if n == 0:  # the others join through it; they start side by side
                healthz = f"http://127.0.0.1:{ports['api']}/healthz"
                await _until(session, healthz, lambda h: bool(h.get("ok")), watch=watch)
        for *_, ports in nodes:
            healthz = f"http://127.0.0.1:{ports['api']}/healthz"
            await _until(session, healthz, lambda h: bool(h.get("ok")), watch=watch)
        for name, *_, ports in nodes:
            await _until(
                session,
                f"http://127.0.0.1:{ports['api']}/v1/nodes",
                lambda listed: len(listed) == 3 and all(n["reachable"] for n in listed),
                headers=_owner(root / name),
                watch=watch,
            )
        say("three members, each sees the others' GPUs:")
        first = f"http://127.0.0.1:{nodes[0][3]['api']}/v1/nodes"
        async with session.get(first, headers=_owner(root / nodes[0][0])) as response:
            for node in await response.json():
                classes = ",".join(sorted({d["deviceClass"] for d in node["devices"]}))
                say(f"  {node['name']}: {len(node['devices'])} x {classes}")
    return [
        (
            name,
            f"http://127.0.0.1:{ports['facade']}",
            f"http://127.0.0.1:{ports['api']}",
            root / name,
        )
        for name, *_, ports in nodes
    ]


async def _deploy(members: list[Member]) -> None:
    """`nvpair deploy` on the first member; every replica ready in every member's view."""
    env = _env(members[0][3])
    say("\ndeploying through gpu-a (the agents launch mock engines on the GPUs placed):")
    for name, *flags in DEPLOYMENTS:
        say("  " + await _cli(["deploy", name, "--model", name, "--engine", "mock", *flags], env))
    async with aiohttp.ClientSession() as session:
        for _, _, api, home in members:
            await _until(
                session,
                f"{api}/v1/replicas",
                lambda listed: (
                    len(listed) == REPLICAS and all(r["state"] == "ready" for r in listed)
                ),
                headers=_owner(home),
                within_s=90.0,
            )
        async with session.get(f"{members[0][2]}/v1/replicas", headers=_owner(members[0][3])) as r:
            listed = await r.json()
    say(f"{REPLICAS} replicas ready, the same in every member's view:")
    for replica in listed:
        say(
            f"  {replica['deployment']:<11} {replica['id']}  on {replica['node']}"
            f"  {len(replica['devices'])} GPU(s)  port {replica['port']}  {replica['state']}"
        )


async def _stop_engines(root: Path) -> None:
    """Undeploy, wait for the engines to stop, and kill any left (by their proc.json)."""
    homes = [root / name for name, _ in NODES]
    with contextlib.suppress(RuntimeError, OSError):
        for name, *_ in DEPLOYMENTS:
            await asyncio.wait_for(_cli(["undeploy", name], _env(homes[0])), 15)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:  # the engines are not our children: poll /proc
            if not any(_engine_pids(home) for home in homes):
                break
            await asyncio.sleep(0.2)
    for home in homes:
        for pid in _engine_pids(home):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # an engine leads its own process group


def _engine_pids(home: Path) -> list[int]:
    """The engines this home's agent launched and that still run (their env names home)."""
    pids = []
    for record in home.glob("replicas/*/proc.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pid = int(json.loads(record.read_text())["pid"])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"NVPAIR_REPLICA_HOME={home}".encode() in environ:
                pids.append(pid)
    return pids


def _all_ready(listed: list[dict[str, Any]]) -> bool:
    return len(listed) == REPLICAS and all(r["state"] == "ready" for r in listed)


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "NVPAIR_HOME": str(home), "NVPAIR_BIND": "127.0.0.1"}


def _owner(home: Path) -> dict[str, str]:
    # The local API answers its owner: the token the agent in `home` wrote at its start.
    return {"Authorization": f"Bearer {read_token(home)}"}


async def _until(
    session: aiohttp.ClientSession,
    url: str,
    check: Any,
    headers: dict[str, str] | None = None,
    within_s: float = 30.0,
    watch: list[Agent] | None = None,
) -> None:
    """Poll `url` until `check` holds; an agent in `watch` that stops ends the wait at once."""
    deadline = time.monotonic() + within_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            async with session.get(url, headers=headers) as response:
                if response.status == 200 and check(await response.json()):
                    return
        for name, proc, log in watch or ():
            if proc.returncode is not None:
                raise RuntimeError(
                    f"{name}'s agent stopped (exit {proc.returncode}); the end of its log:\n"
                    + _tail(log)
                )
        if time.monotonic() > deadline:
            logs = "".join(f"\n{name}'s log ends:\n{_tail(log)}" for name, _, log in watch or ())
            raise RuntimeError(f"timed out waiting for {url}{logs}")
        await asyncio.sleep(0.2)


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(unreadable: {error})"


async def _burst(facades: list[Member], count: int) -> None:
    models = itertools.cycle(["llama-3-8b", "llama-3-8b", "qwen-2-7b", "mistral-7b"])
    say(f"\nsending {count} requests through all three members at once…")

    async def one(n: int, session: aiohttp.ClientSession) -> int:
        _, facade, _, _ = facades[n % len(facades)]
        body = {
            "model": next(models),
            "messages": [{"role": "user", "content": f"demo question {n}"}],
            "max_tokens": 8,
            "stream": n % 4 == 3,
        }
        async with session.post(f"{facade}/v1/chat/completions", json=body) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(one(n, session) for n in range(count)))
    ok = sum(1 for s in statuses if s == 200)
    say(f"{ok} answered, {count - ok} failed (mistral-7b's engine fails 10% on purpose)")


async def _show(facades: list[Member]) -> None:
    async with aiohttp.ClientSession() as session:

        async def settled() -> list[list[dict[str, Any]]]:
            views = []
            for _, _, api, home in facades:
                jobs = f"{api}/v1/jobs?limit=10000"
                async with session.get(jobs, headers=_owner(home)) as response:
                    views.append(await response.json())
            return views

        deadline = time.monotonic() + 20
        while True:
            views = await settled()
            final = all(j["state"] not in ("queued", "running") for view in views for j in view)
            if (final and len({len(v) for v in views}) == 1) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
    names = {}
    nodes, home = f"{facades[0][2]}/v1/nodes", facades[0][3]
    async with aiohttp.ClientSession() as session, session.get(nodes, headers=_owner(home)) as r:
        names = {n["nodeId"]: n["name"] for n in await r.json()}
    keyed = [{(j["originatedFrom"], j["runId"], j["id"]): j for j in view} for view in views]
    every = sorted(set().union(*keyed), key=lambda k: (names.get(k[0], k[0]), int(k[2])))
    header = ["JOB", "MODEL", "RAN ON"] + [f"AS {name.upper()} SEES IT" for name, *_ in facades]
    rows = [header]
    for key in every:
        job = next(view[key] for view in keyed if key in view)
        rows.append(
            [
                f"{names.get(key[0], key[0][-6:])}#{key[2]}",
                job["model"],
                names.get(job.get("scheduledOn", ""), "-"),
            ]
            + [view[key]["state"] if key in view else "(missing)" for view in keyed]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    say("\nthe Jobs list on every member:")
    for row in rows:
        say("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    same = all(
        view.keys() == keyed[0].keys()
        and all(view[k]["state"] == keyed[0][k]["state"] for k in view)
        for view in keyed
    )
    served = Counter(names.get(keyed[0][k].get("scheduledOn", ""), "-") for k in keyed[0])
    say("\nrequests served by node: " + ", ".join(f"{n} {c}" for n, c in sorted(served.items())))
    say(f"{len(every)} jobs; every member shows the same list: {'yes' if same else 'NO'}")
