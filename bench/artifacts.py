"""Moving weights between members (issue 28, item 7): real agents on 127.0.0.1, one artifact
of random bytes (2 GiB by default, `--size-mib`) added on a, in the default 16 MiB pieces.

(a) **One fetch against a raw stream.** Two agents, no rate limit. Baseline: the artifact's
    bytes read piece after piece from a's node API over one kept-alive aiohttp mTLS
    connection (the bench process dialling with b's identity, as b's `NodeClient` does),
    nothing checked or written. Subject: b fetches the artifact (`POST
    /v1/artifacts/NAME/fetch`, until it is resident: many pieces in flight, each SHA-256
    checked, written to disk, the files assembled). Rates in MB/s; `ratio:` subject /
    baseline (goal: at least 0.80). b drops its copy after each round.
(b) **Four at once from one holder.** Five agents; each member's link is emulated by
    `[artifacts] max_rate` (`--link-mb-s` each way, default 50 MB/s: on one small machine the
    members share its CPU, and without a bound per member the figure would measure the CPU,
    not the swarm). Baseline: one member fetches it alone (t1). Subject: four members fetch it
    at once, until all four hold it (t4). The swarm ratio is t4 / t1 (goal: at most 1.5 --
    every receiver serves what it holds); `ratio:` is t1 / t4, higher is better as STYLE.md
    has it. With one source alone t4 would be 4 x t1.
(c) **Verification's limit**: SHA-256 of the same bytes on one core (hashlib), in MB/s.

    python bench/artifacts.py [--size-mib 2048] [--rounds 5] [--link-mb-s 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _interleave import report

from agent.cluster.node_client import NodeClient
from certs import ClusterDir
from facts.records import NodeRecord
from tests.agent.harness import Node, make_node, start_cluster

NAME = "bench-weights"
POLL_S = 0.05
WAIT_S = 1800.0
MB = 1e6


def make_weights(folder: Path, size: int) -> Path:
    """One file of `size` random bytes (written in 64 MiB blocks)."""
    folder.mkdir(parents=True)
    path = folder / "model.safetensors"
    with path.open("wb") as out:
        left = size
        while left:
            block = min(left, 64 * 2**20)
            out.write(os.urandom(block))
            left -= block
    return folder


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: gave up waiting for {what}")
        await asyncio.sleep(POLL_S)


async def call(node: Node, method: str, path: str) -> Any:
    async with (
        aiohttp.ClientSession(headers=node.owner) as session,
        session.request(method, node.api + path) as response,
    ):
        if response.status >= 300:
            raise SystemExit(f"bench: {method} {path} on {node.name}: {await response.text()}")
        return await response.json()


async def here(node: Node) -> str:
    listed = await call(node, "GET", "/v1/artifacts")
    found = [a for a in listed if a["name"] == NAME]
    return str(found[0]["here"]) if found else "unknown"


async def fetch_all(nodes: list[Node]) -> float:
    """Seconds until every one of `nodes` holds the artifact, fetched at once; then each
    drops its copy again."""
    began = time.perf_counter()
    for node in nodes:
        await call(node, "POST", f"/v1/artifacts/{NAME}/fetch")

    async def every() -> bool:
        states = [await here(n) for n in nodes]
        if "failed" in states:
            raise SystemExit(f"bench: a fetch failed: {states}")
        return all(s == "resident" for s in states)

    await until(every, "the fetches")
    took = time.perf_counter() - began
    for node in nodes:  # once its fetch has ended (resident a moment before it does)
        await until(_dropped_by(node), f"{node.name} to drop its copy")
    return took


def _dropped_by(node: Node) -> Callable[[], Awaitable[bool]]:
    async def dropped() -> bool:
        async with (
            aiohttp.ClientSession(headers=node.owner) as session,
            session.delete(node.api + f"/v1/artifacts/{NAME}/here") as response,
        ):
            return response.status == 200

    return dropped


async def raw_stream(holder: Node, reader: Node, digest: str, pieces: int) -> float:
    """Seconds to read every piece from `holder` over one kept-alive mTLS connection, with
    `reader`'s identity, nothing checked or kept."""
    holder_id = await holder.node_id()
    where = NodeRecord(
        nodeId=holder_id, name=holder.name, addresses=["127.0.0.1"], managerPort=0,
        nodePort=holder.ports["node"], facadePort=0, version="bench", updatedAt=0, generation=1,
    )  # fmt: skip
    client = NodeClient(ClusterDir(reader.home / "cluster"), lambda _: where)
    try:
        began = time.perf_counter()
        for index in range(pieces):
            await client.artifact_piece(holder_id, digest, index)
        return time.perf_counter() - began
    finally:
        await client.aclose()


async def added(holder: Node, others: list[Node], weights: Path) -> dict[str, Any]:
    code, _, err = await holder.cli("artifact", "add", str(weights), "--name", NAME)
    if code != 0:
        raise SystemExit(f"bench: artifact add: {err}")
    for node in others:
        await until(_known_by(node), f"{node.name} to learn of the artifact")
    (found,) = [a for a in await call(holder, "GET", "/v1/artifacts") if a["name"] == NAME]
    return dict(found)


def _known_by(node: Node) -> Callable[[], Awaitable[bool]]:
    async def known() -> bool:
        return await here(node) == "absent"

    return known


def homes(root: Path, names: str, rate: int) -> list[Node]:
    nodes = [make_node(root, name, None) for name in names]
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text(
            f"[agent]\nheartbeat_s = 1.0\n[artifacts]\nmax_rate = {rate}\n"
        )
    return nodes


async def one_fetch(root: Path, weights: Path, size: int, rounds: int) -> None:
    cluster = start_cluster(homes(root / "one", "ab", 0))
    a, b = await cluster.__anext__()
    try:
        found = await added(a, [b], weights)
        base: list[float] = []
        subject: list[float] = []
        for i in range(rounds):
            order = [base, subject] if i % 2 == 0 else [subject, base]
            for side in order:
                if side is base:
                    took = await raw_stream(a, b, found["digest"], found["pieceCount"])
                else:
                    took = await fetch_all([b])
                side.append(size / took / MB)
        print("(a) one member fetching from one holder vs a raw mTLS stream")
        report(base, subject, unit="MB/s", label="(a)")
    finally:
        with contextlib.suppress(StopAsyncIteration):  # its end: the agents stopped
            await cluster.__anext__()


async def swarm(root: Path, weights: Path, size: int, rounds: int, link: int) -> None:
    cluster = start_cluster(homes(root / "swarm", "abcde", link))
    nodes = await cluster.__anext__()
    try:
        holder, fetchers = nodes[0], nodes[1:]
        await added(holder, fetchers, weights)
        t1: list[float] = []
        t4: list[float] = []
        for i in range(rounds):
            if i % 2 == 0:
                t1.append(await fetch_all(fetchers[:1]))
                t4.append(await fetch_all(fetchers))
            else:
                t4.append(await fetch_all(fetchers))
                t1.append(await fetch_all(fetchers[:1]))
        print(f"(b) four members at once from one holder, links of {link / MB:.0f} MB/s")
        print(f"(b) t1 (one member) rounds: {' '.join(f'{t:.1f}' for t in t1)} s")
        print(f"(b) t4 (all four)  rounds: {' '.join(f'{t:.1f}' for t in t4)} s")
        swarm_ratio = statistics.median(b / a for a, b in zip(t1, t4, strict=True))
        print(f"(b) swarm ratio t4/t1: {swarm_ratio:.2f} (goal: at most 1.5; one source: 4)")
        report([1000 / t for t in t1], [1000 / t for t in t4], unit="fetches/ks", label="(b)")
    finally:
        with contextlib.suppress(StopAsyncIteration):
            await cluster.__anext__()


def sha256_rate(weights: Path, size: int) -> float:
    began = time.perf_counter()
    digest = hashlib.sha256()
    with (weights / "model.safetensors").open("rb") as f:
        while block := f.read(16 * 2**20):
            digest.update(block)
    return size / (time.perf_counter() - began) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--link-mb-s", type=float, default=50.0)
    parser.add_argument("--only", choices=("a", "b", "c"), default=None)
    args = parser.parse_args()
    size = args.size_mib * 2**20
    root = Path(tempfile.mkdtemp(prefix="nvpair-bench-artifacts-"))
    try:
        weights = make_weights(root / "weights", size)
        print(f"artifact: {args.size_mib} MiB of random bytes, 16 MiB pieces")
        if args.only in (None, "c"):
            rates = [sha256_rate(weights, size) for _ in range(3)]
            print(f"(c) SHA-256 on one core: {statistics.median(rates):,.0f} MB/s "
                  f"(rounds: {' '.join(f'{r:,.0f}' for r in rates)})")  # fmt: skip
        if args.only in (None, "b"):
            link = int(args.link_mb_s * MB)
            asyncio.run(swarm(root, weights, size, args.rounds, link))
        if args.only in (None, "a"):
            asyncio.run(one_fetch(root, weights, size, args.rounds))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
