"""A real plane for end-to-end tests: `nvpair plane serve` as a process on a real PostgreSQL,
called over HTTP with the admin token, and agents' homes pointed at it (`plane.json`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.fixtures.forkserver import ForkedProcess, start_agent
from tests.workload_manager.cluster_harness import free_port

__all__ = ["ADMIN", "PlaneProcess", "point_at_plane"]

ADMIN = "nvpadm1.fleet-test-admin"


class PlaneProcess:
    """`nvpair plane serve` on `dsn`, on a free port; `log` holds what it wrote to stderr
    (read as it comes, so a talkative plane never blocks on a full pipe)."""

    def __init__(self, dsn: str, *, python: str = sys.executable) -> None:
        self.dsn = dsn
        # Another environment's Python runs another release (tests/upgrade), from a folder
        # where this checkout's packages are not importable.
        self.python = python
        self.cwd = None if python == sys.executable else str(Path(python).parents[2])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | ForkedProcess | None = None
        self.log = bytearray()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start it and wait for its "plane listening" line."""
        argv = ["plane", "serve", "--dsn", self.dsn, "--listen", f"127.0.0.1:{self.port}"]
        env = {**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN}
        if self.python == sys.executable:
            self.proc = await start_agent(argv, env=env, stdout=False)
        else:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "agent", *argv, env=env, cwd=self.cwd,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        stderr = self.proc.stderr
        assert stderr is not None
        async with asyncio.timeout(30):
            while b"plane listening" not in (line := await stderr.readline()):
                if not line:  # it exited: say why instead of spinning on EOF
                    said = self.log[-4000:].decode(errors="replace")
                    raise AssertionError(f"the plane exited: {said}")
                self.log += line
        self.log += line
        self._reader = asyncio.create_task(self._read_rest(stderr))

    async def _read_rest(self, stderr: asyncio.StreamReader) -> None:
        while line := await stderr.readline():
            self.log += line

    async def stop(self) -> None:
        """SIGTERM, and wait for it to exit and for the last of its stderr."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader
            self._reader = None

    async def get(self, path: str) -> Any:
        """GET `path` as the admin; the decoded JSON of a 200."""
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + path, headers=headers) as r,
        ):
            assert r.status == 200, await r.text()
            return await r.json()

    async def cli(self, *args: str) -> str:
        """Run `nvpair plane ARGS --plane URL` as the admin; its stdout."""
        argv = ["plane", *args, "--plane", self.url]
        proc = await start_agent(argv, env={**os.environ, "NVPAIR_PLANE_ADMIN_TOKEN": ADMIN})
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        return out.decode()


def point_at_plane(home: Path, plane: PlaneProcess, token: str) -> None:
    """Make `home` (created here) sync into `plane` with the cluster's enrolment `token`."""
    home.mkdir(parents=True)
    # Syncs and desired-state fetches every 0.25 s, not 2 s: the tests wait for them.
    settings = {"url": plane.url, "token": token, "interval_s": 0.25}
    (home / "plane.json").write_text(json.dumps(settings))
    (home / "plane.json").chmod(0o600)  # others may not read a token
