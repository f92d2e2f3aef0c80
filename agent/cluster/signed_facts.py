"""This node's copy of one kind of signed cluster fact (deployments, API keys): the pure set
(`facts.signed_set`) loaded from and saved to one file, and edits made here as signed
versions. Each kind is a small subclass that declares its file, its set and its refusals.

The file (`$NVPAIR_HOME/<kind>.json`, 0600, written atomically) holds every version held,
tombstones included, as the bytes each was signed as (`facts.kept`: fields of a later
release are kept too), and is rewritten on every change. A file that cannot be read is set
aside as `<file>.corrupt` and the node starts with none of that kind (`lost` says so until
a member's push brings some): the members push theirs. An edit made here (`commit`) is the
next version of its key, signed with this node's key, taken into the set (bounded: refused
when the cluster holds all it may of the kind) and saved.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar, Final, Generic

import msgspec

from agent.core.errors import AgentError
from certs import write_atomic
from facts.kept import Kept, raws
from facts.signed_set import F, SignedSet

__all__ = ["FactRefused", "SignedFacts"]

log = logging.getLogger(__name__)

_encode: Final = msgspec.json.Encoder().encode
_pieces: Final = msgspec.json.Decoder(list[msgspec.Raw]).decode


class FactRefused(AgentError):
    """An edit of a cluster fact that cannot be made (the kinds refine it)."""


class SignedFacts(ABC, Generic[F]):
    """One kind of fact, persisted in `home`; `on_change` runs when the set changes (with
    `changes` counted, so readers can tell that an index of theirs is stale). A kind
    declares its file, its set, what `commit` raises and what a lost file means."""

    file: ClassVar[str]  # in NVPAIR_HOME
    refused: ClassVar[type[FactRefused]] = FactRefused
    lost_means: ClassVar[str] = "the members push theirs"  # logged when the file is set aside

    def __init__(
        self,
        home: Path,
        *,
        sign: Callable[[F], F],
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = home / self.file
        self.held = self.new_set()
        self.kind = self.held.kind
        self._sign = sign
        self._on_change = on_change
        self._clock = clock
        # A type built at run time from the kind's Struct, which mypy cannot read as one.
        self._decoder = msgspec.json.Decoder(self.kind.struct)
        self.lost = False  # the file could not be read and no member has pushed since
        self.changes = 0
        # Called with each version taken (merged or made here) and the one it replaced
        # (None: the first of its key here), before `on_change`.
        self.on_version: Callable[[F | None, F], None] = lambda _before, _taken: None
        self.held.merge(self._load(), self._now_ms())

    @abstractmethod
    def new_set(self) -> SignedSet[F]:
        """An empty set of this kind."""

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _load(self) -> list[Kept[F]]:
        try:
            pieces = _pieces(self.path.read_bytes())
            loaded = [Kept(self._decoder.decode(p), bytes(p)) for p in pieces]
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.warning(
                "setting %s aside as %s (%s): %s", self.path, aside.name, self.lost_means, exc
            )
            self.path.replace(aside)
            self.lost = True
            return []
        return loaded

    def _changed(self) -> None:
        write_atomic(self.path, _encode(raws(self.held.kept())))
        self.changes += 1
        self._on_change()

    # -- reads --------------------------------------------------------------------------------

    def all(self) -> list[F]:
        """Every version held, tombstones included (what a push carries)."""
        return self.held.all()

    def live(self) -> list[F]:
        """Every version held that is not a tombstone."""
        return self.held.live()

    # -- changes ------------------------------------------------------------------------------

    def merge(self, offered: Iterable[F | Kept[F]]) -> list[F]:
        """Take the newer versions a member pushed, as signed (signatures checked by the
        caller)."""
        taken = self.held.merge(offered, self._now_ms(), self.on_version)
        if taken:
            self.lost = False
            kind = self.kind
            for f in taken:
                log.info(
                    "%s %s %s (version %d, by %s)",
                    kind.what,
                    kind.key(f),
                    kind.says(f),
                    f.version,
                    f.by,
                )
            self._changed()
        return taken

    def commit(self, fact: F) -> F:
        """Say `fact` here: the next version of its key, signed, taken and saved; the
        version made."""
        now_ms = self._now_ms()
        key = self.kind.key(fact)
        held = self.held.get(key)
        unsigned: F = msgspec.structs.replace(  # type: ignore[type-var]  # every fact is a Struct
            fact,
            version=self.held.next_version(key),
            updatedAt=max(now_ms, held.updatedAt if held is not None else 0),
        )
        signed = self._sign(unsigned)
        if not self.held.offer(signed, now_ms):  # the next version: refused only when full
            raise self.refused(
                f"the cluster holds {self.held.capacity} {self.kind.what}s, none expired or "
                "removed: remove one first"
            )
        self.on_version(held, signed)
        self._changed()
        return signed
