"""Fuzzing the two inputs that need no agent (issue 11, item 7; the agent's are in
test_fuzz.py): the workload manager's local channel (a real `python -m workload_manager
--ipc`, lines thrown at it as its broker) and the plane's `POST /v1/sync` (a real plane
server on a throw-away PostgreSQL). The same input kinds and properties: alive, every
answer documented, nothing changed but what a taken input may change, and a control."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import psycopg
import pytest
import pytest_asyncio
from psycopg_pool import AsyncConnectionPool

from plane.db.migrate import migrate
from plane.db.store import PlaneStore
from plane.http.server import MAX_BODY, PlaneServer
from tests.fixtures.records import workload_record
from tests.plane.conftest import pg_server  # noqa: F401 -- the session's throw-away PostgreSQL
from tests.plane.plane_client import ADMIN, ClusterCa, signed
from tests.workload_manager.manager_process import Channel, ManagerProcess

from .fuzz_inputs import Answer, Case, cases, changed, rpc_documented, throw
from .tiers import Tier

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.quick,
    pytest.mark.asyncio(loop_scope="module"),
]

MiB = 1024 * 1024


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def manager(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ManagerProcess, Channel]]:
    proc = await ManagerProcess.start(ipc=tmp_path_factory.mktemp("wm") / "wm.sock")
    assert proc.proc.stderr is not None
    # Its log is read as it comes, so a chatty refusal cannot fill the pipe and stall it.
    drain = asyncio.create_task(proc.proc.stderr.read())
    channel = await proc.connect()
    await channel.handshake()
    yield proc, channel
    await channel.close()
    drain.cancel()
    await asyncio.gather(drain, return_exceptions=True)
    await proc.aclose()


def _has_result(reply: Any) -> bool:
    replies = reply if isinstance(reply, list) else [reply]
    return any(isinstance(r, dict) and "result" in r for r in replies)


async def throw_lines(channel: Channel, batch: list[Case]) -> list[str]:
    """Send each case as a line, then a probe; every reply before the probe's must be a
    documented response, and only a case that may be taken may have a result."""
    problems = []
    for n, case in enumerate(batch):
        await channel.send_raw(case.body + b"\n")
        await channel.send({"jsonrpc": "2.0", "method": "manager:status", "id": f"probe-{n}"})
        while (reply := await channel.recv()) is not None:
            if isinstance(reply, dict) and reply.get("id") == f"probe-{n}":
                break
            if isinstance(reply, dict) and "method" in reply:
                continue  # the manager asking its broker something: not an answer
            why = rpc_documented(reply)
            if why is None and _has_result(reply) and not case.may_be_taken:
                why = "taken"
            if why is not None:
                problems.append(f"{case!r} -> {str(reply)[:200]}: {why}")
    return problems


async def test_manager_local_channel(manager: tuple[ManagerProcess, Channel], tier: Tier) -> None:
    proc, channel = manager

    async def accepted() -> int:
        status = (await channel.request("manager:status"))["result"]
        return int(status["counters"]["accepted"])

    record = workload_record("ch-base", 1, origin="nod_a", run="fz")
    params = {"workloadInfo": record}
    assert (await channel.request("workload:submitted", params))["result"]["accepted"]
    base = {"jsonrpc": "2.0", "method": "workload:submitted", "params": params, "id": 1}
    batch = cases(
        base, count=tier.pick(40, 2000), limit=MiB,
        targets=lambda path: path != ("id",),  # an id may be a string, a number or null
        unknown=lambda body, name: {**body, "method": name},
    )  # fmt: skip
    # Nothing but a mutation or an oddity may be accepted: those go last, counted apart.
    strict = [c for c in batch if not c.may_change]
    before = await accepted()
    problems = await throw_lines(channel, strict)
    assert await accepted() == before, "a refused line was accepted"
    loose = [c for c in batch if c.may_change]
    problems += await throw_lines(channel, loose)
    assert not problems, f"{len(problems)} answers:\n" + "\n".join(problems[:15])
    assert await accepted() - before <= len(loose)
    assert proc.proc.returncode is None, "the manager died"
    # A slow broker: a line a byte at a time (the pace is the fault), then the control:
    # a new event is accepted and held.
    line = json.dumps({**base, "params": {"workloadInfo": {**record, "id": "ch-slow"}}})
    for byte in line.encode() + b"\n":
        await channel.send_raw(bytes([byte]))
        await asyncio.sleep(tier.pick(0.001, 0.05))
    reply = await channel.recv()
    assert reply["result"] == {"accepted": True}, reply


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def plane(pg_server: str) -> AsyncIterator[tuple[str, str, str]]:  # noqa: F811
    """A plane on its own database: (url, its cluster's id, the cluster's token)."""
    name = f"fuzz_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(f'CREATE DATABASE "{name}"'.encode())
    dsn = pg_server.rsplit("/", 1)[0] + "/" + name
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
        async with pool.connection() as conn:
            await migrate(conn)
        store = PlaneStore(pool)
        await store.ensure_admin(ADMIN)
        cluster_id, token = await store.enrol("fuzz")
        server = PlaneServer(store, host="127.0.0.1", port=0)
        port = await server.start()
        yield f"http://127.0.0.1:{port}", cluster_id, token
        await server.aclose()
    with contextlib.suppress(psycopg.Error):
        async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


def plane_error(answer: Answer) -> str | None:
    """Every plane error body is {"error": "..."} (plane/http/server.py)."""
    if answer.status < 300:
        return None if answer.status == 200 else f"status {answer.status}"
    if answer.status not in (400, 401, 403, 413, 415, 503):
        return f"status {answer.status} is not a documented plane error"
    try:
        error = msgspec.json.decode(answer.body)["error"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return 'not an {"error": ...} body'
    return None if isinstance(error, str) else 'not an {"error": ...} body'


async def test_plane_sync(plane: tuple[str, str, str], tier: Tier) -> None:
    url, cluster_id, token = plane
    node = "nod_" + "0" * 26
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    identity = ClusterCa("fuzz").node(node)  # every body is signed: the decoder is fuzzed
    async with aiohttp.ClientSession() as session:

        async def post(body: bytes) -> Answer:
            data = io.BytesIO(body) if len(body) > MiB else body
            headers = auth | signed(body, identity)
            try:
                async with session.post(url + "/v1/sync", data=data, headers=headers) as response:
                    return Answer(response.status, response.content_type, await response.read())
            except aiohttp.ClientError as exc:
                return Answer(0, type(exc).__name__, str(exc).encode())

        async def rows() -> dict[tuple[str, ...], Any]:
            query = f"/v1/jobs?cluster={cluster_id}&limit=1000"
            async with session.get(url + query, headers=admin) as response:
                assert response.status == 200
                jobs = (await response.json())["jobs"]
            return {(j["originatedFrom"], j["runId"], j["id"]): j for j in jobs}

        def batch_of(*wids: str, generation: int) -> dict[str, Any]:
            jobs = [workload_record(w, 1, origin=node, run="fz") for w in wids]
            node_row = {"name": "fuzz-node", "version": "1"}
            return {"nodeId": node, "generation": generation, "node": node_row, "jobs": jobs}

        base = batch_of("p-base", generation=1)
        assert (await post(json.dumps(base).encode())).status == 200  # the control
        before = await rows()
        assert (node, "fz", "p-base") in before
        found = cases(base, count=tier.pick(40, 2000), limit=MAX_BODY)
        taken = await throw(found, post, plane_error)
        after = await rows()
        assert len(changed(before, after)) <= taken, changed(before, after)
        # The control after: a newer generation with a new job is written and listed.
        newer = json.dumps(batch_of("p-base", "p-after", generation=10**12)).encode()
        assert (await post(newer)).status == 200
        assert (node, "fz", "p-after") in await rows()
        async with session.get(url + "/healthz") as response:
            assert response.status == 200
