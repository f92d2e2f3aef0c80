"""Syncing this node's observed objects into the Postgres plane.

The outbox is durable: the Jobs store remembers, per job, the seq the plane acknowledged
(`plane_seq`), so after an outage of any length -- or a restart of this agent -- the sync
sends every job that changed since, in batches, until the plane has all of them. The plane
upserts newer-wins, so a batch sent twice changes nothing. Each batch also carries this
node's row, devices and topology domains, which keeps the node reachable in the plane.
Retries back off exponentially with full jitter up to 5 s. A finished job's usage (tokens,
times: `usage_store`) goes in the same batch as its final record (`SyncBatch.usage`).

Each batch is signed with this node's key and carries its certificate and the cluster CA's
(`plane.fleet.node_signing`): the plane writes a batch only as the node whose certificate signed
it, so no node of the cluster can sync in another's name.

An https plane's certificate is verified against `[plane] ca` (else the system's CAs) and
its host name; one that does not verify fails the sync (counted, retried), and nothing is
ever sent to it, nor in clear instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import aiohttp
import msgspec

from agent.config import PlaneSettings, plane_settings
from agent.core.errors import AgentError
from agent.plane_link.reports import Reporter
from agent.serving.usage_store import UsageStore, UsageUnavailable
from broker.errors import BrokerError
from broker.jobs import JobsStore, JobsWriter
from certs import Identity
from facts.records import NodeRecord
from netkit import tracing
from netkit.backoff import Backoff
from plane.core.wire import NodeSummary, SyncBatch
from plane.fleet.node_signing import sign_sync

__all__ = ["PlaneRefused", "PlaneSync", "plane_settings"]

log = logging.getLogger(__name__)

BATCH: Final = 5000  # jobs per sync request: the plane's merge costs less per row in bulk


class PlaneRefused(AgentError):
    """The plane answered with an error status (its words, cut short, in the message)."""


class PlaneSync:
    """The background sync of one agent: `run()` until cancelled."""

    def __init__(
        self,
        settings: PlaneSettings,
        *,
        identity: Identity,
        store: JobsStore,
        writer: JobsWriter,
        record: Callable[[], NodeRecord],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        usage: UsageStore | None = None,
        reporters: Sequence[Reporter] = (),
    ) -> None:
        self._usage = usage  # each finished job's usage goes with its record
        self._reporters = tuple(reporters)  # the demand and machinery sides' fields
        self.url = settings.url + "/v1/sync"
        self.interval_s = settings.interval_s
        self._ca = settings.ca
        self._token = settings.token
        self._identity = identity  # signs every batch: the plane takes it as this node's
        self._node_id = identity.node.node_id
        self._store = store
        self._writer = writer
        self._record = record
        self._sleep = sleep  # time is passed in: tests drive the retries without waiting
        # Capped at 5 s: one small request per node while the plane is down, and a plane
        # that comes back is caught up within seconds.
        self.backoff = Backoff(base_s=0.5, cap_s=5.0)
        self.failures = 0
        self.synced = 0
        self.last_error: str | None = None

    def _tls(self) -> ssl.SSLContext | bool:
        """What verifies an https plane: the `ca` file's context, or the system's CAs."""
        if not self.url.startswith("https://"):
            return True  # plain http: aiohttp's default, no TLS involved
        if self._ca is None:
            return ssl.create_default_context()
        return ssl.create_default_context(cafile=self._ca)

    async def run(self) -> None:
        """Sync, then again every `interval_s` (`[plane]`; at once while batches come back
        full)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            tls: ssl.SSLContext | bool | None = None
            while True:
                try:
                    # Built inside the retry loop: a CA file that cannot be read is a failed
                    # sync, counted and logged, not an agent that stops.
                    tls = self._tls() if tls is None else tls
                    more = await self._once(session, tls)
                    self.failures = 0
                    self.last_error = None
                    if more:
                        continue  # a full batch: there is more to send right away
                    delay = self.interval_s
                except (
                    aiohttp.ClientError,
                    TimeoutError,
                    OSError,
                    PlaneRefused,
                    BrokerError,
                    sqlite3.Error,
                    UsageUnavailable,
                ) as exc:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                    delay = max(0.2, self.backoff.delay(self.failures, random.random))
                    log.info("plane sync failed (%s); retry in %.1fs", self.last_error, delay)
                await self._sleep(delay)

    async def _once(self, session: aiohttp.ClientSession, tls: ssl.SSLContext | bool) -> bool:
        # Usage first: a job's row is buffered before its final record is handed on, so
        # every finished job read below has its usage on disk.
        if self._usage is not None:
            await self._usage.flush()
        await self._writer.flush()
        jobs = await self._store.unsynced(self._node_id, BATCH)
        usage = []
        if self._usage is not None:
            finished = [j.key for j in jobs if j.state.is_terminal]
            usage = [row.wire() for row in (await self._usage.of(finished)).values()]
        record = self._record()
        extra: dict[str, object] = {}
        for reporter in self._reporters:
            extra.update(reporter.fields(record))
        batch = SyncBatch(
            nodeId=self._node_id,
            generation=record.generation,
            node=NodeSummary(name=record.name, version=record.version, cordoned=record.cordoned),
            devices=record.devices,
            domains=record.domains,
            jobs=jobs,
            usage=usage,
            **extra,  # type: ignore[arg-type]  # each reporter gives SyncBatch fields
        )
        body = msgspec.json.encode(batch)
        identity = self._identity
        signed = sign_sync(body, key=identity.key, cert=identity.cert, ca=identity.ca)
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
            **signed,
        }
        # A trace of its own (docs/metrics.md, "Tracing"): what was sent, and the answer.
        with tracing.span("nvpair.plane.sync", kind="client") as span:
            headers.update(tracing.injected())
            async with session.post(self.url, data=body, headers=headers, ssl=tls) as response:
                answer = await response.read()
                if span is not None:
                    span.set_attributes(
                        {
                            "nvpair.plane.jobs": len(jobs),
                            "http.response.status_code": response.status,
                        }
                    )
                if response.status != 200:
                    tracing.failed(span, f"plane answered {response.status}")
                    raise PlaneRefused(f"plane answered {response.status}: {answer[:200]!r}")
        await self._store.mark_synced(jobs)
        for reporter in self._reporters:
            reporter.sent()
        self.synced += len(jobs)
        return len(jobs) == BATCH
