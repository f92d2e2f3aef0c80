"""The local channel to the broker: newline-delimited JSON-RPC over stdio or a Unix socket.

Only bytes move here; what they mean is the `Manager`'s business. Reads go through a
`LineFramer` with an explicit maximum frame size. Writes made in one loop iteration are
joined into one write, and the bytes waiting for the broker are bounded: past the bound the
reader waits for the broker to drain (replies), and unsolicited frames are dropped and
counted rather than held without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from netkit.tasks import describe, reporting
from workload_manager.errors import ChannelFailed, IpcPathInUse
from workload_manager.framing import DEFAULT_MAX_FRAME, FrameTooLarge, LineFramer
from workload_manager.jsonrpc import INVALID_REQUEST, ErrorObject, encode_error
from workload_manager.manager import Manager
from workload_manager.view_loader import LOADER_PART, ViewLoader

__all__ = [
    "BrokerLink",
    "FrameWriter",
    "open_stdio",
    "serve_connection",
    "serve_stdio",
    "serve_unix",
]

log = logging.getLogger(__name__)

READ_CHUNK: Final = 64 * 1024
STDIN_PART: Final = "stdin-pump"
DEFAULT_MAX_BUFFER: Final = 16 * 1024 * 1024


@dataclass(slots=True)
class WriterCounters:
    """Frames written to the broker and frames dropped because it was not reading."""

    frames_sent: int = 0
    frames_dropped: int = 0


class FrameWriter:
    """Newline-terminated frames to one stream, coalesced per loop iteration, bounded."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        *,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        counters: WriterCounters | None = None,
    ) -> None:
        self._writer = writer
        self._max_buffer = max_buffer
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._scheduled = False
        self._closed = False
        self.counters = counters or WriterCounters()

    @property
    def high_water(self) -> int:
        """Above this many buffered bytes the reader waits for the broker to drain."""
        return self._max_buffer // 2

    def has_room(self) -> bool:
        """Whether the broker is keeping up (below the high-water mark)."""
        return not self._closed and self.buffered < self.high_water

    @property
    def buffered(self) -> int:
        """Bytes not yet handed to the kernel."""
        return self._pending_bytes + self._writer.transport.get_write_buffer_size()

    def send(self, frame: bytes) -> bool:
        """Queue one frame; `False` (and a count) when closed or over the bound."""
        if self._closed or self._writer.transport.is_closing():
            self.counters.frames_dropped += 1
            return False
        if self.buffered + len(frame) > self._max_buffer:
            self.counters.frames_dropped += 1
            return False
        self._pending.append(frame)
        self._pending.append(b"\n")
        self._pending_bytes += len(frame) + 1
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return True

    def _flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        data = b"".join(self._pending)
        frames = len(self._pending) // 2
        self._pending.clear()
        self._pending_bytes = 0
        if self._writer.transport.is_closing():
            self.counters.frames_dropped += frames
            return
        self._writer.write(data)
        self.counters.frames_sent += frames

    async def drain(self) -> None:
        """Wait until the stream has taken what was queued (backpressure for replies)."""
        self._flush()
        await self._writer.drain()

    async def aclose(self) -> None:
        """Flush what is queued and close the stream."""
        if self._closed:
            return
        with contextlib.suppress(ConnectionError):
            self._flush()
        self._closed = True
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


class BrokerLink:
    """The broker's connection, if any: where the `Manager` sends its frames for the broker.

    The manager is given `send` and `has_room` when it is built; each connection the local
    channel serves is attached for as long as it lasts. With none attached, frames are
    dropped and counted, and the inter-node server answers peers 503 (`has_room` is False).
    """

    def __init__(self) -> None:
        self.counters = WriterCounters()  # shared by every connection's writer
        self._out: FrameWriter | None = None

    def attach(self, out: FrameWriter) -> None:
        """Frames go to `out` from now on (a broker connected)."""
        self._out = out

    def detach(self) -> None:
        """Frames are dropped from now on (the broker went away)."""
        self._out = None

    def send(self, frame: bytes) -> bool:
        """Queue one frame for the broker; `False` (and a count) when it cannot take it."""
        out = self._out
        if out is None:
            self.counters.frames_dropped += 1
            return False
        return out.send(frame)

    def has_room(self) -> bool:
        """Whether a broker is connected and keeping up."""
        out = self._out
        return out is not None and out.has_room()


async def serve_connection(
    manager: Manager,
    loader: ViewLoader,
    reader: asyncio.StreamReader,
    out: FrameWriter,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    """Run one broker connection until end of stream: `ready` first, then answer frames.

    Right after `ready` the manager asks the broker for its view (`workloads:snapshot`);
    a page refused, failed or unanswered is asked for again (`loader`).
    """
    out.send(manager.ready_frame())
    out.send(manager.snapshot_request())
    async with asyncio.TaskGroup() as tasks:
        loading = tasks.create_task(
            reporting(LOADER_PART, loader.load(manager, out.send)), name=LOADER_PART
        )
        try:
            await _answer_frames(manager, reader, out, max_frame)
        finally:
            loading.cancel()


async def _answer_frames(
    manager: Manager, reader: asyncio.StreamReader, out: FrameWriter, max_frame: int
) -> None:
    framer = LineFramer(max_frame)
    too_large = ErrorObject(
        code=INVALID_REQUEST,
        message="Invalid Request",
        data=f"frame exceeds the maximum of {max_frame} bytes",
    )
    while True:
        try:
            chunk = await reader.read(READ_CHUNK)
        except ConnectionError:
            chunk = b""
        frames = framer.feed(chunk) if chunk else framer.close()
        for frame in frames:
            if isinstance(frame, FrameTooLarge):
                out.send(encode_error(None, too_large))
                manager.snapshot_refused()
                continue
            reply = manager.handle_local(frame)
            if reply is not None:
                out.send(reply)
        if not chunk:
            return
        if out.buffered > out.high_water:
            with contextlib.suppress(ConnectionError):
                await out.drain()


async def open_stdio(
    tasks: asyncio.TaskGroup, on_failure: Callable[[str, BaseException], object] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over this process's stdin and stdout, with stdout kept for frames alone.

    File descriptor 1 is duplicated for the channel and then pointed at stderr, so a stray
    `print` or a library's output can never corrupt the frame stream. Pipes, sockets and
    terminals are driven by the event loop; anything else (`< requests.ndjson`,
    `> replies.ndjson`, `/dev/null`) is read in a thread and written directly, which for
    files and devices never blocks long. That reading thread's pump is a task of `tasks`
    (the caller's): a read that fails is logged, ends the stream and goes to `on_failure`.
    """
    loop = asyncio.get_running_loop()
    channel_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    reader = asyncio.StreamReader(limit=READ_CHUNK, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    stdin_fd = os.dup(sys.stdin.fileno())
    if not _pollable(stdin_fd):
        pump = _pump_from_file(reader, stdin_fd)
        tasks.create_task(reporting(STDIN_PART, pump, on_failure), name=STDIN_PART)
    else:
        await loop.connect_read_pipe(lambda: protocol, os.fdopen(stdin_fd, "rb", buffering=0))
    # A reader-less StreamReaderProtocol gives the writer flow control and a close waiter.
    write_protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop)
    transport: asyncio.WriteTransport
    if not _pollable(channel_fd):
        transport = _FileWriteTransport(channel_fd, write_protocol, loop)
    else:
        transport, _ = await loop.connect_write_pipe(
            lambda: write_protocol, os.fdopen(channel_fd, "wb", buffering=0)
        )
    writer = asyncio.StreamWriter(transport, write_protocol, reader, loop)
    return reader, writer


def _pollable(fd: int) -> bool:
    # epoll takes pipes, sockets and terminals; files and /dev/null it refuses (EPERM).
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd)


async def _pump_from_file(reader: asyncio.StreamReader, fd: int) -> None:
    # A read of a file or a device returns at once, so a cancelled pump's last read in its
    # thread finishes promptly; the stream ends however the pump does.
    try:
        while chunk := await asyncio.to_thread(os.read, fd, READ_CHUNK):
            reader.feed_data(chunk)
    finally:
        os.close(fd)
        reader.feed_eof()


class _FileWriteTransport(asyncio.WriteTransport):
    """A write transport over a regular file: writes complete at once."""

    def __init__(
        self, fd: int, protocol: asyncio.BaseProtocol, loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__()
        self._fd: int | None = fd
        self._protocol = protocol
        self._loop = loop
        protocol.connection_made(self)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view and self._fd is not None:
            view = view[os.write(self._fd, view) :]

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._loop.call_soon(self._protocol.connection_lost, None)


async def serve_stdio(
    manager: Manager, broker: BrokerLink, loader: ViewLoader, *, max_frame: int = DEFAULT_MAX_FRAME
) -> None:
    """Serve the broker over stdin/stdout until stdin closes, attached to `broker`.

    Raises `ChannelFailed` when reading stdin failed (the traceback is logged): the channel
    ended, but not because the broker closed it.
    """
    failures: list[BaseException] = []
    async with asyncio.TaskGroup() as tasks:
        reader, writer = await open_stdio(tasks, lambda part, exc: failures.append(exc))
        out = FrameWriter(writer, counters=broker.counters)
        broker.attach(out)
        try:
            await serve_connection(manager, loader, reader, out, max_frame=max_frame)
        finally:
            broker.detach()
            await out.aclose()
    if failures:
        raise ChannelFailed(f"reading stdin failed: {describe(failures[0])}") from failures[0]


async def serve_unix(
    manager: Manager,
    broker: BrokerLink,
    loader: ViewLoader,
    path: Path,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    ready: asyncio.Future[None] | None = None,
) -> None:
    """Listen on a Unix socket (mode 0600) and serve one broker connection at a time,
    attached to `broker` while it lasts.

    A second connection while one is open is told so and closed: the socket belongs to the
    supervising broker, and a broker that reconnects after a restart gets a fresh `ready`.
    Runs until cancelled.
    """
    _clear_stale_socket(path)
    busy = asyncio.Lock()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        out = FrameWriter(writer, counters=broker.counters)
        if busy.locked():
            out.send(
                encode_error(
                    None,
                    ErrorObject(
                        code=INVALID_REQUEST,
                        message="Invalid Request",
                        data="another broker is connected to this workload manager",
                    ),
                )
            )
            await out.aclose()
            return
        async with busy:
            broker.attach(out)
            try:
                await serve_connection(manager, loader, reader, out, max_frame=max_frame)
            finally:
                broker.detach()
                await out.aclose()

    old_umask = os.umask(0o177)  # the socket is born 0600: no window where others can connect
    try:
        server = await asyncio.start_unix_server(on_connect, path=str(path), limit=READ_CHUNK)
    finally:
        os.umask(old_umask)
    log.info("local channel listening on %s", path)
    try:
        async with server:
            if ready is not None:
                ready.set_result(None)
            await server.serve_forever()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _clear_stale_socket(path: Path) -> None:
    # A socket left by a dead manager is removed; anything else at the path is refused.
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise IpcPathInUse(path, "exists and is not a socket; remove it first")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise IpcPathInUse(path, "is another process's socket: it is listening there")
