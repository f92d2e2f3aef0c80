"""The node API and `NodeClient` in one process, over real cluster mTLS on 127.0.0.1:
records pushed both ways, cordon and cancel reach the callables they are wired to, an
unpinned caller and bad bodies are refused and change nothing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from agent.apis.node import NodeApi
from agent.artifacts.store import ArtifactStore, describe_files
from agent.cluster.node_client import NodeClient
from agent.core.errors import MemberRefused, MemberUnreachable
from broker.anti_entropy import Differences, Digest, Exchange, ExchangeAnswer
from certs import ClientContexts, ClusterDir, server_hostname_for
from facts.artifacts import manifest_digest
from facts.kept import raws
from facts.records import NodeRecord, RecordsPush
from netkit.lean_http import LeanRequest, LeanStream
from tests.fixtures.records import node_record
from tests.fixtures.waiting import eventually

decode_record = msgspec.json.Decoder(NodeRecord).decode
PIECE = 64 * 1024


@dataclass
class Rig:
    a: ClusterDir
    b: ClusterDir
    c: ClusterDir
    a_id: str
    api: NodeApi
    pushes: list[tuple[str, RecordsPush]] = field(default_factory=list)
    cordons: list[bool] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    forwarded: list[str] = field(default_factory=list)

    def client(self, member: ClusterDir) -> NodeClient:
        a_record = node_record(self.a_id, node_port=self.api.port)
        return NodeClient(member, lambda node: a_record if node == self.a_id else None)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    a = ClusterDir(tmp_path / "a")
    a.init("lab", "gpu-a", ["127.0.0.1"])
    a.issue("gpu-b", tmp_path / "b")
    a.issue("gpu-c", tmp_path / "c")
    a_id = a.node_id()
    assert a_id is not None
    pushes: list[tuple[str, RecordsPush]] = []
    cordons: list[bool] = []
    cancels: list[str] = []
    forwarded: list[str] = []

    def on_push(push: RecordsPush, sender: str) -> RecordsPush:
        pushes.append((sender, push))
        return RecordsPush(records=raws([node_record(a_id, 7, node_port=api.port)]))

    def on_cancel(target: str) -> int:
        cancels.append(target)
        return 2

    async def run_here(
        request: web.Request | LeanRequest, path: str, body: bytes
    ) -> web.StreamResponse | LeanStream:
        if path == "/v1/completions":  # answered at once, saying which server carried it
            forwarded.append(f"{type(request).__name__}:{body.decode()}")
            return web.Response(text=type(request).__name__)
        # A forwarded request that runs until it is cancelled (an engine generating).
        forwarded.append("started")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            forwarded.append("cancelled")
            raise
        raise AssertionError("unreachable")

    async def answer_digest(digest: Digest) -> Differences:
        pushes.append(("digest", RecordsPush()))
        return Differences()

    async def answer_exchange(exchange: Exchange) -> ExchangeAnswer:
        pushes.append(("exchange", RecordsPush()))
        return ExchangeAnswer()

    api = NodeApi(
        a,
        host="127.0.0.1",
        port=0,
        on_push=on_push,
        on_admitted=lambda: None,
        records=list,
        on_cordon=cordons.append,
        on_cancel=on_cancel,
        run_here=run_here,
        on_digest=answer_digest,
        on_exchange=answer_exchange,
        artifacts=ArtifactStore(tmp_path / "a-artifacts"),
    )
    await api.start()
    yield Rig(a, ClusterDir(tmp_path / "b"), ClusterDir(tmp_path / "c"), a_id, api, pushes,
              cordons, cancels, forwarded)  # fmt: skip
    await api.aclose()


async def test_a_member_fetches_an_artifact_piece_by_piece_and_checks_each(
    rig: Rig, tmp_path: Path
) -> None:
    source = tmp_path / "weights"
    source.mkdir()
    (source / "config.json").write_bytes(b'{"layers": 2}')
    (source / "model.bin").write_bytes(os.urandom(3 * PIECE + 17))
    manifest = describe_files(source, PIECE)
    digest = manifest_digest(manifest)
    assert rig.api.artifacts is not None
    rig.api.artifacts.put_manifest(digest, msgspec.json.encode(manifest))
    rig.api.artifacts.import_files(source, digest)
    mine = ArtifactStore(tmp_path / "b-artifacts")
    client = rig.client(rig.b)
    try:
        mine.put_manifest(digest, await client.artifact_manifest(rig.a_id, digest))
        held = await client.artifact_held(rig.a_id, digest, manifest.piece_count)
        assert held == set(range(manifest.piece_count))
        for piece in sorted(held):
            assert mine.put_piece(
                digest, piece, await client.artifact_piece(rig.a_id, digest, piece)
            )
        ready = mine.assemble(digest)
        assert (ready / "model.bin").read_bytes() == (source / "model.bin").read_bytes()
        # What it does not hold, or cannot be an artifact, is refused with a status.
        for call, status in (
            (client.artifact_manifest(rig.a_id, "sha256:" + "0" * 64), 404),
            (client.artifact_piece(rig.a_id, digest, manifest.piece_count), 404),
            (client.artifact_manifest(rig.a_id, "sha256:ZZ"), 400),
        ):
            with pytest.raises(MemberRefused) as refused:
                await call
            assert refused.value.status == status
    finally:
        await client.aclose()


async def test_records_cordon_and_cancel_through_the_client(rig: Rig) -> None:
    client = rig.client(rig.b)
    try:
        b_id = rig.b.node_id()
        answer = await client.push_records(
            rig.a_id, RecordsPush(records=raws([node_record("nod_x")]))
        )
        assert [decode_record(r).generation for r in answer.records] == [7]
        ((sender, push),) = rig.pushes
        assert sender == b_id  # the caller is named by its certificate, not by its words
        assert [decode_record(r).nodeId for r in push.records] == ["nod_x"]
        await client.cordon(rig.a_id, True)
        await client.cancel(rig.a_id, "nod_target")
        assert rig.cordons == [True]
        assert rig.cancels == ["nod_target"]
    finally:
        await client.aclose()


async def test_an_unpinned_caller_is_refused_and_changes_nothing(rig: Rig) -> None:
    b_id = rig.b.node_id()
    assert b_id is not None
    rig.a.pins.unpin(b_id)
    refused, control = rig.client(rig.b), rig.client(rig.c)
    try:
        with pytest.raises(MemberRefused) as caught:
            await refused.push_records(rig.a_id, RecordsPush())
        assert caught.value.status == 403
        with pytest.raises(MemberRefused):
            await refused.cordon(rig.a_id, True)
        await control.cordon(rig.a_id, False)  # the control: a pinned member gets through
        assert rig.cordons == [False]
        # A removed (unpinned) member can neither fetch artifacts nor learn what is held.
        nothing = "sha256:" + "0" * 64
        for ask in (
            refused.artifact_manifest(rig.a_id, nothing),
            refused.artifact_held(rig.a_id, nothing, 8),
            refused.artifact_piece(rig.a_id, nothing, 0),
        ):
            with pytest.raises(MemberRefused) as caught:
                await ask
            assert caught.value.status == 403
        with pytest.raises(MemberRefused) as caught:  # the control: pinned, it is only absent
            await control.artifact_piece(rig.a_id, nothing, 0)
        assert caught.value.status == 404
        assert [sender for sender, _ in rig.pushes] == []
    finally:
        await refused.aclose()
        await control.aclose()


async def test_a_member_nobody_knows_the_address_of_is_unreachable(rig: Rig) -> None:
    client = rig.client(rig.b)
    try:
        with pytest.raises(MemberUnreachable):
            await client.push_records("nod_nowhere", RecordsPush())
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status"),
    [
        ("/v1/records", b"{not json", "application/json", 400),
        ("/v1/records", b'{"records": 5}', "application/json", 400),
        ("/v1/records", b"{}", "text/plain", 415),
        ("/v1/cordon", b'{"cordoned": "yes"}', "application/json", 400),
        ("/v1/cancel", b"[]", "application/json", 400),
        ("/v1/forward", b"{}", "application/json", 400),  # no X-Nvpair-Path
        ("/v1/repair/digest", b'{"jobs": 5}', "application/json", 400),
        ("/v1/repair/digest", b'{"jobs": [[99999, 1, 1]]}', "application/json", 400),
        ("/v1/repair/exchange", b"{not json", "application/json", 400),
        # Nested past the recursion limit, in a field msgspec skips: a RecursionError, a 500.
        ("/v1/cordon", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "application/json", 400),
        ("/v1/records", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "application/json", 400),
    ],
)
async def test_bad_bodies_are_refused(
    rig: Rig, path: str, body: bytes, content_type: str, status: int
) -> None:
    url = f"https://127.0.0.1:{rig.api.port}{path}"
    connector = aiohttp.TCPConnector(ssl=ClientContexts(rig.b).current())
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(
            url,
            data=body,
            headers={"Content-Type": content_type},
            server_hostname=server_hostname_for(rig.a_id),
        ) as response,
    ):
        assert response.status == status
    assert (rig.pushes, rig.cordons, rig.cancels) == ([], [], [])


async def test_anti_entropy_rounds_reach_their_callables(rig: Rig) -> None:
    client = rig.client(rig.b)
    try:
        assert await client.repair_digest(rig.a_id, Digest()) == Differences()
        assert await client.repair_exchange(rig.a_id, Exchange()) == ExchangeAnswer()
        assert [what for what, _ in rig.pushes] == ["digest", "exchange"]
    finally:
        await client.aclose()


async def test_a_forwarded_request_whose_caller_hangs_up_is_cancelled_here(rig: Rig) -> None:
    client = rig.client(rig.b)
    body = b'{"model": "m", "messages": []}'
    request = asyncio.create_task(
        client.forward(rig.a_id, "/v1/chat/completions", body).__aenter__()
    )
    await eventually(lambda: rig.forwarded == ["started"], "the request runs on a")
    request.cancel()
    await client.aclose()  # the placing member's connection goes
    await eventually(lambda: rig.forwarded == ["started", "cancelled"], "a cancels it")


async def test_forwarded_inference_takes_the_lean_server_with_the_same_checks(rig: Rig) -> None:
    # NodeClient.forward offers FORWARD_ALPN: the node API serves those connections with
    # netkit.lean_http, and checks the caller's pin on every request as aiohttp's route does.
    b_id = rig.b.node_id()
    assert b_id is not None
    client = rig.client(rig.b)
    try:
        async with client.forward(rig.a_id, "/v1/completions", b"one") as reply:
            assert (reply.status, await reply.read()) == (200, b"LeanRequest")
        async with client.forward(rig.a_id, "/v1/nowhere", b"two") as reply:
            assert reply.status == 400  # not an inference route
        # The control: a client that offers no ALPN (aiohttp's) gets aiohttp's route.
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"https://127.0.0.1:{rig.api.port}/v1/forward",
                data=b"three",
                headers={"X-Nvpair-Path": "/v1/completions"},
                ssl=ClientContexts(rig.b).current(),
                server_hostname=server_hostname_for(rig.a_id),
            ) as answer,
        ):
            assert (answer.status, await answer.text()) == (200, "Request")
        # Removed: refused on the connection it already holds, as on a new one.
        rig.a.pins.unpin(b_id)
        async with client.forward(rig.a_id, "/v1/completions", b"four") as reply:
            assert reply.status == 403
        assert client._forwards.opened == 1  # the kept connection: checked per request
        assert rig.forwarded == ["LeanRequest:one", "Request:three"]
    finally:
        await client.aclose()
