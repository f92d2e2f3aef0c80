"""A fault-injecting TCP proxy in the test process: one listener in front of one member's
port, forwarding bytes both ways, with controls to drop, delay, lose, reset and heal.

The members advertise the proxies' ports, so every other member reaches a member only
through its proxies (docs/operations.md, "Advertised address and ports"). A member
advertises one address for everyone, so a proxy stands for a *destination*: dropping it cuts
every member's traffic to that member at once. The bytes are mTLS; the proxy never reads
them, it only decides whether, when and how long they flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from typing import Final

__all__ = ["FaultProxy", "ProxyCounters"]

CHUNK: Final = 64 * 1024
QUEUE_CHUNKS: Final = 64  # per direction: a slow side holds the other back, memory stays bounded


@dataclass
class ProxyCounters:
    """What went through one proxy: evidence that traffic really took the proxied path."""

    accepted: int = 0
    refused: int = 0  # connections closed at once while dropped
    bytes_forwarded: int = 0
    bytes_discarded: int = 0  # read while dropped, never delivered
    resets: int = 0  # connections cut by `reset()`
    chunks_lost: int = 0  # chunks `lose()` held back for a retransmission


class FaultProxy:
    """Forwards connections on `port` to `127.0.0.1:target`; `async with` owns the listener
    and every connection task."""

    def __init__(self, name: str, target: int, rng: random.Random) -> None:
        self.name = name
        self.target = target
        self.rng = rng
        self.counters = ProxyCounters()
        self.port = 0  # known once started
        self._dropped = False
        self._delay_s = 0.0
        self._jitter_s = 0.0
        self._loss = 0.0
        self._retransmit_s = 0.0
        self._server: asyncio.Server | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._open: dict[asyncio.StreamWriter, str] = {}  # each open socket -> the caller's address
        self._cut_from: set[str] = set()  # callers (source addresses) dropped

    def __repr__(self) -> str:
        return f"FaultProxy({self.name}: {self.port} -> {self.target})"

    async def __aenter__(self) -> FaultProxy:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        assert self._tasks is not None
        self._server.close()
        self.reset()  # every pump sees its streams end and returns
        await self._server.wait_closed()
        await self._tasks.__aexit__(None, None, None)

    # -- controls ------------------------------------------------------------------------------

    @property
    def dropped(self) -> bool:
        """Whether the proxy forwards nothing now."""
        return self._dropped

    def drop(self) -> None:
        """Stop forwarding: open connections carry nothing more (what arrives is discarded),
        new ones are closed at once."""
        self._dropped = True

    def delay(self, ms: float, jitter_ms: float = 0.0) -> None:
        """Hold every chunk `ms` (plus or minus up to `jitter_ms`) before passing it on; the
        order of a connection's bytes is kept."""
        if ms < 0 or jitter_ms < 0 or jitter_ms > ms:
            raise ValueError(f"delay needs 0 <= jitter_ms <= ms, not ms={ms} jitter_ms={jitter_ms}")
        self._delay_s, self._jitter_s = ms / 1000, jitter_ms / 1000

    def lose(self, fraction: float, retransmit_ms: float = 200.0) -> None:
        """Lose `fraction` of the chunks the way a TCP stream sees packet loss: a lost
        chunk arrives once it is retransmitted, `retransmit_ms` later (Linux's minimum RTO is
        200 ms), doubling for each further loss of the same chunk, and holds up what follows
        it on its connection. (Dropping bytes from a TLS stream would only corrupt it: a real
        lossy link delays, it never garbles what TCP delivers.)"""
        if not 0 <= fraction < 1 or retransmit_ms < 0:
            raise ValueError(f"lose needs 0 <= fraction < 1, not {fraction}, {retransmit_ms}")
        self._loss, self._retransmit_s = fraction, retransmit_ms / 1000

    def drop_from(self, caller: str) -> None:
        """`drop()` for the connections from one source address only: its open connections
        are cut, new ones closed at once; every other caller still gets through. With each
        member dialling from its own address (`dial_from`), that cuts one link one way."""
        self._cut_from.add(caller)
        self.reset(caller)

    def heal_from(self, caller: str) -> None:
        """Let `caller` through again."""
        self._cut_from.discard(caller)

    def reset(self, caller: str | None = None) -> None:
        """Cut every open connection (both sides see it closed), or only `caller`'s."""
        for writer, source in list(self._open.items()):
            if caller is None or source == caller:
                self.counters.resets += 1
                writer.transport.abort()
                del self._open[writer]

    def heal(self) -> None:
        """Forward again, at once: no drop, no delay, no loss, every caller let through."""
        self._dropped = False
        self._cut_from.clear()
        self._delay_s = self._jitter_s = 0.0
        self._loss = self._retransmit_s = 0.0

    # -- the connections -----------------------------------------------------------------------

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        assert self._tasks is not None
        caller = str(client_w.get_extra_info("peername")[0])
        if self._dropped or caller in self._cut_from:
            self.counters.refused += 1
            client_w.transport.abort()
            return
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            # The member is down (killed, restarting): its peers see a refused connection.
            client_w.transport.abort()
            return
        if self._dropped or caller in self._cut_from:
            # Dropped while this connection was being made upstream: it is one of the
            # connections the drop cuts, not one that got through after it.
            self.counters.refused += 1
            client_w.transport.abort()
            server_w.transport.abort()
            return
        self.counters.accepted += 1
        self._open[client_w] = self._open[server_w] = caller
        self._tasks.create_task(self._pair(client_r, client_w, server_r, server_w))

    async def _pair(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        server_r: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
    ) -> None:
        # One direction ending (a close, a cut) ends the connection: both sockets are cut and
        # the other direction's pump is cancelled, so no task outlives its connection.
        directions = [
            asyncio.create_task(self._pump(client_r, server_w)),
            asyncio.create_task(self._pump(server_r, client_w)),
        ]
        try:
            await asyncio.wait(directions, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for writer in (client_w, server_w):
                self._open.pop(writer, None)
                writer.transport.abort()
            for task in directions:
                task.cancel()
            await asyncio.gather(*directions, return_exceptions=True)

    def _lost(self) -> float:
        # How long a chunk waits for its retransmissions: each try is lost with the set
        # probability, and each retransmission waits twice as long as the one before.
        held, rto = 0.0, self._retransmit_s
        while self._loss and self.rng.random() < self._loss and held < 30 * self._retransmit_s:
            self.counters.chunks_lost += 1
            held, rto = held + rto, rto * 2
        return held

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A reader and a writer joined by a bounded queue of (due, chunk), so a delay holds
        # bytes back without holding up the reading; None marks the end of the stream.
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            last_due = 0.0
            with contextlib.suppress(ConnectionError, OSError):
                while chunk := await reader.read(CHUNK):
                    if self._dropped:
                        self.counters.bytes_discarded += len(chunk)
                        continue
                    jitter = self.rng.uniform(-self._jitter_s, self._jitter_s)
                    last_due = max(last_due, loop.time() + self._delay_s + jitter + self._lost())
                    await queue.put((last_due, chunk))
            await queue.put(None)  # the writer is still taking items: this cannot block long

        async def write() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while (item := await queue.get()) is not None:
                    due, chunk = item
                    if (wait := due - loop.time()) > 0:
                        await asyncio.sleep(wait)  # the injected delay itself, not a sync
                    writer.write(chunk)
                    await writer.drain()
                    self.counters.bytes_forwarded += len(chunk)

        reading = asyncio.create_task(read())
        try:
            await write()
        finally:
            reading.cancel()  # the writer is gone: what is still read has nowhere to go
            await asyncio.gather(reading, return_exceptions=True)
