"""The workload manager of seed 002: relays workload lifecycle events between the broker
and the cluster's pinned peers, de-duplicated, so every member shows the same Jobs list.

It knows nothing of GPUs, the plane or the Jobs store.
"""

from ._version import VERSION
from .dispatch import Dispatcher
from .framing import DEFAULT_MAX_FRAME, FrameTooLarge, LineFramer
from .jsonrpc import RpcError, parse_payload
from .manager import Manager, Peer
from .relay import (
    DeliverToBroker,
    Drop,
    DropReason,
    RelayCore,
    RemoveEvent,
    SendToPeers,
)
from .workload import LIFECYCLE_METHODS, Workload, WorkloadState

__all__ = [
    "DEFAULT_MAX_FRAME",
    "LIFECYCLE_METHODS",
    "VERSION",
    "DeliverToBroker",
    "Dispatcher",
    "Drop",
    "DropReason",
    "FrameTooLarge",
    "LineFramer",
    "Manager",
    "Peer",
    "RelayCore",
    "RemoveEvent",
    "RpcError",
    "SendToPeers",
    "Workload",
    "WorkloadState",
    "parse_payload",
]
