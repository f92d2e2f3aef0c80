"""What elastic deployments did, as every member saw it (issue 30, item 4): scale-ups,
scale-downs and cold starts with their duration, for the page and the plane.

Every member takes every version of a deployment its decider signs (the count, the reason,
who signed it and when), so every member keeps the same list: `changed` is handed each
version as it is taken, with the one it replaced (`SignedFacts.on_version`), and a count
that differs is a `scale-up` or `scale-down` stamped with the version's own time and signer.
A count that left zero starts a cold start; the first sampling round (`saw`) that sees a
replica of it ready ends it: a `cold-start` event with the seconds from the version to that
round (each member times it from its own view; within a sampling period and the records'
delay of one another). A member's first version of a deployment is not a change (a member
that starts or joins late does not report what it did not see happen).

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


class ScaleEvents:
    """The bounded list of what elastic deployments did, as this member saw it."""

    def __init__(self, *, limit: int = MAX_EVENTS) -> None:
        self.events: deque[ScaleEvent] = deque(maxlen=limit)
        # Deployment -> (wall seconds, signer, reason) of the version that left zero, until
        # a replica of it is seen ready.
        self._cold: dict[str, tuple[float, str, str]] = {}
        self._seq = itertools.count(1)

    def changed(self, before: Deployment | None, taken: Deployment) -> None:
        """A version was taken here (`SignedFacts.on_version`): `before` is the one it
        replaced, None for the first of its name here -- not a change this member saw."""
        if taken.deleted:
            self._cold.pop(taken.name, None)
            return
        bounds = taken.scaling
        if before is None or before.deleted or bounds is None:
            return
        if taken.replicas == before.replicas:
            return
        kind: Kind = "scale-up" if taken.replicas > before.replicas else "scale-down"
        self._add(
            int(taken.updatedAt), taken.name, kind, taken.replicas, before.replicas,
            bounds.reason, taken.by,
        )  # fmt: skip
        if before.replicas == 0:
            if len(self._cold) >= MAX_TRACKED:
                self._cold.pop(next(iter(self._cold)))
            self._cold[taken.name] = (taken.updatedAt / 1000, taken.by, bounds.reason)
        elif taken.replicas == 0:
            self._cold.pop(taken.name, None)  # back to zero before a replica came up

    def saw(self, deployment: Deployment, *, ready: int, now_s: float) -> None:
        """One sampling round's view of `deployment`: `ready` replicas ready. The first
        round that sees one ready after a scale-up from zero ends that cold start."""
        cold = self._cold.get(deployment.name)
        if not ready or cold is None:
            return
        since, by, reason = cold
        del self._cold[deployment.name]
        self._add(
            int(now_s * 1000), deployment.name, "cold-start", deployment.replicas, 0, reason,
            by, round(max(0.0, now_s - since), 3),
        )  # fmt: skip

    def forget(self, name: str) -> None:
        """`name` is no longer an elastic deployment: no cold start of it is pending."""
        self._cold.pop(name, None)

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
