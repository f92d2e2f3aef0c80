"""`nvpair plane serve --cert --key` as a real process serving HTTPS, and the agent's sync
verifying it with the `[plane] ca` file: a certificate from another CA fails the sync
(counted), and nothing is sent in clear; plain HTTP off loopback needs `--insecure-http`
(issue 12, item 7). The CAs are made here with `cryptography`."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from agent.config import PlaneSettings, load_config
from agent.engines.gpus import simulate
from agent.plane_link.sync import PlaneSync
from broker.jobs import JobsStore, JobsWriter
from certs import new_node_id
from plane.db.devserver import free_port
from tests.fixtures.https_certs import make_ca, make_server_cert
from tests.fixtures.records import node_record, workload

from ..plane_client import ADMIN, ClusterCa
from .test_plane_sync import Steps

ENV = {**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}


async def serve(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "agent", "plane", "serve", *args),
        env=ENV,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def line_matching(proc: asyncio.subprocess.Process, pattern: str) -> re.Match[str]:
    """The first line of the process's stderr that matches `pattern`."""
    assert proc.stderr is not None
    seen = []
    async with asyncio.timeout(60):
        while line := (await proc.stderr.readline()).decode():
            seen.append(line)
            if found := re.search(pattern, line):
                return found
    raise AssertionError(f"no line matching {pattern!r} in {''.join(seen)!r}")


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(20):
        return await proc.wait()


@pytest.fixture
async def https_plane(pg_dsn: str, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """A real `plane serve` process with a certificate from a fresh CA: (its URL, CA file)."""
    ca_file, ca, ca_key = make_ca(tmp_path, "plane-ca")
    cert, key = make_server_cert(tmp_path, ca, ca_key)
    proc = await serve("--dsn", pg_dsn, "--listen", "127.0.0.1:0", "--cert", cert, "--key", key)
    try:
        found = await line_matching(proc, r"plane listening on (https://127\.0\.0\.1:\d+)")
        yield found[1], ca_file
    finally:
        if proc.returncode is None:
            await stop(proc)


async def run_sync(
    settings: PlaneSettings, tmp_path: Path, name: str, cluster: ClusterCa
) -> PlaneSync:
    """One node of `cluster` syncing one job against `settings`, until its first attempt
    is over."""
    node = new_node_id()
    gpus = simulate("l4:1", node)
    record = node_record(node, devices=gpus.devices, domains=gpus.domains)
    store = await JobsStore.open(tmp_path / f"{name}.db")
    steps = Steps()
    try:
        async with JobsWriter(store) as writer:
            writer.upsert(workload(name, 1, origin=node))
            sync = PlaneSync(
                settings,
                identity=cluster.node(node),
                store=store,
                writer=writer,
                record=lambda: record,
                sleep=steps.sleep,
            )
            running = asyncio.create_task(sync.run())
            try:
                await steps.asleep()
            finally:
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running
    finally:
        await store.close()
    return sync


async def test_the_agent_syncs_into_an_https_plane_verified_by_its_ca(
    https_plane: tuple[str, str], tmp_path: Path
) -> None:
    url, ca_file = https_plane
    trusted = ssl.create_default_context(cafile=ca_file)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/v1/clusters", json={"name": "lab"}, headers=admin, ssl=trusted
        ) as response:
            assert response.status == 201
            token = (await response.json())["token"]
        with pytest.raises(aiohttp.ClientError):  # the port speaks TLS only
            await session.get(url.replace("https:", "http:") + "/healthz")

        other_ca, _, _ = make_ca(tmp_path, "other-ca")
        cluster = ClusterCa("lab")
        refused = await run_sync(
            PlaneSettings(url=url, token=token, ca=other_ca), tmp_path, "1", cluster
        )
        assert refused.failures == 1  # what nvpair_plane_sync_failures shows
        assert refused.last_error is not None
        assert "CERTIFICATE_VERIFY_FAILED" in refused.last_error
        assert refused.synced == 0

        # The control: the same sync with the plane's own CA.
        synced = await run_sync(
            PlaneSettings(url=url, token=token, ca=ca_file), tmp_path, "2", cluster
        )
        assert (synced.failures, synced.synced) == (0, 1)

        async with session.get(url + "/v1/jobs", headers=admin, ssl=trusted) as response:
            assert [j["id"] for j in (await response.json())["jobs"]] == ["2"]


async def test_an_https_url_is_never_answered_in_clear(tmp_path: Path) -> None:
    # Something on the plane's address that speaks plain HTTP: the sync fails on the
    # handshake, counted, and the token never crosses the wire.
    received = bytearray()

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read(65536))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ca_file, _, _ = make_ca(tmp_path, "plane-ca")
    token = "hgro1.clu_01arz3ndektsv4rrffq69g5fav.secret-never-in-clear"
    async with server:
        settings = PlaneSettings(url=f"https://127.0.0.1:{port}", token=token, ca=ca_file)
        sync = await run_sync(settings, tmp_path, "1", ClusterCa())
    assert sync.failures == 1
    assert received  # a TLS ClientHello reached it ...
    assert b"secret-never-in-clear" not in received
    assert b"POST" not in received


async def test_serve_refuses_plain_http_off_loopback_without_insecure_http() -> None:
    nowhere = f"postgresql://nvpair@127.0.0.1:{free_port()}/postgres"
    for args, says in (
        (("--listen", "0.0.0.0:0"), "not a loopback address: give --cert FILE --key FILE, or"),
        (("--listen", "127.0.0.1:0", "--cert", "c.pem"), "--cert and --key go together"),
    ):
        proc = await serve("--dsn", nowhere, *args)
        try:
            async with asyncio.timeout(30):
                _, raw = await proc.communicate()
        finally:
            if proc.returncode is None:  # it served instead of refusing
                proc.kill()
                await proc.wait()
        err = raw.decode()
        assert proc.returncode == 2, err
        assert err.count("\n") == 1, err
        assert err.startswith("nvpair: "), err
        assert says in err, err
    # The control: told --insecure-http, it binds every address over plain HTTP.
    proc = await serve("--dsn", nowhere, "--listen", "0.0.0.0:0", "--insecure-http")
    try:
        await line_matching(proc, r"plane bound to http://0\.0\.0\.0:\d+")
    finally:
        assert await stop(proc) == 0


def test_the_ca_file_of_plane_is_relative_to_nvpair_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    toml = home / "nvpair.toml"
    toml.write_text('[plane]\nurl = "https://plane:14330"\ntoken = "hgro1.x"\nca = "ca.pem"\n')
    toml.chmod(0o600)
    plane = load_config(home, {}).plane
    assert plane is not None
    assert plane.ca == str(home / "ca.pem")
