"""GPU-aware ranking of nodes for a request: pure functions over node snapshots and
pending work, with a reason for every refusal. No I/O."""

from .place import Placement, PlacementRequest, rank_placement
from .rank import Cluster, DeviceView, EngineView, Load, NodeView, Ranking, Request, rank
from .refusal import Refusal

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
    "Request",
    "rank",
    "rank_placement",
]
