"""Events a manager cannot pass on yet wait at the sender: 503 while no broker listens
(`--ipc`) and while the broker's view is loading. Real manager processes on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .cluster_harness import Member, eventually, record
from .manager_process import ManagerProcess
from .test_inter_node import post, trio

__all__ = ["trio"]  # the fixture, shared with test_inter_node


async def ipc_manager(member: Member, sock: Path) -> ManagerProcess:
    """`member`'s manager as a real process with `--ipc`: no broker until one connects."""
    return await ManagerProcess.start(
        "--cluster-dir", str(member.cluster.path), "--port", str(member.port),
        "--log-level", "debug", ipc=sock, env={"NVPAIR_WM_BIND": "127.0.0.1"},
    )  # fmt: skip


def submitted(*records: dict[str, Any]) -> bytes:
    """A batch of `workload:submitted` notifications, as a peer posts them."""
    batch = [
        {"jsonrpc": "2.0", "method": "workload:submitted", "params": {"workloadInfo": r}}
        for r in records
    ]
    return json.dumps(batch).encode()


async def test_events_wait_while_no_broker_listens(trio: list[Member], tmp_path: Path) -> None:
    # With --ipc and no broker connected, the manager cannot tell anyone: it answers 503 and
    # the sender keeps the events until a broker is there.
    a, b, _ = trio
    proc = await ipc_manager(a, tmp_path / "a.sock")
    try:
        body = submitted(record(b.node_id, "1", 1))
        assert await post(b, a, body) == 503
        chan = await proc.connect()
        await chan.handshake()
        assert await post(b, a, body) == 202
        told = await chan.recv()
        assert told["method"] == "workloads:upsert"
        assert told["params"]["workloadInfo"]["id"] == "1"
        await chan.close()
    finally:
        await proc.aclose()


async def test_events_wait_while_the_brokers_view_loads(trio: list[Member], tmp_path: Path) -> None:
    # Taken before the snapshot page that holds them, peers' events would look new to the
    # relay and reach the broker a second time (seen as ~15,000 redundant deliveries when
    # agents restarted under load). So they wait (503) until the view is in.
    a, b, _ = trio
    proc = await ipc_manager(a, tmp_path / "a.sock")
    try:
        held = record(b.node_id, "1", 1)
        body = submitted(held)
        chan = await proc.connect()
        assert (await chan.recv())["method"] == "ready"
        snapshot = await chan.recv()
        assert snapshot["method"] == "workloads:snapshot"
        assert await post(b, a, body) == 503  # the view is still loading
        view = {"workloads": [held], "removed": []}
        await chan.send({"jsonrpc": "2.0", "result": view, "id": snapshot["id"]})
        # The control: once it is in, events are taken -- and the one the broker holds
        # already is a duplicate the relay drops, while a new one reaches the broker.
        new = record(b.node_id, "2", 1)
        both = submitted(held, new)
        await eventually(lambda: _accepted(b, a, both), "events taken once the view is in")
        told = await chan.recv()
        assert told["method"] == "workloads:upsert"
        assert told["params"]["workloadInfo"]["id"] == "2"
        await chan.close()
    finally:
        await proc.aclose()


async def _accepted(sender: Member, receiver: Member, body: bytes) -> bool:
    return await post(sender, receiver, body) == 202
