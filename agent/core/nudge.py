"""A `Nudge`: "something changed", fired by a part built early and followed by parts built
after it, so that the composition root never refers to a part before it exists.

The daemon builds the engine registry before the heartbeat that pushes this node's record,
and the load poller before the facade whose waiters look again when loads move: each gets
a nudge to fire, and the later part follows it once it is built. A nudge fired before anyone
follows it reaches no one (nothing was listening yet), and firing is synchronous and cheap:
the followers only set a flag or an event.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Nudge"]


class Nudge:
    """A named signal with followers; calling it calls each follower in the order they
    followed."""

    __slots__ = ("_followers", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._followers: list[Callable[[], object]] = []

    def follow(self, follower: Callable[[], object]) -> None:
        """Call `follower` on every later nudge."""
        self._followers.append(follower)

    def __call__(self) -> None:
        for follower in self._followers:
            follower()

    def __repr__(self) -> str:
        return f"Nudge({self.name!r}, {len(self._followers)} following)"
