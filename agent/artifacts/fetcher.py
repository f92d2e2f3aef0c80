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
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, cast

from agent.artifacts.counters import ArtifactCounters
from agent.artifacts.pace import Pace
from agent.artifacts.store import ArtifactStore, BadManifest, StoreError
from agent.core.errors import MemberRefused, MemberUnreachable
from facts.artifact_fetch import Fetch
from facts.artifacts import Layout

__all__ = ["FetchFailed", "FetchFigures", "Sources", "fetch"]

log = logging.getLogger(__name__)

RESCAN_S: Final = 1.0  # how long to wait before asking the sources again when stuck
BUSY_REST_S: Final = 0.25  # a source that said it is busy is asked nothing this long
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
    held = await asyncio.to_thread(store.held_checked, digest)
    figures.pieces_held_before = len(held)
    # Each fetcher its own order among equally rare pieces: members fetching at once ask
    # for different pieces, and soon hold pieces to give each other.
    plan = Fetch(
        count=manifest.piece_count,
        have=held,
        per_source=per_source,
        in_flight=in_flight,
        seed=random.randrange(2**32),
    )
    layout = Layout(manifest)
    loop = asyncio.get_running_loop()

    async def paced(piece: int, source: str) -> bytes:
        size = layout.piece(piece).length
        await pace.take(size)
        try:
            return await sources.artifact_piece(source, digest, piece)
        except MemberRefused as exc:
            if exc.status == 503:
                pace.refund(size)  # nothing came: this member's link was not used
            raise

    def rest(source: str) -> None:
        # A busy source rests `BUSY_REST_S`, then may be asked again.
        loop.call_later(BUSY_REST_S, plan.wake, source)

    stuck_since: float | None = None
    await _ask_who_holds(plan, digest, members(), sources)
    next_scan = loop.time() + rescan_s
    scan: asyncio.Task[None] | None = None
    running: dict[asyncio.Task[bytes], tuple[int, str]] = {}
    try:
        while not plan.done:
            for piece, source in plan.next():
                task = asyncio.create_task(paced(piece, source))
                running[task] = (piece, source)
            if not running and scan is None:
                if plan.stuck():
                    stuck_since = stuck_since if stuck_since is not None else loop.time()
                    if loop.time() - stuck_since > give_up_s:
                        raise FetchFailed(
                            f"{digest[:19]}: {plan.count - len(plan.have)} pieces held by no "
                            "member that answers"
                        )
                if plan.resting:  # the sources it needs are busy: a short pause, then again
                    await asyncio.sleep(BUSY_REST_S)  # a pause, not a sync
                    continue
                await asyncio.sleep(rescan_s)  # a pause before asking again, not a sync
                await _ask_who_holds(plan, digest, members(), sources)
                next_scan = loop.time() + rescan_s
                continue
            stuck_since = None
            # Who holds what is asked again every `rescan_s` while pieces come: the other
            # members fetching the same artifact hold more each time (a swarm).
            if scan is None and loop.time() >= next_scan:
                scan = asyncio.create_task(_ask_who_holds(plan, digest, members(), sources))
            waiting: set[asyncio.Future[Any]] = {*running, *([scan] if scan else [])}
            timeout = None if scan is not None else max(0.0, next_scan - loop.time())
            finished, _ = await asyncio.wait(
                waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for ended in finished:
                if ended is scan:
                    scan.result()
                    scan, next_scan = None, loop.time() + rescan_s
                    continue
                got = cast(asyncio.Task[bytes], ended)  # not the scan: a piece's
                piece, source = running.pop(got)
                await _take(store, plan, digest, piece, source, got, figures, counters, rest)
    finally:
        pending: list[asyncio.Future[Any]] = [*running, *([scan] if scan else [])]
        for left in pending:
            left.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
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
    rest: Callable[[str], None],
) -> None:
    try:
        data = task.result()
    except MemberRefused as exc:
        if exc.status == 503:  # its link is booked: another holder is asked meanwhile
            plan.busy(piece, source)
            rest(source)
            return
        log.info("piece %d of %s from %s: %s", piece, digest[:19], source, exc)
        plan.failed(piece, source)
        plan.source_gone(source)  # asked again what it holds at the next scan
        return
    except MemberUnreachable as exc:
        log.info("piece %d of %s from %s: %s", piece, digest[:19], source, exc)
        plan.failed(piece, source)
        plan.source_gone(source)
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
