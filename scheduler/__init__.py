"""GPU-aware ranking of nodes for a request, and of a model's replicas on engine load: pure
functions over snapshots and pending work, with a reason for every refusal. No I/O."""

from scheduler.place import Placement, PlacementRequest, rank_placement
from scheduler.rank import (
    Cluster,
    DeviceView,
    EngineView,
    Load,
    NodeView,
    Ranking,
    Request,
    rank,
    top,
)
from scheduler.refusal import Refusal
from scheduler.replicas import ReplicaRanking, ReplicaView, ReportedLoad, rank_replicas

__all__ = [
    "Cluster",
    "DeviceView",
    "EngineView",
    "Load",
    "NodeView",
    "Placement",
    "PlacementRequest",
    "Ranking",
    "Refusal",
    "ReplicaRanking",
    "ReplicaView",
    "ReportedLoad",
    "Request",
    "rank",
    "rank_placement",
    "rank_replicas",
    "top",
]
