"""The inter-node half of a manager with `--cluster-dir`: the mTLS server on `--port`, in
front of a manager whose peer sinks are a `Broadcaster`'s (`cli.py` builds the broadcaster
first, then the manager, then this server)."""

from __future__ import annotations

import contextlib
import logging
import os

from certs import ClusterDir
from workload_manager.manager import Manager
from workload_manager.server import InterNodeServer

__all__ = ["start_inter_node"]

log = logging.getLogger("workload_manager")


async def start_inter_node(
    manager: Manager, cluster: ClusterDir, stack: contextlib.AsyncExitStack
) -> None:
    """The mTLS server on `manager.port` (0: a free one, which `manager.port` then holds),
    bound to the cluster dir; `stack` closes it."""
    server = InterNodeServer(
        manager,
        cluster,
        host=os.environ.get("NVPAIR_WM_BIND") or None,  # None: every interface
        port=manager.port,
        # Peers' events wait (503) while the broker's view is loading: taken before the page
        # holding them, the relay would think them new and hand the broker what it stored
        # already -- a restarted node's whole catch-up, delivered twice.
        broker_ready=lambda: manager.broker_ready() and manager.view_state != "loading",
    )
    manager.port = await server.start()
    stack.push_async_callback(server.aclose)
    if not cluster.has_identity():
        log.warning(
            "%s holds no cluster identity yet: the port stays bound, handshakes fail and "
            "nothing is broadcast until this node joins",
            cluster.path,
        )
