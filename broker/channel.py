"""The broker's end of the local channel to the workload manager, sans-I/O.

`BrokerChannel` mirrors the manager's `Manager`: it takes one payload from the manager and
returns what to do -- `SendToManager` (a reply), `ManagerReady`, `StoreUpsert` /
`StoreRemove` for the Jobs writer, `SnapshotWanted` (a `workloads:snapshot` to answer from
the store), `Answered` / `Refused` (responses to our own requests) -- and it builds every
frame the broker sends. It is built on the manager's own codec (`workload_manager.jsonrpc`)
and method table (`workload_manager.dispatch`), so both ends of the channel apply the same
JSON-RPC rules and answer bad input with the same errors. The supervisor only moves bytes
and carries out the actions. One channel lives as long as one manager process: requests
pending when it exits die with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from broker.errors import InvalidCursor
from workload_manager.dispatch import Deferred, Dispatcher, decode_params
from workload_manager.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    ErrorObject,
    RequestId,
    Response,
    RpcError,
    encode_error,
    encode_notification,
    encode_request,
    encode_result,
)
from workload_manager.manager import Peer, View
from workload_manager.workload import REMOVE_METHOD, LifecycleParams, Workload, WorkloadRemoval

__all__ = [
    "MAX_SNAPSHOT_PAGE",
    "Answered",
    "BrokerChannel",
    "ChannelAction",
    "ManagerReady",
    "Refused",
    "SendToManager",
    "SnapshotWanted",
    "StoreRemove",
    "StoreUpsert",
]

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_PAGE: Final = 2000
MAX_SNAPSHOT_PAGE: Final = 10_000
MAX_PENDING: Final = 1024  # our own requests awaiting an answer; more is a caller's leak


@dataclass(frozen=True, slots=True)
class SendToManager:
    """Write this frame to the manager (a reply, or an error for a bad frame)."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class ManagerReady:
    """The manager said `ready {version}`: it is up; send it the peer list."""

    version: str


@dataclass(frozen=True, slots=True)
class StoreUpsert:
    """A first-seen remote record (`workloads:upsert`) for the Jobs writer."""

    record: Workload


@dataclass(frozen=True, slots=True)
class StoreRemove:
    """A first-seen remote removal (`workloads:remove`) for the Jobs writer."""

    removal: WorkloadRemoval


@dataclass(frozen=True, slots=True)
class SnapshotWanted:
    """The manager asks for a page of the store's view; answer with `snapshot_reply()`."""

    request_id: RequestId
    cursor: str | None
    limit: int


@dataclass(frozen=True, slots=True)
class Answered:
    """The manager answered our request `request_id` with this (raw JSON) result."""

    request_id: str
    result: Raw


@dataclass(frozen=True, slots=True)
class Refused:
    """The manager answered our request `request_id` with a JSON-RPC error."""

    request_id: str
    method: str
    error: ErrorObject


ChannelAction = (
    SendToManager | ManagerReady | StoreUpsert | StoreRemove | SnapshotWanted | Answered | Refused
)


class _Upsert(Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    # Exactly the frame the manager writes for a first-seen remote record, checked in C.
    jsonrpc: Literal["2.0"]
    method: Literal["workloads:upsert"]
    params: LifecycleParams


class _ReadyParams(Struct, frozen=True):
    version: Annotated[str, Meta(max_length=64)]


class _SnapshotParams(Struct, frozen=True):
    limit: Annotated[int, Meta(ge=1)] = DEFAULT_SNAPSHOT_PAGE
    cursor: Annotated[str, Meta(max_length=4096)] | None = None


_UPSERT_HEAD: Final = b'{"jsonrpc":"2.0","method":"workloads:upsert",'
_upsert_frame: Final = msgspec.json.Decoder(_Upsert)
_ready_decoder: Final = msgspec.json.Decoder(_ReadyParams)
_upsert_decoder: Final = msgspec.json.Decoder(LifecycleParams)
_remove_decoder: Final = msgspec.json.Decoder(WorkloadRemoval)
_snapshot_decoder: Final = msgspec.json.Decoder(_SnapshotParams)


class BrokerChannel:
    """Decides what each payload from the manager means, and encodes what we send it."""

    def __init__(self) -> None:
        self._actions: list[ChannelAction] = []
        self._pending: dict[str, str] = {}  # our request id -> its method
        self._requests = 0
        self.dispatcher = Dispatcher(
            {
                "ready": self._ready,
                "workloads:upsert": self._upsert,
                REMOVE_METHOD: self._remove,
                "workloads:snapshot": self._snapshot,
            },
            on_response=self._on_response,
            on_deferred=self._on_deferred,
        )

    # -- inbound ----------------------------------------------------------------------------

    @staticmethod
    def upsert_of(payload: bytes) -> Workload | None:
        """The record of a `workloads:upsert` frame as the manager writes it, decoded in one
        typed pass (one per relayed event on every member); None for anything else, which
        `receive()` answers."""
        if not payload.startswith(_UPSERT_HEAD):
            return None
        try:
            return _upsert_frame.decode(payload).params.workloadInfo
        except (msgspec.DecodeError, RecursionError):  # malformed, another shape: receive() says
            return None

    def receive(self, payload: bytes | memoryview) -> list[ChannelAction]:
        """What to do about one payload (a frame) from the manager; never raises."""
        reply = self.dispatcher.handle(payload)
        actions, self._actions = self._actions, []
        if reply is not None:
            actions.append(SendToManager(reply))
        return actions

    @property
    def pending(self) -> int:
        """Our requests not yet answered."""
        return len(self._pending)

    # -- outbound ---------------------------------------------------------------------------

    def request(self, method: str, params: Any = UNSET) -> tuple[str, bytes]:
        """A request frame for the manager, and the id its answer will carry."""
        if len(self._pending) >= MAX_PENDING:
            # Requests time out and are forgotten; this many outstanding means they are not.
            oldest = next(iter(self._pending))
            log.warning("forgetting request %s to the workload manager: too many pending", oldest)
            del self._pending[oldest]
        self._requests += 1
        request_id = f"b{self._requests}"
        self._pending[request_id] = method
        return request_id, encode_request(method, params, request_id)

    def forget(self, request_id: str) -> None:
        """We stopped waiting for `request_id` (timed out); a late answer is dropped."""
        self._pending.pop(request_id, None)

    def abandon(self) -> list[str]:
        """The manager is gone: every pending request id, now forgotten."""
        ids = list(self._pending)
        self._pending.clear()
        return ids

    @staticmethod
    def peers_frame(peers: Iterable[Peer]) -> bytes:
        """`peers:set {peers}`: the whole peer list, replacing the previous one."""
        return encode_notification("peers:set", {"peers": list(peers)})

    @staticmethod
    def event_frame(method: str, record: Workload) -> bytes:
        """A local lifecycle event for the manager to broadcast."""
        return encode_notification(method, LifecycleParams(workloadInfo=record))

    @staticmethod
    def removal_frame(removal: WorkloadRemoval) -> bytes:
        """A local removal for the manager to broadcast."""
        return encode_notification(REMOVE_METHOD, removal)

    @staticmethod
    def snapshot_reply(request_id: RequestId, view: View) -> bytes:
        """The answer to a `SnapshotWanted`: one page of the store's view."""
        return encode_result(request_id, view)

    @staticmethod
    def snapshot_failed(request_id: RequestId, exc: Exception) -> bytes:
        """The answer to a `SnapshotWanted` the store could not serve.

        A cursor we never gave out is the manager's fault (-32602); anything else is ours
        (-32603), and says what failed without any record in it.
        """
        if isinstance(exc, InvalidCursor):
            return encode_error(request_id, RpcError(INVALID_PARAMS, str(exc)).to_object())
        detail = f"the Jobs store could not be read: {type(exc).__name__}"
        return encode_error(request_id, RpcError(INTERNAL_ERROR, detail).to_object())

    # -- methods ----------------------------------------------------------------------------

    def _ready(self, params: Raw | UnsetType) -> None:
        decoded: _ReadyParams = decode_params(_ready_decoder, params)
        self._actions.append(ManagerReady(decoded.version))

    def _upsert(self, params: Raw | UnsetType) -> None:
        decoded: LifecycleParams = decode_params(_upsert_decoder, params)
        self._actions.append(StoreUpsert(decoded.workloadInfo))

    def _remove(self, params: Raw | UnsetType) -> None:
        removal: WorkloadRemoval = decode_params(_remove_decoder, params)
        self._actions.append(StoreRemove(removal))

    def _snapshot(self, params: Raw | UnsetType) -> Deferred:
        # Params are optional here: `{}` and none both mean the first page at the default size.
        decoded = _SnapshotParams() if params is UNSET else _snapshot_decoder.decode(params)
        return Deferred((decoded.cursor, min(decoded.limit, MAX_SNAPSHOT_PAGE)))

    def _on_deferred(self, request_id: RequestId, what: Any) -> None:
        cursor, limit = what
        self._actions.append(SnapshotWanted(request_id, cursor, limit))

    def _on_response(self, response: Response) -> None:
        request_id = response.id
        method = self._pending.pop(request_id, None) if isinstance(request_id, str) else None
        if method is None or not isinstance(request_id, str):
            if request_id is None and isinstance(response.error, ErrorObject):
                # The manager refused a frame of ours it could not read (one over its frame
                # limit, say): there is no request to fail, but it must not pass unseen.
                error = response.error
                detail = error.data if isinstance(error.data, str) else ""
                log.warning(
                    "the workload manager refused a frame: %s %s", error.message, detail[:200]
                )
                return
            log.debug("dropping a response to unknown request %r", request_id)
            return
        if isinstance(response.result, Raw):
            self._actions.append(Answered(request_id, response.result))
        elif isinstance(response.error, ErrorObject):
            self._actions.append(Refused(request_id, method, response.error))
