"""Signed cluster facts held as one set: one version per key, converging by a total order,
with tombstones, bounded. Sans-I/O; the one mechanism every kind of fact uses.

A cluster fact (a deployment, an API key; next, artifacts) is a statement signed by the
member that made the version (`facts.record_signing.sign_statement`): members check it
against the cluster CA before they offer it here. A kind of fact declares only what differs
(`FactKind`): its type, its key, what a tombstone is, when a version expires, how many the
cluster holds and how long its tombstones are kept. The rule is the same for every kind:

- **Convergence.** A member takes a version when it is higher in `(version, updatedAt, by)`
  order than the one it holds for that key, so every member ends with the same version
  whichever order the versions arrive in. An edit made here is one version more than the
  highest held (`next_version`).
- **Tombstones.** A removal is a version like any other, marked as a tombstone, so a late
  copy of an older version never brings the fact back while the tombstone is held.
- **Bounded.** At most `capacity` keys, tombstones included. A new key that finds the set full
  makes room: first the version whose expiry passed earliest, then the oldest tombstone (ties
  by key, so members holding the same make the same choice); when neither exists, the new
  key is refused and what is held stays.
- **Forgetting.** Tombstones older than the kind's `tombstone_ms` may be forgotten
  (`forget_old_tombstones`); a kind without one keeps its tombstones until room is needed.
  No member forgets by age yet (docs/protocol.md, "Signed cluster facts", says why).

- **Kept as signed.** Each version is held with the bytes it was signed as (`facts.kept`):
  one from a later release, with fields this one does not know, is passed on unchanged.

A member never signs two versions of one key equal in the order (each edit is the next
version, at its own millisecond), so versions equal in the order are the same version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from facts.kept import Kept

__all__ = ["Fact", "FactKind", "SignedSet", "newer", "order"]


class Fact(Protocol):
    """What every signed cluster fact carries for convergence."""

    @property
    def version(self) -> int: ...
    @property
    def updatedAt(self) -> int: ...  # epoch ms
    @property
    def by(self) -> str: ...  # the member that made this version


F = TypeVar("F", bound=Fact)


def order(fact: Fact) -> tuple[int, int, str]:
    """The total order versions converge by."""
    return (fact.version, fact.updatedAt, fact.by)


def newer(candidate: F, held: F | None) -> bool:
    """Whether `candidate` wins over `held` (the convergence order)."""
    return held is None or order(candidate) > order(held)


def _never(_: object) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class FactKind(Generic[F]):
    """What one kind of signed cluster fact declares; the rest is `SignedSet`'s."""

    what: str  # its name in words ("deployment", "API key")
    struct: type[F]  # the msgspec Struct that carries it
    key: Callable[[F], str]  # one version per key is held
    is_tombstone: Callable[[F], bool]
    says: Callable[[F], str]  # what a version says, for the log ("revoked", "undeployed")
    capacity: int  # keys held at once in one cluster, tombstones included
    expires_at: Callable[[F], int] = _never  # epoch ms; 0 never
    tombstone_ms: int | None = None  # tombstones older than this may be forgotten; None: kept

    def expired(self, fact: F, now_ms: int) -> bool:
        """Whether `fact`'s expiry has passed."""
        return 0 < self.expires_at(fact) <= now_ms


class SignedSet(Generic[F]):
    """The versions of one kind of fact this member holds, one per key, at most `capacity`."""

    def __init__(self, kind: FactKind[F], *, capacity: int | None = None) -> None:
        self.kind = kind
        self.capacity = kind.capacity if capacity is None else capacity
        self._by_key: dict[str, F] = {}
        self._raw: dict[str, bytes] = {}  # key -> the held version's bytes as signed

    def offer(self, fact: F, now_ms: int, raw: bytes | None = None) -> bool:
        """Take `fact` when it is newer than the version held; returns if taken. `now_ms`
        says which held versions have expired, should room be needed; `raw` is the bytes
        it was signed as (None: made here, encoded here)."""
        key = self.kind.key(fact)
        held = self._by_key.get(key)
        if not newer(fact, held):
            return False
        if held is None and len(self._by_key) >= self.capacity and not self._make_room(now_ms):
            return False
        self._by_key[key] = fact
        self._raw[key] = Kept.made(fact).raw if raw is None else raw
        return True

    def merge(
        self,
        offered: Iterable[F | Kept[F]],
        now_ms: int,
        replaced: Callable[[F | None, F], object] = lambda _before, _taken: None,
    ) -> list[F]:
        """Offer every fact (made here, or kept as received); the ones taken, each handed to
        `replaced` with the version it replaced (None: the first of its key here)."""
        taken = []
        for item in offered:
            kept = item if isinstance(item, Kept) else Kept.made(item)
            before = self._by_key.get(self.kind.key(kept.fact))
            if self.offer(kept.fact, now_ms, kept.raw):
                taken.append(kept.fact)
                replaced(before, kept.fact)
        return taken

    def _make_room(self, now_ms: int) -> bool:
        kind = self.kind
        expired = [
            (kind.expires_at(f), k) for k, f in self._by_key.items() if kind.expired(f, now_ms)
        ]
        tombstones = [(f.updatedAt, k) for k, f in self._by_key.items() if kind.is_tombstone(f)]
        for candidates in (expired, tombstones):
            if candidates:
                self._drop(min(candidates)[1])
                return True
        return False

    def _drop(self, key: str) -> None:
        del self._by_key[key]
        del self._raw[key]

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> F | None:
        """The version held for `key`, tombstones included."""
        return self._by_key.get(key)

    def all(self) -> list[F]:
        """Every version held, tombstones included, by key (what a push carries)."""
        return [f for _, f in sorted(self._by_key.items())]

    def kept(self) -> list[Kept[F]]:
        """Every version held as signed, tombstones included, by key (what a push carries,
        what is saved)."""
        return [Kept(f, self._raw[k]) for k, f in sorted(self._by_key.items())]

    def live(self) -> list[F]:
        """Every version held that is not a tombstone, by key."""
        return [f for f in self.all() if not self.kind.is_tombstone(f)]

    def full(self, now_ms: int) -> bool:
        """Whether a new key finds no room (nothing expired or tombstoned to drop)."""
        kind = self.kind
        return len(self._by_key) >= self.capacity and not any(
            kind.is_tombstone(f) or kind.expired(f, now_ms) for f in self._by_key.values()
        )

    def next_version(self, key: str) -> int:
        """The version an edit of `key` made here gets."""
        held = self._by_key.get(key)
        return 1 if held is None else held.version + 1

    def forget_old_tombstones(self, now_ms: int) -> list[str]:
        """Drop tombstones older than the kind's `tombstone_ms` (none where it has none); the
        keys dropped."""
        keep_ms = self.kind.tombstone_ms
        if keep_ms is None:
            return []
        old = [
            k
            for k, f in self._by_key.items()
            if self.kind.is_tombstone(f) and now_ms - f.updatedAt > keep_ms
        ]
        for key in old:
            self._drop(key)
        return old
