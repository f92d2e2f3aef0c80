"""Dividing a workload's replicas across clusters: Webster / Sainte-Laguë, deterministic.

Highest averages, as Karmada divides replicas across member clusters: each seat (replica)
goes in turn to the cluster whose weight divided by `2 * seats + 1` is highest, among those
still under their cap; a tie goes to the lower cluster id. Webster is house-monotone (adding
a seat never takes one from anyone), which is what lets a scale change move only the delta:
a scale up apportions the added replicas alone (weights: each cluster's remaining capacity)
on top of the current shares, and a scale down takes replicas away by the same method from
the current shares (the seat Webster would have given last goes first).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

__all__ = ["apportion", "min_shares", "scale_down", "scale_up"]


def apportion(total: int, weights: Mapping[str, int], caps: Mapping[str, int]) -> dict[str, int]:
    """`total` seats over the clusters of `weights` (> 0 to take part), none past its cap
    (a missing cap: its weight); fewer than `total` when the caps run out. Clusters given
    no seat are left out of the answer."""
    shares: dict[str, int] = {}
    # Heap of (-priority, cluster id): priority weight / (2s + 1), compared exactly as the
    # fractions w_a * (2s_b + 1) vs w_b * (2s_a + 1) would be, through a float key that is
    # exact for the sizes here (weights and seats well below 2**26).
    heap = [(-float(w), cid) for cid, w in weights.items() if w > 0 and caps.get(cid, w) > 0]
    heapq.heapify(heap)
    given = 0
    while given < total and heap:
        _, cid = heapq.heappop(heap)
        seats = shares.get(cid, 0) + 1
        shares[cid] = seats
        given += 1
        if seats < caps.get(cid, weights[cid]):
            heapq.heappush(heap, (-weights[cid] / (2 * seats + 1), cid))
    return shares


def scale_up(
    current: Mapping[str, int], added: int, remaining: Mapping[str, int]
) -> dict[str, int]:
    """The current shares plus `added` replicas apportioned by remaining capacity (weights
    and caps both); a cluster's share only grows."""
    extra = apportion(added, remaining, remaining)
    shares = {cid: n for cid, n in current.items() if n > 0}
    for cid, n in extra.items():
        shares[cid] = shares.get(cid, 0) + n
    return shares


def scale_down(current: Mapping[str, int], removed: int) -> dict[str, int]:
    """The current shares less `removed` replicas: each goes from the cluster holding the
    seat Webster gives last over the current shares (the smallest s / (2s - 1): the largest
    share; a tie: the lower cluster id). A cluster's share only shrinks; one at 0 is left
    out."""
    shares = {cid: n for cid, n in current.items() if n > 0}
    # With weights = the shares themselves, the last seat's priority s / (2(s - 1) + 1)
    # falls as s grows: the largest share loses first.
    heap = [(-n, cid) for cid, n in shares.items()]
    heapq.heapify(heap)
    for _ in range(min(removed, sum(shares.values()))):
        _, cid = heapq.heappop(heap)
        shares[cid] -= 1
        if shares[cid]:
            heapq.heappush(heap, (-shares[cid], cid))
        else:
            del shares[cid]
    return shares


def min_shares(shares: Mapping[str, int], low: int) -> dict[str, int]:
    """A workload on load's `low` (its minReplicas) divided over its clusters' shares of its
    max by the same method, weights and caps the shares: each cluster's min, never above
    its share; every cluster of `shares` is in the answer (0 where it got none)."""
    given = apportion(low, shares, shares)
    return {cid: given.get(cid, 0) for cid in shares}
