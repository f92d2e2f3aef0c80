"""Why a node cannot take a request, and the HTTP status each reason maps to.

The values are the reasons' words as `nvpair explain` and the local API show them, so code
that compares a reason with its string keeps working. `status` is what a front end answers
when this reason is what keeps a request from every node: a full queue is the client's
cue to retry later (429), a model nobody serves does not exist here (404), and everything
else is a cluster that cannot serve right now (503).
"""

from __future__ import annotations

from enum import StrEnum, unique

__all__ = ["Refusal"]


@unique
class Refusal(StrEnum):
    """One filter's reason for refusing a node, in the order `rank` applies them."""

    NOT_A_MEMBER = "not a member"
    UNREACHABLE = "unreachable"
    CORDONED = "cordoned"
    MODEL_NOT_SERVED = "does not serve the model"
    ENGINES_DOWN = "its engines for the model are down"
    NO_HEALTHY_GPU = "no healthy GPU"
    NO_FITTING_DOMAIN = "no single topology domain with enough GPUs and free memory"
    QUEUE_FULL = "queue full"
    # Replica ranking (`rank_replicas`) only; last, so `rank`'s filter indices are unchanged.
    REPLICA_NOT_READY = "replica not ready"

    @property
    def status(self) -> int:
        """The HTTP status for a request that this reason keeps from every node."""
        if self is Refusal.QUEUE_FULL:
            return 429
        if self is Refusal.MODEL_NOT_SERVED:
            return 404
        return 503
