"""A three-member cluster of the previous release upgraded to this one a member at a time
under a steady load of requests and lifecycle events, one member killed during its upgrade,
then one rolled back (issue 27, item 5).

While it is mixed, deployments and keys are declared on an old member and on a new one, and
two more members are removed, one by each. At the end every member's Jobs list is exactly
what the clients were told (the fault tier's ledger), every request was answered (a client
that finds a member down tries the next), and deployments, keys, removals and replicas are
the same on every member, each deployment and key served by every member's facade."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import pytest

from tests.agent.harness import Node, eventually, make_node, start_cluster
from tests.reliability.cluster import Member
from tests.reliability.ledger import RememberingClient, list_jobs

from .previous import Previous

pytestmark = pytest.mark.asyncio(loop_scope="function")

CHAT: Final[dict[str, Any]] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CONVERGE_S: Final = 90.0


@dataclass
class Requests:
    """Chat requests at a steady pace, each to the next member; a member that does not
    answer (it is being restarted) is skipped for the next, as a client behind a list of
    addresses does. Counts what was answered."""

    nodes: list[Node]
    key: str
    answered: int = 0
    retried: int = 0
    failed: int = 0
    statuses: dict[int, int] | None = None
    by_node: dict[str, int] | None = None  # answered, by the member that answered
    # Members about to be killed -9: what they answer may not be in their Jobs list (a
    # job's last events can be in the writer's batch when the kill comes), counted apart.
    doomed: set[str] = field(default_factory=set)
    maybe: dict[str, int] = field(default_factory=dict)  # answered by a doomed member

    async def run(
        self, stop: asyncio.Event, models: Iterable[str], *, pace_s: float = 0.05
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        headers = {"Authorization": f"Bearer {self.key}"}
        order = itertools.cycle(range(len(self.nodes)))
        cycle = itertools.cycle(list(models))
        self.statuses = {}
        self.by_node = {}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            while not stop.is_set():
                model = next(cycle)
                first = next(order)
                for attempt in range(len(self.nodes)):
                    node = self.nodes[(first + attempt) % len(self.nodes)]
                    status = await _chat(session, node, model)
                    if status == 200:
                        self.answered += 1
                        tally = self.maybe if node.name in self.doomed else self.by_node
                        tally[node.name] = tally.get(node.name, 0) + 1
                        break
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                    self.retried += 1
                else:
                    self.failed += 1
                await asyncio.sleep(pace_s)  # the load's pace, not a wait for a result

    def line(self) -> str:
        return (
            f"requests: answered {self.answered}, retried on another member {self.retried} "
            f"({self.statuses}), failed {self.failed}"
        )


async def _chat(session: aiohttp.ClientSession, node: Node, model: str) -> int:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1/chat/completions"
    try:
        async with session.post(url, json={"model": model, **CHAT}) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, TimeoutError):
        return 0  # not answered: down, or going down


async def _ok(node: Node, *args: str) -> str:
    code, out, err = await node.cli(*args)
    assert code == 0, f"{node.name}: nvpair {' '.join(args)}: {err}"
    return out


async def _key(node: Node, name: str) -> str:
    return (await _ok(node, "keys", "create", name)).splitlines()[0]


async def _deploy(node: Node, name: str, replicas: int) -> None:
    await _ok(node, "deploy", name, "--engine", "mock", "--model", name, "--gpus", "0",
              "--replicas", str(replicas))  # fmt: skip


async def _ready(node: Node, wanted: dict[str, int]) -> bool:
    shown = {d["name"]: d.get("replicaStates", {}) for d in await node.get("/v1/deployments")}
    return set(shown) == set(wanted) and all(
        shown[name] == {"ready": count} for name, count in wanted.items()
    )


async def _switch(node: Node, python: str, *, killed_midway: Requests | None = None) -> float:
    """Stop `node`'s agent and start it under `python` (another release); with
    `killed_midway` (the requests' client) the new agent is killed -9 once up and started
    again. Seconds taken."""
    started = time.monotonic()
    await node.stop()
    node.python = python
    if killed_midway is not None:
        killed_midway.doomed.add(node.name)
    await node.start()
    if killed_midway is not None:
        await Member(node, {}).kill_agent()
        killed_midway.doomed.discard(node.name)
        await node.start()
    return time.monotonic() - started


async def _status(node: Node) -> dict[str, Any]:
    import json

    return dict(json.loads(await _ok(node, "cluster", "status", "--json")))


async def test_a_rolling_upgrade_and_a_rollback_under_load(
    previous: Previous, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("upgrade")
    nodes = [make_node(root, name, None) for name in "abcde"]
    for node in nodes:
        node.python = previous.python
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 0.5\n")
    async for _ in start_cluster(nodes):
        await _scenario(nodes, previous)


async def _scenario(nodes: list[Node], previous: Previous) -> None:
    this = sys.executable
    a, b, c, d, e = nodes
    trio = [a, b, c]
    ids = {n.name: await n.node_id() for n in nodes}
    members = [Member(n, {}, node_id=ids[n.name]) for n in trio]
    assert (await _ok(a, "--version")).strip() == previous.version
    load_key = await _key(a, "load")
    await _deploy(a, "chat", 3)
    await eventually(lambda: _ready(c, {"chat": 3}), "chat ready on the old release", within_s=60)

    stop = asyncio.Event()
    requests = Requests(trio, load_key)
    traffic = asyncio.create_task(requests.run(stop, ["chat"]))
    # The facades' own jobs (the requests') are compared between members, not with the
    # events this client entered (its runs are named `up<batch>-run`).
    ledger_runs = RememberingClient(
        random.Random(27), others=lambda key: not key[1].startswith("up")
    )
    async with ledger_runs as ledger:

        async def lifecycle_load() -> None:
            for batch in itertools.count():
                if stop.is_set():
                    return
                await ledger.load(members, jobs=40, rate_per_s=20, prefix=f"up{batch}")

        events = asyncio.create_task(lifecycle_load())
        took: dict[str, float] = {}
        # 1. a runs this release; b and c the previous one.
        took["a up"] = await _switch(a, this)
        await _deploy(a, "from-new", 1)  # declared on a new member ...
        await _deploy(b, "from-old", 1)  # ... and on an old one
        new_key = await _key(a, "team-new")
        old_key = await _key(c, "team-old")
        await _ok(a, "cluster", "remove", ids["d"])  # removed by a new member ...
        await _ok(b, "cluster", "remove", ids["e"])  # ... and by an old one
        await d.stop()
        await e.stop()
        # 2. b, killed during its upgrade; 3. c.
        took["b up, killed midway"] = await _switch(b, this, killed_midway=requests)
        took["c up"] = await _switch(c, this)
        everyone = await _status(a)
        await eventually(lambda: _wire_is(a, 2), "every member speaks wire 2 once all are upgraded")
        # 4. c rolled back to the previous release.
        took["c back"] = await _switch(c, previous.python)
        await eventually(lambda: _wire_is(a, 1), "the gate closes again behind c")
        held = (await _status(a))["heldBackBy"]
        assert [m["nodeId"] for m in held] == [ids["c"]]
        stop.set()
        await events
        await traffic
        try:
            await ledger.wait_converged(members, within_s=CONVERGE_S)
        except AssertionError as exc:
            diffs = [str(d) for d in await ledger.divergences(members) if d]
            raise AssertionError(f"{exc}: {'; '.join(diffs)}") from None
    print(ledger.figures.line("rolling upgrade and rollback"))
    async with aiohttp.ClientSession() as session:
        inference = [
            {k: v for k, v in (await list_jobs(session, m)).items() if not k[1].startswith("up")}
            for m in members
        ]
    assert all(jobs == inference[0] for jobs in inference)  # the same on every member
    origins = {ids[n.name]: n.name for n in nodes}
    per_origin = Counter(origins.get(job[0], job[0]) for job in inference[0])
    print(
        f"inference jobs by origin {per_origin}, answered by member {requests.by_node} "
        f"and by a member killed -9 right after {requests.maybe}"
    )
    for name, answered in (requests.by_node or {}).items():  # every answered request is a job
        assert answered <= per_origin.get(name, 0) <= answered + requests.maybe.get(name, 0)
    print(requests.line())
    print("switches: " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))
    assert requests.failed == 0, requests.line()
    assert everyone["release"] != previous.version

    # Deployments, keys, removals and replicas converge on every member, and each
    # deployment and key declared while mixed is served by every member's facade.
    wanted = {"chat": 3, "from-new": 1, "from-old": 1}
    for node in trio:
        await eventually(
            lambda n=node: _ready(n, wanted), f"{node.name}: replicas", within_s=CONVERGE_S
        )
        keys = {k["name"] for k in await node.get("/v1/keys")}
        assert keys == {"load", "team-new", "team-old"}, node.name
        gone = {m["nodeId"] for m in await node.get("/v1/members") if m["removed"]}
        assert gone == {ids["d"], ids["e"]}, node.name
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for node, model, secret in itertools.product(trio, wanted, (new_key, old_key)):
            session.headers["Authorization"] = f"Bearer {secret}"
            assert await _chat(session, node, model) == 200, (node.name, model)


async def _wire_is(node: Node, version: int) -> bool:
    return int((await _status(node))["clusterWire"]) == version
