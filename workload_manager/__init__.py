"""The workload manager of seed 002: relays workload lifecycle events between the broker
and the cluster's pinned peers, de-duplicated, so every member shows the same Jobs list.

It knows nothing of GPUs, the plane or the Jobs store.
"""

from workload_manager._version import VERSION
from workload_manager.dispatch import Dispatcher, Reply
from workload_manager.errors import ConfigurationError, PortInUse, WorkloadManagerError
from workload_manager.framing import DEFAULT_MAX_FRAME, FrameTooLarge, LineFramer
from workload_manager.jsonrpc import RpcError, parse_payload
from workload_manager.manager import Manager, Peer
from workload_manager.relay import (
    DeliverToBroker,
    Drop,
    DropReason,
    RelayCore,
    SendToPeers,
)
from workload_manager.workload import LIFECYCLE_METHODS, Workload, WorkloadRemoval, WorkloadState

__all__ = [
    "DEFAULT_MAX_FRAME",
    "LIFECYCLE_METHODS",
    "VERSION",
    "ConfigurationError",
    "DeliverToBroker",
    "Dispatcher",
    "Drop",
    "DropReason",
    "FrameTooLarge",
    "LineFramer",
    "Manager",
    "Peer",
    "PortInUse",
    "RelayCore",
    "Reply",
    "RpcError",
    "SendToPeers",
    "Workload",
    "WorkloadManagerError",
    "WorkloadRemoval",
    "WorkloadState",
    "parse_payload",
]
