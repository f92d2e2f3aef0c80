"""One conformance suite for the local channel, run over stdio and over a Unix socket.

Every test drives a real `python -m workload_manager` process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from workload_manager import VERSION

from .manager_process import Channel, ManagerProcess


def workload(seq: int = 1, state: str = "queued", **extra: Any) -> dict[str, Any]:
    return {
        "id": "1",
        "model": "llama-3-8b",
        "engine": "vllm",
        "runId": "01jrun",
        "state": state,
        "originatedFrom": "nod_a",
        "createdAt": 1_764_000_000_000,
        "seq": seq,
        **extra,
    }


@pytest.fixture(params=["stdio", "unix"])
async def manager(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ManagerProcess]:
    ipc = tmp_path / "wm.sock" if request.param == "unix" else None
    proc = await ManagerProcess.start(ipc=ipc)
    yield proc
    await proc.aclose()


@pytest.fixture
async def channel(manager: ManagerProcess) -> AsyncIterator[Channel]:
    chan = await manager.connect()
    ready = await chan.recv()
    assert ready == {"jsonrpc": "2.0", "method": "ready", "params": {"version": VERSION}}
    snapshot = await chan.recv()
    assert snapshot["method"] == "workloads:snapshot"
    assert snapshot["params"]["limit"] > 0
    await chan.send(
        {"jsonrpc": "2.0", "result": {"workloads": [], "removed": []}, "id": snapshot["id"]}
    )
    yield chan
    if manager.ipc is not None:
        await chan.close()


async def test_ready_first_then_status(channel: Channel) -> None:
    reply = await channel.request("manager:status")
    status = reply["result"]
    assert status["version"] == VERSION
    assert status["nodeId"] is None
    assert status["port"] == 14320
    assert status["peers"] == []
    assert status["counters"]["received_local"] == 0


async def test_malformed_line_gets_parse_error_and_channel_survives(channel: Channel) -> None:
    await channel.send_raw(b'{"jsonrpc": "2.0", "method": "foobar, "params": "bar", "baz]\n')
    reply = await channel.recv()
    assert reply["error"]["code"] == -32700
    assert reply["id"] is None
    assert "result" in await channel.request("manager:status")


async def test_unknown_method_gets_32601_and_unknown_notification_nothing(channel: Channel) -> None:
    reply = await channel.request("subtract", [42, 23])
    assert reply["error"] == {"code": -32601, "message": "Method not found"}
    await channel.notify("no:such:thing", {})
    # The next frame is the answer to the next request: the notification got no reply.
    assert "result" in await channel.request("manager:status")


async def test_oversize_frame_is_32600_and_channel_survives(channel: Channel) -> None:
    big = json.dumps({"jsonrpc": "2.0", "method": "x", "params": ["a" * (1024 * 1024)]})
    await channel.send_raw(big.encode() + b"\n")
    reply = await channel.recv()
    assert reply["error"]["code"] == -32600
    assert "maximum" in reply["error"]["data"]
    assert "result" in await channel.request("manager:status")


async def test_frame_split_across_writes(channel: Channel) -> None:
    frame = b'{"jsonrpc":"2.0","method":"manager:status","id":"split"}\n'
    for i in range(0, len(frame), 7):
        await channel.send_raw(frame[i : i + 7])
    assert (await channel.recv())["id"] == "split"


async def test_lifecycle_events_are_accepted_once_and_not_echoed(channel: Channel) -> None:
    await channel.notify("workload:submitted", {"workloadInfo": workload()})
    first = await channel.request("workload:started", {"workloadInfo": workload(2, "running")})
    assert first["result"] == {"accepted": True}
    again = await channel.request("workload:started", {"workloadInfo": workload(2, "running")})
    assert again["result"] == {"accepted": False, "reason": "duplicate"}
    stale = await channel.request("workload:submitted", {"workloadInfo": workload()})
    assert stale["result"] == {"accepted": False, "reason": "stale"}
    status = (await channel.request("manager:status"))["result"]
    assert status["counters"]["received_local"] == 4
    assert status["counters"]["accepted"] == 2
    assert status["workloads"]["held"] == 1


async def test_removal(channel: Channel) -> None:
    await channel.notify("workload:submitted", {"workloadInfo": workload()})
    removed = await channel.request(
        "workloads:remove", {"workloadId": "1", "originatedFrom": "nod_a"}
    )
    assert removed["result"] == {"accepted": True}
    late = await channel.request("workload:started", {"workloadInfo": workload(2, "running")})
    assert late["result"] == {"accepted": False, "reason": "removed"}


@pytest.mark.parametrize(
    ("method", "params", "detail"),
    [
        ("workload:submitted", {"workloadInfo": workload(seq=0)}, "seq"),
        ("workload:submitted", {"workloadInfo": workload(state="exploded")}, "state"),
        ("workload:started", {"workloadInfo": workload()}, "carries state running"),
        ("workload:submitted", {}, "workloadInfo"),
        ("workload:submitted", None, "params are required"),
        ("workloads:remove", {"workloadId": 1, "originatedFrom": "n"}, "workloadId"),
        ("peers:set", {"peers": [{"nodeId": "n", "host": "h", "port": 0}]}, "port"),
        ("peers:set", {"peers": "all"}, "peers"),
    ],
)
async def test_bad_params_get_32602_with_detail(
    channel: Channel, method: str, params: Any, detail: str
) -> None:
    reply = await channel.request(method, params)
    assert reply["error"]["code"] == -32602
    assert detail in reply["error"]["data"]
    status = (await channel.request("manager:status"))["result"]
    assert status["workloads"]["held"] == 0


async def test_peers_set_replaces_the_list(channel: Channel) -> None:
    peers = [
        {"nodeId": "nod_b", "host": "10.0.0.2", "port": 14320},
        {"nodeId": "nod_c", "host": "gpu-c.lan", "port": 14420},
    ]
    assert (await channel.request("peers:set", {"peers": peers}))["result"] == {"peers": 2}
    assert (await channel.request("manager:status"))["result"]["peers"] == peers
    await channel.request("peers:set", {"peers": peers[1:]})
    assert (await channel.request("manager:status"))["result"]["peers"] == peers[1:]


async def test_batch_over_the_channel(channel: Channel) -> None:
    await channel.send(
        [
            {
                "jsonrpc": "2.0",
                "method": "workload:submitted",
                "params": {"workloadInfo": workload()},
            },
            {"jsonrpc": "2.0", "method": "manager:status", "id": "s"},
            {"jsonrpc": "2.0", "method": "nope", "id": "n"},
        ]
    )
    replies = {r["id"]: r for r in await channel.recv()}
    assert replies["s"]["result"]["counters"]["accepted"] == 1
    assert replies["n"]["error"]["code"] == -32601


async def test_many_events_in_one_write(channel: Channel) -> None:
    lines = b"".join(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "method": "workload:submitted",
                "params": {"workloadInfo": {**workload(), "id": str(i)}},
            }
        ).encode()
        + b"\n"
        for i in range(1, 2001)
    )
    await channel.send_raw(lines)
    status = (await channel.request("manager:status"))["result"]
    assert status["counters"]["accepted"] == 2000


async def test_stdio_eof_ends_the_process_cleanly() -> None:
    proc = await ManagerProcess.start()
    chan = await proc.connect()
    await chan.handshake()
    assert proc.proc.stdin is not None
    proc.proc.stdin.close()
    assert await asyncio.wait_for(proc.proc.wait(), 10) == 0
    await proc.aclose()


async def test_stdout_carries_frames_only() -> None:
    proc = await ManagerProcess.start("--log-level", "debug")
    chan = await proc.connect()
    await chan.handshake()
    await chan.send_raw(b"garbage\n")
    assert (await chan.recv())["error"]["code"] == -32700
    await chan.notify("no:such", {})
    await chan.request("manager:status")
    assert proc.proc.stdin is not None
    proc.proc.stdin.close()
    assert proc.proc.stdout is not None
    rest = await proc.proc.stdout.read()
    assert rest == b""  # everything on stdout was a frame we read; logs went to stderr
    await proc.aclose()
    assert "unknown method" in proc.stderr


async def test_unix_socket_reconnect_and_single_broker(tmp_path: Path) -> None:
    sock = tmp_path / "wm.sock"
    proc = await ManagerProcess.start(ipc=sock)
    try:
        assert sock.stat().st_mode & 0o777 == 0o600
        first = await proc.connect()
        await first.handshake()
        await first.notify("workload:submitted", {"workloadInfo": workload()})
        second = await proc.connect()
        refused = await second.recv()
        assert refused["error"]["code"] == -32600
        assert "another broker" in refused["error"]["data"]
        await second.close()
        await first.close()
        # The broker reconnects: a fresh ready, and the relay state is still there.
        third = None
        async with asyncio.timeout(10):
            while third is None:
                chan = await proc.connect()
                frame = await chan.recv()
                if frame.get("method") == "ready":
                    third = chan
                    snapshot = await chan.recv()
                    await chan.send({"jsonrpc": "2.0", "result": {}, "id": snapshot["id"]})
                else:
                    await chan.close()
        status = (await third.request("manager:status"))["result"]
        assert status["workloads"]["held"] == 1
        await third.close()
    finally:
        assert await proc.aclose() == 0
    assert not sock.exists()


async def test_unix_socket_refuses_a_path_that_is_not_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("data")
    bad = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workload_manager",
        "--ipc",
        str(path),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await bad.communicate()
    assert bad.returncode != 0
    assert b"is not a socket" in err
    assert path.read_text() == "data"


async def test_snapshot_view_is_remembered(manager: ManagerProcess) -> None:
    chan = await manager.connect()
    view = {
        "workloads": [workload(2, "running")],
        "removed": [{"workloadId": "9", "originatedFrom": "nod_a"}],
    }
    await chan.handshake(view)
    again = await chan.request("workload:started", {"workloadInfo": workload(2, "running")})
    assert again["result"] == {"accepted": False, "reason": "duplicate"}
    gone = await chan.request("workload:submitted", {"workloadInfo": {**workload(), "id": "9"}})
    assert gone["result"] == {"accepted": False, "reason": "removed"}
    status = (await chan.request("manager:status"))["result"]
    assert status["counters"]["received_local"] == 2  # loading is not receiving
    if manager.ipc is not None:
        await chan.close()


async def test_snapshot_error_counts_as_empty(manager: ManagerProcess) -> None:
    chan = await manager.connect()
    await chan.handshake(error=True)
    reply = await chan.request("workload:submitted", {"workloadInfo": workload()})
    assert reply["result"] == {"accepted": True}
    if manager.ipc is not None:
        await chan.close()


async def test_snapshot_comes_in_pages(manager: ManagerProcess) -> None:
    chan = await manager.connect()
    await chan.handshake({"workloads": [workload()], "removed": [], "next": "page-2"})
    second = await chan.recv()
    assert second["method"] == "workloads:snapshot"
    assert second["params"]["cursor"] == "page-2"
    page = {"workloads": [{**workload(), "id": "2"}], "removed": []}
    await chan.send({"jsonrpc": "2.0", "result": page, "id": second["id"]})
    status = (await chan.request("manager:status"))["result"]
    assert status["workloads"]["held"] == 2
    if manager.ipc is not None:
        await chan.close()


async def test_malformed_snapshot_answer_is_survived(manager: ManagerProcess) -> None:
    chan = await manager.connect()
    await chan.handshake({"workloads": [{"id": 1}]})
    assert "result" in await chan.request("manager:status")
    if manager.ipc is not None:
        await chan.close()


async def test_a_failed_or_refused_snapshot_page_is_asked_for_again(
    manager: ManagerProcess,
) -> None:
    chan = await manager.connect()
    first = await chan.handshake(error=True)
    again = await chan.recv()
    assert again["method"] == "workloads:snapshot"
    assert again["id"] != first["id"]
    # An answer over the frame limit (a page the broker made too big) is refused, and the
    # page asked for again instead of the view counting as empty.
    chan.writer.write(b'{"jsonrpc":"2.0","result":"' + b"a" * (1 << 20) + b'","id":"x"}\n')
    refused = await chan.recv()
    assert refused["error"]["code"] == -32600
    third = await chan.recv()
    assert third["method"] == "workloads:snapshot"
    page = {"workloads": [workload()], "removed": [{"workloadId": "9", "originatedFrom": "n"}]}
    await chan.send({"jsonrpc": "2.0", "result": page, "id": third["id"]})
    status = (await chan.request("manager:status"))["result"]
    assert status["workloads"] == {"held": 1, "tombstones": 1}
    assert status["view"] == {"state": "loaded", "retries": 2}
    if manager.ipc is not None:
        await chan.close()
