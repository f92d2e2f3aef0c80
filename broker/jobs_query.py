"""The Jobs list's filters (state, node, model, requester) and its counts per state.

`requester` is the record's `requesterId` in a column of its own (written by the upsert: a
column computed from the record's JSON cost a JSON parse per write; `open_filters` adds it,
filled from the records, to an older store). Neither it nor `model` is indexed: an index
each cost the store a quarter of its write rate (bench/jobs_store.py: 0.60 against 0.80),
on the path every relayed record takes, while a filtered first page is as fast without
them (the newest-first index finds 50 matches in a ms) and a filtered count over 100,000
jobs scans in about 0.1 s -- once a second at most, while a page with a filter is open.
"""

from __future__ import annotations

from typing import Any, Final

import aiosqlite

__all__ = ["Filters", "count_by_state", "open_filters", "where"]

# A store that had the filters' indexes (an earlier build of this change) loses them.
_INDEXES: Final = """
DROP INDEX IF EXISTS jobs_model;
DROP INDEX IF EXISTS jobs_requester;
"""


class Filters:
    """Which jobs a page or a count is of (None: any)."""

    __slots__ = ("model", "node", "requester", "state")

    def __init__(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        model: str | None = None,
        requester: str | None = None,
    ) -> None:
        self.state, self.node, self.model, self.requester = state, node, model, requester


async def open_filters(db: aiosqlite.Connection) -> None:
    """Add the `requester` column (filled from the stored records) to an older store."""
    async with db.execute("PRAGMA table_info(jobs)") as cursor:
        columns = {row[1] for row in await cursor.fetchall()}
    if "requester" not in columns:
        await db.execute("ALTER TABLE jobs ADD COLUMN requester TEXT")
        await db.execute(
            "UPDATE jobs SET requester = json_extract(CAST(record AS TEXT), '$.requesterId')"
        )
    await db.executescript(_INDEXES)


def where(filters: Filters) -> tuple[list[str], list[Any]]:
    """The SQL conditions and their arguments for `filters`."""
    clauses: list[str] = []
    args: list[Any] = []
    if filters.state is not None:
        clauses.append("state = ?")
        args.append(filters.state)
    if filters.node is not None:
        clauses.append("(scheduled_on = ? OR (scheduled_on IS NULL AND origin = ?))")
        args += [filters.node, filters.node]
    if filters.model is not None:
        clauses.append("model = ?")
        args.append(filters.model)
    if filters.requester is not None:
        clauses.append("requester = ?")
        args.append(filters.requester)
    return clauses, args


async def count_by_state(db: aiosqlite.Connection, filters: Filters) -> dict[str, int]:
    """How many of the jobs `filters` select are in each state."""
    clauses, args = where(filters)
    sql = "SELECT state, count(*) FROM jobs"
    if clauses:
        sql += f" WHERE {' AND '.join(clauses)}"
    async with db.execute(sql + " GROUP BY state", args) as cursor:
        return {str(state): int(count) for state, count in await cursor.fetchall()}
