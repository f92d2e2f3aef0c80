"""How member connections are pooled: one per peer and direction, kept across quiet spells.

A sender sends one batch at a time to its peer, so one connection per peer is all it uses
(`limit_per_host=1`): a manager holds one outgoing and one incoming connection per peer, and
its descriptors are bounded by its peers. Those connections stay open between batches for
`NVPAIR_WM_KEEPALIVE_S` (default 600 s), not aiohttp's 15 s: at 64 members the connections
all open together, so with a short keep-alive they all close together after a quiet spell
and the next events pay 63 TLS handshakes per member at once -- on a loaded machine, enough
to time batches out and send them (and the catch-up) again (docs/scale.md, "Idle and
bounded"). An idle kept-alive connection costs a descriptor and no wake-ups.

The inter-node server keeps a member's idle connection `SERVER_MARGIN_S` longer than the
member's client does, so it is always the client that closes one: a batch never goes out on
a connection the server is closing at that moment (that batch would fail and be retried,
with a catch-up). The listener's caps (`sites.Bounds`) still bound how many connections it
holds, and one over a cap evicts the oldest idle connection, so the longer keep-alive does
not let idle connections pile up; only members get that far (the handshake wants a
certificate of the cluster CA).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

from netkit.sites import Bounds

__all__ = ["client_keepalive_s", "connector_options", "server_keepalive_s"]

DEFAULT_KEEPALIVE_S: Final = 600.0
SERVER_MARGIN_S: Final = 30.0


def client_keepalive_s(environ: Mapping[str, str] | None = None) -> float:
    """How long a sender keeps an idle connection to its peer."""
    env = os.environ if environ is None else environ
    return float(env.get("NVPAIR_WM_KEEPALIVE_S", DEFAULT_KEEPALIVE_S))


def server_keepalive_s(environ: Mapping[str, str] | None = None) -> float:
    """How long the inter-node server keeps an idle member connection: past the client's,
    and never under the listener bound every server has (`NVPAIR_IDLE_TIMEOUT_S`)."""
    return max(Bounds.from_env().idle_s, client_keepalive_s(environ) + SERVER_MARGIN_S)


def connector_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The broadcaster's `TCPConnector` options: one pooled connection per peer."""
    return {
        "limit": 0,  # no cap over all peers: `limit_per_host` bounds each
        "limit_per_host": 1,
        "keepalive_timeout": client_keepalive_s(environ),
        "enable_cleanup_closed": True,
    }
