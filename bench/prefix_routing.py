"""Prefix routing on an agent-like trace: TTFT with prefix-aware routing against load-aware
and round-robin routing, through real agents (issue 29, item 5).

Setup: three real agents (`python -m agent agent run`, simulated GPUs `l4:2` each, formed
as the agent tests form them: `tests/agent/harness.py`) run one deployment of six mock
engines (`python -m agent mock-engine`, two per member) with the prefix-cache model
(`agent.mock.prefix_cache`): prompts are words, cached in blocks of 16 in an LRU of
`--cache-blocks` chained block hashes; the time to first token is 5 ms plus
`--prefill-ms` per word not cached, an engine's prefills taking turns as one GPU's
compute does. Answers are 4 tokens at no pace (`--tokens-per-s 0`) and not streamed, so
the response time, counted at the client from sending to the whole answer read, is the
TTFT plus the way through the facade (and, for a replica on another member, through that
member too).

The trace, drawn from `--seed`: each round has `--conversations` conversations, at most
`--concurrency` at once (a new one starts when one ends). Each opens with one of four
shared system prompts (600-1500 words, as an agent's tool list) and a task of its own
(300-800 words, as a task with the files it is about), then has 3-6 turns: each later
turn appends the previous answer and a tool result of 40-120 words. A conversation sends
its next turn only after its previous answer arrives and a tool time of 50-300 ms; each
turn enters at a member drawn at random, so the turns of concurrent conversations reach
all three facades at once. The first `--concurrency` conversations start spread over 2 s,
the rest as slots free. Defaults: 60 conversations (about 270 requests and 52,000
distinct prompt words a run), 24 at once, 0.15 ms per uncached word, 1152 blocks (18,432
words: about a third of a run's distinct words) per replica.

Rounds: in each round the three policies run the same trace shape (the same lengths,
members and pauses), each in its own run, in an order that rotates from round to round
(round-robin, load, prefix; load, prefix, round-robin; ...). Before each run every
member's policy is switched (`PUT /v1/routing` on its local API). Nothing is restarted:
instead every run draws its words afresh (from the seed, the round and the policy), so no
block of one run's prompts is in any later prompt and what the caches hold from earlier
runs never hits: it only takes room in the LRU, the first to be evicted, as good as an
empty cache. A warm-up run (load policy, not counted) comes first.

Printed per policy, as the median over rounds (each round's figure in brackets for TTFT
p50): TTFT p50 and p99; the share of prompt words the engines found cached (the answers'
`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`); requests per second
over the run; and the most-loaded replica's requests over the mean (counted by the
engines' own `vllm:request_success_total`), with the worst round. For prefix, the
members' routing decisions by reason and how many requests at least left their anchor's
first replica (the anchor's replica computed here, as every member computes it; a net
count: what the engines answered short of what the anchors named). Then
`ratio:` = load TTFT p50 / prefix TTFT p50, the median of the per-round ratios (goal >= 3,
with no replica above 1.5x the mean under prefix).

    python bench/prefix_routing.py [--seed N] [--rounds K] [--conversations 60]
        [--concurrency 24] [--prefill-ms 0.15] [--cache-blocks 1152]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import aiohttp
from _interleave import report
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client.parser import text_string_to_metric_families

# The repository before this directory: bench/scheduler.py would hide the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netkit.processes import alive
from scheduler.prefix import anchor_key, anchor_of, rendezvous
from tests.agent.deploy_harness import formed, post, ready_everywhere, replicas
from tests.agent.harness import Node, engine_pids, eventually, make_node, start_cluster
from tests.workload_manager.cluster_harness import engine_ports

MODEL: Final = "agentic"
MEMBERS: Final = 3
GPUS: Final = "l4:2"  # per member: two replicas each
REPLICAS: Final = 6
POLICIES: Final = ("round-robin", "load", "prefix")
BLOCK_UNITS: Final = 16
SYSTEM_PROMPTS: Final = 4
SYSTEM_WORDS: Final = (600, 1500)
TASK_WORDS: Final = (300, 800)
TURNS: Final = (3, 6)
TOOL_WORDS: Final = (40, 120)
TOOL_S: Final = (0.05, 0.3)  # before each later turn: the tool runs
ARRIVAL_S: Final = 0.3  # before a conversation's first turn: at most this, drawn
RAMP_S: Final = 2.0  # ... and at most this for the first wave, so they do not all start at once
MAX_TOKENS: Final = 4
WAIT_S: Final = 120.0

# The words prompts are drawn from: any 16 in a row are, in practice, in one place only.
VOCABULARY: Final = tuple(
    "".join(random.Random(i).choices(string.ascii_lowercase, k=3 + i % 6)) for i in range(4096)
)


@dataclass(frozen=True, slots=True)
class Shape:
    """One conversation, less its words: its system prompt (an index), its task's words,
    each later turn's tool result words, each turn's member, and the pause before each."""

    system: int
    task_words: int
    tool_words: tuple[int, ...]  # one fewer than the turns
    members: tuple[int, ...]
    pauses: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A round's trace shape: the system prompts' lengths and the conversations."""

    system_words: tuple[int, ...]
    conversations: tuple[Shape, ...]

    @property
    def requests(self) -> int:
        return sum(len(c.members) for c in self.conversations)


def draw_trace(seed: int, round_no: int, conversations: int, concurrency: int) -> Trace:
    """The shape of round `round_no`'s trace: the same for every policy in the round. The
    first `concurrency` conversations start spread over `RAMP_S`, the others as a slot
    frees."""
    rng = random.Random(f"prefix-routing shape {seed} {round_no}")
    systems = tuple(rng.randint(*SYSTEM_WORDS) for _ in range(SYSTEM_PROMPTS))
    shapes = []
    for i in range(conversations):
        turns = rng.randint(*TURNS)
        shapes.append(
            Shape(
                system=rng.randrange(SYSTEM_PROMPTS),
                task_words=rng.randint(*TASK_WORDS),
                tool_words=tuple(rng.randint(*TOOL_WORDS) for _ in range(turns - 1)),
                members=tuple(rng.randrange(MEMBERS) for _ in range(turns)),
                pauses=(
                    rng.uniform(0, RAMP_S if i < concurrency else ARRIVAL_S),
                    *(rng.uniform(*TOOL_S) for _ in range(turns - 1)),
                ),
            )
        )
    return Trace(systems, tuple(shapes))


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=count))


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclass(frozen=True, slots=True)
class Answer:
    """One turn as the client saw it: its response time (ms) and the usage it reported."""

    ms: float
    prompt: int
    cached: int


@dataclass
class Run:
    """One policy's run of one round's trace."""

    answers: list[Answer]
    seconds: float
    per_replica: dict[str, float]  # requests each engine answered in the run
    decisions: Counter[str] = field(default_factory=Counter)  # routing reasons, all members
    off_anchor: int = 0  # at least this many requests left their anchor's first replica

    def ttft(self, q: float) -> float:
        return percentile([a.ms for a in self.answers], q)

    @property
    def cached_share(self) -> float:
        return sum(a.cached for a in self.answers) / max(1, sum(a.prompt for a in self.answers))

    @property
    def rate(self) -> float:
        return len(self.answers) / self.seconds

    @property
    def max_over_mean(self) -> float:
        counts = list(self.per_replica.values())
        return max(counts) / statistics.mean(counts) if sum(counts) else 0.0


class Mesh:
    """The three started members, the deployment's replicas and what the bench reads of
    them."""

    def __init__(self, nodes: list[Node], session: aiohttp.ClientSession) -> None:
        self.nodes = nodes
        self.session = session
        self.facades = [f"http://127.0.0.1:{n.ports['facade']}" for n in nodes]
        self.engines: dict[str, str] = {}  # replica id -> its engine's URL
        self.node_of: dict[str, str] = {}  # replica id -> its member's node id
        ca = x509.load_pem_x509_certificate((nodes[0].home / "cluster" / "ca.crt").read_bytes())
        self.anchor_key = anchor_key(ca.public_bytes(Encoding.DER))

    async def deploy(self, prefill_ms: float, cache_blocks: int) -> None:
        """The deployment, ready in every member's view and its load read everywhere."""
        args = [
            *("--prefix-cache-blocks", str(cache_blocks), "--block-units", str(BLOCK_UNITS)),
            *("--ttft-base-ms", "5", "--prefill-ms-per-unit", str(prefill_ms)),
            *("--tokens-per-s", "0"),
        ]
        body = {"name": MODEL, "engine": "mock", "gpus": 1, "replicas": REPLICAS, "args": args}
        code, text = await post(self.nodes[0], "/v1/deployments", body)
        if code != 201:
            raise RuntimeError(f"deployment refused ({code}): {text}")
        await eventually(
            lambda: ready_everywhere(self.nodes, MODEL, REPLICAS),
            f"{REPLICAS} ready replicas in every member's view",
            within_s=WAIT_S,
        )

        async def loads_read_everywhere() -> bool:
            for node in self.nodes:
                if not all(r["loadAt"] for r in await replicas(node, MODEL)):
                    return False
            return True

        await eventually(loads_read_everywhere, "every replica's load in every view", within_s=30)
        for record in await replicas(self.nodes[0], MODEL):
            self.engines[record["id"]] = f"http://127.0.0.1:{record['port']}"
            self.node_of[record["id"]] = record["nodeId"]

    async def set_policy(self, policy: str) -> None:
        for node in self.nodes:
            url = node.api + "/v1/routing"
            async with self.session.put(url, json={"policy": policy}, headers=node.owner) as r:
                answer = await r.json()
                if r.status != 200 or answer["policy"] != policy:
                    raise RuntimeError(f"{node.name} did not take policy {policy}: {answer}")

    async def _samples(self, url: str) -> list[tuple[str, dict[str, str], float]]:
        async with self.session.get(url) as response:
            text = await response.text()
        return [
            (s.name, s.labels, float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    async def served(self) -> dict[str, float]:
        """Requests each engine has answered so far (its own counter)."""
        counts = {}
        for rid, url in self.engines.items():
            samples = await self._samples(url + "/metrics")
            counts[rid] = sum(v for n, _, v in samples if n == "vllm:request_success_total")
        return counts

    async def decisions(self) -> Counter[str]:
        """Routing decisions for the model so far, by reason, summed over the members."""
        tally: Counter[str] = Counter()
        for node in self.nodes:
            for name, labels, value in await self._samples(node.api + "/metrics"):
                if name == "nvpair_routing_decisions_total" and labels.get("model") == MODEL:
                    tally[labels.get("reason", "?")] += int(value)
        return tally

    def first_replica(self, body: dict[str, Any]) -> str:
        """The replica a request's anchor names first (`scheduler.prefix`, as every member
        computes it with every replica ready)."""
        anchor, _ = anchor_of(body, self.anchor_key)
        return rendezvous(anchor, sorted(self.engines))[0]


async def converse(
    mesh: Mesh,
    shape: Shape,
    systems: list[str],
    rng: random.Random,
    gate: asyncio.Semaphore,
    answers: list[Answer],
) -> str:
    """One conversation, turn after turn; the replica its anchor names first."""
    async with gate:
        messages = [
            {"role": "system", "content": systems[shape.system]},
            {"role": "user", "content": words(rng, shape.task_words)},
        ]
        first = mesh.first_replica({"model": MODEL, "messages": messages})
        said = ""
        for turn, (member, pause) in enumerate(zip(shape.members, shape.pauses, strict=True)):
            await asyncio.sleep(pause)  # the trace's arrival or tool time, not a wait for state
            if turn:
                messages.append({"role": "assistant", "content": said})
                messages.append({"role": "user", "content": words(rng, shape.tool_words[turn - 1])})
            body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
            url = mesh.facades[member] + "/v1/chat/completions"
            started = time.perf_counter()
            async with mesh.session.post(url, json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"turn {turn} answered {response.status}: {answer}")
            elapsed_ms = (time.perf_counter() - started) * 1000
            usage = answer["usage"]
            cached = int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
            answers.append(Answer(elapsed_ms, int(usage["prompt_tokens"]), cached))
            said = answer["choices"][0]["message"]["content"]
        return first


async def run_once(mesh: Mesh, trace: Trace, policy: str, *, tag: str, concurrency: int) -> Run:
    """The trace under `policy`, its words drawn from `tag` (fresh for every run)."""
    await mesh.set_policy(policy)
    rng = random.Random(f"prefix-routing words {tag} systems")
    systems = [words(rng, n) for n in trace.system_words]
    before, decided = await mesh.served(), await mesh.decisions()
    gate = asyncio.Semaphore(concurrency)
    answers: list[Answer] = []
    started = time.perf_counter()
    firsts = await asyncio.gather(
        *(
            converse(mesh, shape, systems, random.Random(f"{tag} {i}"), gate, answers)
            for i, shape in enumerate(trace.conversations)
        )
    )
    seconds = time.perf_counter() - started
    after = await mesh.served()
    per_replica = {rid: after[rid] - before.get(rid, 0.0) for rid in after}
    expected: Counter[str] = Counter()
    for shape, first in zip(trace.conversations, firsts, strict=True):
        expected[first] += len(shape.members)
    off_anchor = sum(max(0, int(expected[r] - per_replica[r])) for r in per_replica)
    decisions = await mesh.decisions()
    decisions.subtract(decided)
    return Run(answers, seconds, per_replica, +decisions, off_anchor)


def member_nodes(root: Path) -> list[Node]:
    """Three members with their own engine ports, as `tests.agent.deploy_harness` makes
    them, logging warnings only (debug lines for every request would cost the engines CPU
    on a 2-core machine)."""
    nodes = []
    for name in ("a", "b", "c")[:MEMBERS]:
        node = make_node(root, name, GPUS)
        node.extra = ["--log-level", "warn"]  # after the harness's own: the last one counts
        node.home.mkdir(parents=True)
        low, high = engine_ports()
        (node.home / "nvpair.toml").write_text(
            f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
        )
        (node.home / "nvpair.toml").chmod(0o600)
        nodes.append(node)
    return nodes


@contextlib.asynccontextmanager
async def started_mesh(root: Path) -> AsyncIterator[Mesh]:
    """The members started and formed; every agent and engine process gone at the end,
    also on failure (`start_cluster` stops the agents and kills their engines; what
    still runs after that is killed here)."""
    nodes = member_nodes(root)
    generator = cast(AsyncGenerator[list[Node], None], start_cluster(nodes))
    try:
        async with (
            contextlib.aclosing(generator) as cluster,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            async for _ in cluster:
                await eventually(lambda: formed(nodes), "every member lists all", within_s=WAIT_S)
                yield Mesh(nodes, session)
                break
    finally:
        leftover = [n.proc for n in nodes if n.proc is not None and n.proc.returncode is None]
        for proc in leftover:
            proc.kill()
            await proc.wait()
        pids = [pid for n in nodes for pid in engine_pids(n.home).values()]
        with contextlib.suppress(AssertionError):  # said below instead
            await eventually(lambda: not any(alive(p) for p in pids), "the engines gone")
        engines = [pid for pid in pids if alive(pid)]
        if leftover or engines:
            print(f"killed {len(leftover)} agents left running; engines alive: {engines}")


async def main_async(args: argparse.Namespace) -> None:
    runs: dict[str, list[Run]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        async with started_mesh(Path(tmp)) as mesh:
            await mesh.deploy(args.prefill_ms, args.cache_blocks)
            per_member = Counter(mesh.node_of.values())
            print(
                f"setup: {MEMBERS} members, {REPLICAS} mock replicas "
                f"({'+'.join(str(c) for c in sorted(per_member.values()))} per member), "
                f"TTFT 5 ms + {args.prefill_ms:g} ms per uncached word, "
                f"{args.cache_blocks} blocks of {BLOCK_UNITS} words cached per replica; "
                f"{args.conversations} conversations per run, {args.concurrency} at once"
            )
            # A warm-up, not counted: connections opened, every path taken once.
            warm = draw_trace(args.seed, -1, args.concurrency, args.concurrency)
            await run_once(mesh, warm, "load", tag="warm-up", concurrency=args.concurrency)
            for i in range(args.rounds):
                trace = draw_trace(args.seed, i, args.conversations, args.concurrency)
                order = POLICIES[i % 3 :] + POLICIES[: i % 3]
                for policy in order:
                    run = await run_once(
                        mesh,
                        trace,
                        policy,
                        tag=f"{args.seed} {i} {policy}",
                        concurrency=args.concurrency,
                    )
                    runs[policy].append(run)
                    print(
                        f"  round {i} {policy}: {len(run.answers)} requests, "
                        f"TTFT p50 {run.ttft(0.5):.0f} ms, {run.rate:.1f} requests/s",
                        flush=True,
                    )
    shape = draw_trace(args.seed, 0, args.conversations, args.concurrency)
    own = sum(c.task_words + sum(c.tool_words) + 4 * len(c.tool_words) for c in shape.conversations)
    distinct = own + sum(shape.system_words)
    print(
        f"trace (round 0): {shape.requests} requests, {distinct:,} distinct prompt words "
        f"({sum(shape.system_words):,} of them the system prompts), "
        f"{args.cache_blocks * BLOCK_UNITS / distinct:.0%} of them fit one replica's cache"
    )
    for policy in POLICIES:
        done = runs[policy]
        p50 = [r.ttft(0.5) for r in done]
        line = (
            f"{policy}: TTFT p50 {statistics.median(p50):.0f} ms "
            f"(rounds: {' '.join(f'{v:.0f}' for v in p50)}), "
            f"p99 {statistics.median(r.ttft(0.99) for r in done):.0f} ms; "
            f"cached {statistics.median(r.cached_share for r in done):.0%} of prompt words; "
            f"{statistics.median(r.rate for r in done):.1f} requests/s; "
            f"busiest replica {statistics.median(r.max_over_mean for r in done):.2f}x the mean "
            f"(worst round {max(r.max_over_mean for r in done):.2f}x)"
        )
        print(line)
    prefix_runs = runs["prefix"]
    decided: Counter[str] = Counter()
    for run in prefix_runs:
        decided.update(run.decisions)
    total = sum(len(r.answers) for r in prefix_runs)
    off = sum(r.off_anchor for r in prefix_runs)
    print(
        "prefix decisions: "
        + ", ".join(f"{reason} {count}" for reason, count in sorted(decided.items()))
        + f"; at least {off} of {total} requests ({off / max(1, total):.0%}) "
        "left their anchor's first replica"
    )
    # report() wants higher-is-better rates: 1 / TTFT p50, so its ratio (subject /
    # baseline) is load p50 / prefix p50.
    report(
        [1000 / r.ttft(0.5) for r in runs["load"]],
        [1000 / r.ttft(0.5) for r in prefix_runs],
        unit="/s (1 / TTFT p50)",
        label="1/TTFT p50, load (baseline) vs prefix (subject):",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=60, help="per run")
    parser.add_argument("--concurrency", type=int, default=24, help="conversations at once")
    parser.add_argument("--prefill-ms", type=float, default=0.15, help="per uncached word")
    parser.add_argument("--cache-blocks", type=int, default=1152, help="per replica")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
