"""The artifact fetches this member runs (issue 28): one per digest at a time, at most a few
at once, each a task of the agent's; what each ended with is kept to be shown (`state`).
A fetch that fails says why and leaves its verified pieces for the next one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence, Set
from typing import Any, Final

from agent.artifacts.counters import ArtifactCounters
from agent.artifacts.fetcher import FetchFailed, FetchFigures, Sources, fetch
from agent.artifacts.pace import Pace
from agent.artifacts.store import ArtifactStore, StoreError
from agent.core.errors import AgentError
from netkit import tracing

__all__ = ["FETCHES_AT_ONCE", "FetchRefused", "Fetches"]

log = logging.getLogger(__name__)

FETCHES_AT_ONCE: Final = 4
RETRY_S: Final = 10.0  # a fetch that failed is tried again, for a replica, this much later
ENDED_KEPT: Final = 1024  # how many ended fetches' outcomes are remembered


class FetchRefused(AgentError):
    """A fetch that cannot start now (too many running)."""


class Fetches:
    """This member's fetches, by digest."""

    def __init__(
        self,
        store: ArtifactStore,
        members: Callable[[], Sequence[str]],
        sources: Sources,
        spawn: Callable[[str, Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        *,
        budget: int = 0,
        max_rate: int = 0,
    ) -> None:
        self.store = store
        self.budget = budget  # bytes the store may hold ([artifacts] max_bytes); 0: no bound
        self.pace = Pace(max_rate)  # bytes a second all fetches together ([artifacts] max_rate)
        self.serve_pace = Pace(max_rate)  # and all pieces served to members together
        self.counters = ArtifactCounters()
        self._members = members
        self._sources = sources
        self._spawn = spawn
        self._running: dict[str, FetchFigures] = {}
        # digest -> why its last fetch failed, and when (monotonic)
        self._ended: dict[str, tuple[str, float]] = {}
        # What eviction keeps besides the fetches: what replicas here use, the warm set.
        self.pinned: Callable[[], Set[str]] = frozenset

    def running(self) -> int:
        """Fetches running now."""
        return len(self._running)

    def progress(self, digest: str) -> tuple[int, str] | None:
        """(pieces verified, why the last try failed) of a fetch running or failed; None
        when there is none."""
        figures = self._running.get(digest)
        if figures is not None:
            return figures.pieces_held_before + figures.pieces_fetched, ""
        ended = self._ended.get(digest)
        return None if ended is None else (len(self.store.held(digest)), ended[0])

    def make_room(self, size: int) -> list[str]:
        """Room for `size` more bytes within the budget: least recently used artifacts
        dropped, never one being fetched; FetchRefused when there is none."""
        try:
            keep = set(self._running) | set(self.pinned())
            return self.store.make_room(size, budget=self.budget, keep=keep)
        except StoreError as exc:
            raise FetchRefused(str(exc)) from None

    async def start(self, digest: str, size: int, *, retry_s: float = 0.0) -> None:
        """Fetch `digest` (`size` bytes) in the background unless it is resident or being
        fetched, or its last fetch failed less than `retry_s` ago; FetchRefused when too
        many run or the disk budget has no room."""
        if digest in self._running:
            return
        ended = self._ended.get(digest)
        if ended is not None and time.monotonic() - ended[1] < retry_s:
            return
        if self.store.resident(digest) is not None:
            await asyncio.to_thread(self.store.touch, digest)  # asked for again: a use
            return
        if len(self._running) >= FETCHES_AT_ONCE:
            raise FetchRefused(f"{FETCHES_AT_ONCE} fetches are running here: try again later")
        for dropped in await asyncio.to_thread(self.make_room, size):
            log.info("dropped %s to make room for %s", dropped[:19], digest[:19])
        if digest in self._running:
            return  # another call started it meanwhile
        if len(self._running) >= FETCHES_AT_ONCE:  # others took the last places meanwhile
            raise FetchRefused(f"{FETCHES_AT_ONCE} fetches are running here: try again later")
        figures = self._running[digest] = FetchFigures()
        self._ended.pop(digest, None)
        self._spawn(f"fetch {digest[:19]}", self._run(digest, figures))

    async def _run(self, digest: str, figures: FetchFigures) -> None:
        with tracing.span("nvpair.artifact.fetch", attributes={"nvpair.artifact": digest}) as span:
            outcome = await self._fetch(digest, figures)
            if span is not None:
                span.set_attributes(
                    {
                        "nvpair.artifact.outcome": outcome,
                        "nvpair.artifact.pieces_fetched": figures.pieces_fetched,
                        "nvpair.artifact.pieces_held_before": figures.pieces_held_before,
                        "nvpair.artifact.pieces_refused": len(figures.pieces_refused),
                    }
                )

    async def _fetch(self, digest: str, figures: FetchFigures) -> str:
        began = time.monotonic()
        outcome = "stopped"  # the agent stopping cancels it
        try:
            ready = await fetch(
                self.store,
                digest,
                self._members,
                self._sources,
                figures=figures,
                pace=self.pace,
                counters=self.counters,
            )
            outcome = "resident"
            log.info(
                "%s resident at %s: %d pieces fetched, %d held before, bad pieces %s",
                digest[:19],
                ready,
                figures.pieces_fetched,
                figures.pieces_held_before,
                figures.pieces_refused or "none",
            )
        except (FetchFailed, StoreError) as exc:
            outcome = "failed"
            log.warning("fetching %s failed: %s", digest[:19], exc)
            if len(self._ended) >= ENDED_KEPT:
                self._ended.clear()
            self._ended[digest] = (str(exc)[:300], time.monotonic())
        finally:
            del self._running[digest]
            self.counters.ended(outcome, time.monotonic() - began)
        return outcome

    def drop(self, digest: str) -> None:
        """Drop what this member holds of `digest` (FetchRefused while it is being fetched)."""
        if digest in self._running:
            raise FetchRefused(f"{digest[:19]} is being fetched here: try again when it ends")
        self.store.remove(digest)
        self._ended.pop(digest, None)

    def state(self, digest: str) -> dict[str, Any]:
        """`{"here": resident | fetching | failed | absent, ...}` for `digest` on this member."""
        if self.store.resident(digest) is not None:
            return {"here": "resident"}
        figures = self._running.get(digest)
        held = len(self.store.held(digest))
        if figures is not None:
            return {"here": "fetching", "held": held, "refusedFrom": figures.pieces_refused}
        if digest in self._ended:
            return {"here": "failed", "held": held, "why": self._ended[digest][0]}
        return {"here": "absent", "held": held}
