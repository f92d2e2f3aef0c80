"""The heartbeat's exchanges: one member's failure, of any kind, fails that exchange only,
and is tried again next beat; one that succeeded is not repeated while nothing changes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import pytest

from agent.cluster.heartbeat import Heartbeat, NodeState, OwnRecord
from agent.cluster.members import Members
from agent.cluster.node_client import NodeClient
from agent.config import AgentConfig
from agent.core.errors import MemberUnreachable
from facts import records
from facts.inventory import GpuInventory
from facts.records import RecordsPush, Replica
from tests.fixtures.waiting import eventually


class Peer:
    def __init__(self, node_id: str) -> None:
        self.nodeId = node_id


class FakeMembers:
    """What the heartbeat asks of `Members`; merging b's answer raises, as a pin write to
    a full disk would."""

    def __init__(self) -> None:
        self.heard: dict[str, int] = {}

    def offer(self, records: list[Any]) -> None:
        pass

    def peers(self) -> list[Peer]:
        return [Peer("nod_a"), Peer("nod_b"), Peer("nod_c")]

    def push_body(self) -> bytes:
        return b"[]"

    def sync_request(self) -> bytes:
        return b"sync"

    def holdings(self) -> dict[str, int]:
        return {}

    def digest(self) -> str:
        return "d"

    def delta_for(self, known: Any, *, statements: bool) -> Any:
        return RecordsPush()

    def merge(self, answer: Any) -> None:
        if answer == "from nod_b":
            raise OSError(28, "No space left on device")

    def heard_from(self, node_id: str) -> None:
        self.heard[node_id] = self.heard.get(node_id, 0) + 1


class FakeClient:
    async def push_records(self, node_id: str, body: bytes) -> str:
        if node_id == "nod_a":
            raise RuntimeError("a bug in the client")
        if node_id == "nod_c":
            raise MemberUnreachable("down")
        return f"from {node_id}"


class Ok(FakeClient):
    async def push_records(self, node_id: str, body: bytes) -> Any:
        return RecordsPush(have=[], digest="d")


@pytest.mark.parametrize("client", [FakeClient(), Ok()], ids=["failing", "control"])
async def test_a_push_that_raises_anything_fails_alone_and_the_beats_go_on(
    tmp_path: Any, client: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    members = FakeMembers()
    own = OwnRecord(AgentConfig(home=tmp_path), "nod_self", NodeState(GpuInventory()), list)
    heartbeat = Heartbeat(
        own=own,
        members=cast(Members, members),
        client=cast(NodeClient, client),
        interval_s=0.01,
        probe=False,
    )
    beating = asyncio.create_task(heartbeat.run())
    try:
        # Failed exchanges are tried again each beat: the heartbeat outlives every failure.
        if isinstance(client, Ok):
            await eventually(lambda: len(members.heard) == 3, "every member synced")
        else:
            await eventually(lambda: heartbeat.pushes_failed >= 30, "many tries")
        assert not beating.done()
    finally:
        beating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await beating
    if isinstance(client, Ok):
        assert heartbeat.pushes_failed == 0
        assert set(members.heard) == {"nod_a", "nod_b", "nod_c"}
        # Nothing changed since: no exchange was repeated (reachability is the probes').
        assert heartbeat.pushes_ok == 3
    else:
        assert heartbeat.pushes_ok == 0
        assert members.heard == {}  # a push whose answer could not be merged is not heard
        assert "a bug in the client" in caplog.text
        assert "No space left on device" in caplog.text


@contextlib.asynccontextmanager
async def beating(members: FakeMembers, client: FakeClient, home: Any) -> AsyncIterator[OwnRecord]:
    """A heartbeat of `nod_self` every 10 ms (no probes) over the fakes, for the block."""
    own = OwnRecord(AgentConfig(home=home), "nod_self", NodeState(GpuInventory()), list)
    heartbeat = Heartbeat(
        own=own,
        members=cast(Members, members),
        client=cast(NodeClient, client),
        interval_s=0.01,
        probe=False,
    )
    task = asyncio.create_task(heartbeat.run())
    try:
        yield own
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


class Previous(FakeClient):
    """A member of the previous version: it answers every push with its full push (no
    holdings), whatever it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def push_records(self, node_id: str, body: bytes) -> Any:
        self.bodies.append(body)
        return RecordsPush()


async def test_a_member_of_the_previous_version_gets_full_pushes_every_beat(
    tmp_path: Any,
) -> None:
    members, client = FakeMembers(), Previous()
    async with beating(members, client, tmp_path):
        await eventually(lambda: len(client.bodies) >= 30, "many beats")
    # A sync first to each; its answer had no holdings, so a full push each beat from then
    # on, as the previous version does (the control, `Ok` above, stops after the syncs).
    assert client.bodies[:3] == [b"sync"] * 3
    assert set(client.bodies[3:]) == {b"[]"}


class Holding(FakeMembers):
    """Holds nod_x's record at generation 9 and a new member nod_new's; records what the
    heartbeat counts each peer as holding when it makes a delta."""

    def __init__(self) -> None:
        super().__init__()
        self.self_id = "nod_self"
        self.deltas: list[dict[str, int]] = []

    def peers(self) -> list[Peer]:
        return [Peer("nod_a")]

    def holdings(self) -> dict[str, int]:
        return {"nod_self": 3, "nod_x": 9, "nod_new": 1}

    def delta_for(self, known: Any, *, statements: bool) -> Any:
        self.deltas.append(dict(known))
        return RecordsPush()

    def sent_in_delta(self, known: Any) -> dict[str, int]:
        return {}  # what the empty delta above carries


class Synced(FakeClient):
    async def push_records(self, node_id: str, body: Any) -> Any:
        return RecordsPush(have=[("nod_self", 1), ("nod_x", 5)], digest="d")


async def test_a_delta_leaves_out_newer_records_of_members_the_peer_knows(tmp_path: Any) -> None:
    # nod_a held nod_x at 5 when they synced; nod_x's later records reach nod_a from nod_x
    # itself, so a delta made here counts nod_a as holding nod_x at the generation held
    # here (9), and carries only what is new to it: this node's record and nod_new.
    members, client = Holding(), Synced()
    async with beating(members, client, tmp_path) as own:
        await eventually(lambda: len(members.deltas) >= 1, "the sync (what nod_a lacks)")
        own.state.cordoned = True  # a change of this node's own record: a delta to every peer
        await eventually(lambda: len(members.deltas) >= 2, "the change's delta")
    made = members.deltas[-1]
    assert made["nod_x"] == 9  # not sent again: nod_a gets it from nod_x
    assert "nod_new" not in made  # new to nod_a: sent, with its certificate
    assert made["nod_self"] < 3  # this node's own change: sent


def test_the_record_says_fetching_and_what_it_holds_only_once_every_member_knows(
    tmp_path: Any,
) -> None:
    """Issue 28 under the skew rules: a member of 0.1.0 checks a record over its own encoding
    of the fields it knows, so until the `artifacts` feature is on the record has no
    `artifacts` field at all and a replica fetching its weights says `starting`."""
    digest = "sha256:" + "ab" * 32
    fetching = Replica(
        id="rep_" + "0" * 26, deployment="m", deploymentId="dep_1", spec="s", state="fetching"
    )
    holding = records.Holding(digest=digest, held=3, pieces=8)
    on: set[str] = set()
    own = OwnRecord(
        AgentConfig(home=tmp_path),
        "nod_self",
        NodeState(GpuInventory()),
        list,
        replicas=lambda: [fetching],
        holdings=lambda: [holding],
        features=lambda: on,
    )
    before = msgspec.json.encode(own.current)
    assert b'"artifacts"' not in before
    assert [r.state for r in own.current.replicas] == ["starting"]
    on.add("artifacts")
    assert own.renew_if_changed()
    assert [r.state for r in own.current.replicas] == ["fetching"]
    assert own.current.artifacts == [holding]
    assert b'"artifacts":[["' + digest.encode() + b'",3,8]]' in msgspec.json.encode(own.current)
