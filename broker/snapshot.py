"""Pages of the Jobs store's view for `workloads:snapshot`, bounded by bytes.

A page must fit in one frame the manager accepts (1 MiB, `workload_manager.framing`), so a
page is bounded by its encoded size, not only by its record count: 2,000 records of ~525 B
already pass 1 MiB (issue 11). A page holds at most `PAGE_BUDGET` bytes of records and
removals; the largest record Workload's bounds allow is ~32 KiB (a 4,096-character `error`
and five 256-character names, every character escaped as `\\uXXXX`), so the budget always
holds at least one and the frame stays well under the limit.

Removals come first, then records. The store gives every removal on its first page, so the
cursor the manager sees is ours, not the store's: `r:N` (N removals sent so far) or
`s:CURSOR` (the store's cursor for the next records).
"""

from __future__ import annotations

import logging
from typing import Final, Protocol

import msgspec

from broker.channel import BrokerChannel, SnapshotWanted
from broker.errors import BrokerError, InvalidCursor
from workload_manager.manager import View
from workload_manager.workload import Workload, WorkloadRemoval

__all__ = ["PAGE_BUDGET", "ViewSource", "answer_snapshot", "snapshot_page"]

log = logging.getLogger(__name__)

PAGE_BUDGET: Final = 512 * 1024  # bytes of records and removals in one page
_ENVELOPE: Final = 64  # `{"workloads":[],"removed":[]}` and the separators' slack

_encode: Final = msgspec.json.Encoder().encode


class ViewSource(Protocol):
    """What the pager reads: the Jobs store's `view()`."""

    async def view(self, *, cursor: str | None = None, limit: int = 2000) -> View:
        """A page of records, plus every removal when `cursor` is None."""
        ...


async def snapshot_page(
    store: ViewSource, cursor: str | None, limit: int, *, budget: int = PAGE_BUDGET
) -> View:
    """One page of the store's view whose encoding stays under `budget` bytes.

    `cursor` is None or a `next` this function gave out; anything else is `InvalidCursor`
    (the manager's fault).
    """
    room = budget - _ENVELOPE
    removed: list[WorkloadRemoval] = []
    store_cursor: str | None = None
    page: View | None = None
    if cursor is None or cursor.startswith("r:"):
        sent = _removals_sent(cursor)
        page = await store.view(cursor=None, limit=limit)
        # Sorted here, so `r:N` means the same N removals whatever order the store reads.
        pending = sorted(page.removed, key=_pair)[sent:]
        taken = _fitting(pending, room, at_least_one=True)
        removed = pending[:taken]
        if taken < len(pending):  # more removals than fit: records wait for a later page
            return View(removed=removed, next=f"r:{sent + taken}")
        room -= sum(len(_encode(item)) + 1 for item in removed)
    elif cursor.startswith("s:"):
        store_cursor = cursor[2:]
    else:
        raise InvalidCursor(cursor)
    if page is None:
        page = await store.view(cursor=store_cursor, limit=limit)
    fits = _fitting(page.workloads, room, at_least_one=not removed)
    if fits < len(page.workloads):
        if not fits:  # the removals filled this page; the records start on the next
            return View(removed=removed, next=f"s:{store_cursor or ''}")
        # Asked again for exactly what fits, so the store's own cursor follows the last one.
        page = await store.view(cursor=store_cursor, limit=fits)
    return View(workloads=page.workloads, removed=removed, next=_ours(page.next))


def _pair(removal: WorkloadRemoval) -> tuple[str, str]:
    return removal.pair


def _ours(store_cursor: str | None) -> str | None:
    return None if store_cursor is None else f"s:{store_cursor}"


def _removals_sent(cursor: str | None) -> int:
    if cursor is None:
        return 0
    try:
        sent = int(cursor[2:])
    except ValueError:
        raise InvalidCursor(cursor) from None
    if sent < 0:
        raise InvalidCursor(cursor)
    return sent


def _fitting(
    items: list[Workload] | list[WorkloadRemoval], room: int, *, at_least_one: bool = False
) -> int:
    # How many of `items`, from the front, encode within `room` bytes (commas included).
    used = 0
    for count, item in enumerate(items):
        used += len(_encode(item)) + 1
        if used > room:
            return 1 if at_least_one and count == 0 else count
    return len(items)


class _Flushable(Protocol):
    async def flush(self) -> None: ...


async def answer_snapshot(
    store: ViewSource, writer: _Flushable, wanted: SnapshotWanted, channel: BrokerChannel
) -> bytes:
    """The frame that answers a `SnapshotWanted`: a page written after everything the
    writer holds, or the error that says whose fault it is that there is none."""
    try:
        await writer.flush()  # the view includes everything written so far
        page = await snapshot_page(store, wanted.cursor, wanted.limit)
    except BrokerError as exc:
        log.warning("cannot answer workloads:snapshot: %s", exc)
        return channel.snapshot_failed(wanted.request_id, exc)
    except Exception as exc:
        log.exception("workloads:snapshot failed")
        return channel.snapshot_failed(wanted.request_id, exc)
    return channel.snapshot_reply(wanted.request_id, page)
