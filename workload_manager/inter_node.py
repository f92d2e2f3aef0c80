"""The inter-node half of a manager with `--cluster-dir`: the mTLS server on `--port` and
the broadcaster, wired to the manager."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable

from certs import ClusterDir
from netkit.backoff import Backoff
from workload_manager.broadcaster import Broadcaster
from workload_manager.manager import Manager
from workload_manager.server import InterNodeServer

__all__ = ["start_inter_node"]

log = logging.getLogger("workload_manager")


async def start_inter_node(
    manager: Manager,
    cluster: ClusterDir,
    stack: contextlib.AsyncExitStack,
    *,
    backoff: Backoff | None = None,
    draw: Callable[[], float] = random.random,
) -> Broadcaster:
    """The mTLS server on --port and the broadcaster, both bound to the cluster dir.

    `backoff` and `draw` shape the outboxes' retries (tests pass fixed ones).
    """
    broadcaster = await stack.enter_async_context(
        Broadcaster(cluster, manager.relay, backoff=backoff, draw=draw)
    )
    manager.send_to_peers = broadcaster.enqueue
    manager.on_peers = broadcaster.set_peers
    manager.on_sync_request = broadcaster.enqueue_view
    manager.on_view_loaded = broadcaster.view_loaded
    manager.on_peer_heard = broadcaster.peer_heard
    manager.status_extras = broadcaster.manager_status
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
    return broadcaster
