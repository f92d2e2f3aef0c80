"""The inter-node relay with 3 to 5 real manager processes on 127.0.0.1, one CA.

Each manager is driven through its local channel by a stand-in broker
(`cluster_harness.Member`); what the brokers are told is what the tests check.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from certs import ClientContexts, ClusterDir, server_hostname_for
from certs.identity import load_cert
from netkit.backoff import Backoff
from workload_manager.broadcaster import Broadcaster
from workload_manager.inter_node import start_inter_node
from workload_manager.manager import Manager, Peer
from workload_manager.relay import RelayCore

from .cluster_harness import (
    Member,
    eventually,
    eventually_async,
    free_port,
    make_cluster,
    record,
)


async def start_all(members: list[Member], links: dict[str, list[str]] | None = None) -> None:
    """Start every member; peers are everyone else unless `links` says otherwise."""
    by_name = {m.name: m for m in members}
    for member in members:
        await member.start()
    for member in members:
        names = (links or {}).get(member.name, [m.name for m in members if m is not member])
        await member.set_peers([by_name[name] for name in names])


@pytest.fixture
async def trio(tmp_path: Path) -> AsyncIterator[list[Member]]:
    members = make_cluster(tmp_path, ["a", "b", "c"])
    yield members
    for member in members:
        if member.proc is not None and member.proc.returncode is None:
            await member.stop()


def seen_keys(member: Member) -> list[tuple[str, str, int]]:
    return [(r["runId"], r["id"], r["seq"]) for r in member.upserts()]


def assert_exactly_once_in_order(member: Member) -> None:
    keys = seen_keys(member)
    duplicates = [key for key, n in Counter(keys).items() if n > 1]
    assert duplicates == [], f"{member.name} was told twice: {duplicates}"
    last: dict[tuple[str, str], int] = {}
    for run, wid, seq in keys:
        assert seq > last.get((run, wid), 0), f"{member.name}: seq went back for {run}/{wid}"
        last[(run, wid)] = seq


def remote_records(members: list[Member], member: Member) -> dict[tuple[str, str], dict[str, Any]]:
    """Every record entered at the other members, as that member's broker should hold it."""
    expected: dict[tuple[str, str], dict[str, Any]] = {}
    for other in members:
        if other is member:
            continue
        for key, rec in other.jobs.items():
            if rec["originatedFrom"] == other.node_id:
                expected[key] = rec
    return expected


def converged(members: list[Member]) -> bool:
    return all(
        all(m.jobs.get(key) == rec for key, rec in remote_records(members, m).items())
        for m in members
    )


async def test_every_event_reaches_every_other_broker_once_in_order(trio: list[Member]) -> None:
    await start_all(trio)
    for member in trio:
        for wid in ("1", "2"):
            for seq in (1, 2, 3):
                await member.enter(wid, seq)
                # paced: each event is sent before the next, so none is coalesced away
                await eventually(
                    lambda m=member, w=wid, s=seq: all(
                        (f"{m.node_id}-run-1", w, s) in seen_keys(o) for o in trio if o is not m
                    ),
                    f"{member.name} {wid}/{seq} everywhere",
                )
    for member in trio:
        assert_exactly_once_in_order(member)
        assert len(member.upserts()) == 2 * 3 * 2  # two other members, 2 workloads, 3 events
    assert converged(trio)


async def test_burst_converges_with_no_duplicates(tmp_path: Path) -> None:
    members = make_cluster(tmp_path, ["a", "b", "c", "d", "e"])
    try:
        await start_all(members)
        for seq in (1, 2, 3):
            for member in members:
                for wid in range(20):
                    await member.enter(str(wid), seq)
        await eventually(lambda: converged(members), "five members converge")
        for member in members:
            assert_exactly_once_in_order(member)
            final = {k: r for k, r in member.jobs.items() if r["originatedFrom"] != member.node_id}
            assert len(final) == 4 * 20
            assert {r["state"] for r in final.values()} == {"completed"}
    finally:
        for member in members:
            if member.proc is not None:
                await member.stop()


async def test_a_stopped_member_catches_up_after_restart(trio: list[Member]) -> None:
    a, b, c = trio
    await start_all(trio)
    await a.enter("1", 1)
    await eventually(lambda: converged(trio), "first event everywhere")
    await c.stop()
    for seq in (2, 3):
        await a.enter("1", seq)
    await b.enter("7", 1)
    await a.enter("2", 1)
    await eventually(
        lambda: all(r["state"] != "queued" for k, r in b.jobs.items() if k[1] == "1"),
        "b sees a's progress while c is down",
    )
    told_before = len(c.told)
    await c.start()
    await c.set_peers([a, b])
    await eventually(lambda: converged(trio), "c catches up after its restart")
    assert_exactly_once_in_order(c)
    # what c's broker already had before the restart was not told again
    told_after = [
        f["params"]["workloadInfo"] for f in c.told[told_before:] if "workloadInfo" in f["params"]
    ]
    assert all(not (r["id"] == "1" and r["seq"] == 1) for r in told_after)


async def test_a_killed_member_catches_up_too(trio: list[Member]) -> None:
    a, b, c = trio
    await start_all(trio)
    await c.stop(kill=True)
    await a.enter("1", 1)
    await a.enter("1", 2)
    await c.start()
    await c.set_peers([a, b])
    await eventually(lambda: converged(trio), "c catches up after kill -9")
    assert_exactly_once_in_order(c)


async def test_blocked_link_converges_through_a_third_member(trio: list[Member]) -> None:
    a, b, c = trio
    # a cannot reach c: its peer list leaves c out. c still sends to a.
    await start_all(trio, links={"a": ["b"], "b": ["a", "c"], "c": ["a", "b"]})
    for seq in (1, 2, 3):
        await a.enter("1", seq)
        await eventually(
            lambda s=seq: (f"{a.node_id}-run-1", "1", s) in seen_keys(c),
            f"c gets a's event {seq} through b",
        )
    assert_exactly_once_in_order(c)
    status = await a.status()
    assert [p["nodeId"] for p in status["broadcast"]] == [b.node_id]


async def test_removal_reaches_everyone_and_holds(trio: list[Member]) -> None:
    a, b, c = trio
    await start_all(trio)
    await a.enter("1", 1)
    await eventually(lambda: converged(trio), "the record everywhere")
    await a.remove("1")
    await eventually(
        lambda: all((a.node_id, "1") in m.removed for m in (b, c)), "removal everywhere"
    )
    assert all(not any(k[1] == "1" for k in m.jobs) for m in (b, c))


async def test_unpinning_stops_traffic_both_ways(trio: list[Member]) -> None:
    a, b, c = trio
    await start_all(trio)
    await a.enter("1", 1)
    await eventually(lambda: converged(trio), "before the removal")
    c_id = c.node_id
    for member in (a, b):  # what `nvpair cluster remove c` does on every member
        member.cluster.pins.unpin(c_id)
    await a.enter("2", 1)
    await c.enter("9", 1)
    await eventually(lambda: (f"{a.node_id}-run-1", "2", 1) in seen_keys(b), "b still gets a's")
    await eventually_async(
        lambda: _refused_with_403(c),
        "c's sends are refused with 403",
    )
    assert (f"{a.node_id}-run-1", "2", 1) not in seen_keys(c)
    for member in (a, b):
        assert all(r["originatedFrom"] != c_id for r in member.upserts())
        states = {p["nodeId"]: p["state"] for p in (await member.status())["broadcast"]}
        assert states[c_id] == "not pinned"


async def _refused_with_403(member: Member) -> bool:
    peers = (await member.status())["broadcast"]
    return all(p["last_error"] == "HTTP 403" for p in peers)


async def test_a_non_member_gets_nothing_then_converges_once_admitted(tmp_path: Path) -> None:
    a, b = make_cluster(tmp_path, ["a", "b"])
    stranger_dir = ClusterDir(tmp_path / "n")
    stranger = Member("n", stranger_dir, free_port())
    try:
        await a.start()
        await b.start()
        await stranger.start()
        # a and b do not know n's node id yet: they list each other only.
        await a.set_peers([b])
        await b.set_peers([a])
        await a.enter("1", 1)
        await eventually(lambda: converged([a, b]), "a and b converge")
        status = await stranger.status()
        assert status["nodeId"] is None
        assert stranger.upserts() == []
        # its port is bound, but no handshake completes
        with pytest.raises(aiohttp.ClientError):
            await post(a, stranger, b"[]")
        # Admission: a issues n an identity, b pins it, everyone lists everyone.
        a.cluster.issue("n", stranger_dir.path, ["127.0.0.1"])
        b.cluster.pins.pin(load_cert(stranger_dir.node_crt.read_bytes()))
        for pem in a.cluster.pins.pems():
            stranger_dir.pins.pin(load_cert(pem))
        await a.set_peers([b, stranger])
        await b.set_peers([a, stranger])
        await stranger.set_peers([a, b])
        await eventually(lambda: converged([a, b, stranger]), "n converges without a restart")
        assert (await stranger.status())["nodeId"] == stranger_dir.node_id()
        assert_exactly_once_in_order(stranger)
    finally:
        for member in (a, b, stranger):
            await member.stop()


BAD_BODIES: list[tuple[str, bytes, int]] = [
    ("application/json", b"{not json", 400),
    ("application/json", b"[]", 400),
    (
        "application/json",
        b'[{"jsonrpc":"2.0","method":"workload:submitted",'
        b'"params":{"workloadInfo":{"id":"1","seq":"one"}}}]',
        400,
    ),
    (
        "application/json",
        b'{"jsonrpc":"2.0","method":"peers:set","params":{"peers":[]},"id":1}',
        400,
    ),
    ("text/plain", b"[]", 415),
    ("application/json", b"[" + b" " * (9 * 1024 * 1024) + b"]", 413),
]


async def test_bad_bodies_from_a_pinned_peer(trio: list[Member]) -> None:
    # One cluster for every kind of bad body: each is refused, changes nothing, and is
    # followed by a control event that still relays.
    a, b, _ = trio
    await start_all(trio)
    connector = aiohttp.TCPConnector(ssl=ClientContexts(b.cluster).current())
    async with aiohttp.ClientSession(connector=connector) as session:
        for n, (content_type, body, status) in enumerate(BAD_BODIES):
            before, told = await a.status(), len(a.told)
            async with session.post(
                f"https://127.0.0.1:{a.port}/v1/workloads/events",
                data=io.BytesIO(body),
                headers={"Content-Type": content_type},
                server_hostname=server_hostname_for(a.node_id),
            ) as response:
                assert response.status == status, (n, await response.text())
                reply = await response.read()
            if b"peers:set" in body:  # a method peers may not call
                assert json.loads(reply)["error"]["code"] == -32601
            after = await a.status()
            assert after["workloads"] == before["workloads"], n
            assert after["peers"] == before["peers"], n
            assert len(a.told) == told, n
            # and the manager still works
            await b.enter(f"5-{n}", 1)
            key = (f"{b.node_id}-run-1", f"5-{n}", 1)
            await eventually(lambda key=key: key in seen_keys(a), f"a still relays after {n}")


async def test_events_from_a_peer_with_a_prompt_reach_nobody_with_it(trio: list[Member]) -> None:
    a, b, c = trio
    await start_all(trio)
    marker = "PROMPT-MARKER-5e1d"
    rec = {**record(b.node_id, "3", 1), "prompt": marker, "messages": [{"content": marker}]}
    frame = {"jsonrpc": "2.0", "method": "workload:submitted", "params": {"workloadInfo": rec}}
    connector = aiohttp.TCPConnector(ssl=ClientContexts(b.cluster).current())
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(
            f"https://127.0.0.1:{a.port}/v1/workloads/events",
            json=[frame],
            server_hostname=server_hostname_for(a.node_id),
        ) as response,
    ):
        assert response.status == 202
    await eventually(lambda: any(r["id"] == "3" for r in c.upserts()), "c gets it through a")
    for member in trio:
        assert marker not in json.dumps(member.told)
        assert marker.encode() not in member.stderr


async def post(sender: Member, receiver: Member, body: bytes) -> int:
    """POST a body to `receiver` with `sender`'s identity; returns the HTTP status."""
    connector = aiohttp.TCPConnector(ssl=ClientContexts(sender.cluster).current())
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(
            f"https://127.0.0.1:{receiver.port}/v1/workloads/events",
            data=body,
            headers={"Content-Type": "application/json"},
            server_hostname=server_hostname_for(receiver.node_id)
            if receiver.cluster.has_identity()
            else "unknown.nvpair.internal",
        ) as response,
    ):
        await response.read()
        return response.status


async def in_process(
    member: Member, stack: contextlib.AsyncExitStack, **broadcaster_options: Any
) -> tuple[Broadcaster, Manager]:
    """`member`'s manager, run in this process as cli.py builds one with --cluster-dir
    (broadcaster, manager, inter-node server), its view loaded (empty: no broker here)."""
    relay = RelayCore()
    broadcaster = await stack.enter_async_context(
        Broadcaster(member.cluster, relay, **broadcaster_options)
    )
    manager = Manager(
        version="t",
        port=member.port,
        identity=member.cluster.node_id,
        relay=relay,
        **broadcaster.manager_hooks(),
    )
    await start_inter_node(manager, member.cluster, stack)
    return broadcaster, manager


def submitted(origin: str, wid: str) -> bytes:
    """A broker's `workload:submitted` frame for a new workload."""
    params = {"workloadInfo": record(origin, wid, 1)}
    return json.dumps({"jsonrpc": "2.0", "method": "workload:submitted", "params": params}).encode()


async def test_a_restarted_peer_is_sent_to_at_once_not_after_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a runs in this process with a fixed 36 s retry delay; b is a real manager, down at
    # first. When b comes back, its catch-up reaches a, and a must send to b at once.
    monkeypatch.setenv("NVPAIR_WM_BIND", "127.0.0.1")
    a_member, b = make_cluster(tmp_path, ["a", "b"])
    async with contextlib.AsyncExitStack() as stack:
        broadcaster, a = await in_process(
            a_member, stack, backoff=Backoff(base_s=40.0, cap_s=40.0), draw=lambda: 0.9
        )
        a.on_peers((Peer(nodeId=b.node_id, host="127.0.0.1", port=b.port),))
        a.view_state = "loaded"
        a.on_view_loaded()
        rec = record(a_member.node_id, "1", 1)
        a.handle_local(submitted(a_member.node_id, "1"))
        await eventually(
            lambda: broadcaster.status()[0]["failures"] >= 1, "a's send to b fails: b is down"
        )
        try:
            await b.start()
            await b.set_peers([a_member])
            started = time.monotonic()
            await eventually(
                lambda: (rec["runId"], "1") in b.jobs, "a's queued event reaches b", within_s=15.0
            )
            assert time.monotonic() - started < 15.0  # a's backoff had ~36 s left
        finally:
            await b.stop()


async def test_a_full_batch_goes_at_once_while_its_sender_lingers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a batch, a sender waits out the linger before the next, so a trickle of events
    # goes a request per linger. A burst that fills a batch meanwhile must not wait for it:
    # here the linger is a minute, and the full batch must reach b at once.
    monkeypatch.setenv("NVPAIR_WM_BIND", "127.0.0.1")
    a_member, b = make_cluster(tmp_path, ["a", "b"])
    await b.start()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(b.stop)
        await b.set_peers([])  # b only takes a's batches: nothing comes back to a's outbox
        broadcaster, a = await in_process(a_member, stack, max_batch=8)
        a.on_peers((Peer(nodeId=b.node_id, host="127.0.0.1", port=b.port),))
        broadcaster.linger_s = 60.0
        a.view_state = "loaded"
        a.on_view_loaded()
        origin = a_member.node_id
        run = record(origin, "first", 1)["runId"]
        a.handle_local(submitted(origin, "first"))  # after a quiet spell: goes at once
        await eventually(lambda: (run, "first") in b.jobs, "the first event reaches b")
        await eventually(lambda: broadcaster.status()[0]["queued"] == 0, "b's answer is in")
        for wid in range(7):  # a trickle: waits for the linger
            a.handle_local(submitted(origin, str(wid)))
        [status] = broadcaster.status()
        assert status["queued"] == 7
        assert not any((run, str(w)) in b.jobs for w in range(7))
        a.handle_local(submitted(origin, "7"))  # the eighth fills a batch: it goes now
        await eventually(
            lambda: all((run, str(w)) in b.jobs for w in range(8)),
            "the full batch reaches b within the minute's linger",
            within_s=15.0,
        )
