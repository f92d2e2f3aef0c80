"""GPU-aware ranking of nodes for an inference request. Pure: no I/O, no clock.

`Cluster.compile(nodes)` turns node snapshots into arrays once per change of the node
records; `rank(request, cluster, load)` then filters and scores every node in a few numpy
passes, so a decision over 5,000 nodes costs well under a millisecond. `Load` is the pending
work per node (queued + running jobs from the shared Jobs view, plus requests assigned but
not yet visible there), updated in place as jobs come and go.

Filters, in order (the first that fails is the node's reason): not a member, unreachable,
cordoned, model not served (by the requested engine), every engine for it down, no healthy
GPU, no single topology domain with the GPUs the request needs each holding its memory. A
node that reports no GPU at all (no NVML, or none present) passes the two GPU filters: its
engines run on the CPU (llama.cpp) or on devices NVML cannot see, and they answer for
themselves; a node whose GPUs are all unhealthy does not.
Score, higher is better: pending work per healthy GPU dominates, then GPU utilisation,
then free memory, then locality (the node the request entered on). Ties go to the lower
node id, so the same inputs always give the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from scheduler.refusal import Refusal

__all__ = [
    "Cluster",
    "DeviceView",
    "EngineView",
    "Load",
    "NodeView",
    "Ranking",
    "Refusal",
    "Request",
    "rank",
    "top",
]

MAX_GROUP: Final = 16  # the largest tensor-parallel group the fit arrays cover
W_LOAD: Final = 1.0
W_UTIL: Final = 0.5
W_FREE: Final = 0.25
W_LOCAL: Final = 0.1

# The filters' reasons, in the order `rank` builds its masks (one mask per reason).
REASONS: Final = tuple(Refusal)


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What ranking needs of a GPU."""

    memory_free: int
    memory_total: int
    utilization: float  # percent
    healthy: bool
    domain: str
    device_class: str = ""


@dataclass(frozen=True, slots=True)
class EngineView:
    """A model server on a node."""

    name: str
    kind: str
    models: frozenset[str]
    up: bool = True


@dataclass(frozen=True, slots=True)
class NodeView:
    """What ranking needs of a node (built from its node record and reachability)."""

    node_id: str
    member: bool = True
    reachable: bool = True
    cordoned: bool = False
    engines: tuple[EngineView, ...] = ()
    devices: tuple[DeviceView, ...] = ()
    queue_limit: float = float("inf")  # pending jobs beyond which the node takes no more


@dataclass(frozen=True, slots=True)
class Request:
    """An inference request as the scheduler sees it (never its prompt)."""

    model: str
    engine: str | None = None  # an engine kind, when the client insists on one
    memory_bytes: int = 0  # free GPU memory it needs on each GPU of its group
    gpus: int = 1  # GPUs that must share one topology domain
    origin: str | None = None  # the node it entered on


# The filters but the queue's, what passes them all, the score but the load's part, and the
# load's weight per pending request on each node.
_Static = tuple[
    list[npt.NDArray[np.bool_]],
    npt.NDArray[np.bool_],
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
]


@dataclass
class Cluster:
    """Node snapshots compiled into arrays; rebuild when the node records change."""

    node_ids: list[str]
    index: dict[str, int]
    member: npt.NDArray[np.bool_]
    reachable: npt.NDArray[np.bool_]
    cordoned: npt.NDArray[np.bool_]
    healthy: npt.NDArray[np.int64]
    gpuless: npt.NDArray[np.bool_]  # reports no device at all: its engines serve without one
    utilization: npt.NDArray[np.float64]
    free_fraction: npt.NDArray[np.float64]
    queue_limit: npt.NDArray[np.float64]
    fit: npt.NDArray[np.int64]  # [g - 1, node]: the g-th largest free memory in one domain
    served: dict[tuple[str | None, str], npt.NDArray[np.bool_]]  # (kind|None, model) -> mask
    up: dict[tuple[str | None, str], npt.NDArray[np.bool_]]
    # What ranking a kind of request finds that does not move with the load, per
    # (engine, model, GPUs, memory, origin): the filters but the queue's, the static score.
    _static: dict[tuple[object, ...], _Static] = field(
        default_factory=dict, repr=False, compare=False
    )
    # The best nodes per kind of request and load (`top`).
    _tops: dict[tuple[object, ...], list[tuple[str, float]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def compile(cls, nodes: Iterable[NodeView]) -> Cluster:
        """Sort by node id (ties go to the lower id) and precompute what ranking reads."""
        views = sorted(nodes, key=lambda n: n.node_id)
        count = len(views)
        fit = np.zeros((MAX_GROUP, count), dtype=np.int64)
        served: dict[tuple[str | None, str], npt.NDArray[np.bool_]] = {}
        up: dict[tuple[str | None, str], npt.NDArray[np.bool_]] = {}
        healthy = np.zeros(count, dtype=np.int64)
        utilization = np.zeros(count, dtype=np.float64)
        free_fraction = np.zeros(count, dtype=np.float64)
        for i, node in enumerate(views):
            good = [d for d in node.devices if d.healthy]
            healthy[i] = len(good)
            if good:
                utilization[i] = sum(d.utilization for d in good) / len(good)
                total = sum(d.memory_total for d in good)
                free_fraction[i] = sum(d.memory_free for d in good) / total if total else 0.0
            by_domain: dict[str, list[int]] = {}
            for device in good:
                by_domain.setdefault(device.domain, []).append(device.memory_free)
            for frees in by_domain.values():
                frees.sort(reverse=True)
                for g, free in enumerate(frees[:MAX_GROUP]):
                    fit[g, i] = max(fit[g, i], free)
            for engine in node.engines:
                for model in engine.models:
                    for key in ((None, model), (engine.kind, model)):
                        served.setdefault(key, np.zeros(count, dtype=np.bool_))[i] = True
                        if engine.up:
                            up.setdefault(key, np.zeros(count, dtype=np.bool_))[i] = True
        return cls(
            node_ids=[n.node_id for n in views],
            index={n.node_id: i for i, n in enumerate(views)},
            member=np.array([n.member for n in views], dtype=np.bool_),
            reachable=np.array([n.reachable for n in views], dtype=np.bool_),
            cordoned=np.array([n.cordoned for n in views], dtype=np.bool_),
            healthy=healthy,
            gpuless=np.array([not n.devices for n in views], dtype=np.bool_),
            utilization=utilization,
            free_fraction=free_fraction,
            queue_limit=np.array([n.queue_limit for n in views], dtype=np.float64),
            fit=fit,
            served=served,
            up=up,
        )

    def __len__(self) -> int:
        return len(self.node_ids)

    def models(self) -> dict[str, list[str]]:
        """Every model served, with the nodes that serve it."""
        return {
            model: [self.node_ids[i] for i in np.flatnonzero(mask)]
            for (kind, model), mask in sorted(self.served.items(), key=lambda kv: kv[0][1])
            if kind is None
        }


@dataclass
class Load:
    """Pending work per node, in the cluster's order; updated in place."""

    cluster: Cluster
    # A list, made into an array only when a ranking is not remembered (`top`): one is made
    # per request, for a handful of nodes, where numpy's per-call cost is most of the work.
    counts: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = [0.0] * len(self.cluster)

    @classmethod
    def of(cls, cluster: Cluster, pending: Mapping[str, float]) -> Load:
        """Load from a mapping node id -> queued + running (+ assigned) jobs."""
        load = cls(cluster)
        for node_id, count in pending.items():
            load.add(node_id, count)
        return load

    def add(self, node_id: str, delta: float) -> None:
        """A job was assigned to (+1) or left (-1) a node."""
        i = self.cluster.index.get(node_id)
        if i is not None:
            count = self.counts[i] + delta
            self.counts[i] = count if count > 0.0 else 0.0


@dataclass
class Ranking:
    """The outcome: nodes that can serve, best first, and why the others cannot."""

    cluster: Cluster
    request: Request
    masks: list[npt.NDArray[np.bool_]]  # one per filter, True = passes
    eligible: npt.NDArray[np.bool_]
    scores: npt.NDArray[np.float64]

    @property
    def best(self) -> str | None:
        """The node to run on, or None when no node can."""
        if not self.eligible.any():
            return None
        # argmax takes the first maximum: the lowest node id among equal scores.
        masked = np.where(self.eligible, self.scores, -np.inf)
        return self.cluster.node_ids[int(np.argmax(masked))]

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The n best nodes with their scores, best first."""
        candidates = np.flatnonzero(self.eligible)
        order = candidates[np.argsort(-self.scores[candidates], kind="stable")][:n]
        return [(self.cluster.node_ids[i], float(self.scores[i])) for i in order]

    def refused(self) -> list[tuple[str, Refusal]]:
        """Every node that cannot serve, with the first filter that refused it, by node id."""
        first_fail = self._first_fail()
        return [
            (self.cluster.node_ids[i], REASONS[first_fail[i]])
            for i in np.flatnonzero(first_fail >= 0)
        ]

    def reason(self, node_id: str) -> str | None:
        """Why `node_id` cannot serve, in words with this request's figures, or None if it can."""
        i = self.cluster.index.get(node_id)
        if i is None:
            return None
        k = int(self._first_fail()[i])
        return self.describe(REASONS[k]) if k >= 0 else None

    def describe(self, refusal: Refusal) -> str:
        """`refusal` in words for this request: the topology reason names the GPUs and memory
        it needed."""
        if refusal is Refusal.NO_FITTING_DOMAIN:
            return (
                f"no single topology domain with {self.request.gpus} healthy GPU(s) "
                f"of {self.request.memory_bytes / 1024**3:.1f} GiB free each"
            )
        return refusal.value

    def refusal(self) -> Refusal | None:
        """Why the request as a whole cannot be placed now, or None when some node can.

        A node that could serve but whose queue is full makes it `QUEUE_FULL` (429: retry
        later); no node serving the model makes it `MODEL_NOT_SERVED` (404); otherwise it is
        the reason of the node that passed the most filters (503).
        """
        if self.eligible.any():
            return None
        first_fail = self._first_fail()
        if (first_fail == REASONS.index(Refusal.QUEUE_FULL)).any():
            return Refusal.QUEUE_FULL
        served = self.masks[REASONS.index(Refusal.MODEL_NOT_SERVED)]
        if len(first_fail) == 0 or not served.any():
            return Refusal.MODEL_NOT_SERVED
        return REASONS[int(first_fail.max())]

    def _first_fail(self) -> npt.NDArray[np.int64]:
        """Per node, the index of the first filter that refused it (-1: none did)."""
        passing = np.ones(len(self.cluster), dtype=np.bool_)
        first_fail = np.full(len(self.cluster), -1, dtype=np.int64)
        for k, mask in enumerate(self.masks):
            first_fail[passing & ~mask] = k
            passing &= mask
        return first_fail


def rank(request: Request, cluster: Cluster, load: Load | None = None) -> Ranking:
    """Filter and score every node for `request`."""
    count = len(cluster)
    masks, passing, static_scores, per_gpu = _static_part(request, cluster)
    pending = (
        np.array(load.counts, dtype=np.float64)
        if load is not None
        else np.zeros(count, dtype=np.float64)
    )
    room = pending < cluster.queue_limit
    scores = static_scores - pending * per_gpu
    return Ranking(cluster, request, [*masks, room], passing & room, scores)


MAX_STATIC: Final = 256  # kinds of request remembered per compiled cluster
MAX_TOPS: Final = 1024  # (kind of request, load) pairs whose best nodes are remembered


def top(
    request: Request, cluster: Cluster, load: Load, n: int = 2
) -> list[tuple[str, float]] | Ranking:
    """`rank(request, cluster, load).top(n)`, remembered per compiled cluster for each kind
    of request and load: a facade asks this for every request, and the pending work per
    node takes few values (what is in flight), so most requests are a dict lookup. The
    `Ranking` instead when no node can take it (its `refusal()` says why)."""
    key = (request.engine, request.model, request.gpus, request.memory_bytes, request.origin, n,
           tuple(load.counts))  # fmt: skip
    cached = cluster._tops.get(key)
    if cached is not None:
        return cached
    ranking = rank(request, cluster, load)
    best = ranking.top(n)
    if not best:
        return ranking  # not remembered: a refusal is asked for rarely, and explained
    if len(cluster._tops) >= MAX_TOPS:
        cluster._tops.clear()
    cluster._tops[key] = best
    return best


def _static_part(request: Request, cluster: Cluster) -> _Static:
    """The filters that do not look at the load, and the score without it: the same for
    every request of a kind until the records change (a new `Cluster`), so made once."""
    group = min(max(request.gpus, 1), MAX_GROUP)
    memory = max(request.memory_bytes, 1)
    kind = (request.engine, request.model, group, memory, request.origin)
    cached = cluster._static.get(kind)
    if cached is not None:
        return cached
    nothing = np.zeros(len(cluster), dtype=np.bool_)
    key = (request.engine, request.model)
    masks = [
        cluster.member,
        cluster.reachable,
        ~cluster.cordoned,
        cluster.served.get(key, nothing),
        cluster.up.get(key, nothing),
        (cluster.healthy > 0) | cluster.gpuless,
        (cluster.fit[group - 1] >= memory) | cluster.gpuless,
    ]
    scores = -W_UTIL * cluster.utilization / 100.0 + W_FREE * cluster.free_fraction
    if request.origin is not None and request.origin in cluster.index:
        scores[cluster.index[request.origin]] += W_LOCAL
    if len(cluster._static) >= MAX_STATIC:
        cluster._static.clear()
    passing = masks[0].copy()
    for mask in masks[1:]:
        passing &= mask
    per_gpu = W_LOAD / np.maximum(cluster.healthy, 1)
    cluster._static[kind] = (masks, passing, scores, per_gpu)
    return cluster._static[kind]


def node_view_order(views: Sequence[NodeView]) -> list[str]:
    """The order `Cluster.compile` puts nodes in (for tests and tools)."""
    return sorted(v.node_id for v in views)
