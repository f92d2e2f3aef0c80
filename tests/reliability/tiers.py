"""The fault harness's two tiers: every scenario runs at quick scale by default (CI) and at
long scale with `--long` (`python -m pytest tests/reliability --long -s`), whose figures go
into docs/reliability.md. A scenario asks its `tier` fixture for its sizes: `tier.pick(quick,
long)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, TypeVar

__all__ = ["LONG", "QUICK", "Tier"]

T = TypeVar("T")


@dataclass(frozen=True)
class Tier:
    """Which scale a scenario runs at."""

    name: str

    @property
    def long(self) -> bool:
        return self.name == "long"

    def pick(self, quick: T, long: T) -> T:
        """The quick tier's value or the long tier's."""
        return long if self.long else quick


QUICK: Final = Tier("quick")
LONG: Final = Tier("long")
