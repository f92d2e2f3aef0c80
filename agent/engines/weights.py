"""What the replica controller asks of this member's artifacts (issue 28): the weights a
replica loads, fetched first when they are not here. The store and the fetches live in
`agent.artifacts` (a layer above); the controller sees only this."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["NoWeights", "Weights", "WeightsState"]


@dataclass(frozen=True, slots=True)
class WeightsState:
    """Where an artifact stands on this member: resident (`path`, what the engine loads) or
    being fetched (`held` of `pieces` verified, `why` its last try failed)."""

    path: Path | None
    held: int = 0
    pieces: int = 0
    why: str = ""

    def progress(self) -> str:
        """How far the fetch is, in words (for the replica's record: never a path)."""
        shown = f"fetching its weights: {self.held} of {self.pieces} pieces"
        if self.pieces:
            shown += f" ({100 * self.held // self.pieces}%)"
        return f"{shown}; {self.why}" if self.why else shown


class Weights(Protocol):
    """This member's artifacts, as replicas need them."""

    async def need(self, digest: str) -> WeightsState:
        """The artifact's state here; a fetch is started (or kept going) unless resident."""
        ...


class NoWeights:
    """A member without an artifact store (tests of the controller alone)."""

    async def need(self, digest: str) -> WeightsState:
        """Never resident."""
        return WeightsState(None, why="this member keeps no artifacts")
