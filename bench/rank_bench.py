"""Scheduler decisions per second at 100, 1,000 and 5,000 nodes x 8 GPUs (issue 6).

Each node serves 3 of 20 models on one engine; GPUs have varied free memory and
utilisation; pending work is what a busy cluster has (0-40 jobs per node, updated after
every decision as the chosen node takes the job). One line per size:
`nodes=N decisions_per_s=X p99_ms=Y`. Then, at 1,000 nodes, the numpy ranking against a
plain-Python loop over the same nodes making the same decisions, paired rounds, `ratio:`.

    python bench/scheduler.py [--decisions 2000]   (runs this file with the path fixed)
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from _interleave import interleave

from scheduler import Cluster, DeviceView, EngineView, Load, NodeView, Request, rank
from scheduler.rank import W_FREE, W_LOAD, W_UTIL

GIB = 1024**3
MODELS = [f"model-{i}" for i in range(20)]


def make_nodes(count: int, rng: random.Random) -> list[NodeView]:
    nodes = []
    for n in range(count):
        devices = tuple(
            DeviceView(
                memory_free=rng.randrange(5, 80) * GIB,
                memory_total=80 * GIB,
                utilization=rng.uniform(0, 100),
                healthy=rng.random() > 0.01,
                domain="nvl0" if g < 4 else "nvl1",
            )
            for g in range(8)
        )
        engine = EngineView(
            "vllm", "vllm", frozenset(rng.sample(MODELS, 3)), up=rng.random() > 0.02
        )
        nodes.append(
            NodeView(
                f"nod_{n:06d}",
                reachable=rng.random() > 0.02,
                cordoned=rng.random() < 0.01,
                engines=(engine,),
                devices=devices,
            )
        )
    return nodes


def requests(count: int, nodes: list[NodeView], rng: random.Random) -> list[Request]:
    return [
        Request(
            rng.choice(MODELS),
            memory_bytes=rng.choice([4, 8, 16]) * GIB,
            gpus=rng.choice([1, 1, 1, 2, 4]),
            origin=rng.choice(nodes).node_id,
        )
        for _ in range(count)
    ]


def measure(count: int, decisions: int) -> tuple[float, float]:
    rng = random.Random(count)
    nodes = make_nodes(count, rng)
    cluster = Cluster.compile(nodes)
    load = Load.of(cluster, {n.node_id: rng.randrange(0, 40) for n in nodes})
    batch = requests(decisions, nodes, rng)
    latencies = []
    start = time.perf_counter()
    for request in batch:
        t0 = time.perf_counter()
        best = rank(request, cluster, load).best
        latencies.append(time.perf_counter() - t0)
        if best is not None:
            load.add(best, 1)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return decisions / elapsed, latencies[int(len(latencies) * 0.99) - 1] * 1000


def python_rank(request: Request, nodes: list[NodeView], pending: dict[str, float]) -> str | None:
    """The same filters and score as a plain loop: the baseline."""
    best: tuple[float, str] | None = None
    for node in sorted(nodes, key=lambda n: n.node_id):
        if not (node.member and node.reachable and not node.cordoned):
            continue
        if not any(request.model in e.models and e.up for e in node.engines):
            continue
        good = [d for d in node.devices if d.healthy]
        if not good:
            continue
        domains: dict[str, list[int]] = {}
        for d in good:
            domains.setdefault(d.domain, []).append(d.memory_free)
        if not any(
            len(f) >= request.gpus
            and sorted(f, reverse=True)[request.gpus - 1] >= request.memory_bytes
            for f in domains.values()
        ):
            continue
        util = sum(d.utilization for d in good) / len(good)
        free = sum(d.memory_free for d in good) / sum(d.memory_total for d in good)
        score = (
            -W_LOAD * pending.get(node.node_id, 0) / len(good) - W_UTIL * util / 100 + W_FREE * free
        )
        if request.origin == node.node_id:
            score += 0.1
        if best is None or score > best[0]:
            best = (score, node.node_id)
    return best[1] if best else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
    for count in (100, 1000, 5000):
        rate, p99 = measure(count, args.decisions)
        print(f"nodes={count} decisions_per_s={rate:,.0f} p99_ms={p99:.2f}")
    rng = random.Random(7)
    nodes = make_nodes(1000, rng)
    pending = {n.node_id: float(rng.randrange(0, 40)) for n in nodes}
    cluster = Cluster.compile(nodes)
    load = Load.of(cluster, pending)
    batch = requests(100, nodes, rng)
    assert [python_rank(r, nodes, pending) for r in batch] == [
        rank(r, cluster, load).best for r in batch
    ]

    def timed(decide: Callable[[Request], str | None]) -> float:
        start = time.perf_counter()
        for request in batch:
            decide(request)
        return len(batch) / (time.perf_counter() - start)

    interleave(
        lambda: timed(lambda r: python_rank(r, nodes, pending)),
        lambda: timed(lambda r: rank(r, cluster, load).best),
        rounds=5,
        unit="decisions/s",
        label="1,000 nodes, numpy ranking vs a plain loop:",
    )


if __name__ == "__main__":
    main()
