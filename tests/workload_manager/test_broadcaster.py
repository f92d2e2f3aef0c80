"""The broadcaster's reactions to the manager's news, in one process (no peer answers)."""

from __future__ import annotations

from pathlib import Path

from certs import ClusterDir
from workload_manager.broadcaster import Broadcaster
from workload_manager.manager import Peer
from workload_manager.relay import RelayCore

from .cluster_harness import free_port


async def test_a_view_that_loads_late_is_caught_up_again(tmp_path: Path) -> None:
    cluster = ClusterDir(tmp_path / "a")
    cluster.init("t", "a", ["127.0.0.1"])
    async with Broadcaster(cluster, RelayCore()) as broadcaster:
        broadcaster.set_peers((Peer(nodeId="nod_b", host="127.0.0.1", port=free_port()),))
        [sender] = broadcaster._senders.values()
        broadcaster.view_loaded()  # the first load: senders start with their catch-up
        assert broadcaster.view_ready.is_set()
        sender.needs_sync = False  # as after a catch-up made before the view was in
        broadcaster.view_loaded()  # the view came late (or the broker reconnected)
        assert sender.needs_sync, "the peer would never get what the late view holds"


async def test_hearing_from_a_peer_ends_its_backoff(tmp_path: Path) -> None:
    cluster = ClusterDir(tmp_path / "a")
    cluster.init("t", "a", ["127.0.0.1"])
    async with Broadcaster(cluster, RelayCore()) as broadcaster:
        broadcaster.set_peers((Peer(nodeId="nod_b", host="127.0.0.1", port=free_port()),))
        [sender] = broadcaster._senders.values()
        sender.outbox.note_failure(0.0, "down")
        assert sender.outbox.failures == 1
        broadcaster.peer_heard("nod_b")
        assert sender.outbox.retry_at() == 0.0
        assert sender.outbox.failures == 0
        broadcaster.peer_heard("nod_unknown")  # no sender: nothing to do, nothing raised
