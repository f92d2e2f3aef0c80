"""What elastic deployments did, as every member saw it (issue 30, item 4): scale-ups,
scale-downs and cold starts with their duration, for the page and the plane.

Every member sees every version of a deployment its decider signs (the count, the reason,
who signed it and when), so every member keeps the same list: `saw` is handed each
elastic deployment once a sampling round, and a count that differs from the one it held
before is a `scale-up` or `scale-down` stamped with the version's own time and signer. A
count that left zero starts a cold start; the first round that sees a replica of it ready
ends it: a `cold-start` event with the seconds from the version to that round (each member
times it from its own view; within a sampling period and the records' delay of one another).
The first sighting of a deployment is not a change (a member that starts or joins late
does not report what it did not see happen).

The list is bounded (`MAX_EVENTS`, the newest kept). Nothing in it comes from a request:
names, counts, reasons and member ids only.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from facts.deployments import Deployment

__all__ = ["MAX_EVENTS", "ScaleEvent", "ScaleEvents"]

MAX_EVENTS: Final = 256  # events kept on a member, the newest
MAX_TRACKED: Final = 4096  # deployments whose last count is remembered

Kind = Literal["scale-up", "scale-down", "cold-start"]


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """One change of an elastic deployment's count, or one cold start ended."""

    seq: int  # this member's order of seeing it (a cursor for the plane's reporter)
    at: int  # epoch ms: the version's time; a cold start's end, when this member saw it
    deployment: str
    kind: Kind
    replicas: int  # the count after it
    previous: int  # the count before it (a cold start: 0)
    reason: str  # the decider's reason (a cold start: the scale-up's)
    by: str  # the member that signed the version (a cold start: the scale-up's)
    seconds: float | None = None  # a cold start's duration

    def to_json(self) -> dict[str, object]:
        """Its JSON shape for `GET /v1/deployments/events`."""
        return {
            "at": self.at,
            "deployment": self.deployment,
            "kind": self.kind,
            "replicas": self.replicas,
            "previous": self.previous,
            "reason": self.reason,
            "by": self.by,
            "seconds": self.seconds,
        }

    def message(self) -> str:
        """One line for the plane's event list."""
        if self.kind == "cold-start":
            return f"{self.deployment}: a replica ready {self.seconds:.1f}s after a scale-up from 0"
        return f"{self.deployment}: {self.previous} -> {self.replicas} replica(s) ({self.reason})"


@dataclass(slots=True)
class _Seen:
    version: int
    replicas: int
    cold_since: float | None  # wall seconds of the version that left zero, until ready
    cold_by: str
    cold_reason: str


class ScaleEvents:
    """The bounded list of what elastic deployments did, as this member saw it."""

    def __init__(self, *, limit: int = MAX_EVENTS) -> None:
        self.events: deque[ScaleEvent] = deque(maxlen=limit)
        self._seen: dict[str, _Seen] = {}
        self._seq = itertools.count(1)

    def saw(self, deployment: Deployment, *, ready: int, now_s: float) -> None:
        """One round's view of an elastic `deployment` with `ready` replicas ready."""
        bounds = deployment.scaling
        reason = bounds.reason if bounds is not None else ""
        at_s = deployment.updatedAt / 1000
        seen = self._seen.get(deployment.name)
        if seen is None:
            if len(self._seen) >= MAX_TRACKED:
                self._seen.pop(next(iter(self._seen)))
            seen = self._seen[deployment.name] = _Seen(
                deployment.version, deployment.replicas, None, "", ""
            )
        elif deployment.version != seen.version:
            if deployment.replicas != seen.replicas:
                kind: Kind = "scale-up" if deployment.replicas > seen.replicas else "scale-down"
                self._add(
                    int(deployment.updatedAt), deployment.name, kind, deployment.replicas,
                    seen.replicas, reason, deployment.by,
                )  # fmt: skip
                if seen.replicas == 0:
                    seen.cold_since, seen.cold_by, seen.cold_reason = at_s, deployment.by, reason
                elif deployment.replicas == 0:
                    seen.cold_since = None  # back to zero before a replica came up
            seen.version, seen.replicas = deployment.version, deployment.replicas
        if ready and seen.cold_since is not None:
            took = max(0.0, now_s - seen.cold_since)
            self._add(
                int(now_s * 1000), deployment.name, "cold-start", deployment.replicas, 0,
                seen.cold_reason, seen.cold_by, round(took, 3),
            )  # fmt: skip
            seen.cold_since = None

    def forget(self, name: str) -> None:
        """`name` is no longer an elastic deployment: a later one of that name starts anew."""
        self._seen.pop(name, None)

    def since(self, seq: int) -> list[ScaleEvent]:
        """The events kept that came after `seq`, oldest first."""
        return [e for e in self.events if e.seq > seq]

    def _add(
        self,
        at: int,
        deployment: str,
        kind: Kind,
        replicas: int,
        previous: int,
        reason: str,
        by: str,
        seconds: float | None = None,
    ) -> None:
        self.events.append(
            ScaleEvent(
                next(self._seq), at, deployment, kind, replicas, previous, reason, by, seconds
            )
        )
