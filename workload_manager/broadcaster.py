"""The outbound broadcaster: each peer gets its own outbox and its own sender task.

Events are coalesced per workload in the peer's `Outbox` and sent as JSON-RPC batch arrays
on a kept-alive mTLS connection; the HTTP 2xx is the acknowledgement. One batch is in flight
per peer at a time, so a slow or dead peer holds up only its own outbox.

A sender sends only while this node has a cluster identity and the peer is pinned: a node
that is not a member broadcasts nothing, and unpinning a member stops traffic to it on the
next batch. Each time a sender (re)connects -- at start, after a failure, after it becomes
able to send -- it catches up: it queues this node's whole view (the latest record per
workload and the removals) for the peer and asks the peer, with a `workloads:sync` request
in the same batch, to queue its view for us (docs/protocol.md, "Catch-up").
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import os
import random
import sys
from collections.abc import Callable
from typing import Any, Final

import aiohttp
from msgspec import UNSET
from yarl import URL

from certs import CertsError, ClientContexts, ClusterDir, server_hostname_for
from netkit.backoff import Backoff
from netkit.guard import PinnedConnector
from netkit.keepalive import connector_options
from netkit.tasks import describe, reporting
from workload_manager.errors import ConfigurationError
from workload_manager.jsonrpc import (
    Batch,
    Call,
    Response,
    encode_batch,
    notification,
    parse_payload,
    request,
)
from workload_manager.manager import Peer
from workload_manager.outbox import DEFAULT_MAX_BATCH, Outbox
from workload_manager.relay import Event, RelayCore
from workload_manager.server import EVENTS_PATH
from workload_manager.workload import (
    METHOD_FOR_STATE,
    REMOVE_METHOD,
    LifecycleParams,
    Workload,
)

__all__ = ["RELAY_MODES", "Broadcaster", "encode_events", "linger_left", "ring_successor"]

log = logging.getLogger(__name__)

IDLE_POLL_S: Final = 0.5  # how often a sender that may not send looks again
VIEW_WAIT_S: Final = 5.0  # how long senders wait for the broker's snapshot before syncing
# A batch follows the previous one by at least this much unless it, or the previous one, is
# full (`linger_left`): an event after a quiet spell goes out at once, a burst back to back,
# and under a steady load a peer gets a request per LINGER_S with every
# event of that time in it (a job's submitted/started/completed often coalesced into one)
# instead of one request per event or two -- a TLS write and a wake-up each, on both sides.
LINGER_S: Final = 0.025
# With many peers the origin's requests add up (a request per peer per linger): the gap
# grows by this much per peer, so a member makes at most ~400 requests/s whatever N is
# (25 ms up to 10 peers, ~160 ms at 63). Only back-to-back batches wait for it.
LINGER_PER_PEER_S: Final = 0.0025
_SYNC_ID: Final = "sync"
# How a first-seen remote event goes on (docs/protocol.md, "Relay"): to one ring successor
# (about 2N link deliveries per event), or to every peer but its sender and origin ((N-1)²;
# kept for comparison in bench/scale.py).
RELAY_MODES: Final = ("ring", "flood")
_CANNOT_SEND: Final = frozenset({"retrying", "no identity", "not pinned"})
_NEVER: Final = sys.maxsize  # a sender's `wake_at` while no enqueue should wake it


def encode_events(events: list[Event], *, sync: bool = False) -> bytes:
    """A JSON-RPC batch of notifications, plus a `workloads:sync` request when asked."""
    calls: list[Call] = []
    for event in events:
        if type(event) is Workload:
            method = METHOD_FOR_STATE[event.state]
            calls.append(notification(method, LifecycleParams(workloadInfo=event)))
        else:
            calls.append(notification(REMOVE_METHOD, event))
    if sync:
        calls.append(request("workloads:sync", UNSET, _SYNC_ID))
    return encode_batch(calls)


def linger_left(
    now: float, last_at: float, last_full: bool, depth: int, max_batch: int, linger_s: float
) -> float:
    """How long a sender waits before its next batch (`LINGER_S`): not at all when a full
    batch waits, or when the last batch was full -- a burst's tail goes at once, as its full
    batches did; else what is left of `linger_s` since the last batch, so a trickle goes out
    a request per `linger_s`, not one per event."""
    if depth >= max_batch or last_full:
        return 0.0
    return max(0.0, last_at + linger_s - now)


def ring_successor(
    ring: list[str], own: str, exclude: tuple[str, ...], healthy: Callable[[str], bool]
) -> str | None:
    """The first of `ring` (sorted node ids, wrapping) after `own` that is not in `exclude`
    and is `healthy` (its link is not failing); None when there is none. A peer passed over
    while its link fails gets what it missed from the catch-up its sender makes when it
    connects again (docs/protocol.md, "Relay")."""
    if not ring:
        return None
    start = bisect.bisect_right(ring, own)
    for step in range(len(ring)):
        node_id = ring[(start + step) % len(ring)]
        if node_id != own and node_id not in exclude and healthy(node_id):
            return node_id
    return None


class Broadcaster:
    """Per-peer outboxes and sender tasks; `async with` owns their lifetime.

    Of the relay core it reads only its view (what catch-up sends) and this node's id (where
    it stands on the ring), so it is built before the `Manager` that feeds it.
    """

    def __init__(
        self,
        cluster: ClusterDir,
        relay: RelayCore,
        *,
        backoff: Backoff | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        request_timeout_s: float = 10.0,
        draw: Callable[[], float] = random.random,
        relay_mode: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.relay = relay
        self.backoff = backoff or Backoff()
        self.max_batch = max_batch
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=3.0)
        self.draw = draw
        self.contexts = ClientContexts(cluster)
        self.view_ready = asyncio.Event()
        self._senders: dict[str, _Sender] = {}
        self._ring: list[str] = []  # the peers' node ids, sorted: the relay's ring
        self.linger_s = LINGER_S  # the least gap between two batches to one peer
        self.relay_mode = relay_mode or os.environ.get("NVPAIR_WM_RELAY") or "ring"
        if self.relay_mode not in RELAY_MODES:
            raise ConfigurationError(
                f"NVPAIR_WM_RELAY is {self.relay_mode!r}; one of {', '.join(RELAY_MODES)}"
            )
        self._session: aiohttp.ClientSession | None = None
        self._tasks: asyncio.TaskGroup | None = None

    async def __aenter__(self) -> Broadcaster:
        # Connections leave from NVPAIR_WM_DIAL_FROM when the agent sets it (its `[agent]
        # dial_from`): a multi-homed host that must reach its peers over one interface.
        dial_from = os.environ.get("NVPAIR_WM_DIAL_FROM") or None
        self._session = aiohttp.ClientSession(
            connector=PinnedConnector(
                self.cluster.pins,
                **connector_options(),
                local_addr=(dial_from, 0) if dial_from else None,
            ),
            timeout=self.timeout,
        )
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for sender in self._senders.values():
            sender.task.cancel()
        assert self._tasks is not None
        assert self._session is not None
        with contextlib.suppress(asyncio.CancelledError):
            await self._tasks.__aexit__(None, None, None)
        await self._session.close()

    # -- called by the manager ----------------------------------------------------------------

    def set_peers(self, peers: tuple[Peer, ...]) -> None:
        """Start senders for new peers, stop those of peers no longer listed."""
        wanted = {peer.nodeId: peer for peer in peers}
        for node_id in list(self._senders):
            if node_id not in wanted:
                sender = self._senders.pop(node_id)
                sender.task.cancel()
                sender.outbox.clear()
        for node_id, peer in wanted.items():
            existing = self._senders.get(node_id)
            if existing is None:
                assert self._tasks is not None, "set_peers() before the broadcaster started"
                sender = _Sender(self, peer)
                name = f"send-{node_id}"
                # A sender that dies is logged with its traceback and shows as failed in
                # manager:status, instead of tearing down every other peer's sender.
                sender.task = self._tasks.create_task(sender.supervised(name), name=name)
                self._senders[node_id] = sender
            elif existing.peer != peer:
                existing.peer = peer  # moved: the next batch goes to the new address
                existing.wake.set()
        self._ring = sorted(self._senders)
        self.linger_s = max(LINGER_S, LINGER_PER_PEER_S * len(self._senders))

    def enqueue(self, event: Event, exclude: tuple[str, ...]) -> None:
        """Queue an event: a local one (`exclude` empty) for every peer; a relayed one
        (`exclude` = its sender and origin) for the next healthy member on the ring, or,
        with `NVPAIR_WM_RELAY=flood`, for every peer but those in `exclude`."""
        if exclude and self.relay_mode == "ring":
            target = self.successor(exclude)
            if target is not None and target.outbox.add(event) >= target.wake_at:
                target.wake_at = _NEVER  # woken once: the rest of a burst need not again
                target.wake.set()
            return
        for node_id, sender in self._senders.items():
            if node_id not in exclude and sender.outbox.add(event) >= sender.wake_at:
                sender.wake_at = _NEVER
                sender.wake.set()

    def successor(self, exclude: tuple[str, ...]) -> _Sender | None:
        """The sender of the next healthy member on the ring (`ring_successor`)."""
        senders = self._senders
        node_id = ring_successor(
            self._ring,
            self.relay.own_id or "",
            exclude,
            lambda peer: (
                senders[peer].outbox.failures == 0 and senders[peer].state not in _CANNOT_SEND
            ),
        )
        return None if node_id is None else senders[node_id]

    def enqueue_view(self, node_id: str) -> int:
        """Queue this node's whole view for one peer (its `workloads:sync`)."""
        sender = self._senders.get(node_id)
        if sender is None:
            return 0
        return sender.queue_view()

    def view_loaded(self) -> None:
        """The broker's view is in: senders start, and any that already caught up without
        it (the view came after `VIEW_WAIT_S`) catch up again, now with everything."""
        if self.view_ready.is_set() or any(not s.needs_sync for s in self._senders.values()):
            for sender in self._senders.values():
                sender.needs_sync = True
                sender.wake.set()
        self.view_ready.set()

    def peer_heard(self, node_id: str) -> None:
        """Something arrived from `node_id` (its catch-up, any batch): it is up, so its
        outbox stops backing off and sends now instead of after up to 30 s."""
        sender = self._senders.get(node_id)
        if sender is None:
            return
        sender.heard += 1  # payloads from this peer, for `/metrics`
        if sender.outbox.resume():
            log.info("%s is back; sending to it now", node_id)
            sender.wake.set()

    def manager_hooks(self) -> dict[str, Any]:
        """The `Manager` arguments that connect a manager to this broadcaster: the events
        it relays, the peer list, sync requests, its view loaded, a peer heard, status."""
        return {
            "send_to_peers": self.enqueue,
            "on_peers": self.set_peers,
            "on_sync_request": self.enqueue_view,
            "on_view_loaded": self.view_loaded,
            "on_peer_heard": self.peer_heard,
            "status_extras": self.manager_status,
        }

    def manager_status(self) -> dict[str, Any]:
        """What `manager:status` shows of the broadcaster: per-peer counters, the relay mode."""
        return {"broadcast": self.status(), "relay": self.relay_mode}

    def status(self) -> list[dict[str, Any]]:
        """Per-peer counters for `manager:status`."""
        return [
            {
                "nodeId": node_id,
                "host": sender.peer.host,
                "port": sender.peer.port,
                "queued": sender.outbox.depth,
                "failures": sender.outbox.failures,
                "state": sender.state,
                "heard": sender.heard,
                **dataclasses.asdict(sender.outbox.counters),
            }
            for node_id, sender in sorted(self._senders.items())
        ]


class _Sender:
    """Sends one peer's outbox, one batch at a time."""

    def __init__(self, owner: Broadcaster, peer: Peer) -> None:
        self.owner = owner
        self.peer = peer
        self.outbox = Outbox(max_batch=owner.max_batch, backoff=owner.backoff, draw=owner.draw)
        self.wake = asyncio.Event()
        self.needs_sync = True
        self.state = "starting"
        self.heard = 0  # payloads received from this peer (its batches, its catch-up)
        self.task: asyncio.Task[None]
        self._last_batch_at = -LINGER_S
        self._last_full = False  # the last batch was a full one: a burst is going out
        # How many events must wait before an enqueue wakes this sender: one while it is
        # idle, a full batch while it lingers (a burst goes on at once, not a linger later),
        # never while it sends or may not (it looks again when that ends). An enqueue then
        # costs a comparison, not an `Event.set()` per event.
        self.wake_at = _NEVER

    async def supervised(self, name: str) -> None:
        """`run()`, reported when it dies. Its coroutine is made only once this task starts,
        so a peer dropped before that leaves no coroutine never awaited."""
        await reporting(name, self.run(), self.died)

    def died(self, part: str, exc: BaseException) -> None:
        self.state = f"failed: {describe(exc)}"

    def queue_view(self) -> int:
        workloads, removals = self.owner.relay.view()
        # Not the peer's own jobs: it is their only writer, and drops them from anyone else.
        peer = self.peer.nodeId
        queued = 0
        events: list[Event] = [*workloads, *removals]
        for event in events:
            if event.originatedFrom != peer:
                self.outbox.add(event)
                queued += 1
        self.wake.set()
        return queued

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.owner.view_ready.wait(), VIEW_WAIT_S)
        while True:
            if not self._may_send():
                self.needs_sync = True
                await self._sleep(IDLE_POLL_S)
                continue
            now = loop.time()
            if now < self.outbox.retry_at():
                await self._sleep(self.outbox.retry_at() - now)
                continue
            sync = self.needs_sync
            if sync:
                self.queue_view()
            else:
                outbox = self.outbox
                linger = linger_left(
                    now, self._last_batch_at, self._last_full, outbox.depth, outbox.max_batch,
                    self.owner.linger_s,
                )  # fmt: skip
                if linger > 0:
                    await self._sleep(linger, wake_at=outbox.max_batch)
                    continue  # from the top: the peer may have been unpinned meanwhile
            batch = self.outbox.next_batch(now)
            if batch is None and not sync:
                self.state = "idle"
                await self._sleep(None, wake_at=1)
                continue
            self._last_batch_at = now
            self._last_full = batch is not None and len(batch) >= self.outbox.max_batch
            await self._send(batch or [], sync=sync)

    def _may_send(self) -> bool:
        try:
            self.owner.contexts.current()
        except CertsError:
            self.state = "no identity"
            return False
        if not self.owner.cluster.pins.is_member(self.peer.nodeId):
            self.state = "not pinned"
            return False
        return True

    async def _sleep(self, delay: float | None, *, wake_at: int = _NEVER) -> None:
        # Until `delay` passes or `wake` is set, whichever comes first: by an enqueue that
        # leaves `wake_at` events waiting, or by news (a peer back, moved, a catch-up).
        self.wake.clear()
        self.wake_at = wake_at
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.wake.wait()
        finally:
            self.wake_at = _NEVER

    async def _send(self, batch: list[Event], *, sync: bool) -> None:
        owner = self.owner
        assert owner._session is not None
        url = URL.build(scheme="https", host=self.peer.host, port=self.peer.port, path=EVENTS_PATH)
        body = encode_events(batch, sync=sync)
        self.state = "sending"
        try:
            async with owner._session.post(
                url,
                data=body,
                headers={"Content-Type": "application/json"},
                ssl=owner.contexts.current(),
                server_hostname=server_hostname_for(self.peer.nodeId),
            ) as response:
                reply = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError, CertsError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}"[:200], retry=True, batch=batch)
            return
        if 200 <= status < 300:
            if batch:
                self.outbox.ack()
            if sync:
                self.needs_sync = not _sync_answered(reply)
            self.state = "connected"
            return
        # 400/413/415: the peer calls the batch malformed; sending it again cannot help.
        retry = status not in (400, 413, 415)
        self._failed(f"HTTP {status}", retry=retry, batch=batch)

    def _failed(self, error: str, *, retry: bool, batch: list[Event]) -> None:
        loop = asyncio.get_running_loop()
        self.needs_sync = True
        self.state = "retrying"
        if batch:
            self.outbox.fail(loop.time(), error, retry=retry)
        else:  # a sync-only request: back off all the same
            self.outbox.note_failure(loop.time(), error)
        log.info(
            "sending to %s failed (%s); retry in %.2fs",
            self.peer.nodeId,
            error,
            max(0.0, self.outbox.retry_at() - loop.time()),
        )


def _sync_answered(reply: bytes) -> bool:
    # Whether the peer's reply holds a success response to our `workloads:sync`.
    if not reply:
        return False
    parsed = parse_payload(reply)
    messages = parsed.messages if isinstance(parsed, Batch) else [parsed]
    return any(
        isinstance(message, Response) and message.id == _SYNC_ID and message.result is not UNSET
        for message in messages
    )
