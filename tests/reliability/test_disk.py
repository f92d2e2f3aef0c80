"""A full disk and a read-only disk under one member's home (issue 11, item 5): three members
under load, one of them on a disk of its own (tests/reliability/disk.py). While the fault
holds, that member answers its events with a clear 503 (never a 202 it then loses), its
/healthz is 503 naming the Jobs store and why, no process dies and the other members keep
taking events; once the disk is back it takes events again, its jobs.db passes `PRAGMA
integrity_check`, and every member lists exactly what the client was told."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures.records import lifecycle_event, workload_record
from tests.fixtures.waiting import eventually

from .cluster import NAMES, Member, fault_cluster, fault_rng, manager_pid
from .disk import Ext4Disk, SmallDisk, disks, integrity
from .ledger import RememberingClient
from .tiers import Tier

pytestmark = [pytest.mark.reliability, pytest.mark.quick]

MEMBERS = 3
STORE = "jobs-store"  # the part /healthz names for the Jobs store and its writer


async def health(member: Member) -> tuple[int, dict[str, Any]]:
    """/healthz's status and body."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(member.node.api + "/healthz") as response,
    ):
        return response.status, await response.json()


async def store_failing(member: Member) -> str:
    """Until /healthz is 503 naming the Jobs store: its reason."""
    reason = ""

    async def failing() -> bool:
        nonlocal reason
        status, body = await health(member)
        reason = next((f["error"] for f in body["failing"] if f["part"] == STORE), "")
        return status == 503 and bool(reason)

    await eventually(failing, f"{member.name}'s /healthz names the {STORE} failing")
    return reason


async def post(member: Member, record: dict[str, Any]) -> tuple[int, str]:
    """One `POST /v1/jobs/events`, no retry: the status and the body."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(
            member.node.api + "/v1/jobs/events",
            json=lifecycle_event(record),
            headers=member.node.owner,
        ) as r,
    ):
        return r.status, await r.text()


def accepted(client: RememberingClient, prefix: str) -> int:
    """Jobs of one load (by id prefix) with an event answered 202 so far."""
    return sum(1 for (_, _, wid) in client.acked if wid.startswith(prefix + "-"))


def processes(members: list[Member]) -> dict[str, tuple[int, int | None]]:
    """Each member's agent pid and its workload manager's."""
    return {m.name: (m.pid, manager_pid(m.pid)) for m in members}


class Fault:
    """What one scenario measures while its disk fault holds."""

    def __init__(self, client: RememberingClient, victim: Member, others: list[Member]) -> None:
        self.client = client
        self.victim = victim
        self.others = others

    async def check_while_held(self, scenario: asyncio.TaskGroup, tier: Tier, words: str) -> None:
        """The fault bit and was clear, and everyone else went on: /healthz is 503 naming the
        store with `words` in its reason, an event at the member is answered 503 saying the
        same (its probe is entered again, through the client, once the disk is back), no
        secret path in either, and the other members take a load of their own meanwhile."""
        victim, client = self.victim, self.client
        reason = await store_failing(victim)
        others = scenario.create_task(
            client.load(
                self.others,
                jobs=tier.pick(30, 300),
                rate_per_s=tier.pick(40, 100),
                prefix=f"{victim.name}-others",
            )
        )
        self.probe = workload_record(
            "probe", 1, origin=victim.node_id, run=f"{victim.name}-probe", created_at=1
        )
        status, text = await post(victim, self.probe)
        assert status == 503, (status, text)
        home = str(victim.node.home)
        for said in (reason, text):
            assert words in said.lower(), said
            assert home not in said, f"the error names the member's home: {said}"
        print(f"{victim.name} healthz: {reason}; its POST: {status} {text.strip()}")
        await eventually(
            lambda: accepted(client, f"{victim.name}-others") >= 10,
            "the other members take events while the disk fault holds",
        )
        assert (await health(victim))[0] == 503, "the fault ended before its checks"
        self.others_load = others

    async def check_recovered(self) -> None:
        """The member takes events again: its probe (refused above) is answered 202."""
        await eventually(self.victim.node.healthy, f"{self.victim.name} is well again")
        assert await self.client.enter(self.victim, self.probe)
        await self.others_load


@contextlib.asynccontextmanager
async def on_its_own_disk(
    root: Path, rng: random.Random, name: str, disk: SmallDisk | Ext4Disk
) -> AsyncIterator[tuple[list[Member], RememberingClient, Member, Fault]]:
    """A fault cluster whose member `name` has its home on `disk` (mounted before anything is
    written there, unmounted however the scenario ends), a client, and that member's Fault."""
    with disks() as mounted:

        def prepare(member: str, home: Path) -> None:
            if member == name:
                disk.mount()
                mounted.append(disk)

        async with (
            fault_cluster(root, MEMBERS, rng, prepare_home=prepare) as members,
            RememberingClient(random.Random(rng.random())) as client,
        ):
            victim = next(m for m in members if m.name == name)
            yield (
                members,
                client,
                victim,
                Fault(client, victim, [m for m in members if m is not victim]),
            )


async def test_a_full_disk_refuses_events_clearly_and_recovers_when_space_returns(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1151)
    name = rng.choice(NAMES[:MEMBERS])
    disk = SmallDisk(tmp_path / name, "16m")
    async with on_its_own_disk(tmp_path, rng, name, disk) as (members, client, victim, fault):
        before = processes(members)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members,
                    jobs=tier.pick(90, 1500),
                    rate_per_s=tier.pick(50, 100),
                    prefix="full",
                )
            )
            await eventually(lambda: client.figures.accepted >= 20, "load under way")
            filled = await asyncio.to_thread(disk.fill)
            await fault.check_while_held(scenario, tier, "full")
            disk.empty()
            freed = time.monotonic()
            await fault.check_recovered()
            await load
        assert processes(members) == before, "a process died or was restarted"
        assert integrity(victim.node.home / "jobs.db") == "ok"
        await client.wait_converged(members, since=freed)
        print(f"the filler took {filled / 2**20:.1f} MiB of {name}'s 16 MiB tmpfs")
        print(client.figures.line(f"{name}'s disk full under load, then space returns"))
        assert client.figures.unacknowledged == 0


async def test_a_disk_turned_read_only_refuses_events_clearly_and_loses_nothing(
    tmp_path: Path, tier: Tier
) -> None:
    rng = fault_rng(1152)
    name = rng.choice(NAMES[:MEMBERS])
    disk = Ext4Disk(tmp_path / name, tmp_path / f"{name}.ext4")
    async with on_its_own_disk(tmp_path, rng, name, disk) as (members, client, victim, fault):
        before = processes(members)
        async with asyncio.TaskGroup() as scenario:
            load = scenario.create_task(
                client.load(
                    members,
                    jobs=tier.pick(90, 1500),
                    rate_per_s=tier.pick(50, 100),
                    prefix="readonly",
                )
            )
            await eventually(lambda: client.figures.accepted >= 20, "load under way")
            disk.force_read_only()
            assert disk.read_only()
            await fault.check_while_held(scenario, tier, "sqlite_ioerr_write")
            assert processes(members) == before, "a process died under the read-only disk"
            # The disk comes back the only way a forced read-only ext4 does: the agent
            # is stopped, the file system unmounted, checked and mounted again.
            await victim.node.stop()
            assert victim.node.proc is not None
            stopped = victim.node.proc.returncode
            # The writer retried with backoff the whole time, its close included (it
            # used to retry ~1,000 times a second for the close bound).
            retries = victim.node.log_count("the Jobs store still refuses writes")
            disk.unmount()
            fsck = disk.repair().rsplit(": ", 1)[-1]  # its summary, not the image's path
            disk.mount()
            assert integrity(victim.node.home / "jobs.db") == "ok"
            await victim.restart()
            back = time.monotonic()
            await fault.check_recovered()
            await load
        await client.wait_converged(members, since=back)
        print(
            f"{name} stopped with status {stopped} on its read-only home after {retries} "
            f"retried writes; e2fsck: {fsck}"
        )
        print(client.figures.line(f"{name}'s disk read-only under load, repaired, restart"))
        assert stopped == 0
        assert retries < 100, retries
        assert client.figures.unacknowledged == 0
