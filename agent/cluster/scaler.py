"""Carrying out `scheduler.scale` (issue 30): elastic deployments' counts follow their load.

**Sampling.** Every member samples each elastic deployment's load once a `SAMPLE_S` from
what it already sees: its replicas ready in the members' records, the requests their
engines run and queue (the records' load readings), and the requests waiting in every
member's wait line (`NodeRecord.waitLine`; this member's own line read directly). The
samples of the longest window the policy looks back over are kept, in at most
`MAX_SAMPLES` buckets (a bucket keeps its peak running and waiting, the latest ready).

**One decider.** For each deployment one member decides: the first in the rendezvous order
of the deployment's name over this member and the members it works with and reaches (the
same member from every member whose views agree, as a key's holder is), and only while it
reaches more than half of the members it knows -- on the small side of a partition no
member changes a count, so two sides never scale one deployment two ways. The decider
passes its samples, the count and when it changed (the version's `updatedAt`), and how
many more replicas the free GPUs hold to `scheduler.scale.decide`; a new count is a new
signed version of the deployment (`Deployments.scale`, with the reason), which every
member's replica controller carries out as it carries out an operator's `nvpair scale`:
exactly that many replicas, placed once. A decider that dies leaves the last version; the
next one decides from its own samples (every member keeps them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from agent.cluster.deployments import DeploymentRefused, Deployments
from agent.cluster.scale_events import ScaleEvents
from agent.core.timings import Timings
from facts.deployments import Deployment, Elastic
from facts.key_limits import holder_of
from facts.records import NodeRecord, is_worker
from scheduler.scale import Ask, Bounds, Decision, LoadSample, ScalePolicy, decide, share

__all__ = ["MAX_SAMPLES", "SAMPLE_S", "Scaler", "deployment_load", "free_gpus", "placed_replicas"]

log = logging.getLogger(__name__)

SAMPLE_S: Final = 1.0  # how often each elastic deployment's load is sampled
MAX_SAMPLES: Final = 600  # buckets kept per deployment, whatever its windows
NO_LIMIT: Final = 1024  # the room of a deployment that needs no GPU
COLD_BUCKETS: Final = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0)  # seconds


@dataclass(slots=True)
class _Track:
    """What this member knows of one deployment's load."""

    samples: deque[LoadSample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES + 1))
    capacity: float | None = None  # requests one replica runs at once, once learned
    last: Decision | None = None  # the last decision made here


def deployment_load(
    deployment: Deployment,
    records: list[NodeRecord],
    *,
    self_id: str,
    waiting_here: dict[str, int],
    now_s: float,
) -> LoadSample:
    """`deployment`'s load now: ready replicas, requests running, requests waiting (in the
    engines' queues and in every member's wait line; this member's from `waiting_here`)."""
    ready = 0
    running = waiting = 0.0
    for record in records:
        for r in record.replicas:
            if r.deploymentId != deployment.id or is_worker(r, record.nodeId):
                continue  # a worker part: its replica is counted at its head
            if r.state == "ready":
                ready += 1
            running += r.running
            waiting += r.waiting
        if record.nodeId != self_id and isinstance(record.waitLine, dict):
            waiting += record.waitLine.get(deployment.name, 0)
    waiting += waiting_here.get(deployment.name, 0)
    return LoadSample(now_s, ready, running, waiting)


def free_gpus(records: list[NodeRecord]) -> int:
    """The GPUs of the members' records that no replica holds and that have not failed (a
    cordoned member's none)."""
    free = 0
    for record in records:
        if record.cordoned:
            continue
        taken = {d for r in record.replicas for d in r.devices}
        free += sum(1 for d in record.devices if d.id not in taken and d.health != "failed")
    return free


def placed_replicas(records: list[NodeRecord]) -> dict[str, int]:
    """Deployment id -> its replicas the members' records list (any state: each holds its
    GPUs, as `free_gpus` counts them); a replica counted but in no record waits for room."""
    placed: dict[str, int] = {}
    for record in records:
        for r in record.replicas:
            if not is_worker(r, record.nodeId):  # a replica across members: once, its head
                placed[r.deploymentId] = placed.get(r.deploymentId, 0) + 1
    return placed


class Scaler:
    """Samples every elastic deployment and, where this member decides, changes its count."""

    def __init__(
        self,
        *,
        self_id: str,
        deployments: Deployments,
        records: Callable[[], list[NodeRecord]],
        waiting_here: Callable[[], dict[str, int]],
        holders: Callable[[], list[str]],
        members: Callable[[], int],
        enabled: Callable[[], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.self_id = self_id
        self._deployments = deployments
        self._records = records  # the working members' records (reachable or not)
        self._waiting_here = waiting_here  # this member's wait line, per model
        self._holders = holders  # this member and the members it works with and reaches
        self._members = members  # every member known, reachable or not
        self._enabled = enabled  # every member knows elastic deployments (the feature gate)
        self._clock = clock  # wall time: versions' updatedAt are wall times
        self.tracks: dict[str, _Track] = {}
        self.changes: dict[tuple[str, str], int] = {}  # (deployment, reason) -> changes here
        self.cold_starts = Timings(COLD_BUCKETS)  # from zero to a replica ready, decided here
        self._cold_since: dict[str, float] = {}  # deployment -> when this member scaled it up
        self._cold: set[str] = set()  # elastic deployments with no replica ready, last sampled
        self._woken = asyncio.Event()
        self.events = ScaleEvents()  # scale-ups, -downs and cold starts, as seen here
        deployments.on_version = self.events.changed  # each version, as it is taken

    async def run(self) -> None:
        """Sample and decide every `SAMPLE_S`, and at once when woken (`wake`), until
        cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_S):  # a period, or a wake
                    await self._woken.wait()
            self._woken.clear()
            self.step()

    def wake(self) -> None:
        """Decide now, not at the next period: requests wait for a deployment at zero."""
        self._woken.set()

    def cold_line(self, model: str) -> bool:
        """Whether a wait line for `model` is a cold start: an elastic deployment with no
        replica ready when last sampled here (the facade's line started; see `pushed`)."""
        return model in self._cold

    def pushed(self, record: NodeRecord | None) -> None:
        """A member pushed its record: where it brings a wait line for a deployment at zero,
        decide now (this member may be its decider)."""
        line = record.waitLine if record is not None else None
        if isinstance(line, dict) and any(line.get(name) for name in self._cold):
            self.wake()

    def step(self) -> list[tuple[str, Decision]]:
        """One round: sample every elastic deployment, decide those this member decides;
        the decisions made (changed or not)."""
        if not self._enabled():
            return []
        elastic = [(d, e) for d in self._deployments.live() if (e := d.scaling) is not None]
        if not elastic and not self.tracks:
            return []  # nothing scales on load: no records read
        now = self._clock()
        records = self._records()
        waiting = self._waiting_here()
        holders = self._holders()
        for gone in set(self.tracks) - {d.name for d, _ in elastic}:
            del self.tracks[gone]
            self._cold.discard(gone)
            self._cold_since.pop(gone, None)
            self.events.forget(gone)
            self.changes = {k: n for k, n in self.changes.items() if k[0] != gone}
        wishes: list[tuple[Deployment, Decision, LoadSample]] = []
        for deployment, bounds in elastic:
            track = self.tracks.setdefault(deployment.name, _Track())
            sample = deployment_load(
                deployment, records, self_id=self.self_id, waiting_here=waiting, now_s=now
            )
            _add(track.samples, sample, _bucket_s(bounds))
            self.events.saw(deployment, ready=sample.ready, now_s=now)
            if sample.ready and deployment.name in self._cold_since:
                self.cold_starts.observe(now - self._cold_since.pop(deployment.name))
            if sample.ready:
                self._cold.discard(deployment.name)
            else:
                self._cold.add(deployment.name)
            wish = self._wish(deployment, bounds, track, now)  # room aside
            wishes.append((deployment, wish, sample))
        # Every elastic deployment's wish, shared over the free GPUs by one rule
        # (`scheduler.scale.share`): each decider applies its own deployments' part of the
        # same sharing, so two deciders do not both count one free GPU as theirs.
        placed = placed_replicas(records)
        counts = share(
            [
                Ask(
                    d.name, d.gpus * d.span, d.replicas, w.desired, b.min, s.ready, s.waiting,
                    placed=placed.get(d.id, 0), priority=b.priority or 0,
                )
                for (d, w, s), (_, b) in zip(wishes, elastic, strict=True)
            ],
            free_gpus(records),
        )  # fmt: skip
        made = []
        for deployment, wish, _ in wishes:
            if not self._decides(deployment.name, holders):
                continue
            count = counts[deployment.name]
            reason = wish.reason
            if count != wish.desired:
                reason = "yielded" if count < deployment.replicas else "no room"
            decision = Decision(count, reason, wish.capacity)
            self.tracks[deployment.name].last = decision
            self._carry_out(deployment, decision, now)
            made.append((deployment.name, decision))
        return made

    def _decides(self, name: str, holders: list[str]) -> bool:
        """Whether this member decides `name`'s count: it is first in the name's rendezvous
        order over `holders`, and reaches more than half of the members it knows."""
        majority = 2 * len(holders) > self._members()
        return majority and holder_of(name, holders) == self.self_id

    def explain(self, name: str) -> dict[str, object] | None:
        """What this member sees of `name`'s load and who decides its count (for `nvpair
        explain --deployment`); None when it is not elastic here."""
        track = self.tracks.get(name)
        if track is None:
            return None
        holders = self._holders()
        latest = track.samples[-1] if track.samples else None
        last = track.last
        return {
            "decider": holder_of(name, holders),
            "decidesHere": self._decides(name, holders),
            "load": None
            if latest is None
            else {"ready": latest.ready, "running": latest.running, "waiting": latest.waiting},
            "samples": len(track.samples),
            "capacity": track.capacity,
            "lastDecision": None
            if last is None
            else {"desired": last.desired, "reason": last.reason},
            "events": [e.to_json() for e in self.events.events if e.deployment == name][-10:],
        }

    def _wish(self, deployment: Deployment, bounds: Elastic, track: _Track, now: float) -> Decision:
        """What `scheduler.scale.decide` wants for `deployment`, room aside; the capacity
        it learns is kept."""
        decision = decide(
            list(track.samples),
            current=deployment.replicas,
            bounds=Bounds(bounds.min, bounds.max),
            policy=ScalePolicy(bounds.targetWaiting, bounds.scaleDownAfterS, bounds.idleToZeroS),
            now_s=now,
            changed_at_s=deployment.updatedAt / 1000,
            room=NO_LIMIT,
            capacity=track.capacity,
        )
        track.capacity = decision.capacity
        return decision

    def _carry_out(self, deployment: Deployment, decision: Decision, now: float) -> None:
        """A new version of `deployment` with the decided count, when it differs."""
        if decision.desired == deployment.replicas:
            return
        try:
            self._deployments.scale(deployment.name, decision.desired, decision.reason)
        except DeploymentRefused as exc:  # undeployed or redeclared meanwhile
            log.info("scaling %s: %s", deployment.name, exc)
            return
        key = (deployment.name, decision.reason)
        self.changes[key] = self.changes.get(key, 0) + 1
        if deployment.replicas == 0:
            self._cold_since[deployment.name] = now  # a cold start: timed until ready
        log.info(
            "scaled %s from %d to %d replica(s): %s",
            deployment.name,
            deployment.replicas,
            decision.desired,
            decision.reason,
        )


def _bucket_s(bounds: Elastic) -> float:
    """How much time one kept sample covers: the longest window over `MAX_SAMPLES`."""
    longest = max(bounds.scaleDownAfterS, bounds.idleToZeroS)
    return max(SAMPLE_S, math.ceil(longest / MAX_SAMPLES))


def _add(samples: deque[LoadSample], sample: LoadSample, bucket_s: float) -> None:
    """Keep `sample`: merged into the newest bucket when it falls in that bucket's time (its
    peaks and latest ready kept, its start time too), else as a new bucket."""
    if samples and math.floor(samples[-1].at_s / bucket_s) == math.floor(sample.at_s / bucket_s):
        last = samples[-1]
        running, waiting = max(last.running, sample.running), max(last.waiting, sample.waiting)
        samples[-1] = LoadSample(last.at_s, sample.ready, running, waiting)
        return
    samples.append(sample)
