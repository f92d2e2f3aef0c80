"""Carrying out `facts.probing`: pings, indirect pings, verdicts told to every member.

`Probes.probe(node_id)` pings a member; when the ping fails it asks a few others to ping it
(`ping-req`), and when none reaches it the prober suspects it. A ping's answer whose digest
differs from ours asks for a records exchange with that member (`on_mismatch`). A member
of the previous version has no ping route: its 404 is an answer all the same (it is up).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Final

from agent.cluster.members import Members
from agent.cluster.node_client import NodeClient
from agent.core.errors import MemberRefused, MemberUnreachable
from facts.probing import Ping, PingReq, PingReqAnswer, Prober

__all__ = ["Probes", "member_probes"]

log = logging.getLogger(__name__)

_NOT_FOUND: Final = 404


class Probes:
    """The prober's I/O for one node."""

    def __init__(
        self,
        prober: Prober,
        client: NodeClient,
        *,
        digest: Callable[[], str],
        on_mismatch: Callable[[str], None],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prober = prober
        self._client = client
        self._digest = digest
        self._on_mismatch = on_mismatch
        self._timeout_s = timeout_s
        self._clock = clock
        self.sent = 0  # pings and ping-reqs sent, for the bench
        self.failed = 0

    def _ping_body(self) -> Ping:
        return Ping(
            digest=self._digest(),
            incarnation=self.prober.incarnation,
            rumors=self.prober.rumors(),
        )

    async def ping(self, node_id: str, body: Ping | None = None) -> int | None:
        """Ping one member; its incarnation when it answered, else None."""
        self.sent += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                ack = await self._client.ping(node_id, body or self._ping_body())
        except MemberRefused as exc:
            if exc.status != _NOT_FOUND:
                self.failed += 1
                return None
            self.prober.contact(node_id, None, self._clock())  # a previous version's member
            return 0
        except (MemberUnreachable, TimeoutError) as exc:
            self.failed += 1
            log.debug("ping to %s failed: %s", node_id, exc)
            return None
        now = self._clock()
        self.prober.contact(node_id, ack.incarnation, now)
        self.prober.hear(ack.rumors, now)
        if ack.digest and ack.digest != self._digest():
            self._on_mismatch(node_id)
        return ack.incarnation

    async def probe(self, node_id: str) -> None:
        """A direct ping, then indirect ones through up to k helpers; suspect when none."""
        if await self.ping(node_id) is not None:
            return
        helpers = self.prober.helpers_for(node_id)
        answers = await asyncio.gather(*(self._ask(h, node_id) for h in helpers))
        reached = [a for a in answers if a is not None and a.reached]
        now = self._clock()
        if reached:
            self.prober.contact(node_id, max(a.incarnation for a in reached), now)
        else:
            self.prober.unreached(node_id, now)

    async def _ask(self, helper: str, target: str) -> PingReqAnswer | None:
        self.sent += 1
        try:
            async with asyncio.timeout(2 * self._timeout_s):  # the helper's ping, and ours
                return await self._client.ping_req(helper, target)
        except (MemberUnreachable, MemberRefused, TimeoutError):
            return None

    async def tell(self, node_ids: list[str]) -> None:
        """Send our rumors (a verdict just taken) to these members at once: one body for
        all, so every one of them hears it whatever the rumors' retransmission count."""
        body = self._ping_body()
        await asyncio.gather(*(self.ping(n, body) for n in node_ids))

    # -- the server side (node API) ---------------------------------------------------------

    def on_ping(self, ping: Ping, sender: str) -> Ping:
        """A member's probe: it is alive; its rumors heard; our digest and rumors back."""
        now = self._clock()
        self.prober.contact(sender, ping.incarnation, now)
        self.prober.hear(ping.rumors, now)
        if ping.digest and ping.digest != self._digest():
            self._on_mismatch(sender)
        return self._ping_body()

    async def on_ping_req(self, request: PingReq) -> PingReqAnswer:
        """Probe `target` for a member whose own probe failed."""
        if request.target not in self.prober:
            return PingReqAnswer(reached=False)
        incarnation = await self.ping(request.target)
        return PingReqAnswer(reached=incarnation is not None, incarnation=incarnation or 0)


def member_probes(
    members: Members, client: NodeClient, heartbeat_s: float, on_mismatch: Callable[[str], None]
) -> Probes:
    """This node's probes, watching its members: a ping waits half a beat, a suspect is
    given up on one beat later (detection in a few beats at any size). The incarnation is
    the start time, so a restarted member's is higher than any verdict about it."""
    prober = Prober(
        members.self_id,
        int(time.time() * 1000),
        random.Random(),
        suspect_s=heartbeat_s,
    )
    members.prober = prober
    return Probes(
        prober, client, digest=members.digest, on_mismatch=on_mismatch, timeout_s=heartbeat_s / 2
    )
