"""The mock engine across members (issue 32): a worker that holds what the head sends, as
llama.cpp's `ggml-rpc-server` holds the tensors `llama-server --rpc` puts on it.

`mock-rpc-worker --port P` listens on 127.0.0.1 only (as the real one should: it has no
authentication) and keeps a running digest of the "weights" it is sent. `mock-engine --rpc
host:port,...` is the head: before its own port opens it connects to every worker, sends each
`--rpc-weights-bytes` of weights, and for every request asks each worker for one step of
work over the same connection. A worker lost mid-way ends the head at once (exit status 3),
as llama.cpp's head aborts on a lost RPC backend: the replica's parts restart together.

Frames, both ways: one byte of kind, four of length (big-endian), the payload (at most
`MAX_FRAME`). `W` weights (no answer), `C` a step of work (answered `R` with 32 bytes: the
digest of what the worker holds and the step).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import sys
from typing import Any, Final

__all__ = ["MAX_FRAME", "RpcHead", "add_worker_command", "parse_endpoints"]

log = logging.getLogger(__name__)

MAX_FRAME: Final = 1 << 20
CONNECT_S: Final = 60.0  # the head waits this long for its workers to answer
_HEADER: Final = struct.Struct(">cI")


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """`host:port,host:port` -> [(host, port)]; ValueError naming what is wrong."""
    out = []
    for item in filter(None, text.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rpc: {item!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("--rpc names no worker")
    return out


async def _frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    try:
        kind, size = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes")
        return kind, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None


def _pack(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


class RpcHead:
    """The head's connections to its workers."""

    def __init__(self, endpoints: list[tuple[str, int]], weights_bytes: int) -> None:
        self.endpoints = endpoints
        self.weights_bytes = weights_bytes
        self._links: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._lock = asyncio.Lock()  # one step at a time over each connection

    async def connect(self) -> None:
        """Reach every worker (waiting for them while they start), send its weights."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_S
        for host, port in self.endpoints:
            while True:
                try:
                    link = await asyncio.open_connection(host, port)
                    break
                except OSError:
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(0.2)  # a retry's pace, not a synchronisation
            self._links.append(link)
            sent = 0
            chunk = bytes(range(256)) * 1024  # 256 KiB of "tensors"
            while sent < self.weights_bytes:
                piece = chunk[: min(len(chunk), self.weights_bytes - sent)]
                link[1].write(_pack(b"W", piece))
                await link[1].drain()
                sent += len(piece)
        print(f"mock head: {len(self._links)} worker(s), {self.weights_bytes} B each", flush=True)

    async def step(self, what: bytes) -> None:
        """One step of work on every worker; a worker lost ends this process (status 3)."""
        async with self._lock:
            try:
                for reader, writer in self._links:
                    writer.write(_pack(b"C", hashlib.sha256(what).digest()))
                    await writer.drain()
                    answer = await _frame(reader)
                    if answer is None or answer[0] != b"R":
                        raise ConnectionError("the worker closed the connection")
            except (OSError, ValueError) as exc:
                print(f"mock head: lost a worker ({exc}); ending", file=sys.stderr, flush=True)
                os._exit(3)


async def _serve_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    held = hashlib.sha256()
    try:
        while (frame := await _frame(reader)) is not None:
            kind, payload = frame
            if kind == b"W":
                held.update(payload)
            elif kind == b"C":
                writer.write(_pack(b"R", hashlib.sha256(held.digest() + payload).digest()))
                await writer.drain()
            else:
                return  # not a head of ours
    except (OSError, ValueError):
        return
    finally:
        writer.close()


def add_worker_command(commands: Any) -> None:
    """Register `mock-rpc-worker`."""
    parser = commands.add_parser("mock-rpc-worker", help="a worker part of a spanning mock")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="loopback only, as llama.cpp's")
    parser.set_defaults(run=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    async def serve() -> None:
        server = await asyncio.start_server(_serve_worker, args.host, args.port)
        print(f"mock rpc worker on {args.host}:{args.port}", flush=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0
