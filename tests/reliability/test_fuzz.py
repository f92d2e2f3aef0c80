"""Fuzzing every input of an agent (issue 11, item 7): deep nesting, huge numbers, invalid
UTF-8, wrong types, unknown methods and fields, mutated valid bodies, a body just over each
limit and a slow client, thrown at `POST /v1/workloads/events` (the manager's mTLS port, as
a pinned peer), the node API, the local API and the facade. The manager's local channel and
the plane's `POST /v1/sync` are in test_fuzz_standalone.py; the inputs in fuzz_inputs.py.

After each batch: the process is alive (its manager not restarted), every answer is an error
the route documents (never a 500, never a dropped connection), and nothing changed but what a
taken mutation may change -- paired with a control that is taken and shows up.

One two-member cluster of real agents serves the module: a is fuzzed and serves `llama` on
a mock engine; b's cluster certificate is the pinned peer that calls a's mTLS ports.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import strategies as st

from certs import ClientContexts, ClusterDir, server_hostname_for
from tests.agent.harness import Engine, Node, make_node, start_cluster, start_engine
from tests.fixtures.records import lifecycle_event, workload_record
from tests.fixtures.waiting import eventually

from .fuzz_inputs import (
    HUGE,
    Answer,
    Rows,
    cases,
    changed,
    draw,
    is_json_value,
    openai_error,
    reaches_engine,
    rpc_documented,
    slow_request,
    text_error,
    throw,
)
from .tiers import Tier

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.quick,
    pytest.mark.asyncio(loop_scope="module"),
]

MiB = 1024 * 1024


@dataclass
class Rig:
    """The module's cluster: a (fuzzed), b (the pinned peer whose certificate calls a)."""

    a: Node
    b: Node
    a_id: str
    b_id: str
    session: aiohttp.ClientSession  # plain HTTP
    mtls: aiohttp.ClientSession  # b's cluster certificate

    async def post(
        self, url: str, body: bytes, *, tls: bool = False, headers: dict[str, str] | None = None
    ) -> Answer:
        session = self.mtls if tls else self.session
        extra: dict[str, Any] = {"server_hostname": server_hostname_for(self.a_id)} if tls else {}
        try:
            # A large body goes as a stream (aiohttp warns about big raw bytes).
            data = io.BytesIO(body) if len(body) > MiB else body
            sent = {"Content-Type": "application/json", **(headers or {})}
            if url.startswith(self.a.api):
                sent = self.a.owner | sent  # the local API's token
            async with session.post(
                url, data=data, headers=sent,
                **extra,
            ) as response:  # fmt: skip
                return Answer(response.status, response.content_type, await response.read())
        except aiohttp.ClientError as exc:
            return Answer(0, type(exc).__name__, str(exc).encode())

    async def rows(self) -> Rows:
        """a's whole Jobs list, by job."""
        return {(j["originatedFrom"], j["runId"], j["id"]): j for j in await self.a.jobs()}

    async def restarts(self) -> int:
        return int((await self.a.get("/healthz"))["manager"]["restarts"])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine() -> AsyncIterator[Engine]:
    started = await start_engine("llama")
    yield started
    await started.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> AsyncIterator[Rig]:
    root = tmp_path_factory.mktemp("fuzz")
    nodes = [make_node(root, "a", "l4:2"), make_node(root, "b", "l4:2")]
    nodes[0].extra = ["--engine", f"vllm={engine.url}"]
    async for a, b in start_cluster(nodes):

        async def serves(a: Node = a) -> bool:
            return any(m["id"] == "llama" for m in (await a.get_facade("/v1/models"))["data"])

        await eventually(serves, "a's facade serves llama")
        context = ClientContexts(ClusterDir(b.home / "cluster")).current()
        async with (
            aiohttp.ClientSession() as session,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as mtls,
        ):
            yield Rig(a, b, await a.node_id(), await b.node_id(), session, mtls)


async def alive(rig: Rig, restarts: int) -> None:
    assert rig.a.proc is not None
    assert rig.a.proc.returncode is None, "agent a died"
    assert await rig.a.healthy(), "a's /healthz is not ok"
    assert await rig.restarts() == restarts, "a's workload manager restarted"


async def test_local_api_events(rig: Rig, tier: Tier) -> None:
    url = rig.a.api + "/v1/jobs/events"
    base = lifecycle_event(workload_record("fz-base", 1, origin=rig.a_id, run="fz"))
    assert (await rig.post(url, json.dumps(base).encode())).status == 202  # the control
    before, restarts = await rig.rows(), await rig.restarts()
    assert ((rig.a_id, "fz", "fz-base")) in before
    batch = cases(base, count=tier.pick(40, 2000), limit=MiB)
    taken = await throw(batch, lambda body: rig.post(url, body), text_error(400, 413))
    await alive(rig, restarts)
    after = await rig.rows()
    assert len(changed(before, after)) <= taken, changed(before, after)
    # The control after: a new event is taken and listed.
    record = workload_record("fz-after", 1, origin=rig.a_id, run="fz")
    assert (await rig.post(url, json.dumps(lifecycle_event(record)).encode())).status == 202
    assert (rig.a_id, "fz", "fz-after") in await rig.rows()


async def test_local_api_operations_and_removals(rig: Rig, tier: Tier) -> None:
    before, restarts = await rig.rows(), await rig.restarts()
    count = tier.pick(20, 1000)
    ops = cases({"kind": "cordon", "target": "nod_nobody"}, count=count, limit=MiB)
    await throw(ops, lambda b: rig.post(rig.a.api + "/v1/ops", b), text_error(400, 413))
    gone = rig.a.api + "/v1/jobs/fz-none/remove"
    removals = cases({"originatedFrom": rig.a_id}, count=count, limit=MiB)
    await throw(removals, lambda b: rig.post(gone, b), text_error(400, 404, 413))
    await alive(rig, restarts)
    assert changed(before, await rig.rows()) == []
    assert await rig.a.get("/v1/ops") == []
    # The control: a removal of a job a originated is taken and the job leaves the list.
    url = rig.a.api + "/v1/jobs/fz-base/remove"
    assert (await rig.post(url, b"")).status == 200
    assert (rig.a_id, "fz", "fz-base") not in await rig.rows()


async def test_local_api_queries(rig: Rig, tier: Tier) -> None:
    # GET /v1/jobs takes only its query: any text in any of its parameters is a 200 or a 400.
    names = st.sampled_from(["state", "node", "limit", "after", "page"])
    values = st.text(max_size=30) | st.sampled_from([s.decode() for s in HUGE]) | st.just("%ff")
    queries = draw(st.dictionaries(names, values, min_size=1, max_size=3), tier.pick(40, 2000))
    before, restarts = await rig.rows(), await rig.restarts()
    problems = []
    for query in queries:
        jobs = rig.a.api + "/v1/jobs"
        async with rig.session.get(jobs, params=query, headers=rig.a.owner) as response:
            answer = Answer(response.status, response.content_type, await response.read())
        if (why := text_error(400)(answer)) is not None:
            problems.append(f"{query!r} -> {answer.status} {answer.body[:100]!r}: {why}")
    assert not problems, "\n".join(problems[:15])
    await alive(rig, restarts)
    assert changed(before, await rig.rows()) == []


async def test_manager_events(rig: Rig, tier: Tier) -> None:
    url = f"https://127.0.0.1:{rig.a.ports['manager']}/v1/workloads/events"

    def note(wid: str) -> dict[str, Any]:
        record = workload_record(wid, 1, origin=rig.b_id, run="fz-peer")
        return {"jsonrpc": "2.0", **lifecycle_event(record)}

    def documented(answer: Answer) -> str | None:
        if answer.status in (200, 400):
            if not is_json_value(answer):
                return "a 200 or 400 carries JSON-RPC responses"
            return rpc_documented(json.loads(answer.body))
        return text_error(413, 415, 503)(answer)

    async def listed(key: tuple[str, ...]) -> bool:
        return key in await rig.rows()

    base = note("fz-peer-base")
    assert (await rig.post(url, json.dumps(base).encode(), tls=True)).status == 202
    await eventually(lambda: listed((rig.b_id, "fz-peer", "fz-peer-base")), "the control")
    before, restarts = await rig.rows(), await rig.restarts()
    batch = cases(
        base, count=tier.pick(40, 2000), limit=8 * MiB,
        unknown=lambda body, name: {**body, "method": name},
    )  # fmt: skip
    taken = await throw(batch, lambda body: rig.post(url, body, tls=True), documented)
    control = json.dumps(note("fz-peer-after")).encode()
    assert (await rig.post(url, control, tls=True)).status == 202
    await eventually(lambda: listed((rig.b_id, "fz-peer", "fz-peer-after")), "the control after")
    await alive(rig, restarts)
    after = await rig.rows()
    assert len(changed(before, after)) <= taken + 1, changed(before, after)


NODE_ROUTES = [
    ("/v1/records", {"records": []}),
    ("/v1/cordon", {"cordoned": False}),
    ("/v1/cancel", {"target": "nod_nobody"}),
    ("/v1/repair/digest", {"jobs": [[1, 1, 1]], "removed": []}),
    ("/v1/repair/exchange", {"want": [["nod_x", "run", "1"]]}),
    ("/v1/limits/lease", {"keys": [{"name": "nobody", "want": 1, "tokens": 0}]}),
]


@pytest.mark.parametrize(("route", "base"), NODE_ROUTES, ids=[r for r, _ in NODE_ROUTES])
async def test_node_api(rig: Rig, tier: Tier, route: str, base: dict[str, Any]) -> None:
    # A digest's counts have no upper bound (only compared, never stored): a huge one is a
    # digest that differs, not an error. Everything else a route takes must leave a alone.
    url = f"https://127.0.0.1:{rig.a.ports['node']}{route}"

    async def members() -> Any:
        nodes = sorted((n["nodeId"], n["cordoned"]) for n in await rig.a.get("/v1/nodes"))
        return nodes, await rig.a.get("/v1/members")

    assert (await rig.post(url, json.dumps(base).encode(), tls=True)).status == 200
    before, restarts, seen = await rig.rows(), await rig.restarts(), await members()
    batch = cases(base, count=tier.pick(25, 1000), limit=4 * MiB)
    if route == "/v1/repair/digest":
        batch = [replace(c, may_be_taken=True) if c.kind == "huge" else c for c in batch]
    await throw(batch, lambda body: rig.post(url, body, tls=True), text_error(400, 413, 415))
    await alive(rig, restarts)
    assert changed(before, await rig.rows()) == []
    assert await members() == seen
    # The control: a cordon through the node API is taken and shows in a's record.
    cordon = f"https://127.0.0.1:{rig.a.ports['node']}/v1/cordon"
    for cordoned in (True, False):
        body = json.dumps({"cordoned": cordoned}).encode()
        assert (await rig.post(cordon, body, tls=True)).status == 200

        async def shows(cordoned: bool = cordoned) -> bool:
            return (rig.a_id, cordoned) in (await members())[0]

        await eventually(shows, f"a's record says cordoned={cordoned}")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_facade(rig: Rig, tier: Tier, route: str) -> None:
    url = f"http://127.0.0.1:{rig.a.ports['facade']}{route}"
    base = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    before, restarts = await rig.rows(), await rig.restarts()
    # Only the model is the facade's to check; the rest goes to the engine as it came.
    batch = cases(
        base, count=tier.pick(40, 2000), limit=8 * MiB,
        targets=lambda path: path in ((), ("model",)),
        unknown=lambda body, name: {**body, "model": name},  # a model nobody serves
    )  # fmt: skip
    batch = [replace(c, may_be_taken=reaches_engine(c.body)) for c in batch]
    may_run = sum(reaches_engine(c.body) for c in batch)
    await throw(batch, lambda body: rig.post(url, body), openai_error)
    await alive(rig, restarts)
    new = changed(before, await rig.rows())
    assert len(new) <= may_run, new
    # The control: a valid request is answered and its job is listed, finished.
    answer = await rig.post(url, json.dumps(base).encode())
    assert answer.status == 200, answer

    async def listed() -> bool:
        jobs = changed(before, after := await rig.rows())
        return len(jobs) > len(new) and all(
            after[k]["state"] in ("completed", "failed", "cancelled") for k in jobs
        )

    await eventually(listed, "the control's job, finished, and every fuzzed job finished")


async def test_facade_models_ignores_bodies(rig: Rig) -> None:
    # GET /v1/models takes no input but its query: junk there changes nothing.
    url = f"http://127.0.0.1:{rig.a.ports['facade']}/v1/models?model=%ff&limit=1e400"
    async with rig.session.get(url, data=b"[" * 100_000) as response:
        assert response.status == 200
        assert any(m["id"] == "llama" for m in (await response.json())["data"])


SLOW = [
    ("api", "/v1/jobs/events", False, 202),
    ("manager", "/v1/workloads/events", True, 202),
    ("node", "/v1/cordon", True, 200),
    ("facade", "/v1/completions", False, 404),
]


@pytest.mark.parametrize(("kind", "route", "tls", "status"), SLOW, ids=[k for k, *_ in SLOW])
async def test_a_slow_client_holds_up_nobody(
    rig: Rig, tier: Tier, kind: str, route: str, tls: bool, status: int
) -> None:
    origin = rig.b_id if kind == "manager" else rig.a_id
    event = lifecycle_event(workload_record(f"fz-slow-{kind}", 1, origin=origin, run="fz-slow"))
    body = {
        "api": event,
        "manager": {"jsonrpc": "2.0", **event},
        "node": {"cordoned": False},
        "facade": {"model": "nobody-serves-this", "prompt": "x"},
    }[kind]
    data = json.dumps(body).encode()
    port = rig.a.ports[kind]
    head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in rig.a.owner.items()) if kind == "api" else ""
    request = (head + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    context = ClientContexts(ClusterDir(rig.b.home / "cluster")).current() if tls else None
    slow = asyncio.create_task(
        slow_request(
            rig.a.ports[kind], request + data, pace_s=tier.pick(0.005, 0.2), context=context,
            server_hostname=server_hostname_for(rig.a_id) if tls else None,
        )
    )  # fmt: skip
    scheme = "https" if tls else "http"
    control = await rig.post(f"{scheme}://127.0.0.1:{rig.a.ports[kind]}{route}", data, tls=tls)
    assert control.status == status, control
    assert not slow.done(), "the slow client finished first: nothing was held up"
    assert (await slow).startswith(f"HTTP/1.1 {status}".encode())
    await alive(rig, await rig.restarts())
