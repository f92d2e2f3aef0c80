"""Several real `python -m workload_manager` processes on 127.0.0.1, one cluster CA.

Each `Member` is a manager process with its own cluster dir and a stand-in broker that
does what the real one does with the local channel: it enters local events, keeps a Jobs
view (its own events and every `workloads:upsert` / `workloads:remove`), and answers
`workloads:snapshot` with that view, so a restarted manager remembers what it relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from certs import ClusterDir
from certs.identity import load_cert
from netkit.ports import bindable
from tests.fixtures.forkserver import ForkedProcess, start_manager
from tests.fixtures.records import METHODS, STATES, workload_record
from tests.fixtures.waiting import TIMEOUT_S, eventually

__all__ = [
    "METHODS",
    "STATES",
    "TIMEOUT",
    "Member",
    "engine_ports",
    "eventually",
    "eventually_async",
    "free_port",
    "make_cluster",
    "record",
]

TIMEOUT = TIMEOUT_S
# One `eventually` takes plain and async checks alike; the old name stays for its callers.
eventually_async = eventually


# Ports handed to a process that binds them later. Taken below the kernel's ephemeral range
# (32768-60999 on Linux): a port the kernel gave out for port 0 or an outgoing connection can
# be taken again by it before our process binds; one below the range cannot (the race behind
# an agent that found its port in use). Never the same one twice in a run. Under pytest-xdist
# each worker takes only its own residue class, so two workers never hand out the same port;
# engine port ranges (`engine_ports`) come from a band of their own, split between workers.
_PORTS_LOW, _PORTS_HIGH = 20_000, 30_000
_ENGINES_LOW, _ENGINES_HIGH = 30_000, 32_000
_handed_out: set[int] = set()
_pick = random.Random()


def _worker() -> tuple[int, int]:
    """(this xdist worker's index, the number of workers); (0, 1) without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return int(name.removeprefix("gw") or 0) % max(count, 1), max(count, 1)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that the kernel will not hand out itself."""
    index, count = _worker()
    for _ in range(1000):
        port = _pick.randrange(_PORTS_LOW, _PORTS_HIGH)
        if port in _handed_out or port % count != index or not bindable(port):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


_engine_next: list[int] = []


def engine_ports(size: int = 100) -> tuple[int, int]:
    """A range of `size` ports for one agent's engines (`[engines] port_range`), this
    worker's own, never handed out twice in a run (ports in use in it are skipped anyway)."""
    index, count = _worker()
    band = (_ENGINES_HIGH - _ENGINES_LOW) // count
    low, high = _ENGINES_LOW + index * band, _ENGINES_LOW + (index + 1) * band
    start = _engine_next[0] if _engine_next else low
    if start + size > high:
        start = low  # wrapped: the earliest ranges' engines are long gone
    _engine_next[:] = [start + size]
    return start, start + size - 1


def record(origin: str, wid: str, seq: int, *, run: str = "run-1") -> dict[str, Any]:
    """A lifecycle record: seq 1 queued, 2 running, 3 completed (placed on its origin)."""
    return workload_record(
        wid, seq, origin=origin, run=f"{origin}-{run}", scheduled_on=origin if seq >= 2 else None
    )


@dataclass
class Member:
    """One manager process and its stand-in broker."""

    name: str
    cluster: ClusterDir
    port: int
    proc: asyncio.subprocess.Process | ForkedProcess | None = None
    # Every upsert / remove the broker was told about, in order, across restarts.
    told: list[dict[str, Any]] = field(default_factory=list)
    # The broker's Jobs view: (runId, id) -> record; removed (originatedFrom, id) pairs.
    jobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    removed: set[tuple[str, str]] = field(default_factory=set)
    _pending: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None
    _logs: asyncio.Task[None] | None = None
    _next_id: int = 0
    stderr: bytes = b""
    env: dict[str, str] = field(default_factory=dict)  # more for the manager's environment

    @property
    def node_id(self) -> str:
        node_id = self.cluster.node_id()
        assert node_id is not None, f"{self.name} has no identity"
        return node_id

    async def start(self) -> None:
        argv = ["--cluster-dir", str(self.cluster.path), "--port", str(self.port)]
        argv += ["--log-level", "debug"]
        env = {**os.environ, "NVPAIR_WM_BIND": "127.0.0.1", "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = await start_manager(argv, env=env, limit=16 * 1024 * 1024)
        self._reader = asyncio.create_task(self._read())
        self._logs = asyncio.create_task(self._drain_stderr())
        await self.request("manager:status")  # answered once the channel is up

    async def stop(self, *, kill: bool = False) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
        async with asyncio.timeout(TIMEOUT):
            await self.proc.wait()
            for task in (self._reader, self._logs):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            frame = json.loads(line)
            method = frame.get("method")
            if method == "workloads:upsert":
                rec = frame["params"]["workloadInfo"]
                self.told.append(frame)
                key = (rec["runId"], rec["id"])
                if key not in self.jobs or self.jobs[key]["seq"] < rec["seq"]:
                    self.jobs[key] = rec
            elif method == "workloads:remove":
                params = frame["params"]
                self.told.append(frame)
                pair = (params["originatedFrom"], params["workloadId"])
                self.removed.add(pair)
                for key in [
                    k for k, r in self.jobs.items() if (r["originatedFrom"], r["id"]) == pair
                ]:
                    del self.jobs[key]
            elif method == "workloads:snapshot":
                view = {
                    "workloads": list(self.jobs.values()),
                    "removed": [{"originatedFrom": o, "workloadId": w} for o, w in self.removed],
                }
                await self._send({"jsonrpc": "2.0", "result": view, "id": frame["id"]})
            elif "id" in frame and frame["id"] in self._pending:
                self._pending.pop(frame["id"]).set_result(frame)

    async def _drain_stderr(self) -> None:
        # Read the logs as they come, or a chatty manager blocks on a full pipe.
        assert self.proc is not None
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr = (self.stderr + chunk)[-256 * 1024 :]

    async def _send(self, message: Any) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()

    async def request(self, method: str, params: Any = None) -> Any:
        self._next_id += 1
        request_id = f"t{self._next_id}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            message["params"] = params
        await self._send(message)
        async with asyncio.timeout(TIMEOUT):
            reply = await future
        assert "result" in reply, reply
        return reply["result"]

    async def enter(self, wid: str, seq: int, *, run: str = "run-1") -> dict[str, Any]:
        """The broker enters a local lifecycle event, as the facade would."""
        rec = record(self.node_id, wid, seq, run=run)
        await self._send(
            {"jsonrpc": "2.0", "method": METHODS[seq], "params": {"workloadInfo": rec}}
        )
        self.jobs[(rec["runId"], rec["id"])] = rec
        return rec

    async def remove(self, wid: str) -> None:
        await self._send(
            {
                "jsonrpc": "2.0",
                "method": "workloads:remove",
                "params": {"workloadId": wid, "originatedFrom": self.node_id},
            }
        )
        pair = (self.node_id, wid)
        self.removed.add(pair)
        for key in [k for k, r in self.jobs.items() if (r["originatedFrom"], r["id"]) == pair]:
            del self.jobs[key]

    async def set_peers(self, peers: list[Member]) -> None:
        await self.request(
            "peers:set",
            {"peers": [{"nodeId": p.node_id, "host": "127.0.0.1", "port": p.port} for p in peers]},
        )

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("manager:status")
        return result

    def upserts(self) -> list[dict[str, Any]]:
        return [f["params"]["workloadInfo"] for f in self.told if f["method"] == "workloads:upsert"]


def make_cluster(root: Path, names: list[str]) -> list[Member]:
    """One CA (on the first member), every member issued from it, all pinned everywhere."""
    first = ClusterDir(root / names[0])
    first.init("test", names[0], ["127.0.0.1"])
    for name in names[1:]:
        first.issue(name, root / name, ["127.0.0.1"])
    # issue() pins each new member on the first; give every member every pin.
    pems = first.pins.pems()
    for name in names[1:]:
        member = ClusterDir(root / name)
        for pem in pems:
            member.pins.pin(load_cert(pem))
    return [Member(name, ClusterDir(root / name), free_port()) for name in names]
