"""Fetching an artifact from the members that hold it, many at once (issue 28).

`fetch()` makes an artifact resident in this member's store: it takes the manifest from the
first member that has one matching the digest (checked here: any member may answer), asks
every source which pieces it holds, then keeps pieces in flight from all of them as
`facts.artifact_fetch.Fetch` decides -- rarest first, a few per source, a bounded number in
all -- checks each piece against the manifest before it counts, and assembles the files
when every piece is held. A piece that fails its hash is asked of another source and counts
against the one that sent it; a source that stops answering is dropped and its pieces asked
of others; the sources are asked again what they hold when nothing is left to ask (a member
still fetching holds more each time). A fetch that starts again begins with the pieces the
store holds: verified pieces are never fetched twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from agent.artifacts.counters import ArtifactCounters
from agent.artifacts.pace import Pace
from agent.artifacts.store import ArtifactStore, BadManifest, StoreError
from agent.core.errors import MemberRefused, MemberUnreachable
from facts.artifact_fetch import Fetch
from facts.artifacts import Layout

__all__ = ["FetchFailed", "FetchFigures", "Sources", "fetch"]

log = logging.getLogger(__name__)

RESCAN_S: Final = 1.0  # how long to wait before asking the sources again when stuck
GIVE_UP_S: Final = 60.0  # stuck this long (no source holds a missing piece): the fetch fails


class Sources(Protocol):
    """What the fetch asks of members (`agent.cluster.node_client.NodeClient`)."""

    async def artifact_manifest(self, node_id: str, digest: str) -> bytes: ...
    async def artifact_held(self, node_id: str, digest: str, count: int) -> set[int]: ...
    async def artifact_piece(self, node_id: str, digest: str, index: int) -> bytes: ...


class FetchFailed(Exception):
    """The artifact cannot be fetched now: no member has its manifest, or a missing piece
    is held by no member that answers."""


@dataclass
class FetchFigures:
    """What one fetch did, for its log line, metrics and tests."""

    pieces_fetched: int = 0  # verified and kept
    pieces_held_before: int = 0  # held when the fetch (re)started: not fetched again
    pieces_refused: dict[str, int] = field(default_factory=dict)  # source -> bad pieces
    bytes_from: dict[str, int] = field(default_factory=dict)  # source -> bytes kept


async def fetch(
    store: ArtifactStore,
    digest: str,
    members: Callable[[], Sequence[str]],
    sources: Sources,
    *,
    per_source: int = 4,
    in_flight: int = 16,
    figures: FetchFigures | None = None,
    rescan_s: float = RESCAN_S,
    give_up_s: float = GIVE_UP_S,
    pace: Pace | None = None,
    counters: ArtifactCounters | None = None,
) -> Path:
    """Make `digest` resident here from the `members()` that hold it; its folder.
    FetchFailed when it cannot be had. `pace` bounds the rate pieces are asked at;
    `counters` count what came from whom."""
    figures = figures if figures is not None else FetchFigures()
    counters = counters if counters is not None else ArtifactCounters()
    pace = pace if pace is not None else Pace(0)
    done = await asyncio.to_thread(store.resident, digest)
    if done is not None:
        return done
    manifest = await asyncio.to_thread(store.manifest, digest)
    if manifest is None:
        await _manifest(store, digest, members(), sources)
        manifest = await asyncio.to_thread(store.manifest, digest)
        assert manifest is not None  # put_manifest kept it
    held = await asyncio.to_thread(store.held, digest)
    figures.pieces_held_before = len(held)
    plan = Fetch(count=manifest.piece_count, have=held, per_source=per_source, in_flight=in_flight)
    layout = Layout(manifest)

    async def paced(piece: int, source: str) -> bytes:
        await pace.take(layout.piece(piece).length)
        return await sources.artifact_piece(source, digest, piece)

    stuck_since: float | None = None
    loop = asyncio.get_running_loop()
    await _ask_who_holds(plan, digest, members(), sources)
    running: dict[asyncio.Task[bytes], tuple[int, str]] = {}
    try:
        while not plan.done:
            for piece, source in plan.next():
                task = asyncio.create_task(paced(piece, source))
                running[task] = (piece, source)
            if not running:
                if plan.stuck():
                    stuck_since = stuck_since if stuck_since is not None else loop.time()
                    if loop.time() - stuck_since > give_up_s:
                        raise FetchFailed(
                            f"{digest[:19]}: {plan.count - len(plan.have)} pieces held by no "
                            "member that answers"
                        )
                await asyncio.sleep(rescan_s)  # a pause before asking again, not a sync
                await _ask_who_holds(plan, digest, members(), sources)
                continue
            stuck_since = None
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                piece, source = running.pop(task)
                await _take(store, plan, digest, piece, source, task, figures, counters)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return await asyncio.to_thread(store.assemble, digest)


async def _manifest(
    store: ArtifactStore, digest: str, members: Sequence[str], sources: Sources
) -> None:
    for member in members:
        try:
            raw = await sources.artifact_manifest(member, digest)
            await asyncio.to_thread(store.put_manifest, digest, raw)
            return
        except (MemberUnreachable, MemberRefused):
            continue
        except BadManifest as exc:
            log.warning("%s sent a manifest that is not %s: %s", member, digest[:19], exc)
    raise FetchFailed(f"no member has the manifest of {digest[:19]}")


async def _ask_who_holds(
    plan: Fetch, digest: str, members: Sequence[str], sources: Sources
) -> None:
    async def ask(member: str) -> None:
        try:
            plan.source_holds(member, await sources.artifact_held(member, digest, plan.count))
        except (MemberUnreachable, MemberRefused):
            plan.source_gone(member)

    await asyncio.gather(*(ask(m) for m in members))


async def _take(
    store: ArtifactStore,
    plan: Fetch,
    digest: str,
    piece: int,
    source: str,
    task: asyncio.Task[bytes],
    figures: FetchFigures,
    counters: ArtifactCounters,
) -> None:
    try:
        data = task.result()
    except (MemberUnreachable, MemberRefused) as exc:
        log.info("piece %d of %s from %s: %s", piece, digest[:19], source, exc)
        plan.failed(piece, source)
        plan.source_gone(source)  # asked again what it holds at the next scan
        return
    try:
        kept = await asyncio.to_thread(store.put_piece, digest, piece, data)
    except StoreError as exc:
        raise FetchFailed(str(exc)) from exc
    if kept:
        plan.verified(piece)
        figures.pieces_fetched += 1
        figures.bytes_from[source] = figures.bytes_from.get(source, 0) + len(data)
        counters.fetched(source, len(data))
        return
    figures.pieces_refused[source] = figures.pieces_refused.get(source, 0) + 1
    counters.refused(source)
    log.warning(
        "piece %d of %s from %s failed its hash; asked of another", piece, digest[:19], source
    )
    plan.refused(piece, source)
