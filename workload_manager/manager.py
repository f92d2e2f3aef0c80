"""The workload manager's methods, bound to the relay core.

`Manager` answers JSON-RPC payloads from the broker (lifecycle events, removals, `peers:set`,
`manager:status`) and from peers (lifecycle events and removals only), and turns the relay
core's actions into frames for the broker and events for the peers. It does no I/O itself:
frames for the broker go to `send_to_broker`, events for peers to `send_to_peers`, and what
it learns to the other `on_*` sinks -- all given to it when it is built (`cli.py` builds the
parts that own the sockets first), and never re-pointed after.

Lifecycle notifications are the hot path. A payload made only of them (one, or a batch) is
decoded in one typed pass straight into records; anything else -- requests, removals, bad
input -- takes the general `Dispatcher` path, which gives the same result with full error
reporting. Both paths apply the same checks; tests hold them to the same answers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Final, Literal, TypeGuard

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from workload_manager.dispatch import NOTHING, Dispatcher, Reply, decode_params
from workload_manager.jsonrpc import (
    INVALID_PARAMS,
    Response,
    RpcError,
    encode_notification,
    encode_request,
)
from workload_manager.relay import Action, DeliverToBroker, Drop, Event, RelayCore, SendToPeers
from workload_manager.workload import (
    LIFECYCLE_METHODS,
    REMOVE_METHOD,
    LifecycleParams,
    Workload,
    WorkloadRemoval,
    lifecycle_mismatch,
)

__all__ = ["MAX_PEERS", "SNAPSHOT_PAGE", "Manager", "Peer", "PeersParams", "View", "broker_frame"]

MAX_PEERS: Final = 1024

log = logging.getLogger(__name__)


class Peer(Struct, kw_only=True, frozen=True):
    """A peer's workload manager, from the broker's node records."""

    nodeId: Annotated[str, Meta(min_length=1, max_length=256)]
    host: Annotated[str, Meta(min_length=1, max_length=255)]
    port: Annotated[int, Meta(ge=1, le=65535)]


class PeersParams(Struct, kw_only=True, frozen=True):
    """Params of `peers:set`: the whole peer list, replacing the previous one."""

    peers: Annotated[list[Peer], Meta(max_length=MAX_PEERS)]


class View(Struct, kw_only=True, frozen=True):
    """Result of `workloads:snapshot`: the broker's records and removals.

    `next`, when present, is a cursor: ask again with `{cursor: next}` for the rest (a view
    larger than one frame comes in pages).
    """

    workloads: list[Workload] = []
    removed: list[WorkloadRemoval] = []
    next: str | None = None


class _LifecycleFrame(Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    # The fast path's shape: exactly a lifecycle notification, checked by msgspec in C.
    # Anything else (an `id`, a stray member, another method) fails to decode here and
    # takes the general path, which answers it with the spec's full rules.
    jsonrpc: Literal["2.0"]
    method: Literal[
        "workload:submitted", "workload:started", "workload:completed", "workload:errored"
    ]
    params: LifecycleParams


_lifecycle_decoder: Final = msgspec.json.Decoder(LifecycleParams)
_remove_decoder: Final = msgspec.json.Decoder(WorkloadRemoval)
_peers_decoder: Final = msgspec.json.Decoder(PeersParams)
_view_decoder: Final = msgspec.json.Decoder(View)
SNAPSHOT_PAGE: Final = 2000
_fast_decoder: Final = msgspec.json.Decoder(_LifecycleFrame | list[_LifecycleFrame])
_encode: Final = msgspec.json.Encoder().encode
_UPSERT_HEAD: Final = b'{"jsonrpc":"2.0","method":"workloads:upsert","params":{"workloadInfo":'


Handler = Callable[[Raw | UnsetType], Any]


class Manager:
    """Binds the relay core to the local and inter-node methods."""

    def __init__(
        self,
        *,
        version: str,
        port: int,
        identity: Callable[[], str | None] = lambda: None,
        relay: RelayCore | None = None,
        clock: Callable[[], float] = time.monotonic,
        send_to_broker: Callable[[bytes], object] = lambda frame: None,
        broker_ready: Callable[[], bool] = lambda: True,
        on_snapshot_answer: Callable[[bool], object] = lambda ok: None,
        send_to_peers: Callable[[Event, tuple[str, ...]], object] = lambda event, exclude: None,
        on_peers: Callable[[tuple[Peer, ...]], object] = lambda peers: None,
        on_sync_request: Callable[[str], int] = lambda node_id: 0,
        on_view_loaded: Callable[[], object] = lambda: None,
        on_peer_heard: Callable[[str], object] = lambda node_id: None,
        status_extras: Callable[[], dict[str, Any]] = dict,
        fast_path: bool = True,
    ) -> None:
        self.version = version
        self.port = port
        self.identity = identity
        self.relay = relay or RelayCore()
        self.clock = clock
        # The sinks: fixed once built (Final), so what a frame or event does can be read
        # where the manager is built (cli.py), not traced through later assignments.
        self.send_to_broker: Final = send_to_broker
        # Whether frames for the broker can be taken now (a broker is connected and keeping
        # up); the inter-node server refuses peers' events with 503 while it cannot.
        self.broker_ready: Final = broker_ready
        # Each answer to our snapshot request: True a page came, False it failed. The view
        # loader times and bounds the retries (view_loader.py); this core only says what
        # happened.
        self.on_snapshot_answer: Final = on_snapshot_answer
        self.send_to_peers: Final = send_to_peers
        self.on_peers: Final = on_peers
        self.on_sync_request: Final = on_sync_request
        self.on_view_loaded: Final = on_view_loaded
        # Anything at all arrived from this peer (it is up again): its outbox may stop waiting.
        self.on_peer_heard: Final = on_peer_heard
        self.status_extras: Final = status_extras
        self.fast_path = fast_path
        self.peers: tuple[Peer, ...] = ()
        self._sender: str | None = None  # the peer whose payload is being handled
        self._requests = 0
        self._snapshot_id: str | None = None
        self._snapshot_cursor: str | None = None  # of the page asked for last
        # "loading" until the last page is in, "loaded", or "incomplete" when the broker
        # never answered well enough (manager:status shows it: an empty view is not silent).
        self.view_state = "loading"
        self.snapshot_retries = 0

        events: dict[str, Handler] = {
            method: self._lifecycle_handler(method) for method in LIFECYCLE_METHODS
        }
        events[REMOVE_METHOD] = self._remove
        # Peers may send lifecycle events, removals and a catch-up request, nothing else.
        self.remote_dispatcher = Dispatcher({**events, "workloads:sync": self._sync})
        self.dispatcher = Dispatcher(
            {**events, "peers:set": self._peers_set, "manager:status": self._status},
            on_response=self._on_response,
        )

    def ready_frame(self) -> bytes:
        """The first frame on every local channel: `ready {version}` (seed 002)."""
        return encode_notification("ready", {"version": self.version})

    def snapshot_request(self, cursor: str | None = None) -> bytes:
        """Ask the broker for its view (`workloads:snapshot`), so a restarted manager
        remembers what it relayed. The answer arrives through `handle_local`."""
        self._requests += 1
        self._snapshot_id = f"snapshot-{self._requests}"
        self._snapshot_cursor = cursor
        if cursor is None:
            self.view_state = "loading"  # a (re)connected broker: its view from the start
        params: dict[str, Any] = {"limit": SNAPSHOT_PAGE}
        if cursor is not None:
            params["cursor"] = cursor
        return encode_request("workloads:snapshot", params, self._snapshot_id)

    def retry_snapshot(self) -> bytes | None:
        """Ask again for the page that failed or went unanswered; None once loaded."""
        if self.view_state != "loading":
            return None
        self.snapshot_retries += 1
        return self.snapshot_request(self._snapshot_cursor)

    def snapshot_refused(self) -> None:
        """The channel refused a frame (over its size limit) while a page was awaited: it
        may have been that page, so count the page as failed and let it be asked again."""
        if self.view_state == "loading" and self._snapshot_id is not None:
            self._snapshot_failed("a frame over the channel's limit arrived instead")

    def snapshot_abandoned(self) -> None:
        """The retries are spent: serve with what loaded, and say so in `manager:status`."""
        if self.view_state == "loading":
            log.error(
                "gave up on the broker's view after %d retries; serving with an incomplete "
                "view (what the broker stored meanwhile reaches peers only by their catch-up)",
                self.snapshot_retries,
            )
            self.view_state = "incomplete"
            self._snapshot_id = None
            self.on_view_loaded()

    def _snapshot_failed(self, why: str) -> None:
        self._snapshot_id = None  # a late answer to it is dropped; the retry has a new id
        log.warning("workloads:snapshot page failed (%s); it will be asked for again", why)
        self.on_snapshot_answer(False)

    def _on_response(self, response: Response) -> None:
        if response.id != self._snapshot_id or response.id is None:
            log.debug("dropping a response to unknown request %r", response.id)
            return
        if response.error is not UNSET or not isinstance(response.result, Raw):
            message = response.error.message if response.error is not UNSET else "no result"
            self._snapshot_failed(f"the broker answered {message[:200]!r}")
            return
        try:
            view = _view_decoder.decode(response.result)
        except msgspec.ValidationError as exc:
            self._snapshot_failed(f"a malformed answer: {exc}")
            return
        self._snapshot_id = None
        loaded = self.relay.load(view.workloads, view.removed, self.clock())
        log.info("loaded %d records and removals from the broker's view", loaded)
        if view.next is not None:
            self.send_to_broker(self.snapshot_request(view.next))
            self.on_snapshot_answer(True)
        else:
            self.view_state = "loaded"
            self.on_snapshot_answer(True)
            self.on_view_loaded()

    def handle_local(self, payload: bytes | memoryview) -> bytes | None:
        """Answer one payload from the broker; the reply (if any) goes back to it."""
        if self.fast_path and self._relay_notifications(payload, None):
            return None
        return self.dispatcher.handle(payload)

    def handle_remote(
        self,
        payload: bytes | memoryview,
        sender: str,
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> Reply:
        """Answer one payload from peer `sender` (a pinned member's node id).

        The reply says what to send back and how many messages were invalid, which the
        inter-node server turns into its HTTP status. With `defer` (the server's
        `loop.call_soon`), a batch of lifecycle notifications, once decoded and checked, is
        relayed by the callback it is given: the sender has its answer while the batch is
        relayed, and sends the next one meanwhile (which, on the same connection, is read
        only after).
        """
        self.on_peer_heard(sender)
        relay = self.relay
        if relay.own_id is None:
            # Read once: a node's id does not change while it runs (a new one needs a
            # restart), and a node without one takes no peer's payload (handshakes fail).
            relay.own_id = self.identity()
        if self.fast_path:
            # One lifecycle frame, the common case: `_relay_notifications` inlined (this
            # runs once per event on every member; a call is a tenth of its Python).
            try:
                decoded = _fast_decoder.decode(payload)
            except (msgspec.DecodeError, RecursionError):
                decoded = None
            if type(decoded) is _LifecycleFrame:
                workload = decoded.params.workloadInfo
                if workload.state in LIFECYCLE_METHODS[decoded.method]:
                    if relay.take(workload, self.clock(), sender) is None:
                        self.send_to_broker(_UPSERT_HEAD + _encode(workload) + b"}}")
                        self.send_to_peers(workload, (sender, workload.originatedFrom))
                    return NOTHING
            elif _all_lifecycle(decoded):
                if defer is None:
                    self._relay_frames(decoded, sender)
                else:
                    defer(functools.partial(self._relay_frames, decoded, sender))
                return NOTHING
        self._sender = sender
        try:
            return self.remote_dispatcher.answer(payload)
        finally:
            self._sender = None

    def carry_out(self, actions: Iterable[Action]) -> None:
        """Do what the relay core decided: frames to the broker, events to the peers."""
        for action in actions:
            kind = type(action)
            if kind is SendToPeers:
                self.send_to_peers(action.event, action.exclude)  # type: ignore[union-attr]
            elif kind is DeliverToBroker:
                event = action.event  # type: ignore[union-attr]
                if type(event) is Workload:
                    # Spliced, not nested structs: this runs once per relayed event.
                    self.send_to_broker(_UPSERT_HEAD + _encode(event) + b"}}")
                else:
                    self.send_to_broker(broker_frame(event))

    # -- the hot path -------------------------------------------------------------------------

    def _relay_notifications(self, payload: bytes | memoryview, sender: str | None) -> bool:
        """Relay a payload of lifecycle notifications; `False` leaves it to the dispatcher."""
        try:
            decoded = _fast_decoder.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return False
        if type(decoded) is _LifecycleFrame:  # one frame: the common case, kept short
            workload = decoded.params.workloadInfo
            if workload.state not in LIFECYCLE_METHODS[decoded.method]:
                return False
            # receive() and carry_out(), inlined for the common case: no actions are built.
            if self.relay.take(workload, self.clock(), sender) is None:
                if sender is None:
                    self.send_to_peers(workload, ())
                else:
                    self.send_to_broker(_UPSERT_HEAD + _encode(workload) + b"}}")
                    self.send_to_peers(workload, (sender, workload.originatedFrom))
            return True
        if not _all_lifecycle(decoded):  # not one frame: a list, or something else
            return False
        self._relay_frames(decoded, sender)
        return True

    def _relay_frames(self, frames: list[_LifecycleFrame], sender: str | None) -> None:
        """Relay a batch of lifecycle notifications (`_all_lifecycle`)."""
        # receive() and carry_out() inlined, as for one frame: a batch is what members send.
        now = self.clock()
        take = self.relay.take
        to_broker = self.send_to_broker
        to_peers = self.send_to_peers
        for frame in frames:
            workload = frame.params.workloadInfo
            if take(workload, now, sender) is None:
                if sender is None:
                    to_peers(workload, ())
                else:
                    to_broker(_UPSERT_HEAD + _encode(workload) + b"}}")
                    to_peers(workload, (sender, workload.originatedFrom))

    # -- methods --------------------------------------------------------------------------

    def _lifecycle_handler(self, method: str) -> Handler:
        def handle(params: Raw | UnsetType) -> dict[str, Any]:
            workload = decode_params(_lifecycle_decoder, params).workloadInfo
            mismatch = lifecycle_mismatch(method, workload)
            if mismatch is not None:
                raise RpcError(INVALID_PARAMS, mismatch)
            return self._accept(workload)

        return handle

    def _remove(self, params: Raw | UnsetType) -> dict[str, Any]:
        removal: WorkloadRemoval = decode_params(_remove_decoder, params)
        return self._accept(removal)

    def _accept(self, event: Event) -> dict[str, Any]:
        now = self.clock()
        if self._sender is None:
            actions = self.relay.receive_local(event, now)
        else:
            actions = self.relay.receive_remote(event, self._sender, now)
        first = actions[0]
        if isinstance(first, Drop):
            return {"accepted": False, "reason": first.reason.value}
        self.carry_out(actions)
        return {"accepted": True}

    def _peers_set(self, params: Raw | UnsetType) -> dict[str, int]:
        decoded: PeersParams = decode_params(_peers_decoder, params)
        self.peers = tuple(decoded.peers)
        self.on_peers(self.peers)
        return {"peers": len(self.peers)}

    def _sync(self, params: Raw | UnsetType) -> dict[str, int]:
        # A peer (re)connected: it has sent us its view; we queue ours for it (seed 002
        # catch-up, docs/protocol.md).
        assert self._sender is not None
        return {"queued": self.on_sync_request(self._sender)}

    def _status(self, params: Raw | UnsetType) -> dict[str, Any]:
        return {
            "version": self.version,
            "nodeId": self.identity(),
            "port": self.port,
            "peers": [msgspec.to_builtins(peer) for peer in self.peers],
            "workloads": {
                "held": self.relay.live_count,
                "tombstones": self.relay.tombstone_count,
            },
            "view": {"state": self.view_state, "retries": self.snapshot_retries},
            "counters": {
                **dataclasses.asdict(self.relay.counters),
                "errors_sent": self.dispatcher.errors_sent + self.remote_dispatcher.errors_sent,
                "notification_errors": self.dispatcher.notification_errors
                + self.remote_dispatcher.notification_errors,
            },
            **self.status_extras(),
        }


def _all_lifecycle(decoded: object) -> TypeGuard[list[_LifecycleFrame]]:
    # A non-empty batch (a list the fast decoder made) of lifecycle notifications only.
    return (
        isinstance(decoded, list)
        and bool(decoded)
        and all(map(_is_lifecycle_notification, decoded))
    )


def _is_lifecycle_notification(frame: _LifecycleFrame) -> bool:
    # The one check msgspec cannot make: the method may carry this record's state.
    return frame.params.workloadInfo.state in LIFECYCLE_METHODS[frame.method]


def broker_frame(event: Event) -> bytes:
    """The notification that tells the broker about a first-seen remote event."""
    if type(event) is Workload:
        # Spliced rather than nested structs: this runs once per relayed event.
        return _UPSERT_HEAD + _encode(event) + b"}}"
    return encode_notification(REMOVE_METHOD, event)
