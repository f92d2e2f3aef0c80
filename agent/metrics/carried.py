"""The workload manager's counts, carried across restarts of the child, for `/metrics`.

The relay and each peer's outbox count in the child (`workload_manager.relay`,
`workload_manager.outbox`), and `manager:status` reports them. A child that restarts starts
counting from zero again; a counter that falls while the agent lives would read, to
Prometheus, as a reset, and one that falls and climbs past its old value between two
scrapes would hide the reset altogether. So the agent adds what each child had counted
when it went to what the next one counts: the exported counters only fall when the agent
itself restarts. What a child counted after the last scrape before it died is lost.

A reading is tied to the child that answered it by the supervisor's restart count
(`generation`): read before and after the request, and a reading whose generation moved
meanwhile is not taken. A single series that falls within one generation (a peer that left
and came back starts its outbox again) is carried the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Final, Generic, TypeVar

__all__ = ["PEER_COUNTS", "CarriedCounts", "carried_status"]

K = TypeVar("K", bound=Hashable)

# The fields of a peer in `manager:status`'s `broadcast` list that count (the rest --
# `queued`, `failures`, `state` -- are gauges or words).
PEER_COUNTS: Final = ("sent", "batches", "retried", "coalesced", "dropped", "heard")


class CarriedCounts(Generic[K]):
    """Counts read from a source that restarts, made monotonic: each series is what earlier
    lives of the source had counted plus what the current one has."""

    def __init__(self) -> None:
        self._generation: int | None = None
        self._base: dict[K, int] = {}  # what earlier lives counted, per series
        self._last: dict[K, int] = {}  # the current life's last reading

    def read(self, generation: int, counts: Mapping[K, int]) -> dict[K, int]:
        """Take a reading of `generation` (the source's life); the carried value of each
        series in it."""
        if generation != self._generation:
            for key, last in self._last.items():
                self._base[key] = self._base.get(key, 0) + last
            self._last = {}
            self._generation = generation
        for key, value in counts.items():
            last = self._last.get(key, 0)
            if value < last:  # this series started again within the same life
                self._base[key] = self._base.get(key, 0) + last
            self._last[key] = value
        return {key: self.value(key) for key in counts}

    def value(self, key: K) -> int:
        """The carried value of one series (0 for one never read)."""
        return self._base.get(key, 0) + self._last.get(key, 0)

    def series(self) -> list[K]:
        """Every series ever read."""
        return list(self._base.keys() | self._last.keys())


def carried_status(
    counts: CarriedCounts[tuple[str, ...]], generation: int | None, status: Mapping[str, Any]
) -> dict[str, Any]:
    """`status` (the child's `manager:status`) with its counts carried. No generation: the
    status is not to be trusted (none came, or the child changed while it was asked); the
    relay's counts are then the ones last carried, and there are no peers."""
    if generation is None:
        held = {key[1]: counts.value(key) for key in counts.series() if key[0] == "relay"}
        return {"counters": held}
    relay = {n: v for n, v in status.get("counters", {}).items() if isinstance(v, int)}
    peers = status.get("broadcast", [])
    readings: dict[tuple[str, ...], int] = {("relay", name): v for name, v in relay.items()}
    for peer in peers:
        for field in PEER_COUNTS:
            readings["peer", peer["nodeId"], field] = peer.get(field, 0)
    carried = counts.read(generation, readings)
    return {
        **status,
        "counters": {**status.get("counters", {}), **{n: carried["relay", n] for n in relay}},
        "broadcast": [
            {**peer, **{f: carried["peer", peer["nodeId"], f] for f in PEER_COUNTS}}
            for peer in peers
        ],
    }
