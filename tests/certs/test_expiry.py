"""Expired certificates stop working (issue 12, item 9): a member whose certificate passes
its notAfter is refused on the next request of a kept-alive connection and of a resumed TLS
session, where no handshake verifies it again, and a new connection fails its handshake."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from certs import ClientContexts, ClusterDir, new_node_id, server_hostname_for
from certs.identity import NODE_VALIDITY, issue_node_cert, load_cert, new_key
from tests.fixtures.waiting import eventually

from .conftest import Cluster, Server, get, start_server
from .test_tls_server import _connect, _request_over

VALID_FOR_S = 4  # long enough for the controls on a busy machine, short for the suite


def issue_short_lived(ca_holder: ClusterDir, out: Path, seconds: float) -> datetime.datetime:
    """Admit a member at `out` whose certificate expires `seconds` from now; its notAfter.

    The CA's own code signs it, dated so that its ordinary validity ends then.
    """
    ca_key, ca_cert = ca_holder.load_ca()
    key = new_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = issue_node_cert(
        ca_key=ca_key,
        ca_cert=ca_cert,
        public_key=key.public_key(),
        node_id=new_node_id(),
        name="gpu-brief",
        now=now - NODE_VALIDITY + datetime.timedelta(seconds=seconds),
    )
    ca_holder.pins.pin(cert, ca=ca_cert)
    members = [load_cert(pem) for pem in ca_holder.pins.pems()]
    ClusterDir(out).write_identity(key, cert, ca_cert, pins=members)
    return cert.not_valid_after_utc


@pytest.fixture
async def server(cluster: Cluster) -> AsyncIterator[Server]:
    """One form of the guard: both run the same `certs.pinned_peer` (one test waits for an
    expiry; twice would double its wait)."""
    srv, runner = await start_server(cluster.a, guard="decorator")
    yield srv
    await runner.cleanup()


async def test_an_expired_member_is_refused_on_kept_alive_resumed_and_new_connections(
    cluster: Cluster, server: Server, tmp_path: Path
) -> None:
    not_after = issue_short_lived(cluster.a, tmp_path / "brief", VALID_FOR_S)
    brief = ClusterDir(tmp_path / "brief")
    context = ClientContexts(brief).current()
    hostname = server_hostname_for(cluster.a_id)
    connections = 0

    async def on_connection(*_: object) -> None:
        nonlocal connections
        connections += 1

    def first() -> ssl.SSLSession:
        with _connect(server.url, context, hostname, None) as sock:
            assert _request_over(sock) == 200
            assert sock.session is not None
            return sock.session

    def resumed() -> tuple[bool | None, int]:
        with _connect(server.url, context, hostname, saved) as sock:
            return sock.session_reused, _request_over(sock)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_connection)
    connector = aiohttp.TCPConnector(ssl=context, limit=1)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
        # The controls, while the certificate is valid: a request, and a session to resume.
        assert await get(session, server, cluster.a_id) == 200
        saved = await asyncio.to_thread(first)
        assert time.time() < not_after.timestamp(), "too slow for the controls: raise VALID_FOR_S"

        await eventually(
            lambda: time.time() > not_after.timestamp() + 1,
            "the certificate has expired",
            within_s=VALID_FOR_S + 10,
        )
        assert await get(session, server, cluster.a_id) == 403
    assert connections == 1, "the refused request must reuse the first connection"

    reused, status = await asyncio.to_thread(resumed)
    assert reused, "the session must really be resumed for this test to mean anything"
    assert status == 403

    def fresh(member: ssl.SSLContext) -> bytes:
        # What a new connection gets back for a request: the server verifies the client's
        # certificate after the client's side of the TLS 1.3 handshake, so the refusal shows
        # as an alert or a closed connection at the first read, never an HTTP answer.
        try:
            with _connect(server.url, member, hostname, None) as sock:
                sock.sendall(b"GET /ping HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
                return sock.recv(65536)
        except (ssl.SSLError, ConnectionError):
            return b""

    assert await asyncio.to_thread(fresh, context) == b""
    # The control after expiry: a member whose certificate is valid is served as before.
    valid = ClientContexts(cluster.c).current()
    assert (await asyncio.to_thread(fresh, valid)).startswith(b"HTTP/1.1 200")
