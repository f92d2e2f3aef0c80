"""A proxy that understands nothing: bytes from each client connection to a connection of
its own upstream and back. `bench/facade.py` measures it beside the facade as the ceiling
any proxy process reaches on the machine at hand (one more process, two more hops).

    python bench/_byte_pipe.py UPSTREAM_PORT PORT
"""

from __future__ import annotations

import asyncio
import sys


class _Side(asyncio.Protocol):
    """One end of a pipe: what it reads, the other end writes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _Side | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


async def serve(upstream: int, port: int) -> None:
    """Pipe every connection on `port` to `upstream`, for ever."""
    loop = asyncio.get_running_loop()

    class Front(_Side):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            assert self.transport is not None
            self.transport.pause_reading()
            self.connecting = loop.create_task(self._connect())  # held: not collected

        async def _connect(self) -> None:
            back = _Side()
            await loop.create_connection(lambda: back, "127.0.0.1", upstream)
            back.other, self.other = self, back
            if self.transport is not None:
                self.transport.resume_reading()

    server = await loop.create_server(Front, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2])))
