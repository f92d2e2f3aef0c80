"""Ranking nodes for placing a new engine (a Replica): device class, memory fit, and a
tensor-parallel group inside one topology domain. Pure; placement is rare, so plain Python.

The plane uses it to choose where a declared serving configuration's replicas go; the agent
uses it for `nvpair explain`-style answers. Every refused node carries its reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.rank import NodeView

__all__ = ["Placement", "PlacementRequest", "rank_placement"]


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """An engine to place."""

    gpus: int  # its tensor-parallel group: all in one topology domain
    memory_bytes: int  # free memory it needs on each of those GPUs
    device_class: str | None = None  # e.g. "h100-80gb-sxm"; None: any


@dataclass(frozen=True, slots=True)
class Placement:
    """The outcome: (node, domain, score) best first, and (node, reason) for the others."""

    ranked: list[tuple[str, str, float]]
    refused: list[tuple[str, str]]

    @property
    def best(self) -> tuple[str, str] | None:
        return (self.ranked[0][0], self.ranked[0][1]) if self.ranked else None


def rank_placement(request: PlacementRequest, nodes: Iterable[NodeView]) -> Placement:
    """Where the engine fits; tighter fits first (less stranded memory), then idler GPUs."""
    ranked: list[tuple[str, str, float]] = []
    refused: list[tuple[str, str]] = []
    for node in sorted(nodes, key=lambda n: n.node_id):
        if not node.member:
            refused.append((node.node_id, "not a member"))
            continue
        if not node.reachable:
            refused.append((node.node_id, "unreachable"))
            continue
        if node.cordoned:
            refused.append((node.node_id, "cordoned"))
            continue
        devices = [
            d
            for d in node.devices
            if d.healthy
            and (request.device_class is None or d.device_class == request.device_class)
        ]
        if not devices:
            what = (
                f"no healthy {request.device_class} GPU"
                if request.device_class
                else "no healthy GPU"
            )
            refused.append((node.node_id, what))
            continue
        best: tuple[float, str] | None = None
        for domain in sorted({d.domain for d in devices}):
            fitting = sorted(
                (
                    d
                    for d in devices
                    if d.domain == domain and d.memory_free >= request.memory_bytes
                ),
                key=lambda d: d.memory_free,
            )
            if len(fitting) < request.gpus:
                continue
            group = fitting[: request.gpus]  # the tightest GPUs that fit
            stranded = sum(d.memory_free - request.memory_bytes for d in group) / max(
                1, sum(d.memory_total for d in group)
            )
            util = sum(d.utilization for d in group) / len(group) / 100
            score = -stranded - 0.5 * util
            if best is None or score > best[0]:
                best = (score, domain)
        if best is None:
            refused.append(
                (
                    node.node_id,
                    f"no topology domain with {request.gpus} GPU(s) of "
                    f"{request.memory_bytes / 1024**3:.1f} GiB free",
                )
            )
            continue
        ranked.append((node.node_id, best[1], best[0]))
    ranked.sort(key=lambda r: -r[2])  # stable: node-id order among equal scores
    return Placement(ranked, refused)
