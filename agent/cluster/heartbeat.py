"""This node's own record, and the heartbeat that spreads it and probes the members.

`OwnRecord` builds the record this node publishes about itself (only it speaks for itself):
the advertised address and ports (`agent.advertise`, which may differ from the listening
ports), GPUs, engines, cordon, with a generation taken from the wall clock so
it keeps rising across restarts. `Heartbeat` renews it only when it changed (or every
`REFRESH_S`), reads the GPUs again every `GPU_REFRESH_BEATS`, and then pushes what changed
to every pinned member; a member met for the first time (or whose digest differs) gets a
sync, which exchanges only what each lacks (docs/protocol.md, "Membership"). Each beat it
also probes a few members (`agent.cluster.probes`), which is what keeps reachability, so a beat
where nothing changed costs the same bytes at 4 members as at 64. One exchange in flight
per member, not in lockstep, so a member that is down does not hold back the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

from agent.cluster.members import Members
from agent.cluster.node_client import NodeClient
from agent.cluster.probes import member_probes
from agent.config import AgentConfig
from agent.core.errors import MemberRefused, MemberUnreachable
from facts.inventory import GpuInventory
from facts.records import Engine, Holding, NodeRecord, RecordsPush, Replica
from workload_manager import VERSION

__all__ = ["Heartbeat", "NodeState", "OwnRecord"]

log = logging.getLogger(__name__)

GPU_REFRESH_BEATS: Final = 5  # GPUs are read again every fifth heartbeat (10 s by default)
REFRESH_S: Final = 300.0  # an unchanged record is renewed this often (reachability is the probes')


@dataclass(slots=True)
class NodeState:
    """What this node is now: its GPUs (read again by the heartbeat) and whether it is
    cordoned. The record is built from it, and the replica controller reads it."""

    gpus: GpuInventory
    cordoned: bool = False


class OwnRecord:
    """The record this node publishes; `renew()` makes a new generation of it."""

    def __init__(
        self,
        config: AgentConfig,
        node_id: str,
        state: NodeState,
        engines: Callable[[], list[Engine]],
        sign: Callable[[NodeRecord], NodeRecord] = lambda record: record,
        replicas: Callable[[], list[Replica]] = list,
        release: str = VERSION,
        holdings: Callable[[], list[Holding]] = list,
        waiting: Callable[[], dict[str, int]] = dict,
        features: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._release = release  # what its record says it runs (its Speaks statement's)
        self._config = config
        self._sign = sign  # with this node's key (facts/record_signing.py)
        self._node_id = node_id
        self.state = state
        self._engines = engines
        self._replicas = replicas  # this node's replicas and their engine load
        self._holdings = holdings  # the artifacts it holds (issue 28)
        self._waiting = waiting  # its wait line's length per model (issue 30)
        self._features = features  # what every member knows (facts.wire.gate)
        self._generation = 0
        self._content: NodeRecord | None = None
        self.current = self.renew()

    def renew_if_changed(self) -> bool:
        """Renew when anything in the record changed or it is `REFRESH_S` old; whether it was."""
        content = self._build(0, 1)
        fresh = time.time() * 1000 - self.current.updatedAt < REFRESH_S * 1000
        if content == self._content and fresh:
            return False
        self.renew()
        return True

    def renew(self) -> NodeRecord:
        """A new generation of this node's record, from what it knows now."""
        now_ms = int(time.time() * 1000)
        self._generation = max(self._generation + 1, now_ms)
        self._content = self._build(0, 1)
        self.current = self._sign(self._build(now_ms, self._generation))
        return self.current

    def _build(self, now_ms: int, generation: int) -> NodeRecord:
        config = self._config
        # What peers dial, which may differ from where this node listens (NAT, forwards).
        manager_port, node_port, facade_port = config.advertised_ports
        replicas = self._replicas()
        artifacts: list[Holding] | UnsetType = UNSET
        if "artifacts" in self._features():
            artifacts = self._holdings()
        else:  # a member of 0.1.0 knows neither the field nor the word (docs/upgrade.md)
            replicas = [
                msgspec.structs.replace(r, state="starting") if r.state == "fetching" else r
                for r in replicas
            ]
        waiting: dict[str, int] | UnsetType = UNSET
        if "elastic-deployments" in self._features():
            waiting = {model: n for model, n in self._waiting().items() if n} or UNSET
        return NodeRecord(
            nodeId=self._node_id,
            name=config.name,
            addresses=[config.advertise_host],
            managerPort=manager_port,
            nodePort=node_port,
            facadePort=facade_port,
            version=self._release,
            devices=self.state.gpus.devices,
            domains=self.state.gpus.domains,
            engines=self._engines(),
            replicas=replicas,
            artifacts=artifacts,
            waitLine=waiting,
            queueLimit=config.queue_limit,
            cordoned=self.state.cordoned,
            gpuNote=self.state.gpus.reason,
            updatedAt=now_ms,
            generation=generation,
        )


class Heartbeat:
    """Spreads this node's record and probes members; `run()` beats until cancelled."""

    def __init__(
        self,
        *,
        own: OwnRecord,
        members: Members,
        client: NodeClient,
        interval_s: float,
        read_gpus: Callable[[], Awaitable[GpuInventory]] | None = None,
        probe: bool = True,
    ) -> None:
        self._own = own
        self._members = members
        self._client = client
        self._interval_s = interval_s
        self._read_gpus = read_gpus
        # Reachability (agent/cluster/probes.py); the node API answers other members' probes.
        self.probes = member_probes(members, client, interval_s, self.resync) if probe else None
        self._wake = asyncio.Event()
        self._forced = False  # push_now: statements (deployments, keys, pins) changed too
        self._pushes: dict[str, asyncio.Task[None]] = {}
        self._probing: dict[str, asyncio.Task[None]] = {}
        # What each member is known to hold (its last sync's answer, and what we sent it
        # since); a member not in it gets a sync first. `_old`: members of the previous
        # version (their answer had no holdings), pushed in full every beat as before.
        self._known: dict[str, dict[str, int]] = {}
        self._old: set[str] = set()
        self._resync: set[str] = set()
        self.pushes_ok = 0
        self.pushes_failed = 0
        # Called when this node's own record changed and the members' view holds it (a
        # replica here became ready: requests waiting here look again now).
        self.on_renewed: Callable[[], object] = lambda: None

    def push_now(self) -> None:
        """Something changed: renew and push without waiting for the next beat."""
        self._forced = True
        self._wake.set()

    def resync(self, node_id: str) -> None:
        """A digest differs: exchange what each lacks with that member at the next beat."""
        self._resync.add(node_id)

    def set_cordon(self, cordoned: bool) -> None:
        """Cordon (no new placements) or uncordon this node; members learn at once."""
        if cordoned != self._own.state.cordoned:
            self._own.state.cordoned = cordoned
            self._members.offer([self._own.renew()])
            self.push_now()
            log.info("node %s", "cordoned" if cordoned else "uncordoned")

    async def run(self) -> None:
        """Beat until cancelled; the pushes and probes in flight belong to this task."""
        async with asyncio.TaskGroup() as tasks:
            beats = 0
            changed = True
            while True:
                beats += 1
                if self._read_gpus is not None and beats % GPU_REFRESH_BEATS == 0:
                    self._own.state.gpus = await self._read_gpus()
                renewed = self._own.renew_if_changed()
                changed = renewed or changed
                self._members.offer([self._own.current])
                if renewed:
                    self.on_renewed()
                forced, self._forced = self._forced, False
                peers = [p.nodeId for p in self._members.peers()]
                for node_id in peers:
                    pending = self._pushes.get(node_id)
                    if pending is not None and not pending.done():
                        continue
                    if node_id not in self._known or node_id in self._old | self._resync:
                        job = self._sync(node_id)
                    elif changed or forced:
                        # A newer record of a member the peer already knows reaches it from
                        # that member itself: a delta carries what changed here, and members
                        # (and certificates) new to the peer. A peer that still lacks one
                        # answers with a digest that differs; the next exchange is a sync.
                        known = self._known[node_id]
                        for other, generation in self._members.holdings().items():
                            if known.get(other, -1) >= 0 and other != self._members.self_id:
                                known[other] = max(known[other], generation)
                        job = self._delta(node_id, statements=forced)
                    else:
                        continue
                    self._resync.discard(node_id)
                    self._pushes[node_id] = tasks.create_task(job)
                changed = False
                self._beat_probes(tasks, peers)
                for done in [n for n, t in self._pushes.items() if t.done()]:
                    del self._pushes[done]
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._interval_s):
                        await self._wake.wait()

    def _beat_probes(self, tasks: asyncio.TaskGroup, peers: list[str]) -> None:
        probes = self.probes
        if probes is None:
            return
        probes.prober.set_peers(peers)
        for node_id in probes.prober.targets():
            pending = self._probing.get(node_id)
            if pending is None or pending.done():
                self._probing[node_id] = tasks.create_task(probes.probe(node_id))
        dead = probes.prober.tick(time.monotonic())
        if dead:
            log.info("members not reached: %s", ", ".join(dead))
            alive = [n for n in peers if probes.prober.reachable(n)]
            tasks.create_task(probes.tell(alive))  # the verdict to every member at once
        for done in [n for n, t in self._probing.items() if t.done()]:
            del self._probing[done]

    async def _sync(self, node_id: str) -> None:
        old = node_id in self._old
        body = self._members.push_body() if old else self._members.sync_request()
        answer = await self._exchange(node_id, body)
        if answer is None:
            return
        if answer.have is None:
            self._old.add(node_id)  # a previous version's full push
            return
        self._old.discard(node_id)
        known = self._known[node_id] = dict(answer.have)
        missing = self._members.delta_for(known, statements=False)
        if missing.records or missing.certificates or missing.removals:
            await self._delta(node_id, statements=False)

    async def _delta(self, node_id: str, *, statements: bool) -> None:
        known = self._known.get(node_id)
        body = self._members.delta_for(known, statements=statements)
        # What the body carries, taken with it (records that come in during the exchange
        # were not sent).
        sent = self._members.sent_in_delta(known) if known is not None else {}
        answer = await self._exchange(node_id, body)
        if answer is None:
            return
        if known is not None:
            known.update(sent)
            for node_id_sent in self._members.holdings():  # its certificate was in it
                known.setdefault(node_id_sent, 0)
        if answer.digest and answer.digest != self._members.digest():
            self._resync.add(node_id)

    async def _exchange(self, node_id: str, body: RecordsPush) -> RecordsPush | None:
        try:
            answer = await self._client.push_records(node_id, body)
            self._members.merge(answer)
        except (MemberUnreachable, MemberRefused) as exc:
            self.pushes_failed += 1
            self._known.pop(node_id, None)  # after a failure, start again with a sync
            if isinstance(exc, MemberRefused) and exc.why:
                self._members.refused_by[node_id] = exc.why  # shown by `nvpair cluster status`
            log.debug("record push to %s failed: %s", node_id, exc)
            return None
        except Exception:
            # Anything else (a pin that cannot be written to a full disk, a bug) fails this
            # push, not the heartbeat: an exception out of a push would end the task group
            # and with it every later push to every member.
            self.pushes_failed += 1
            self._known.pop(node_id, None)
            log.exception("record push to %s failed; the next beat tries again", node_id)
            return None
        self._members.heard_from(node_id)
        self.pushes_ok += 1
        return answer
