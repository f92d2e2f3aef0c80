"""Syncing this node's observed objects into the Postgres plane.

The outbox is durable: the Jobs store remembers, per job, the seq the plane acknowledged
(`plane_seq`), so after an outage of any length -- or a restart of this agent -- the sync
sends every job that changed since, in batches, until the plane has all of them. The plane
upserts newer-wins, so a batch sent twice changes nothing. Each batch also carries this
node's row, devices and topology domains, which keeps the node reachable in the plane.
Retries back off exponentially with full jitter up to 5 s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Final

import aiohttp
import msgspec

from plane.store import NodeSummary, SyncBatch
from workload_manager.outbox import Backoff

if TYPE_CHECKING:
    from .daemon import Agent

__all__ = ["PlaneSync", "plane_settings"]

log = logging.getLogger(__name__)

BATCH: Final = 5000  # jobs per sync request: the plane's merge costs less per row in bulk
INTERVAL_S: Final = 2.0


def plane_settings(home: Path) -> tuple[str, str] | None:
    """(url, token): `[plane] url, token` in `nvpair.toml`, else `$NVPAIR_HOME/plane.json`
    (written by `nvpair plane join`); None when neither says."""
    toml = home / "nvpair.toml"
    if toml.exists():
        try:
            section = tomllib.loads(toml.read_text()).get("plane")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            log.warning("ignoring %s: %s", toml, exc)
            section = None
        if isinstance(section, dict) and "url" in section and "token" in section:
            return str(section["url"]).rstrip("/"), str(section["token"])
    path = home / "plane.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return str(data["url"]).rstrip("/"), str(data["token"])
    except (OSError, ValueError, KeyError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None


class PlaneSync:
    """The background sync task of one agent."""

    def __init__(self, agent: Agent, url: str, token: str) -> None:
        self.agent = agent
        self.url = url + "/v1/sync"
        self.token = token
        # Capped at 5 s: one small request per node while the plane is down, and a plane
        # that comes back is caught up within seconds.
        self.backoff = Backoff(base_s=0.5, cap_s=5.0)
        self.failures = 0
        self.synced = 0
        self.last_error: str | None = None

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while True:
                try:
                    more = await self._once(session)
                    self.failures = 0
                    self.last_error = None
                    if more:
                        continue  # a full batch: there is more to send right away
                    delay = INTERVAL_S
                except (aiohttp.ClientError, TimeoutError, OSError, RuntimeError) as exc:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                    delay = max(0.2, self.backoff.delay(self.failures, random.random))
                    log.info("plane sync failed (%s); retry in %.1fs", self.last_error, delay)
                await asyncio.sleep(delay)

    async def _once(self, session: aiohttp.ClientSession) -> bool:
        agent = self.agent
        await agent.writer.flush()
        jobs = await agent.store.unsynced(agent.node_id, BATCH)
        record = agent.record
        batch = SyncBatch(
            nodeId=agent.node_id,
            generation=record.generation,
            node=NodeSummary(name=record.name, version=record.version, cordoned=record.cordoned),
            devices=record.devices,
            domains=record.domains,
            jobs=jobs,
        )
        async with session.post(
            self.url,
            data=msgspec.json.encode(batch),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        ) as response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"plane answered {response.status}: {body[:200]!r}")
        await agent.store.mark_synced(jobs)
        self.synced += len(jobs)
        return len(jobs) == BATCH
