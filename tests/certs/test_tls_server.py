"""Cluster mTLS on real aiohttp servers on 127.0.0.1 with real certificates."""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import ssl
import sys
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from certs import (
    ClientContexts,
    ClusterDir,
    InsecurePermissions,
    ServerContexts,
    server_hostname_for,
)
from certs.identity import cert_pem, key_pem, new_key
from tests.fixtures.waiting import eventually

from .conftest import Cluster, Server, client_session, get, start_server


async def test_pinned_member_gets_200_and_the_handler_learns_who(
    cluster: Cluster, server: Server
) -> None:
    async with client_session(cluster.b) as session:
        assert await get(session, server, cluster.a_id) == 200
    assert server.handled == [cluster.b.node_id()]


async def test_client_refuses_a_server_that_is_not_the_expected_node(
    cluster: Cluster, server: Server
) -> None:
    other = cluster.c.node_id()
    assert other is not None
    async with client_session(cluster.b) as session:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(session, server, other)


async def test_unpinned_member_gets_403_on_a_new_connection(
    cluster: Cluster, server: Server
) -> None:
    b_id = cluster.b.node_id()
    assert b_id is not None
    cluster.a.pins.unpin(b_id)
    async with client_session(cluster.b) as session:
        assert await get(session, server, cluster.a_id) == 403
    async with client_session(cluster.c) as session:
        assert await get(session, server, cluster.a_id) == 200


async def test_unpinned_member_gets_403_on_a_kept_alive_connection(
    cluster: Cluster, server: Server
) -> None:
    b_id = cluster.b.node_id()
    assert b_id is not None
    connections = 0

    async def on_connection(*_: object) -> None:
        nonlocal connections
        connections += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_connection)
    connector = aiohttp.TCPConnector(ssl=ClientContexts(cluster.b).current(), limit=1)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
        assert await get(session, server, cluster.a_id) == 200
        cluster.a.pins.unpin(b_id)
        assert await get(session, server, cluster.a_id) == 403
    assert connections == 1, "the second request must reuse the first connection"


def _request_over(sock: ssl.SSLSocket) -> int:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return int(data.split(b" ", 2)[1])


def _connect(
    url: str, context: ssl.SSLContext, hostname: str, session: ssl.SSLSession | None
) -> ssl.SSLSocket:
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    return context.wrap_socket(raw, server_hostname=hostname, session=session)


async def test_unpinned_member_gets_403_on_a_resumed_tls_session(
    cluster: Cluster, server: Server
) -> None:
    b_id = cluster.b.node_id()
    assert b_id is not None
    context = ClientContexts(cluster.b).current()
    hostname = server_hostname_for(cluster.a_id)

    def first() -> ssl.SSLSession:
        with _connect(server.url, context, hostname, None) as sock:
            assert _request_over(sock) == 200
            assert sock.session is not None
            return sock.session

    saved = await asyncio.to_thread(first)
    cluster.a.pins.unpin(b_id)

    def resumed() -> tuple[bool | None, int]:
        with _connect(server.url, context, hostname, saved) as sock:
            status = _request_over(sock)
            return sock.session_reused, status

    reused, status = await asyncio.to_thread(resumed)
    assert reused, "the session must really be resumed for this test to mean anything"
    assert status == 403


def _foreign_identity(tmp_path: Path) -> tuple[Path, Path]:
    foreign = ClusterDir(tmp_path / "foreign")
    foreign.init("other", "intruder")
    return foreign.node_crt, foreign.node_key


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "self")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "self.crt").write_bytes(cert_pem(cert))
    (tmp_path / "self.key").write_bytes(key_pem(key))
    return tmp_path / "self.crt", tmp_path / "self.key"


@pytest.mark.parametrize("who", ["another CA", "self-signed", "no certificate"])
async def test_handshake_fails_for_strangers(
    who: str, cluster: Cluster, server: Server, tmp_path: Path
) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cluster.a.ca_crt)  # the stranger even trusts our CA
    if who == "another CA":
        context.load_cert_chain(*_foreign_identity(tmp_path))
    elif who == "self-signed":
        context.load_cert_chain(*_self_signed(tmp_path))
    connector = aiohttp.TCPConnector(ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(
                server.url, server_hostname=server_hostname_for(cluster.a_id)
            ) as r:
                await r.read()
    assert server.handled == []


async def test_server_without_identity_fails_then_serves_after_init(tmp_path: Path) -> None:
    empty = ClusterDir(tmp_path / "a")
    srv, runner = await start_server(empty)
    try:
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe)) as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(srv.url) as r:
                    await r.read()
        assert srv.contexts.refused_handshakes >= 1
        # The identity arrives through the real command, while the server keeps running.
        init = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent",
            "cluster",
            "init",
            "--cluster-dir",
            str(empty.path),
            stdout=asyncio.subprocess.DEVNULL,
        )
        assert await init.wait() == 0
        empty.issue("gpu-b", tmp_path / "b")
        node_id = empty.node_id()
        assert node_id is not None
        async with client_session(ClusterDir(tmp_path / "b")) as session:
            assert await get(session, srv, node_id) == 200
    finally:
        await runner.cleanup()


async def test_rotation_during_a_stream_of_requests_fails_none(
    cluster: Cluster, server: Server
) -> None:
    statuses: list[int] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def stream(force_close: bool) -> None:
        async with client_session(cluster.b, force_close=force_close) as session:
            while not stop.is_set():
                try:
                    statuses.append(await get(session, server, cluster.a_id))
                except aiohttp.ClientError as exc:  # pragma: no cover - the failure we test for
                    errors.append(exc)

    builds_before = server.contexts.builds
    workers = [asyncio.create_task(stream(force_close)) for force_close in (True, True, False)]
    for rotation in range(3):
        builds, answered = server.contexts.builds, len(statuses)
        done = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent",
            "cluster",
            "rotate",
            "--cluster-dir",
            str(cluster.a.path),
            stdout=asyncio.subprocess.DEVNULL,
            env={**os.environ},
        )
        assert await done.wait() == 0

        # Each rotation is seen: the server loads the new certificate and goes on answering
        # the stream before the next one.
        def rotated_and_serving(builds: int = builds, answered: int = answered) -> bool:
            return server.contexts.builds > builds and len(statuses) > answered + 5

        await eventually(rotated_and_serving, f"requests served across rotation {rotation + 1}")
    stop.set()
    await asyncio.gather(*workers)
    assert errors == []
    assert set(statuses) == {200}
    assert len(statuses) > 20
    assert server.contexts.builds > builds_before, "the rotated certificate was never loaded"


async def test_loose_key_permissions_fail_handshakes_and_loading(
    cluster: Cluster, server: Server
) -> None:
    os.chmod(cluster.a.node_key, 0o644)
    with pytest.raises(InsecurePermissions, match=r"node\.key .*chmod 600"):
        cluster.a.load_identity()
    async with client_session(cluster.b) as session:
        with pytest.raises(aiohttp.ClientError):
            await get(session, server, cluster.a_id)
    os.chmod(cluster.a.node_key, 0o600)
    async with client_session(cluster.b) as session:
        assert await get(session, server, cluster.a_id) == 200


def test_contexts_are_built_once_per_change_not_per_handshake(cluster: Cluster) -> None:
    contexts = ServerContexts(cluster.a)
    identity = contexts._identity
    assert identity.current() is identity.current()
    assert contexts.builds == 1
    cluster.a.rotate()
    assert identity.current() is not None
    assert contexts.builds == 2


def test_a_client_looks_at_its_files_once_a_recheck_window_not_per_call(cluster: Cluster) -> None:
    contexts = ClientContexts(cluster.a)
    before = contexts.current()
    identity = contexts._identity
    identity.recheck_s = 3600.0  # a window that cannot pass during the test
    cluster.a.rotate()
    assert contexts.current() is before  # no stat() per call: the hot paths ask per batch
    identity.recheck_s = 0.0  # the window has passed
    rotated = contexts.current()
    assert rotated is not before
    assert identity.builds == 2
