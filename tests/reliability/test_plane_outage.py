"""A plane outage loses nothing: two clusters of real agents syncing into one real plane
(`nvpair plane serve` on a throw-away PostgreSQL), the plane stopped while jobs keep
flowing and finishing, then started again: every job is in Postgres once, in its final
state, as the members hold it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest

from tests.agent.harness import eventually
from tests.plane.fleet.test_fleet import members_jobs, plane_jobs, two_clusters
from tests.plane.plane_process import PlaneProcess

from .plane import fresh_database, postgres

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    with postgres() as dsn:
        yield dsn


@pytest.fixture
async def plane(pg_server: str) -> AsyncIterator[PlaneProcess]:
    with fresh_database(pg_server) as dsn:
        process = PlaneProcess(dsn)
        await process.start()
        yield process
        await process.stop()


SYNC_FAILED = "plane sync failed"  # agent/plane_link/sync.py logs it on every failed attempt
OUTAGE_ROUNDS = 2  # the attempt-by-attempt retries are tests/plane/http/test_plane_sync.py's


async def test_a_plane_outage_loses_nothing(tmp_path: Path, plane: PlaneProcess) -> None:
    async with AsyncExitStack() as stack:
        clusters = await two_clusters(tmp_path, plane, stack)
        east = clusters[0]
        origin = await east[0].node_id()
        await east[0].enter("0", 1, origin)
        await eventually(lambda: _has(plane, "0"), "the first job reaches the plane")
        await plane.stop()
        # Jobs keep flowing while the plane is down: the outage lasts until the agent has
        # failed to sync them OUTAGE_ROUNDS times, with new jobs entered and others
        # finished before each failure, not for a fixed time.
        failed = east[0].log_count(SYNC_FAILED)
        entered = 0
        for round_ in range(OUTAGE_ROUNDS):
            for _ in range(30 // OUTAGE_ROUNDS):
                entered += 1
                await east[0].enter(str(entered), 1, origin)
                if entered % 3 == 1:
                    await east[0].enter(str(entered // 3), 3, origin)
            await eventually(
                lambda failed=failed: east[0].log_count(SYNC_FAILED) > failed,
                f"sync attempt {round_ + 1} fails while the plane is down",
            )
            failed = east[0].log_count(SYNC_FAILED)
        await plane.start()

        async def caught_up() -> bool:
            theirs = {k: j["state"] for k, j in (await plane_jobs(plane)).items()}
            return theirs == await members_jobs(clusters)

        await eventually(caught_up, "every job in Postgres once, final state")
        assert len(await plane_jobs(plane)) == 31


async def _has(plane: PlaneProcess, wid: str) -> bool:
    try:
        return any(j["id"] == wid for j in (await plane_jobs(plane)).values())
    except aiohttp.ClientError:
        return False
