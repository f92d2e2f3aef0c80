"""The engines' own channel between members, over the node API's mTLS (issue 32, item 3).

llama.cpp's RPC server has no authentication (its own documentation: never expose it on an
open network). A worker part of a spanning replica runs `ggml-rpc-server` on 127.0.0.1 only;
the head part's `llama-server` reaches it through a tunnel:

    llama-server --rpc 127.0.0.1:P  ->  head member's agent, listening on 127.0.0.1:P
        ->  binary WebSocket messages over the worker member's node API (cluster mTLS, the
            worker member's pin)  ->  worker member's agent  ->  127.0.0.1:{rpc port}

No engine port is ever open to the network. **Who may open one**: only the member that holds
the head part of the worker part's replica (the layout the worker part was started with names
it first); any other member gets 403 (an unpinned caller never reaches the route). On the
head's member, only the head's engine: a connection to the listener from any other local
process (another user's, say) is closed at once (`agent.engines.ports.client_of`). **Bounded**:
`MAX_CONNECTIONS` at once through one worker part (the head's listener closes more at once),
messages of at most `CHUNK` bytes, each side reading only as fast as the other side's
transport drains. **Counted**: bytes each way per part (`Tunnels.counts`, in `/metrics` and
`nvpair replicas`). **Closed** with the replica: its listener and every connection through
it, on both members.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp
from aiohttp import web

from agent.core.errors import AgentError
from agent.engines.ports import client_of
from netkit.guard import peer_node_id

__all__ = ["CHUNK", "HEARTBEAT_S", "MAX_CONNECTIONS", "MAX_MESSAGE", "Counts", "Tunnels"]

log = logging.getLogger(__name__)

CHUNK: Final = 256 * 1024  # bytes read from a socket at once: one message, each way
MAX_MESSAGE: Final = 2 * CHUNK  # what either end takes (aiohttp's bound is exclusive)
MAX_CONNECTIONS: Final = 16  # through one worker part at once
HEARTBEAT_S: Final = 30.0  # a tunnel whose other end vanished is closed within about this


class _Socket(Protocol):
    """A WebSocket either end of a tunnel holds (aiohttp's client or server one)."""

    async def send_bytes(self, data: bytes) -> None: ...

    async def receive(self) -> aiohttp.WSMessage: ...

    async def close(self) -> bool: ...


Dial = Callable[[str, str], AbstractAsyncContextManager[aiohttp.ClientWebSocketResponse]]
"""(member, worker replica) -> a WebSocket to that member's tunnel route for the replica."""

Admit = Callable[[str, str], "int | str"]
"""(calling member, replica) -> the local port of the part's engine, or why not."""


@dataclass
class Counts:
    """Bytes through one part's tunnels: `sent` towards the worker, `received` from it."""

    sent: int = 0
    received: int = 0
    connections: int = 0  # opened, in all

    def add_sent(self, size: int) -> None:
        self.sent += size

    def add_received(self, size: int) -> None:
        self.received += size


@dataclass
class _Ends:
    """The open tunnels of one part on this member: its listener (the head's side) and the
    connections through it."""

    server: asyncio.Server | None = None
    port: int = 0
    live: set[asyncio.Task[None]] = field(default_factory=set)


class Tunnels:
    """Both ends: `open()` a listener for a head part, `serve()` the worker's route."""

    def __init__(
        self, dial: Dial, admit: Admit, owner: Callable[[str], int | None] = lambda _: None
    ) -> None:
        self._dial = dial
        self._admit = admit
        # A head part -> the process group leader of its engine (None: none runs): the head's
        # listener takes connections from that engine's processes only.
        self._owner = owner
        self.refused = 0  # local connections not from the head's engine, closed
        self._ends: dict[str, _Ends] = {}  # part (replica id) -> its open tunnels
        self.counts: dict[str, Counts] = {}  # part -> its bytes; forgotten when it closes

    # -- the head's side ------------------------------------------------------------------

    async def open(self, head: str, member: str, worker: str) -> int:
        """A listener on 127.0.0.1 for `head` reaching `worker` on `member`; its port."""
        key = _key(head, worker)
        ends = self._ends.get(key)
        if ends is not None and ends.server is not None:
            return ends.port
        ends = self._ends.setdefault(key, _Ends())
        counts = self.counts.setdefault(key, Counts())

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(ends.live) >= MAX_CONNECTIONS or not await self._from_engine(head, writer):
                writer.close()
                return
            task = asyncio.current_task()
            assert task is not None
            ends.live.add(task)
            counts.connections += 1
            try:
                async with self._dial(member, worker) as ws:
                    await _pump(reader, writer, ws, counts.add_sent, counts.add_received)
            except (aiohttp.ClientError, OSError, TimeoutError, AgentError) as exc:
                log.warning("tunnel to %s on %s: %s", worker, member, exc)
            except asyncio.CancelledError:
                pass  # closed with its part: this task is the connection's, and ends here
            finally:
                ends.live.discard(task)
                writer.close()

        ends.server = await asyncio.start_server(accepted, "127.0.0.1", 0, limit=CHUNK)
        ends.port = ends.server.sockets[0].getsockname()[1]
        return ends.port

    async def _from_engine(self, head: str, writer: asyncio.StreamWriter) -> bool:
        leader = self._owner(head)
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("sockname")
        if leader is None or not peer or not sock:
            self.refused += 1
            return False
        ours = await asyncio.to_thread(client_of, peer[1], sock[1], leader)
        if not ours:
            self.refused += 1
            log.warning("tunnel of %s: a local connection not from its engine, closed", head)
        return ours

    # -- the worker's side ----------------------------------------------------------------

    async def serve(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/tunnel/{replica}` on the node API (pinned): a WebSocket to the part's
        engine on this member's loopback."""
        replica = request.match_info["replica"]
        admitted = self._admit(peer_node_id(request), replica)
        if isinstance(admitted, str):
            raise web.HTTPForbidden(text=f"{admitted}\n")
        key = _key("", replica)
        ends = self._ends.setdefault(key, _Ends())
        if len(ends.live) >= MAX_CONNECTIONS:
            raise web.HTTPServiceUnavailable(text=f"{MAX_CONNECTIONS} tunnels to {replica} open\n")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", admitted, limit=CHUNK)
        except OSError:
            raise web.HTTPBadGateway(text=f"{replica}: its engine does not answer\n") from None
        counts = self.counts.setdefault(key, Counts())
        counts.connections += 1
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE, heartbeat=HEARTBEAT_S)
        task = asyncio.current_task()
        assert task is not None
        ends.live.add(task)
        try:
            await ws.prepare(request)
            # Here what comes from the head goes to the engine: towards the worker, `sent`.
            await _pump(reader, writer, ws, counts.add_received, counts.add_sent)
        finally:
            ends.live.discard(task)
            writer.close()
            await ws.close()
        return ws

    # -- closing --------------------------------------------------------------------------

    async def close(self, replica: str) -> None:
        """Close every tunnel of `replica` (a head part or a worker part) on this member."""
        for key in [k for k in self._ends if replica in k.split("|")]:
            ends = self._ends.pop(key)
            self.counts.pop(key, None)
            if ends.server is not None:
                ends.server.close()
            for task in list(ends.live):
                task.cancel()
            if ends.live:
                await asyncio.gather(*ends.live, return_exceptions=True)

    async def aclose(self) -> None:
        """Close them all (the agent stops)."""
        for key in list(self._ends):
            await self.close(key.split("|")[-1])

    def open_now(self, replica: str) -> int:
        """Connections through `replica`'s tunnels on this member now."""
        return sum(len(e.live) for k, e in self._ends.items() if replica in k.split("|"))

    def totals(self) -> dict[str, Counts]:
        """Bytes through each part of this member: a head's through all its tunnels, sent
        towards its workers; a worker's sent towards its engine."""
        out: dict[str, Counts] = {}
        for key, counts in self.counts.items():
            head, worker = key.split("|")
            total = out.setdefault(head or worker, Counts())
            total.sent += counts.sent
            total.received += counts.received
            total.connections += counts.connections
        return out


def _key(head: str, worker: str) -> str:
    return f"{head}|{worker}"


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    ws: _Socket,
    to_ws: Callable[[int], None],
    to_socket: Callable[[int], None],
) -> None:
    """Bytes both ways, each counted, until either side ends; then both end."""

    async def socket_to_ws() -> None:
        while data := await reader.read(CHUNK):
            await ws.send_bytes(data)
            to_ws(len(data))

    async def ws_to_socket() -> None:
        while True:
            message = await ws.receive()
            if message.type is not aiohttp.WSMsgType.BINARY:
                return  # a close, an error, a text message: the tunnel ends
            writer.write(message.data)
            await writer.drain()
            to_socket(len(message.data))

    one = asyncio.create_task(socket_to_ws())
    other = asyncio.create_task(ws_to_socket())
    try:
        await asyncio.wait({one, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (one, other):
            task.cancel()
        await asyncio.gather(one, other, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close()
