"""`NodeClient` checks whom it reached: a server whose certificate is not the pin of the
member a call is for gets nothing, not a byte of the request (issue 12, item 3)."""

from __future__ import annotations

import contextlib
import datetime
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.cluster.node_client import NodeClient
from agent.core.errors import MemberUnreachable
from certs import ClusterDir, ServerContexts
from certs.identity import load_cert, new_key
from certs.ids import new_node_id, node_dns_name, node_uri
from facts.records import NodeRecord
from tests.fixtures.records import node_record
from tests.workload_manager.cluster_harness import Member, free_port, make_cluster


def impostor(root: Path, ca_holder: Member, victim: Member) -> Member:
    """A node whose certificate, signed by the cluster CA, also carries the victim's DNS name
    in capitals (DNS matching ignores case): what the admitter used to issue to a joiner
    that asked for it in its CSR. It is not pinned anywhere."""
    ca_key, ca_cert = ca_holder.cluster.load_ca()
    key = new_key()
    now = datetime.datetime.now(datetime.UTC)
    names = [
        x509.UniformResourceIdentifier(node_uri(new_node_id())),
        x509.DNSName(node_dns_name(victim.node_id).upper()),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mallory")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cluster = ClusterDir(root / "mallory")
    pins = [load_cert(pem) for pem in ca_holder.cluster.pins.pems()]
    cluster.write_identity(key, cert, ca_cert, pins=pins)
    return Member("mallory", cluster, free_port())


@contextlib.asynccontextmanager
async def node_api(member: Member, hits: list[str]) -> AsyncIterator[int]:
    """A TLS server with `member`'s identity that records every request it is sent."""

    async def cordon(request: web.Request) -> web.Response:
        hits.append(member.name)
        await request.read()
        return web.json_response({})

    async def forward(request: web.Request) -> web.Response:
        hits.append(f"{member.name}:{request.headers['X-Nvpair-Path']}:{await request.text()}")
        return web.json_response({"ran": member.name})

    app = web.Application()
    app.router.add_post("/v1/cordon", cordon)
    app.router.add_post("/v1/forward", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(
        runner, "127.0.0.1", port, ssl_context=ServerContexts(member.cluster).listening
    )
    await site.start()
    try:
        yield port
    finally:
        await runner.cleanup()


@dataclass
class Scene:
    """a's client; b, c and mallory (whose certificate passes TLS as b) serving; what each
    server was sent (`hits`) and where a's records say each member is (`records`)."""

    b: Member
    c: Member
    b_port: int
    c_port: int
    mallory_port: int
    client: NodeClient
    records: dict[str, NodeRecord] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def scene(tmp_path: Path) -> AsyncIterator[Scene]:
    a, b, c = make_cluster(tmp_path, ["a", "b", "c"])
    mallory = impostor(tmp_path, a, b)
    hits: list[str] = []
    records: dict[str, NodeRecord] = {}
    async with (
        node_api(b, hits) as b_port,
        node_api(c, hits) as c_port,
        node_api(mallory, hits) as mallory_port,
    ):
        client = NodeClient(a.cluster, records.get)
        try:
            yield Scene(b, c, b_port, c_port, mallory_port, client, records, hits)
        finally:
            await client.aclose()


async def test_a_record_pointing_a_member_elsewhere_gets_that_server_nothing(
    tmp_path: Path,
) -> None:
    async with scene(tmp_path) as s:
        b, c = s.b.node_id, s.c.node_id
        # The control: b's record points at b, and b takes the call.
        s.records[b] = node_record(b, node_port=s.b_port)
        await s.client.cordon(b, True)
        assert s.hits == ["b"]
        # A record that points b's address at a member that is not b: TLS refuses c (its
        # certificate names only c) ...
        s.records[b] = node_record(b, node_port=s.c_port)
        with pytest.raises(MemberUnreachable, match="Hostname mismatch"):
            await s.client.cordon(b, True)
        # ... and the pin check refuses one whose certificate passes TLS as b.
        s.records[b] = node_record(b, node_port=s.mallory_port)
        with pytest.raises(MemberUnreachable, match="not that member's pin"):
            await s.client.cordon(b, True)
        assert s.hits == ["b"]
        # c itself, by its own record, still answers: nothing else broke.
        s.records[c] = node_record(c, node_port=s.c_port)
        await s.client.cordon(c, True)
        assert s.hits == ["b", "c"]


async def test_a_forwarded_request_goes_to_the_pinned_member_only_on_a_kept_connection(
    tmp_path: Path,
) -> None:
    # Forwarded inference has a client of its own (agent.engines.client with Tls): the same
    # checks as every other call, made once per connection, and the connection kept.
    async with scene(tmp_path) as s:
        b = s.b.node_id

        async def forward(body: bytes) -> bytes:
            async with s.client.forward(b, "/v1/completions", body) as reply:
                assert reply.status == 200
                return await reply.read()

        s.records[b] = node_record(b, node_port=s.b_port)  # the control
        assert await forward(b"one") == b'{"ran": "b"}'
        assert await forward(b"two") == b'{"ran": "b"}'
        assert s.client._forwards.opened == 1  # one connection, one handshake, kept
        s.records[b] = node_record(b, node_port=s.c_port)
        with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
            await forward(b"to c")
        s.records[b] = node_record(b, node_port=s.mallory_port)
        with pytest.raises(aiohttp.ClientConnectionError, match="not that member's pin"):
            await forward(b"to mallory")
        assert s.hits == ["b:/v1/completions:one", "b:/v1/completions:two"]


def test_the_admitter_drops_names_of_the_clusters_own_namespace(tmp_path: Path) -> None:
    a, b = make_cluster(tmp_path, ["a", "b"])
    issued = a.cluster.issue(
        "joiner",
        tmp_path / "joiner",
        [node_dns_name(b.node_id).upper(), "*.example.com", "gpu-7.example.com", "10.0.0.7"],
    )
    cert = ClusterDir(tmp_path / "joiner").load_identity().cert
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = sans.get_values_for_type(x509.DNSName)
    # Its own node-id name (added by the issuer) and the operator's plain name, nothing else.
    assert sorted(dns) == sorted([node_dns_name(issued.node_id), "gpu-7.example.com"])
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
