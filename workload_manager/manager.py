"""The workload manager's local method table, bound to the relay core.

`Manager` answers the broker's JSON-RPC payloads (lifecycle events, removals, `peers:set`,
`manager:status`) and turns the relay core's actions into frames for the broker and events
for the peers. It does no I/O itself: frames for the broker go to `send_to_broker`, events
for peers to `send_to_peers`, both supplied by the layer that owns the sockets.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Raw, Struct, UnsetType

from .dispatch import Dispatcher, decode_params
from .jsonrpc import INVALID_PARAMS, RpcError, encode_notification
from .relay import (
    Action,
    DeliverToBroker,
    Drop,
    Event,
    InvalidEvent,
    LifecycleEvent,
    RelayCore,
    RemoveEvent,
    SendToPeers,
)
from .workload import LIFECYCLE_METHODS, REMOVE_METHOD, LifecycleParams, RemoveParams

__all__ = ["MAX_PEERS", "Manager", "Peer", "PeersParams"]

MAX_PEERS: Final = 1024


class Peer(Struct, kw_only=True, frozen=True):
    """A peer's workload manager, from the broker's node records."""

    nodeId: Annotated[str, Meta(min_length=1, max_length=256)]
    host: Annotated[str, Meta(min_length=1, max_length=255)]
    port: Annotated[int, Meta(ge=1, le=65535)]


class PeersParams(Struct, kw_only=True, frozen=True):
    """Params of `peers:set`: the whole peer list, replacing the previous one."""

    peers: Annotated[list[Peer], Meta(max_length=MAX_PEERS)]


class _Upsert(Struct, kw_only=True, frozen=True):
    workloadInfo: Any


_lifecycle_decoder: Final = msgspec.json.Decoder(LifecycleParams)
_remove_decoder: Final = msgspec.json.Decoder(RemoveParams)
_peers_decoder: Final = msgspec.json.Decoder(PeersParams)


class Manager:
    """Binds the relay core to the local channel's methods."""

    def __init__(
        self,
        *,
        version: str,
        port: int,
        node_id: str | None = None,
        relay: RelayCore | None = None,
        clock: Callable[[], float] = time.monotonic,
        send_to_broker: Callable[[bytes], object] = lambda frame: None,
        send_to_peers: Callable[[Event, frozenset[str]], object] = lambda event, exclude: None,
        status_extras: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.version = version
        self.port = port
        self.node_id = node_id
        self.relay = relay or RelayCore()
        self.clock = clock
        self.send_to_broker = send_to_broker
        self.send_to_peers = send_to_peers
        self.status_extras = status_extras
        self.peers: tuple[Peer, ...] = ()
        methods: dict[str, Callable[[Raw | UnsetType], Any]] = {
            method: self._lifecycle_handler(method) for method in LIFECYCLE_METHODS
        }
        methods[REMOVE_METHOD] = self._remove
        methods["peers:set"] = self._peers_set
        methods["manager:status"] = self._status
        self.dispatcher = Dispatcher(methods)

    def ready_frame(self) -> bytes:
        """The first frame on every local channel: `ready {version}` (seed 002)."""
        return encode_notification("ready", {"version": self.version})

    def handle_local(self, payload: bytes) -> bytes | None:
        """Answer one payload from the broker; the reply (if any) goes back to it."""
        return self.dispatcher.handle(payload)

    def carry_out(self, actions: Iterable[Action]) -> None:
        """Do what the relay core decided: frames to the broker, events to the peers."""
        for action in actions:
            if isinstance(action, DeliverToBroker):
                self.send_to_broker(_broker_frame(action.event))
            elif isinstance(action, SendToPeers):
                self.send_to_peers(action.event, action.exclude)

    # -- methods --------------------------------------------------------------------------

    def _lifecycle_handler(self, method: str) -> Callable[[Raw | UnsetType], dict[str, Any]]:
        def handle(params: Raw | UnsetType) -> dict[str, Any]:
            decoded: LifecycleParams = decode_params(_lifecycle_decoder, params)
            try:
                event = LifecycleEvent(method, decoded.workloadInfo)
            except InvalidEvent as exc:
                raise RpcError(INVALID_PARAMS, str(exc)) from exc
            return self._accept(event)

        return handle

    def _remove(self, params: Raw | UnsetType) -> dict[str, Any]:
        decoded: RemoveParams = decode_params(_remove_decoder, params)
        return self._accept(RemoveEvent(decoded.workloadId, decoded.originatedFrom))

    def _accept(self, event: Event) -> dict[str, Any]:
        actions = self.relay.receive_local(event, self.clock())
        first = actions[0]
        if isinstance(first, Drop):
            return {"accepted": False, "reason": first.reason.value}
        self.carry_out(actions)
        return {"accepted": True}

    def _peers_set(self, params: Raw | UnsetType) -> dict[str, int]:
        decoded: PeersParams = decode_params(_peers_decoder, params)
        self.peers = tuple(decoded.peers)
        return {"peers": len(self.peers)}

    def _status(self, params: Raw | UnsetType) -> dict[str, Any]:
        counters = dataclasses.asdict(self.relay.counters)
        return {
            "version": self.version,
            "nodeId": self.node_id,
            "port": self.port,
            "peers": [msgspec.to_builtins(peer) for peer in self.peers],
            "workloads": {
                "held": self.relay.live_count,
                "tombstones": self.relay.tombstone_count,
            },
            "counters": {
                **counters,
                "errors_sent": self.dispatcher.errors_sent,
                "notification_errors": self.dispatcher.notification_errors,
            },
            **self.status_extras(),
        }


def _broker_frame(event: Event) -> bytes:
    if isinstance(event, LifecycleEvent):
        return encode_notification("workloads:upsert", _Upsert(workloadInfo=event.workload))
    return encode_notification(
        REMOVE_METHOD,
        RemoveParams(workloadId=event.workload_id, originatedFrom=event.originated_from),
    )
