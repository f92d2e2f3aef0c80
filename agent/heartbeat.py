"""This node's own record, and the heartbeat that pushes it to every member.

`OwnRecord` builds the record this node publishes about itself (only it speaks for itself):
the advertised address and ports (`agent.advertise`, which may differ from the listening
ports), GPUs, engines, cordon, with a generation taken from the wall clock so
it keeps rising across restarts. `Heartbeat` renews it every beat (and at once when
something changed), reads the GPUs again every `GPU_REFRESH_BEATS`, and pushes the records
it holds to every pinned member -- one push in flight per member, not in lockstep, so a
member that is down and times out does not hold back the heartbeat to the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from broker.inventory import GpuInventory
from broker.records import Engine, NodeRecord, Replica
from workload_manager import VERSION

from .config import AgentConfig
from .errors import MemberRefused, MemberUnreachable
from .members import Members
from .node_client import NodeClient

__all__ = ["Heartbeat", "OwnRecord"]

log = logging.getLogger(__name__)

GPU_REFRESH_BEATS: Final = 5  # GPUs are read again every fifth heartbeat (10 s by default)


class OwnRecord:
    """The record this node publishes; `renew()` makes a new generation of it."""

    def __init__(
        self,
        config: AgentConfig,
        node_id: str,
        gpus: GpuInventory,
        engines: Callable[[], list[Engine]],
        sign: Callable[[NodeRecord], NodeRecord] = lambda record: record,
        replicas: Callable[[], list[Replica]] = list,
    ) -> None:
        self._config = config
        self._sign = sign  # with this node's key (broker/record_signing.py)
        self._node_id = node_id
        self.gpus = gpus
        self._engines = engines
        self._replicas = replicas  # this node's replicas and their engine load
        self.cordoned = False
        self._generation = 0
        self.current = self.renew()

    def renew(self) -> NodeRecord:
        """A new generation of this node's record, from what it knows now."""
        now_ms = int(time.time() * 1000)
        self._generation = max(self._generation + 1, now_ms)
        config = self._config
        # What peers dial, which may differ from where this node listens (NAT, forwards).
        manager_port, node_port, facade_port = config.advertised_ports
        self.current = self._sign(
            NodeRecord(
                nodeId=self._node_id,
                name=config.name,
                addresses=[config.advertise_host],
                managerPort=manager_port,
                nodePort=node_port,
                facadePort=facade_port,
                version=VERSION,
                devices=self.gpus.devices,
                domains=self.gpus.domains,
                engines=self._engines(),
                replicas=self._replicas(),
                queueLimit=config.queue_limit,
                cordoned=self.cordoned,
                gpuNote=self.gpus.reason,
                updatedAt=now_ms,
                generation=self._generation,
            )
        )
        return self.current


class Heartbeat:
    """Renews and pushes this node's record; `run()` beats until cancelled."""

    def __init__(
        self,
        *,
        own: OwnRecord,
        members: Members,
        client: NodeClient,
        interval_s: float,
        read_gpus: Callable[[], Awaitable[GpuInventory]] | None = None,
    ) -> None:
        self._own = own
        self._members = members
        self._client = client
        self._interval_s = interval_s
        self._read_gpus = read_gpus
        self._wake = asyncio.Event()
        self._pushes: dict[str, asyncio.Task[None]] = {}
        self.pushes_ok = 0
        self.pushes_failed = 0

    def push_now(self) -> None:
        """Something changed: renew and push without waiting for the next beat."""
        self._wake.set()

    def set_cordon(self, cordoned: bool) -> None:
        """Cordon (no new placements) or uncordon this node; members learn at once."""
        if cordoned != self._own.cordoned:
            self._own.cordoned = cordoned
            self._members.offer([self._own.renew()])
            self.push_now()
            log.info("node %s", "cordoned" if cordoned else "uncordoned")

    async def run(self) -> None:
        """Beat until cancelled; the pushes in flight belong to this task."""
        async with asyncio.TaskGroup() as pushes:
            beats = 0
            while True:
                beats += 1
                if self._read_gpus is not None and beats % GPU_REFRESH_BEATS == 0:
                    self._own.gpus = await self._read_gpus()
                self._members.offer([self._own.renew()])
                for peer in self._members.peers():
                    pending = self._pushes.get(peer.nodeId)
                    if pending is None or pending.done():
                        self._pushes[peer.nodeId] = pushes.create_task(self._push(peer.nodeId))
                for node_id in [n for n, t in self._pushes.items() if t.done()]:
                    del self._pushes[node_id]
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._interval_s):
                        await self._wake.wait()

    async def _push(self, node_id: str) -> None:
        try:
            answer = await self._client.push_records(node_id, self._members.push_body())
            self._members.merge(answer)
        except (MemberUnreachable, MemberRefused) as exc:
            self.pushes_failed += 1
            log.debug("record push to %s failed: %s", node_id, exc)
            return
        except Exception:
            # Anything else (a pin that cannot be written to a full disk, a bug) fails this
            # push, not the heartbeat: an exception out of a push would end the task group
            # and with it every later push to every member.
            self.pushes_failed += 1
            log.exception("record push to %s failed; the next beat tries again", node_id)
            return
        self._members.heard_from(node_id)
        self.pushes_ok += 1
