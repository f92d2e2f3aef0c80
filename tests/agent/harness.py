"""Real agents on 127.0.0.1 for the agent tests: each is `python -m agent agent run` with its
own NVPAIR_HOME and ports, driven through the real CLI and its local API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from agent.cli.join import join_cluster
from agent.engines.proc_os import unrecorded_processes
from certs import ClusterDir, create_invite
from tests.fixtures import forkserver
from tests.fixtures.owner import owner
from tests.fixtures.records import lifecycle_event, workload_record
from tests.fixtures.waiting import TIMEOUT_S, eventually
from tests.workload_manager.cluster_harness import free_port

__all__ = [
    "TIMEOUT",
    "Engine",
    "JobKey",
    "Node",
    "eventually",
    "init",
    "invite",
    "join",
    "make_node",
    "start_cluster",
    "start_engine",
]

TIMEOUT = TIMEOUT_S
FINAL = ("completed", "failed", "cancelled")

JobKey = tuple[str, str, str]  # (originatedFrom, runId, id): one job, across members


def job_key(job: dict[str, Any]) -> JobKey:
    """The identity of a job in a member's Jobs list."""
    return (job["originatedFrom"], job["runId"], job["id"])


@dataclass
class Node:
    """One agent: its home, its ports and, once started, its process and log."""

    name: str
    home: Path
    ports: dict[str, int]
    gpus: str | None
    proc: asyncio.subprocess.Process | forkserver.ForkedProcess | None = None
    log: Path | None = None
    extra: list[str] = field(default_factory=list)  # more `agent run` flags
    open_files: int | None = None  # the agent's open-files limit (soft and hard), if set
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. NVPAIR_TEST_SPEAKS
    # The Python it runs `-m agent` with: another environment's runs another release
    # (tests/upgrade), from a folder where this checkout's packages are not importable.
    python: str = sys.executable

    @property
    def cwd(self) -> Path | None:
        return None if self.python == sys.executable else self.home.parent

    @property
    def env(self) -> dict[str, str]:
        home = {"NVPAIR_HOME": str(self.home), "NVPAIR_BIND": "127.0.0.1"}
        return {**os.environ, **home, **self.extra_env}

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    async def cli(self, *args: str) -> tuple[int, str, str]:
        """Run `nvpair ARGS` as this member; (exit status, stdout, stderr)."""
        proc: asyncio.subprocess.Process | forkserver.ForkedProcess
        if self.python == sys.executable:
            proc = await forkserver.start_agent(list(args), env=self.env, cwd=self.cwd)
        else:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "agent", *args, env=self.env, cwd=self.cwd,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def start(self) -> None:
        """Start `agent run` and wait until its /healthz says ok."""
        args = [
            "agent", "run", "--name", self.name, "--log-level", "debug",
            "--manager-port", str(self.ports["manager"]), "--node-port", str(self.ports["node"]),
            "--api-port", str(self.ports["api"]), "--facade-port", str(self.ports["facade"]),
        ]  # fmt: skip
        if self.gpus:
            args += ["--simulate-gpus", self.gpus]
        args += self.extra
        self.log = self.home.parent / f"{self.name}.log"
        limit = self.open_files

        def limited() -> None:  # in the child, before exec
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        env = self.env
        if (
            forkserver.enabled()
            and self.python == sys.executable
            and env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
        ):
            # Forked from this worker's fork server, which imported the agent once (not a
            # node with a path of its own: the server's modules are found already).
            self.proc = await forkserver.spawn(
                args, env=env, log=self.log, cwd=self.cwd, nofile=limit
            )
        else:
            with self.log.open("ab") as log:
                self.proc = await asyncio.create_subprocess_exec(
                    self.python, "-m", "agent", *args, env=env, stdout=log, stderr=log,
                    preexec_fn=limited if limit is not None else None, cwd=self.cwd,
                )  # fmt: skip

        async def up() -> bool:
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            return await self.healthy()

        await eventually(up, f"{self.name} is up")

    async def stop(self) -> None:
        """SIGTERM, and wait for the agent to exit."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), TIMEOUT)

    async def get(self, path: str) -> Any:
        """GET the local API; the decoded JSON of a 200."""
        async with (
            aiohttp.ClientSession(headers=self.owner) as session,
            session.get(self.api + path) as response,
        ):
            assert response.status == 200, await response.text()
            return await response.json()

    @property
    def owner(self) -> dict[str, str]:
        """The header the local API asks of its owner (the token in `home`)."""
        return owner(self.home)

    async def get_facade(self, path: str) -> Any:
        """GET the inference facade; the decoded JSON of a 200."""
        url = f"http://127.0.0.1:{self.ports['facade']}{path}"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def jobs(self) -> list[Any]:
        """This member's whole Jobs list."""
        jobs: list[Any] = await self.get("/v1/jobs?limit=10000")
        return jobs

    async def job_keys(self) -> set[JobKey]:
        """Every job this member lists now: a baseline for `get_settled_jobs(since=...)`."""
        return {job_key(j) for j in await self.jobs()}

    async def get_settled_jobs(self, count: int, *, since: Collection[JobKey] = ()) -> list[Any]:
        """Wait until this member lists exactly `count` jobs besides those in `since` (what a
        shared cluster held before the test), all finished; those jobs."""
        jobs: list[Any] = []

        async def settled() -> bool:
            nonlocal jobs
            jobs = [j for j in await self.jobs() if job_key(j) not in since]
            return len(jobs) == count and all(j["state"] in FINAL for j in jobs)

        await eventually(settled, f"{count} finished jobs on {self.name}")
        return jobs

    async def healthy(self) -> bool:
        """Whether /healthz answers and says ok (false while it cannot be reached)."""
        try:
            health = await self.get("/healthz")
        except (aiohttp.ClientError, AssertionError):
            return False
        return bool(health["ok"])

    async def node_id(self) -> str:
        return str((await self.get("/healthz"))["nodeId"])

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the Prometheus endpoint (0 when it is not there)."""
        async with aiohttp.ClientSession() as session, session.get(self.api + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0

    def log_count(self, text: str) -> int:
        """How many times `text` is in this agent's log so far."""
        assert self.log is not None
        return self.log.read_bytes().count(text.encode())

    async def enter(self, wid: str, seq: int, origin: str) -> None:
        """Enter a local lifecycle event (seq 1 queued, 2 running, 3 completed) on this member."""
        record = workload_record(wid, seq, origin=origin, run=f"{origin}-run")
        url = self.api + "/v1/jobs/events"
        async with (
            aiohttp.ClientSession(headers=self.owner) as session,
            session.post(url, json=lifecycle_event(record)) as response,
        ):
            assert response.status == 202, await response.text()


def make_node(root: Path, name: str, gpus: str | None) -> Node:
    """A member with free ports under `root`; not started."""
    return Node(
        name,
        root / name,
        {k: free_port() for k in ("manager", "node", "api", "facade")},
        gpus,
    )


async def start_cluster(nodes: list[Node]) -> AsyncIterator[list[Node]]:
    """init on the first, invite + join over the network for the others, all started."""
    a, *joiners = nodes
    try:
        await init(a, "lab", "a")
        await a.start()
        for joiner in joiners:  # one at a time: sixteen agents starting at once on two cores
            await join(a, joiner)  # leave the first ones busy for seconds after the last join
            await joiner.start()
        yield nodes
    finally:
        stopped = await asyncio.gather(*(node.stop() for node in nodes), return_exceptions=True)
        for node in nodes:
            kill_engines(node.home)  # agents leave engines running (the next start adopts them)
        for outcome in stopped:
            if isinstance(outcome, BaseException):
                raise outcome


def engine_pids(home: Path) -> dict[str, int]:
    """Replica id -> pid of the engines this home's agent launched (from proc.json)."""
    pids = {}
    for record in home.glob("replicas/*/proc.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids[record.parent.name] = int(json.loads(record.read_text())["pid"])
    return pids


def kill_engines(home: Path) -> None:
    """SIGKILL the engines this home's agent launched, and their groups: agents leave their
    engines running when they stop (the next start adopts them). Those with no proc.json
    too -- an agent killed -9 between starting an engine and writing its record leaves one
    that only its next start would find (by the marks in its environment): the test may
    never start it again."""
    for pid in engine_pids(home).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in unrecorded_processes(home, keep=set()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# Setting a cluster up: what `nvpair cluster init`, `cluster invite` and `cluster join` do,
# called in this process -- each CLI call is a Python start-up (0.3 s of CPU), and the suite
# sets up over a hundred clusters. The CLI's own tests (tests/certs/test_cluster_cli.py, the
# demo's) run the commands. A node of another release (tests/upgrade) runs its own CLI.


async def init(node: Node, cluster: str, name: str) -> None:
    """`nvpair cluster init --name CLUSTER --node-name NAME` for `node` (not started)."""
    if node.python != sys.executable:
        code, _, err = await node.cli("cluster", "init", "--name", cluster, "--node-name", name)
        assert code == 0, err
        return
    await asyncio.to_thread(ClusterDir(node.home / "cluster").init, cluster, name, [])


async def invite(admitter: Node) -> str:
    """`nvpair cluster invite` on `admitter`: a one-use token."""
    if admitter.python != sys.executable:
        code, token, err = await admitter.cli("cluster", "invite")
        assert code == 0, err
        return token.strip()
    made = await asyncio.to_thread(create_invite, ClusterDir(admitter.home / "cluster"))
    return made.token()


async def join(admitter: Node, joiner: Node) -> None:
    """An invite from `admitter` (running), and `joiner` joins with it over the network (not
    started): the CLI's own join, through the admitter's node API."""
    token = await invite(admitter)
    address = f"127.0.0.1:{admitter.ports['node']}"
    if joiner.python != sys.executable:
        code, out, err = await joiner.cli(
            "cluster", "join", address, token, "--name", joiner.name
        )  # fmt: skip
        assert code == 0, err
        assert "joined as nod_" in out
        return
    cluster = ClusterDir(joiner.home / "cluster")
    node_id = await join_cluster(address, token, joiner.name, [], cluster)
    assert node_id.startswith("nod_"), node_id


@dataclass
class Engine:
    """A `nvpair mock-engine` process."""

    port: int
    proc: asyncio.subprocess.Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()


async def start_engine(model: str, *flags: str) -> Engine:
    """Start a mock engine serving `model` (comma-separated names) and wait until it serves."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.mock", "mock-engine", "--port", str(port), "--model", model,
        *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
    assert b"mock engine serving" in line, line
    return Engine(port, proc)


def module_engine(model: str, *flags: str) -> Any:
    """A module-scoped fixture named as the assignment that takes it (`engine =
    module_engine("m")`): one mock engine serving `model` for the module's tests."""

    @pytest_asyncio.fixture(loop_scope="module", scope="module")
    async def engine() -> AsyncIterator[Engine]:
        started = await start_engine(model, *flags)
        yield started
        await started.stop()

    return engine


async def settled_jobs(nodes: list[Node]) -> set[JobKey]:
    """The jobs earlier tests left, once every member lists the same ones, all finished:
    what a test's own counts leave out."""
    keys: set[JobKey] = set()

    async def settled_everywhere() -> bool:
        nonlocal keys
        views = [await node.jobs() for node in nodes]
        if any(j["state"] in ("queued", "running") for view in views for j in view):
            return False
        keys = {job_key(j) for j in views[0]}
        return all({job_key(j) for j in view} == keys for view in views[1:])

    await eventually(settled_everywhere, "earlier tests' jobs final and the same everywhere")
    return keys
