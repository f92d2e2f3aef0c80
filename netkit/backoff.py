"""How long to wait before trying again: exponential backoff with full jitter and a cap.

Every retry loop that reaches another node waits this way -- the manager's outboxes, the
agent's sync up to its plane and its reads of the desired state down -- so that many
members failing at once spread their retries instead of returning together ("full jitter",
the AWS architecture blog). The random source is passed in, so tests are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: delay in [0, min(cap, base * 2**attempt))."""

    base_s: float = 0.1
    cap_s: float = 30.0

    def delay(self, attempt: int, draw: Callable[[], float]) -> float:
        """The delay before retry number `attempt` (1 = the first retry)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** min(attempt, 30)))
        return float(draw() * ceiling)
