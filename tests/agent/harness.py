"""Real agents on 127.0.0.1 for the agent tests: each is `python -m agent agent run` with its
own NVPAIR_HOME and ports, driven through the real CLI and its local API."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.workload_manager.cluster_harness import free_port

TIMEOUT = 20.0


@dataclass
class Node:
    name: str
    home: Path
    ports: dict[str, int]
    gpus: str | None
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None
    extra: list[str] = field(default_factory=list)  # more `agent run` flags

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "NVPAIR_HOME": str(self.home), "NVPAIR_BIND": "127.0.0.1"}

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    async def cli(self, *args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", *args, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def start(self) -> None:
        args = [
            "agent", "run", "--name", self.name, "--log-level", "debug",
            "--manager-port", str(self.ports["manager"]), "--node-port", str(self.ports["node"]),
            "--api-port", str(self.ports["api"]), "--facade-port", str(self.ports["facade"]),
        ]  # fmt: skip
        if self.gpus:
            args += ["--simulate-gpus", self.gpus]
        args += self.extra
        self.log = self.home.parent / f"{self.name}.log"
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", *args, env=self.env, stdout=log, stderr=log
            )
        await eventually(self.healthy, f"{self.name} is up")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), TIMEOUT)

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(self.api + path) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def get_facade(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.ports['facade']}{path}"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def get_settled_jobs(self, count: int) -> list[Any]:
        """Wait until this member's Jobs list has `count` jobs, all finished."""
        jobs: list[Any] = []

        async def settled() -> bool:
            nonlocal jobs
            jobs = await self.get("/v1/jobs?limit=10000")
            return len(jobs) == count and all(j["state"] not in ("queued", "running") for j in jobs)

        await eventually(settled, f"{count} finished jobs on {self.name}")
        return jobs

    async def healthy(self) -> bool:
        try:
            health = await self.get("/healthz")
        except (aiohttp.ClientError, AssertionError):
            return False
        return bool(health["ok"])

    async def node_id(self) -> str:
        return str((await self.get("/healthz"))["nodeId"])

    async def enter(self, wid: str, seq: int, origin: str) -> None:
        record = {
            "id": wid, "model": "llama", "engine": "vllm", "runId": f"{origin}-run",
            "state": {1: "queued", 2: "running", 3: "completed"}[seq],
            "originatedFrom": origin, "createdAt": 1_764_000_000_000, "seq": seq,
        }  # fmt: skip
        method = {1: "workload:submitted", 2: "workload:started", 3: "workload:completed"}[seq]
        body = {"method": method, "params": {"workloadInfo": record}}
        url = self.api + "/v1/jobs/events"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            assert response.status == 202, await response.text()


async def eventually(check: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.1)


def make_node(root: Path, name: str, gpus: str | None) -> Node:
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
        code, _, err = await a.cli("cluster", "init", "--name", "lab", "--node-name", "a")
        assert code == 0, err
        await a.start()
        for joiner in joiners:
            code, token, err = await a.cli("cluster", "invite")
            assert code == 0, err
            code, out, err = await joiner.cli(
                "cluster",
                "join",
                f"127.0.0.1:{a.ports['node']}",
                token.strip(),
                "--name",
                joiner.name,
            )
            assert code == 0, err
            assert "joined as nod_" in out
            await joiner.start()
        yield nodes
    finally:
        for node in nodes:
            await node.stop()


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
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "mock-engine", "--port", str(port), "--model", model, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
    assert b"mock engine serving" in line, line
    return Engine(port, proc)
