"""Starting an aiohttp site and learning the port it bound.

Every nvpair server (the inter-node server, the agent's APIs and facade, the plane, the mock
engine) binds the same way; port 0 asks the kernel for a free port, which tests use.
"""

from __future__ import annotations

import ssl

from aiohttp import web

__all__ = ["start_site"]


async def start_site(
    runner: web.AppRunner,
    host: str | None,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> int:
    """Set `runner` up, serve it on `host:port` and return the port actually bound.

    `host` None listens on every interface. An address in use raises `OSError` (errno
    EADDRINUSE) from the bind, with the runner left set up for the caller's `cleanup()`.
    """
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return site.port  # the bound port once started (the kernel's choice for port 0)
