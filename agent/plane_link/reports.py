"""What the demand and machinery sides add to each plane sync batch (`plane.desired.state`).

A reporter gives some of `SyncBatch`'s fields for the batch being built, and is told when
that batch was accepted: what it reports once (events, operation phases) it drops only then,
so a batch the plane never took is reported again in the next.
"""

from __future__ import annotations

from typing import Any, Protocol

from facts.records import NodeRecord

__all__ = ["Reporter"]


class Reporter(Protocol):
    """One source of `SyncBatch` fields."""

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """The fields this reporter adds to the batch being built from `record`."""
        ...

    def sent(self) -> None:
        """The batch built with the last `fields()` was accepted by the plane."""
        ...
