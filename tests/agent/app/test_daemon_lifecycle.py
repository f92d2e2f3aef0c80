"""`nvpair agent run` as a daemon (issue 10): a port in use, two agents on one NVPAIR_HOME, a
signal during start-up, a Jobs database that cannot be written, an unusable NVPAIR_HOME and a
stale agent.json. Each test drives one real agent process through the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.agent.harness import Node, make_node
from tests.fixtures.forkserver import ForkedProcess
from tests.fixtures.waiting import TIMEOUT_S
from tests.workload_manager.cluster_harness import free_port

FLAGS = {"manager": "--manager-port", "node": "--node-port", "api": "--api-port"}
FLAGS["facade"] = "--facade-port"


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 20) -> None:
    """Wait until `check()` holds, polling; fail naming `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for: {what}")
        await asyncio.sleep(0.05)


def processes_with_home(home: Path) -> list[int]:
    """Live processes whose environment has NVPAIR_HOME=home: an agent and its children
    (orphans included, which a parent-pid check would miss once they are re-parented)."""
    needle = f"NVPAIR_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for a zombie
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


async def health(node: Node) -> tuple[int, Any]:
    """`GET /healthz`: its status and JSON body, whatever the status."""
    async with aiohttp.ClientSession() as session, session.get(node.api + "/healthz") as answer:
        return answer.status, await answer.json()


class Run:
    """One `nvpair agent run`, its stderr in a file read once it has exited."""

    def __init__(self, proc: asyncio.subprocess.Process | ForkedProcess, stderr: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr

    async def exited(self, within: float = TIMEOUT_S) -> int:
        """Its exit status; fails the test if it is still running after `within` seconds
        (the waits' bound: what is asserted is that it ends, not how fast on a busy machine)."""
        try:
            return await asyncio.wait_for(self.proc.wait(), within)
        except TimeoutError:
            raise AssertionError(
                f"agent run still running after {within} s; stderr so far:\n{self.stderr()}"
            ) from None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


class Agents:
    """Starts agents for one test and kills whatever is left of them at its end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[asyncio.subprocess.Process | ForkedProcess] = []
        self.homes: list[Path] = []

    async def run(self, node: Node, *extra: str, ports: dict[str, int] | None = None) -> Run:
        """`agent run` on `node`'s home, with `ports` (by kind) instead of the node's own."""
        chosen = {**node.ports, **(ports or {})}
        flags = [f"{FLAGS[kind]}={port}" for kind, port in chosen.items()]
        stderr = self.logs / f"{node.name}-{len(self.procs)}.stderr"
        with stderr.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "agent", "run", "--name", node.name, *flags, *extra,
                env=node.env, stdout=asyncio.subprocess.DEVNULL, stderr=sink,
            )  # fmt: skip
        self.procs.append(proc)
        self.homes.append(node.home)
        return Run(proc, stderr)

    async def start(self, node: Node) -> asyncio.subprocess.Process | ForkedProcess:
        """The harness's start (it waits for /healthz ok); the process is killed at the end."""
        self.homes.append(node.home)
        try:
            await node.start()
        finally:
            if node.proc is not None:
                self.procs.append(node.proc)
        assert node.proc is not None
        return node.proc

    async def aclose(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for home in self.homes:  # a child the agent left behind (a failure already reported)
            for pid in processes_with_home(home):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[Agents]:
    started = Agents(tmp_path)
    try:
        yield started
    finally:
        await started.aclose()


async def initialised(tmp_path: Path) -> Node:
    node = make_node(tmp_path, "a", None)
    code, _, err = await node.cli("cluster", "init", "--name", "lab", "--node-name", "a")
    assert code == 0, err
    return node


def nvpair_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("nvpair: ")]


# -- a port in use ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(FLAGS))
async def test_a_port_in_use_ends_the_agent_with_one_line(
    tmp_path: Path, agents: Agents, kind: str
) -> None:
    node = await initialised(tmp_path)
    port = node.ports[kind]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        run = await agents.run(node)
        code = await run.exited()
    err = run.stderr()
    assert code == 2, err
    lines = [line for line in nvpair_lines(err) if line.startswith(f"nvpair: port {port} ")]
    assert len(lines) == 1, err
    assert FLAGS[kind] in lines[0], lines[0]
    assert "another agent may be running" in lines[0], lines[0]
    assert processes_with_home(node.home) == [], "a child of the agent outlived it"
    assert not (node.home / "agent.json").exists()


# -- one agent per NVPAIR_HOME ------------------------------------------------------------------


async def test_a_second_agent_on_the_same_home_is_refused(tmp_path: Path, agents: Agents) -> None:
    node = await initialised(tmp_path)
    first = await agents.start(node)
    second = await agents.run(node, ports={kind: free_port() for kind in FLAGS})
    code = await second.exited()
    err = second.stderr()
    assert code == 2, err
    expected = f"nvpair: another agent (pid {first.pid}) is running with NVPAIR_HOME={node.home}"
    assert expected in nvpair_lines(err), err
    assert (node.home / "agent.lock").exists()
    # The control: the first agent is untouched and still the one the CLI finds.
    assert await node.healthy()
    assert json.loads((node.home / "agent.json").read_text())["pid"] == first.pid


# -- signals during start-up --------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_during_start_up_stops_the_agent(
    tmp_path: Path, agents: Agents, signum: signal.Signals
) -> None:
    # An engine that accepts and never answers holds start-up in its engine probe (up to 5 s).
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    engine = await asyncio.start_server(silent, "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    node = await initialised(tmp_path)
    try:
        run = await agents.run(node, "--engine", f"vllm=http://127.0.0.1:{engine_port}")
        await asyncio.wait_for(accepted.wait(), 20)
        # The control for "no child left": the workload manager child is there now.
        assert set(processes_with_home(node.home)) - {run.proc.pid}, "no workload manager child"
        run.proc.send_signal(signum)
        code = await run.exited()
    finally:
        for writer in held:
            writer.close()
        engine.close()
        await engine.wait_closed()
    err = run.stderr()
    assert code == 0, err
    assert "Traceback" not in err, err
    assert processes_with_home(node.home) == [], "a child of the agent outlived it"
    assert not (node.home / "agent.json").exists()


# -- the Jobs database cannot be written --------------------------------------------------------


def lock_jobs_db(home: Path) -> sqlite3.Connection:
    """Another process's write transaction on the Jobs database: in WAL mode the agent can
    still read, but every write fails with "database is locked" until it ends. (Root ignores
    file modes and an open fd ignores chmod, so this is how a store becomes unwritable.)"""
    db = sqlite3.connect(home / "jobs.db", isolation_level=None, timeout=10)
    db.execute("BEGIN EXCLUSIVE")
    return db


async def test_an_unwritable_jobs_store_is_named_and_loses_nothing(
    tmp_path: Path, agents: Agents
) -> None:
    node = await initialised(tmp_path)
    await agents.start(node)
    origin = await node.node_id()
    await node.enter("before", 1, origin)
    assert [j["id"] for j in await node.get("/v1/jobs")] == ["before"]  # the control: written
    failing: list[Any] = []

    async def store_failing() -> bool:
        nonlocal failing
        status, body = await health(node)
        failing = body.get("failing", [])
        return status == 503 and body["ok"] is False

    db = lock_jobs_db(node.home)
    # A 202 is durable (issue 11): these are answered only once the store takes them again.
    entered = [
        asyncio.create_task(node.enter(wid, seq, origin))
        for wid, seq in (("done", 1), ("done", 2), ("done", 3), ("queued", 1), ("before", 2))
    ]
    try:
        await eventually(store_failing, "/healthz 503 while the Jobs store cannot be written")
        assert "jobs-store" in [f["part"] for f in failing], failing
        assert all(f["error"] for f in failing), failing
        assert not any(task.done() for task in entered)  # not acknowledged while unwritten
    finally:
        db.rollback()
        db.close()
    await asyncio.gather(*entered)  # each a 202 once written

    async def healthy_again() -> bool:
        status, body = await health(node)
        return status == 200 and body["ok"] is True and body["failing"] == []

    await eventually(healthy_again, "/healthz ok once the Jobs store can be written")
    jobs = {j["id"]: j["state"] for j in await node.get("/v1/jobs")}
    assert jobs == {"before": "running", "done": "completed", "queued": "queued"}


async def test_an_agent_with_an_unwritable_jobs_store_stops_when_asked(
    tmp_path: Path, agents: Agents
) -> None:
    node = await initialised(tmp_path)
    proc = await agents.start(node)
    db = lock_jobs_db(node.home)
    origin = await node.node_id()
    # A batch that cannot be written (its 202 waits for the commit that does not come).
    stuck = asyncio.create_task(node.enter("stuck", 1, origin))

    async def store_failing() -> bool:
        return (await health(node))[0] == 503

    try:
        await eventually(store_failing, "/healthz 503 while the Jobs store cannot be written")
        assert not stuck.done()
        proc.send_signal(signal.SIGTERM)
        assert node.log is not None
        await Run(proc, node.log).exited()
    finally:
        db.rollback()
        db.close()
    with contextlib.suppress(AssertionError, aiohttp.ClientError):
        await stuck  # answered 503 or cut off as the agent stopped: never acknowledged
    assert processes_with_home(node.home) == [], "a child of the agent outlived it"


# -- an unusable NVPAIR_HOME --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["under-a-file", "lock-unwritable"])
async def test_an_unusable_home_is_named_in_one_line(
    tmp_path: Path, agents: Agents, how: str
) -> None:
    if how == "under-a-file":
        (tmp_path / "file").write_text("not a directory\n")
        node = Node("a", tmp_path / "file" / "home", make_node(tmp_path, "a", None).ports, None)
    else:
        # A home the agent cannot write its lock file in. (Directory modes would not stop
        # root, who runs CI; a directory where the lock file goes stops anyone.)
        node = await initialised(tmp_path)
        (node.home / "agent.lock").mkdir()
    run = await agents.run(node)
    code = await run.exited()
    err = run.stderr()
    assert code == 2, err
    lines = nvpair_lines(err)
    assert len(lines) == 1, err
    assert str(node.home) in lines[0], lines[0]


# -- a stale agent.json -------------------------------------------------------------------------


async def test_a_stale_agent_json_is_recognised(tmp_path: Path, agents: Agents) -> None:
    node = await initialised(tmp_path)
    killed = await agents.start(node)
    killed.kill()
    await killed.wait()
    assert (node.home / "agent.json").exists()  # the control: kill -9 leaves it behind

    async def child_gone() -> bool:
        return processes_with_home(node.home) == []

    # The workload manager child sees its stdin close and exits; then the ports are free.
    await eventually(child_gone, "the killed agent's workload manager child to exit")
    code, _, err = await node.cli("jobs")
    assert code == 1, err
    assert "Traceback" not in err, err
    assert "stale" in err, err
    assert str(killed.pid) in err, err
    restarted = await agents.start(node)  # the stale file and lock do not stop a new agent
    assert await node.healthy()
    assert json.loads((node.home / "agent.json").read_text())["pid"] == restarted.pid
