"""The broadcaster's reactions to the manager's news, in one process (no peer answers), and
when a sender waits before its next batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from certs import ClusterDir
from workload_manager.broadcaster import Broadcaster, linger_left
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


def test_a_bursts_tail_goes_at_once_and_a_trickle_waits_for_the_linger() -> None:
    linger, batch = 0.025, 1024
    # A full batch waits: it goes at once.
    assert linger_left(1.0, 1.0, False, batch, batch, linger) == 0.0
    # The tail of a burst (the last batch was full): at once, not a linger after it.
    assert linger_left(1.001, 1.0, True, 10, batch, linger) == 0.0
    # The control, a trickle (the last batch was not full): what is left of the linger.
    assert linger_left(1.01, 1.0, False, 10, batch, linger) == pytest.approx(0.015)
    assert linger_left(1.03, 1.0, False, 10, batch, linger) == 0.0  # its time is up
