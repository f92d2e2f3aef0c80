"""A real `python -m workload_manager` process and a line client for its local channel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tests.fixtures.forkserver import ForkedProcess, start_manager

TIMEOUT = 10.0


class Channel:
    """A newline-delimited JSON-RPC client over a pair of streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._next_id = 0

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send(self, message: Any) -> None:
        await self.send_raw(json.dumps(message).encode() + b"\n")

    async def recv(self) -> Any:
        line = await asyncio.wait_for(self.reader.readline(), TIMEOUT)
        if not line:
            raise EOFError("the manager closed the channel")
        return json.loads(line)

    async def request(self, method: str, params: Any = None) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": self._next_id}
        if params is not None:
            message["params"] = params
        await self.send(message)
        reply = await self.recv()
        while reply.get("method") == "workloads:snapshot":
            reply = await self.recv()  # the manager asking again for a view it lacks
        assert reply.get("id") == self._next_id, reply
        return reply

    async def handshake(self, view: Any = None, *, error: bool = False) -> Any:
        """Read `ready` and the `workloads:snapshot` request; answer it with `view`."""
        ready = await self.recv()
        assert ready["method"] == "ready", ready
        snapshot = await self.recv()
        assert snapshot["method"] == "workloads:snapshot", snapshot
        if error:
            await self.send(
                {"jsonrpc": "2.0", "error": {"code": -32000, "message": "no"}, "id": snapshot["id"]}
            )
        else:
            result = view if view is not None else {"workloads": [], "removed": []}
            await self.send({"jsonrpc": "2.0", "result": result, "id": snapshot["id"]})
        return snapshot

    async def notify(self, method: str, params: Any) -> None:
        await self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


class ManagerProcess:
    """`python -m workload_manager` over stdio or `--ipc PATH`, stopped on `aclose()`."""

    def __init__(self, proc: asyncio.subprocess.Process | ForkedProcess, ipc: Path | None) -> None:
        self.proc = proc
        self.ipc = ipc

    @classmethod
    async def start(
        cls, *args: str, ipc: Path | None = None, env: dict[str, str] | None = None
    ) -> ManagerProcess:
        argv = [*args, *(["--ipc", str(ipc)] if ipc is not None else [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = await start_manager(argv, env=env, limit=4 * 1024 * 1024)
        self = cls(proc, ipc)
        if ipc is not None:
            await self.wait_for_log("local channel listening")
        return self

    async def wait_for_log(self, text: str) -> None:
        assert self.proc.stderr is not None
        async with asyncio.timeout(TIMEOUT):
            while True:
                line = await self.proc.stderr.readline()
                if not line:
                    raise EOFError(f"manager exited before logging {text!r}")
                if text.encode() in line:
                    return

    async def connect(self) -> Channel:
        if self.ipc is None:
            assert self.proc.stdin is not None
            assert self.proc.stdout is not None
            return Channel(self.proc.stdout, self.proc.stdin)
        reader, writer = await asyncio.open_unix_connection(str(self.ipc), limit=4 * 1024 * 1024)
        return Channel(reader, writer)

    async def aclose(self) -> int:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
        try:
            async with asyncio.timeout(TIMEOUT):
                _, stderr = await self.proc.communicate()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise
        self.stderr = stderr.decode(errors="replace")
        assert self.proc.returncode is not None
        return self.proc.returncode
