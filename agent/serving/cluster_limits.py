"""A key's limits held for the whole cluster, whichever members its traffic enters (issue 29,
item 4). No external store: one member counts each key.

**The holder.** Every key has one holder: the member first in the key's rendezvous order
(a hash of the key's name and each member's id, highest first) among this member and the
members it works with and reaches -- the same member from every member whose views agree.
The holder counts the key's requests and tokens for the cluster in its windows
(`rate_limit.KeyLimiter.grant`).

**Leases.** A member admits a request of a key it does not hold out of a lease: a few
requests (`chunk`: a quarter of the limit over the members, 1 to `MAX_CHUNK`) granted by
the holder and counted there when granted. An empty lease is refilled with one call to the
holder, made by the first request that finds it empty while the others wait for its
answer; a lease half spent is refilled in the background, so a steady stream rarely waits.
A grant of none is a 429 with the holder's `Retry-After`. Tokens are known only when a
request ends: each member reports its keys' tokens to their holders once a second, in one
call per holder, and each answer brings the key's cluster-wide count, which a member
adds its unreported tokens to before it admits.

**Tolerance.** While the holder stays the same: requests exactly the limit a minute,
less what leases were granted and not used (at most a lease per member), and a lease used
up to `LEASE_S` after it was granted is counted when granted, so a sliding minute can hold
one lease per member more than the limit. Tokens: the limit plus what the cluster used in
the last second and what requests still running will use (as on one member: a request is
admitted while the count is under the limit). When the holder changes (it goes, or a
member joins ahead of it in a key's order) the new holder starts counting from zero: up
to one limit more in that minute.

**Cut off.** A member that cannot reach the holder (a partition, the holder down and not
yet counted out), or that reaches no more than half of the members it knows (it may be on
the small side of a partition, where a holder of its own would count from zero), admits
alone: its share of the limit -- the limit over every member it knows, reachable or not,
so the members cut off never admit more than their part -- and says so: a warning in its
log, `nvpair_key_limit_alone` on `/metrics`, and its 429s name the share. It asks the
holder again after `ALONE_S`. The larger side of a partition picks a holder among the
members it reaches and goes on with the whole limit.

A cluster with a member of 0.1.0 (which neither holds nor leases) keeps 0.1.0's rule: each
member admits limit / members alive (the `cluster-key-limits` feature, `facts.wire`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Literal

from agent.core.errors import MemberRefused, MemberUnreachable
from agent.serving.rate_limit import WINDOW_S, Grant, KeyLimiter, Limited
from facts.key_limits import MAX_CHUNK, MAX_KEYS, KeyAsk, KeyGrant, LeaseAnswer, LeaseAsk, holder_of

__all__ = [
    "ClusterLimits",
    "KeyAsk",
    "KeyGrant",
    "LeaseAnswer",
    "LeaseAsk",
    "holder_of",
]

log = logging.getLogger(__name__)

LEASE_S: Final = 10.0  # a lease's requests are used within this, or dropped
ALONE_S: Final = 5.0  # after a holder did not answer, how long this member admits alone
FLUSH_S: Final = 1.0  # tokens reported to holders this often
ACTIVE_S: Final = 60.0  # a key asked about in the last minute has its tokens refreshed
MAX_HELD: Final = 4096  # keys with lease state kept here
# A holder that did not answer, or answered with an error status (starting, or releases
# too far apart): either way no grant came, and this member admits alone.
_NO_ANSWER: Final = (MemberUnreachable, MemberRefused, OSError, TimeoutError)


def _chunk(rpm: int, members: int) -> int:
    # A lease: a quarter of the limit over the members, 1 to MAX_CHUNK requests.
    return max(1, min(MAX_CHUNK, rpm // (4 * max(1, members))))


def _limited(kind: Literal["requests", "tokens"], wait_s: int, rpm: int, tpm: int) -> Limited:
    # Refused against the key's whole limit (the cluster's), not a share.
    return Limited(kind, max(1, wait_s), float(rpm if kind == "requests" else tpm))


@dataclass(frozen=True, slots=True)
class _View:
    """The membership the limits are decided on, as read for one request."""

    enabled: bool  # every member knows holders (the feature gate)
    holders: list[str]  # this member and the members it works with and reaches
    members: int  # every member known, reachable or not
    alive: int  # this member and the members heard from lately


@dataclass(slots=True)
class _Lease:
    left: int = 0  # requests this member may admit without asking
    until: float = 0.0  # when what is left is dropped
    unsent: int = 0  # tokens used here, not yet reported to the holder
    tokens: int = 0  # the key's tokens cluster-wide, as the holder last said
    tokens_at: float = 0.0  # when it said so (a minute later they have all expired)
    refused_until: float = 0.0  # the holder granted none: 429 until then
    refused_for: Literal["requests", "tokens"] = "requests"  # ... for this limit
    asked: float = 0.0  # when a request of the key was last admitted or refused here
    refill: asyncio.Task[KeyGrant | None] | None = None  # the call in flight, if any


class ClusterLimits:
    """This member's side of the keys' limits: admits out of leases, asks and reports to
    holders, and answers as the holder for the keys it holds."""

    def __init__(
        self,
        *,
        self_id: str,
        limiter: KeyLimiter,
        limits_of: Callable[[str], tuple[int, int] | None],
        holders: Callable[[], list[str]],
        members: Callable[[], int],
        members_alive: Callable[[], int],
        enabled: Callable[[], bool],
        ask: Callable[[str, LeaseAsk], Awaitable[LeaseAnswer]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.self_id = self_id
        self.limiter = limiter  # this member's windows: as holder, and alone
        self._limits_of = limits_of  # key name -> (rpm, tpm), None when not a live key
        self._holders = holders  # this member and the members it works with and reaches
        self._members = members  # every member known, reachable or not
        self._members_alive = members_alive
        self._enabled = enabled  # every member knows holders (the feature gate)
        self._ask = ask
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._alone: dict[str, float] = {}  # holder -> until when we admit alone
        self._cut_off = False  # reaching no more than half of the members

    # -- admitting ------------------------------------------------------------------------

    async def admit(self, name: str, rpm: int, tpm: int) -> Limited | None:
        """Admit one request of key `name` (counted) or say why not."""
        if not rpm and not tpm:
            return None
        now = self._clock()
        view = self._view()
        if not view.enabled:  # a 0.1.0 member in the cluster: its rule, shares
            share = 1.0 / max(1, view.alive)
            return self.limiter.admit(name, rpm=rpm, tpm=tpm, share=share, now=now)
        if self._minority(view):  # cut off from most members: no holder to trust
            return self._admit_alone(name, rpm, tpm, now, view.members)
        holder = holder_of(name, view.holders)
        if holder == self.self_id:
            return self._admit_here(name, rpm, tpm, now)
        if self._alone.get(holder, 0.0) > now:
            return self._admit_alone(name, rpm, tpm, now, view.members)
        lease = self._lease(name)
        lease.asked = now
        said = lease.tokens if now - lease.tokens_at < WINDOW_S else 0
        if tpm and said + lease.unsent >= tpm:
            return _limited("tokens", 1, rpm, tpm)
        if lease.refused_until > now:
            wait = max(1, math.ceil(lease.refused_until - now))
            return _limited(lease.refused_for, wait, rpm, tpm)
        if not rpm:  # tokens alone: the count the reports bring back decides, no lease
            return None
        while not (lease.left > 0 and lease.until > now):
            grant = await self._refill(name, holder, lease, _chunk(rpm, view.members))
            now = self._clock()
            if grant is None:  # the holder did not answer: alone until it does
                return self._admit_alone(name, rpm, tpm, now, view.members)
            if not grant.known:  # the key has not reached the holder yet: a share, now
                share = 1.0 / max(1, view.members)
                return self.limiter.admit(name, rpm=rpm, tpm=tpm, share=share, now=now)
            if not grant.granted and not (lease.left > 0 and lease.until > now):
                kind: Literal["requests", "tokens"] = (
                    "tokens" if tpm and grant.tokens >= tpm else "requests"
                )
                lease.refused_until, lease.refused_for = now + grant.retryAfter, kind
                return _limited(kind, grant.retryAfter, rpm, tpm)
        lease.left -= 1
        chunk = _chunk(rpm, view.members)
        if rpm and lease.left <= chunk // 2 and lease.refill is None:
            self._refill_soon(name, holder, lease, chunk)
        return None

    def _view(self) -> _View:
        """The membership now. Read for each request, not kept: a gate that opens or a
        member that goes counts at once (a few dictionary walks over the members)."""
        return _View(self._enabled(), self._holders(), self._members(), self._members_alive())

    def _minority(self, view: _View) -> bool:
        """Whether this member reaches no more than half of the members it knows (itself
        included): it may be on the small side of a partition, where the members it reaches
        would pick a holder of their own and count from zero."""
        minority = 2 * len(view.holders) <= view.members
        if minority and not self._cut_off:
            log.warning(
                "key limits: this member reaches %d of %d members; it admits its share of "
                "every key's limits alone until it reaches more than half",
                len(view.holders),
                view.members,
            )
        self._cut_off = minority
        return minority

    def _admit_here(self, name: str, rpm: int, tpm: int, now: float) -> Limited | None:
        grant = self.limiter.grant(name, rpm=rpm, tpm=tpm, want=1, tokens=0, now=now)
        if grant.granted:
            return None
        kind: Literal["requests", "tokens"] = (
            "tokens" if tpm and grant.tokens >= tpm else "requests"
        )
        return _limited(kind, grant.retry_after_s, rpm, tpm)

    def _admit_alone(
        self, name: str, rpm: int, tpm: int, now: float, members: int
    ) -> Limited | None:
        share = 1.0 / max(1, members)
        return self.limiter.admit(name, rpm=rpm, tpm=tpm, share=share, now=now)

    def _lease(self, name: str) -> _Lease:
        lease = self._leases.get(name)
        if lease is None:
            if len(self._leases) >= MAX_HELD:
                self._forget_idle()
            lease = self._leases[name] = _Lease()
        return lease

    def _forget_idle(self) -> None:
        now = self._clock()
        idle = [
            n
            for n, lease in self._leases.items()
            if lease.refill is None and not lease.unsent and now - lease.asked > ACTIVE_S
        ]
        for name in idle or list(self._leases)[: len(self._leases) // 2]:
            self._leases.pop(name, None)

    async def _refill(self, name: str, holder: str, lease: _Lease, want: int) -> KeyGrant | None:
        if lease.refill is None:
            self._refill_soon(name, holder, lease, want)
        assert lease.refill is not None
        return await asyncio.shield(lease.refill)

    def _refill_soon(self, name: str, holder: str, lease: _Lease, want: int) -> None:
        lease.refill = asyncio.get_running_loop().create_task(
            self._call(name, holder, lease, want), name=f"lease {name}"
        )

    async def _call(self, name: str, holder: str, lease: _Lease, want: int) -> KeyGrant | None:
        sent, lease.unsent = lease.unsent, 0
        try:
            answer = await self._ask(holder, LeaseAsk([KeyAsk(name, want, sent)]))
            grant = next((g for g in answer.keys if g.name == name), None)
            if grant is None:
                raise MemberUnreachable(f"{holder} answered a lease without {name}")
        except _NO_ANSWER as exc:
            lease.unsent += sent  # reported to the next holder we reach, or counted alone
            self._went_alone(holder, exc)
            return None
        finally:
            lease.refill = None
        self._heard(holder)
        now = self._clock()
        lease.tokens, lease.tokens_at = grant.tokens, now
        if grant.granted:
            lease.left = (lease.left if lease.until > now else 0) + grant.granted
            lease.until = now + LEASE_S
            lease.refused_until = 0.0
        return grant

    def _went_alone(self, holder: str, why: BaseException) -> None:
        now = self._clock()
        if self._alone.get(holder, 0.0) <= now:
            log.warning(
                "key limits: %s, which holds some keys' counts, does not answer (%s); this "
                "member admits its share of those keys' limits alone for %gs",
                holder,
                why,
                ALONE_S,
            )
        self._alone[holder] = now + ALONE_S

    def _heard(self, holder: str) -> None:
        self._alone.pop(holder, None)

    def alone(self) -> bool:
        """Whether this member admits some keys alone now (a holder it cannot reach)."""
        now = self._clock()
        return self._cut_off or any(until > now for until in self._alone.values())

    # -- tokens ---------------------------------------------------------------------------

    def record_tokens(self, name: str, tokens: int) -> None:
        """The tokens an engine reported for one of key `name`'s requests here."""
        if tokens <= 0:
            return
        now = self._clock()
        view = self._view()
        if not view.enabled:
            self.limiter.record_tokens(name, tokens, now)
            return
        holder = holder_of(name, view.holders)
        if holder == self.self_id:
            self.limiter.grant(name, rpm=0, tpm=0, want=0, tokens=tokens, now=now)
        else:
            self._lease(name).unsent += tokens
            # Counted alone too: while the holder cannot be reached, the share sees them.
            self.limiter.record_tokens(name, tokens, now)

    async def run(self) -> None:
        """Report tokens and refresh the cluster-wide counts once a second (cancel to stop)."""
        while True:
            await asyncio.sleep(FLUSH_S)  # a period, not a synchronisation
            await self.flush()

    async def flush(self) -> None:
        """One round: per holder, one call with its keys' unreported tokens and the keys
        asked about lately."""
        now = self._clock()
        view = self._view()
        if not view.enabled:
            return
        calls: dict[str, list[KeyAsk]] = {}
        for name, lease in list(self._leases.items()):
            if not lease.unsent and now - lease.asked > ACTIVE_S:
                continue
            holder = holder_of(name, view.holders)
            if holder == self.self_id or self._alone.get(holder, 0.0) > now:
                continue
            asks = calls.setdefault(holder, [])
            if len(asks) < MAX_KEYS:
                asks.append(KeyAsk(name, 0, lease.unsent))
                lease.unsent = 0
        await asyncio.gather(*(self._report(h, asks) for h, asks in calls.items()))

    async def _report(self, holder: str, asks: list[KeyAsk]) -> None:
        try:
            answer = await self._ask(holder, LeaseAsk(asks))
        except _NO_ANSWER as exc:
            for ask in asks:
                self._lease(ask.name).unsent += ask.tokens
            self._went_alone(holder, exc)
            return
        self._heard(holder)
        for grant in answer.keys:
            lease = self._leases.get(grant.name)
            if lease is not None:
                lease.tokens, lease.tokens_at = grant.tokens, self._clock()

    # -- as the holder --------------------------------------------------------------------

    def answer(self, ask: LeaseAsk) -> LeaseAnswer:
        """The holder's grants: each key's requests out of its whole limit, its tokens."""
        now = self._clock()
        grants = []
        for key in ask.keys:
            limits = self._limits_of(key.name)
            if limits is None:
                grants.append(KeyGrant(key.name, known=False))
                continue
            rpm, tpm = limits
            grant: Grant = self.limiter.grant(
                key.name, rpm=rpm, tpm=tpm, want=key.want, tokens=key.tokens, now=now
            )
            grants.append(KeyGrant(key.name, grant.granted, grant.tokens, grant.retry_after_s))
        return LeaseAnswer(grants)
