"""The plane under faults: three members enrolled with a real `nvpair plane serve` on a
throw-away PostgreSQL, the plane killed with -9 every few seconds during the load and
started again on its port; in the end the members and the plane both hold exactly what the
client was told."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fixtures.waiting import eventually

from .cluster import Member, fault_cluster, fault_rng
from .ledger import Divergence, RememberingClient
from .plane import PlaneProcess, fresh_database, plane_divergence, postgres, sync_open
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """One throw-away PostgreSQL for the module; each scenario takes a fresh database."""
    with postgres() as dsn:
        yield dsn


class Aim:
    """Waits for a moment a sync's transaction is open in the plane's database."""

    def __init__(self, watch: psycopg.AsyncConnection[Any], dsn: str) -> None:
        self.watch = watch
        self.dsn = dsn
        self.tries = 0
        self.caught = 0

    async def sync_open(self, *, within_s: float) -> None:
        """Until a sync is open, or `within_s` went by without one (counted)."""
        self.tries += 1
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if await sync_open(self.watch, self.dsn):
                self.caught += 1
                return
            await asyncio.sleep(0.002)  # polling: a sync's transaction lasts milliseconds


async def sync_failures(members: list[Member]) -> list[int]:
    """Each member's plane sync attempts failed in a row, from its /metrics."""
    got = await asyncio.gather(*(m.node.metric("nvpair_plane_sync_failures") for m in members))
    return [int(v) for v in got]


async def test_the_plane_killed_under_load_loses_and_duplicates_nothing(
    tmp_path: Path, tier: Tier, pg_server: str
) -> None:
    rng = fault_rng(1105)
    with fresh_database(pg_server) as dsn:
        plane = PlaneProcess(dsn, tmp_path / "plane.log")
        await plane.start()
        try:
            cluster, token = await plane.enrol("fault-lab")
            async with (
                fault_cluster(tmp_path, 3, rng, toml=plane.toml(token)) as members,
                RememberingClient(random.Random(rng.random())) as client,
                await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as watch,
            ):
                aim = Aim(watch, dsn)
                await scenario(plane, cluster, members, client, aim, rng, tier)
        finally:
            await plane.stop()


async def scenario(
    plane: PlaneProcess,
    cluster: str,
    members: list[Member],
    client: RememberingClient,
    aim: Aim,
    rng: random.Random,
    tier: Tier,
) -> None:
    async def all_synced_once() -> bool:
        _, body = await plane.call("GET", f"/v1/clusters/{cluster}")
        return int(body["nodes"]["reachable"]) == len(members)

    # The enrolment works before any fault: every member's node row reached the plane.
    await eventually(all_synced_once, "every member has synced into the plane")
    outages: list[float] = []
    failing_seen: list[int] = []  # members whose sync had failed when the plane came back
    last_restart = time.monotonic()

    async def kill_plane(load: asyncio.Task[None]) -> None:
        nonlocal last_restart
        while not load.done():
            # The plane's uptime before the next kill (the faults' own pace), or, for about
            # half the kills, until a sync's transaction is open in PostgreSQL: a kill at a
            # moment drawn at random almost always falls between two syncs.
            uptime, aimed = rng.uniform(0.5, 2.0), rng.random() < 0.5
            if aimed:
                await aim.sync_open(within_s=uptime + 5.0)  # the sync's backoff cap is 5 s
            else:
                await asyncio.sleep(uptime)
            if load.done():
                return
            before = plane.pid
            down = time.monotonic()
            await plane.kill()
            # The controls: nothing answers where it was, and the members' syncs fail.
            assert not await plane.healthy()

            async def a_sync_failed() -> bool:
                return any(await sync_failures(members))

            await eventually(a_sync_failed, "a member's plane sync fails while it is down")
            await asyncio.sleep(rng.uniform(0.2, 1.0))  # the rest of the outage
            failing_seen.append(sum(1 for n in await sync_failures(members) if n))
            await plane.restart()
            last_restart = time.monotonic()
            outages.append(last_restart - down)
            assert plane.pid != before

    async with asyncio.TaskGroup() as faults:
        load = faults.create_task(
            client.load(
                members,
                jobs=tier.pick(120, 900),
                rate_per_s=tier.pick(25, 40),
                prefix="plane",
            )
        )
        faults.create_task(kill_plane(load))
    assert len(outages) >= 2, outages
    # The aim worked: some kill fell while a sync's transaction was open.
    assert aim.tries == 0 or aim.caught > 0, (aim.tries, aim.caught)
    await client.wait_converged(members, since=last_restart)

    diff = Divergence("the plane")
    listed: dict[tuple[str, str, str], tuple[int, str]] = {}

    async def plane_agrees() -> bool:
        nonlocal diff, listed
        listed = await plane.jobs(cluster)
        diff = plane_divergence(client, listed)
        return not diff

    try:
        # Within the sync's backoff cap (5 s) and its interval (2 s), on a busy machine.
        await eventually(plane_agrees, "the plane holds what the client was told", within_s=30)
    finally:
        plane_s = time.monotonic() - last_restart
        print(client.figures.line(f"kill -9 of the plane {len(outages)} times, members"))
        refused = sum(m.node.log_count("plane sync failed (ClientConnectorError") for m in members)
        failed = sum(m.node.log_count("plane sync failed (") for m in members)
        print(
            f"the plane after {len(outages)} kills ({aim.caught} of {aim.tries} while a sync's "
            f"transaction was open; outages {min(outages, default=0):.1f}-"
            f"{max(outages, default=0):.1f}s; members' syncs failed {failed} times, "
            f"{failed - refused} of them cut in flight, members failing per outage "
            f"{min(failing_seen, default=0)}-{max(failing_seen, default=0)}): "
            f"jobs {len(listed)} of {len(client.acked)}, lost "
            f"{len(diff.missing) + len(diff.older)}, extra {len(diff.newer) + len(diff.unknown)}, "
            f"converged in {plane_s:.1f}s after the last restart"
        )
    assert not diff, str(diff)
    # The plane's outages cost the members' event intake nothing.
    assert client.figures.unacknowledged == 0
    # The control that it really received them: every job, from every origin.
    assert len(listed) == len(client.acked) == client.figures.jobs
    assert {key[0] for key in listed} == {m.node_id for m in members}
    # Nothing counted twice: the rollups the merge keeps agree with the rows.
    states = Counter(state for _, state in listed.values())
    assert await plane.jobs_by_state(cluster) == dict(states)
    synced = await asyncio.gather(
        *(m.node.metric("nvpair_plane_synced_jobs_total") for m in members)
    )
    assert sum(synced) >= len(listed)
