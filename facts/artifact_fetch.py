"""Which piece of an artifact to ask of which member, next (issue 28). Sans-I/O.

A member that needs an artifact fetches its pieces from every member that holds some of them
at once. `Fetch` keeps what this member holds, what each source says it holds, and what is
in flight from whom, and decides:

- **Rarest first.** Among the pieces nobody is fetching yet, the ones the fewest sources hold
  go first (ties in a seeded random order, so fetchers spread over the sources instead of
  all asking for piece 0): a piece only one member holds is the one at risk if it leaves.
- **Bounded.** At most `per_source` pieces in flight from one source and `in_flight` in all.
- **Every source replaceable.** A source that goes (`source_gone`) gives back what it had in
  flight, and those pieces are asked of others; a piece that fails its hash (`refused`) is
  asked again of another source, and a source that sends `strikes` bad pieces is never
  asked again (`avoided`). A source whose link is booked says so (`busy`): it rests a moment
  while the others are asked.
- **Resumable.** A fetcher that starts again begins with the pieces it already holds.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["STRIKES", "Fetch", "from_bitmap", "to_bitmap"]

STRIKES: Final = 3  # bad pieces after which a source is never asked again


def to_bitmap(held: Iterable[int], count: int) -> str:
    """The pieces held, as a member says it: a bit per piece, base64 (1,000,000 pieces in
    167 KB)."""
    bits = bytearray((count + 7) // 8)
    for piece in held:
        if 0 <= piece < count:
            bits[piece // 8] |= 0x80 >> (piece % 8)
    return base64.b64encode(bytes(bits)).decode("ascii")


def from_bitmap(text: str, count: int) -> set[int]:
    """The pieces a bitmap says are held (ValueError when it is not one of `count` pieces)."""
    try:
        bits = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError("not a base64 bitmap") from None
    if len(bits) != (count + 7) // 8:
        raise ValueError(f"a bitmap of {len(bits)} bytes for {count} pieces")
    return {i for i in range(count) if bits[i // 8] & (0x80 >> (i % 8))}


@dataclass
class Fetch:
    """One artifact's fetch on this member."""

    count: int  # pieces in the artifact
    have: set[int] = field(default_factory=set)  # verified here
    per_source: int = 4
    in_flight: int = 16
    strikes: int = STRIKES
    seed: int = 0
    _sources: dict[str, set[int]] = field(default_factory=dict)  # source -> pieces it holds
    _asked: dict[int, str] = field(default_factory=dict)  # piece -> the source asked for it
    _bad: dict[str, int] = field(default_factory=dict)  # source -> bad pieces it sent
    _order: list[int] = field(default_factory=list)  # the tie-break order of pieces
    _resting: set[str] = field(default_factory=set)  # busy sources, asked nothing for now

    def __post_init__(self) -> None:
        self._order = list(range(self.count))
        random.Random(self.seed).shuffle(self._order)

    # -- what the sources say ------------------------------------------------------------------

    def source_holds(self, source: str, held: Iterable[int]) -> None:
        """`source` says it holds these pieces (its whole answer: it replaces the last)."""
        self._sources[source] = {p for p in held if 0 <= p < self.count}

    def source_gone(self, source: str) -> list[int]:
        """`source` left or stopped answering: what it had in flight is asked of others;
        the pieces given back."""
        self._sources.pop(source, None)
        back = [p for p, s in self._asked.items() if s == source]
        for piece in back:
            del self._asked[piece]
        return back

    def busy(self, piece: int, source: str) -> None:
        """`source` said it is busy (its link booked): `piece` is asked of another, and the
        source rests -- asked nothing -- until `wake(source)`, when the caller's pause ends."""
        if self._asked.get(piece) == source:
            del self._asked[piece]
        self._resting.add(source)

    def wake(self, source: str) -> None:
        """`source` may be asked again."""
        self._resting.discard(source)

    @property
    def resting(self) -> bool:
        """Whether some source rests (said it was busy)."""
        return bool(self._resting)

    def avoided(self, source: str) -> bool:
        """Whether `source` sent `strikes` bad pieces and is asked for nothing more."""
        return self._bad.get(source, 0) >= self.strikes

    # -- the decisions ---------------------------------------------------------------------

    def next(self) -> list[tuple[int, str]]:
        """(piece, source) pairs to ask for now, rarest first, within the bounds."""
        busy: dict[str, int] = {}
        for source in self._asked.values():
            busy[source] = busy.get(source, 0) + 1
        room = self.in_flight - len(self._asked)
        if room <= 0:
            return []
        usable = {
            s: held
            for s, held in self._sources.items()
            if not self.avoided(s) and s not in self._resting
        }
        holders: dict[int, list[str]] = {}
        for source, held in sorted(usable.items()):
            for piece in held:
                if piece not in self.have and piece not in self._asked:
                    holders.setdefault(piece, []).append(source)
        rank = {piece: n for n, piece in enumerate(self._order)}
        chosen: list[tuple[int, str]] = []
        for piece in sorted(holders, key=lambda p: (len(holders[p]), rank[p])):
            free = [s for s in holders[piece] if busy.get(s, 0) < self.per_source]
            if not free:
                continue
            source = min(free, key=lambda s: (busy.get(s, 0), s))  # the least busy
            chosen.append((piece, source))
            busy[source] = busy.get(source, 0) + 1
            self._asked[piece] = source
            if len(chosen) >= room:
                break
        return chosen

    def verified(self, piece: int) -> None:
        """`piece` arrived and matched the manifest: held here now."""
        self._asked.pop(piece, None)
        self.have.add(piece)

    def refused(self, piece: int, source: str) -> None:
        """`piece` from `source` failed its hash (or did not come): asked again, of another
        source if there is one; the source earns a strike."""
        if self._asked.get(piece) == source:
            del self._asked[piece]
        self._bad[source] = self._bad.get(source, 0) + 1
        held = self._sources.get(source)
        if held is not None and any(s != source for s, h in self._sources.items() if piece in h):
            held.discard(piece)  # another source holds it: ask that one next time

    def failed(self, piece: int, source: str) -> None:
        """The ask for `piece` failed without an answer (a timeout, a refused call): asked
        again, with no strike -- a network's fault is not a lie."""
        if self._asked.get(piece) == source:
            del self._asked[piece]

    @property
    def done(self) -> bool:
        """Whether every piece is held here."""
        return len(self.have) >= self.count

    def stuck(self) -> bool:
        """Whether some missing piece is held by no usable source and nothing is in flight:
        the fetch cannot go on until a source appears."""
        if self.done or self._asked:
            return False
        usable = [h for s, h in self._sources.items() if not self.avoided(s)]
        reachable = set().union(*usable) if usable else set()
        return bool(set(range(self.count)) - self.have - reachable)
