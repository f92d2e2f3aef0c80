"""`nvpair plane serve` as a real process: without its database it starts and answers 503,
and stops on SIGTERM; a port in use and a malformed DSN end it with one line, no traceback."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys

import aiohttp

from plane.db.devserver import free_port

from ..plane_client import ADMIN

ENV = {**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}


async def serve(dsn: str, listen: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        "plane",
        "serve",
        "--dsn",
        dsn,
        "--listen",
        listen,
        env=ENV,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def finished(proc: asyncio.subprocess.Process, within_s: float = 10) -> tuple[int, str]:
    """The exit status and all of stderr, once the process has ended."""
    async with asyncio.timeout(within_s):
        _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


async def test_without_its_database_the_plane_serves_503_and_stops_on_sigterm() -> None:
    proc = await serve(f"postgresql://nvpair@127.0.0.1:{free_port()}/postgres", "127.0.0.1:0")
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(20):
            line = (await proc.stderr.readline()).decode()
        bound = re.search(r"plane bound to (http://127\.0\.0\.1:\d+)", line)
        assert bound, line
        url = bound[1]
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/clusters", "/v1/fleet/summary", "/healthz"):
                async with session.get(url + path, headers=headers) as response:
                    assert response.status == 503, path
                    assert response.headers["Retry-After"] == "1"
                    assert "database" in (await response.json())["error"]
        proc.send_signal(signal.SIGTERM)
        code, err = await finished(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, err
    assert "Traceback" not in err
    assert "plane listening" not in err  # it never served


async def test_a_port_in_use_ends_serve_with_one_line_and_status_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        nowhere = f"postgresql://nvpair@127.0.0.1:{free_port()}/postgres"
        proc = await serve(nowhere, f"127.0.0.1:{port}")
        code, err = await finished(proc)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("nvpair: ")]
    assert len(lines) == 1, err
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0]
    assert "--listen" in lines[0]
    assert "Traceback" not in err


async def test_a_malformed_dsn_ends_serve_with_one_line_and_status_1() -> None:
    proc = await serve("this is not a dsn", "127.0.0.1:0")
    code, err = await finished(proc)
    assert code == 1, err
    assert "nvpair: the plane cannot start: " in err
    assert "Traceback" not in err
