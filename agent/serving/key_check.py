"""Who may use the facade: the API keys checked per request, and their limits.

Two kinds of key let a request in: the cluster's keys (`agent.cluster.api_keys`: issued with
`nvpair keys create` on any member, known to every member) and the static keys of this
node's `nvpair.toml` (`api_keys = { name = "sk-…" }`: this node only, no scope or limit).
With neither -- no key ever issued in the cluster, none configured -- the facade is open, as
it always was. Otherwise a request needs `Authorization: Bearer <secret>` of a key that is
not revoked and has not expired (401 `invalid_api_key`), asks for a model the key allows (403
`model_not_allowed`) and fits the key's limits (429 `rate_limit_exceeded` with `Retry-After`;
`agent.serving.cluster_limits` says how the limit holds cluster-wide). The key's name is the job's
`requesterId`; a static key named as a cluster key shares that key's models and limits.

The secret presented is hashed and looked up by its hash, then compared in constant time:
what the lookup's timing could reveal is about the hash, which says nothing about a secret.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

from aiohttp import web

from agent.cluster.api_keys import ApiKeys
from agent.serving.cluster_limits import ClusterLimits
from agent.serving.openai_errors import openai_error
from agent.serving.rate_limit import KeyLimiter
from facts.api_keys import ApiKey, hash_secret, hashes_match

__all__ = ["Access", "KeyCheck", "Requester"]


class Access(enum.Enum):
    """What the key check found when it names no key."""

    OPEN = "open"  # no key is needed: the facade takes requests without one
    REFUSED = "refused"  # a key is needed and this one is missing, unknown, revoked or expired


# Who sent a request: the name of the key it presented (a cluster key's or a static one's),
# or what the check found without one.
Requester: TypeAlias = str | Access

SHARE_REFRESH_S: Final = 1.0  # how often the count of members alive is asked again


class KeyCheck:
    """The facade's key check; the names it returns are requester ids."""

    def __init__(
        self,
        static: Mapping[str, str],
        keys: ApiKeys | None = None,
        *,
        members_alive: Callable[[], int] = lambda: 1,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        # The cluster-wide count (`connect_cluster`); without it each member admits its
        # share, limit / members alive, alone.
        self.cluster: ClusterLimits | None = None
        self._static = {hash_secret(secret): name for name, secret in static.items()}
        self._keys = keys
        self._members_alive = members_alive
        self._clock = clock
        self._monotonic = monotonic
        self.limiter = KeyLimiter()
        self._seen = -1  # the `keys.changes` the index was built from
        self._by_hash: dict[str, ApiKey] = {}
        self._by_name: dict[str, ApiKey] = {}
        self._share = (float("-inf"), 1.0)  # (asked at, 1 / members alive)

    def in_use(self) -> bool:
        """Whether requests need a key."""
        return bool(self._static) or (self._keys is not None and self._keys.in_use())

    def _index(self) -> None:
        if self._keys is None or self._keys.changes == self._seen:
            return
        self._seen = self._keys.changes
        live = [k for k in self._keys.all() if not k.revoked and k.keyHash]
        self._by_hash = {k.keyHash: k for k in live}
        self._by_name = {k.name: k for k in live}

    def scopes(self) -> dict[str, frozenset[str] | None]:
        """The names a request can carry as its requester now, each with the models it may
        use (None: any): every usable cluster key and every static key (`/metrics` keeps a
        series for each). Empty while no key is needed."""
        self._index()
        now_ms = int(self._clock() * 1000)
        scopes = {
            name: frozenset(key.models) or None
            for name, key in self._by_name.items()
            if key.usable(now_ms)
        }
        for name in self._static.values():  # a static key shares its cluster key's scope
            key = self._by_name.get(name)
            scopes[name] = None if key is None else frozenset(key.models) or None
        return scopes

    def requester(self, authorization: str) -> Requester:
        """The key's name for an `Authorization` header; `Access.OPEN` when no key is needed,
        `Access.REFUSED` when the key is missing, unknown, revoked or expired."""
        if not self.in_use():
            return Access.OPEN
        secret = authorization[7:] if authorization.startswith("Bearer ") else ""
        if not secret:
            return Access.REFUSED
        digest = hash_secret(secret)
        self._index()
        key = self._by_hash.get(digest)
        if key is not None and hashes_match(key.keyHash, digest):
            return key.name if key.usable(int(self._clock() * 1000)) else Access.REFUSED
        name = self._static.get(digest)
        return name if name is not None else Access.REFUSED

    def may_use(self, requester: Requester, model: str) -> bool:
        """Whether `requester`'s key is scoped to `model` (no limit counted): what
        `/v1/models` lists for it."""
        key = self._by_name.get(requester) if isinstance(requester, str) else None
        return key is None or key.allows(model)

    def limits_of(self, name: str) -> tuple[int, int] | None:
        """A live key's (rpm, tpm), for its holder (`cluster_limits`); None when unknown."""
        self._index()
        key = self._by_name.get(name)
        if key is None or not key.usable(int(self._clock() * 1000)):
            return None
        return key.rpm, key.tpm

    async def admit(self, requester: Requester, model: str) -> web.Response | None:
        """None when `requester` (from `requester()`) may send a request for `model` now
        (counted against its limits); else the answer that refuses it."""
        if not isinstance(requester, str):
            return None
        key = self._by_name.get(requester)
        if key is None:
            return None  # a static key: no scope, no limit
        if not key.allows(model):
            return openai_error(
                403,
                f"this API key may not use the model `{model[:256]}`",
                "invalid_request_error",
                "model_not_allowed",
            )
        if self.cluster is not None:
            limited = await self.cluster.admit(key.name, key.rpm, key.tpm)
        else:
            limited = self.limiter.admit(
                key.name, rpm=key.rpm, tpm=key.tpm, share=self._share_now(), now=self._monotonic()
            )
        if limited is None:
            return None
        per = "requests" if limited.kind == "requests" else "tokens"
        limit = key.rpm if per == "requests" else key.tpm
        where = (
            "in the cluster"
            if limited.allowed >= limit
            else f"in the cluster; {limited.allowed:g} on this member, which admits its share"
            " alone now"
        )
        response = openai_error(
            429,
            f"rate limit of {key.name}: {limit} {per} per minute {where}; "
            f"try again in {limited.retry_after_s}s",
            limited.kind,
            "rate_limit_exceeded",
        )
        response.headers["Retry-After"] = str(limited.retry_after_s)
        return response

    def record_tokens(self, key_name: str | None, tokens: int) -> None:
        """Count the tokens the engine reported for a request of `key_name` (the facade
        calls this after each request; no name: no key, nothing to count)."""
        if key_name and key_name in self._by_name:
            if self.cluster is not None:
                self.cluster.record_tokens(key_name, tokens)
            else:
                self.limiter.record_tokens(key_name, tokens, self._monotonic())

    def _share_now(self) -> float:
        now = self._monotonic()
        asked, share = self._share
        if now - asked >= SHARE_REFRESH_S:
            share = 1.0 / max(1, self._members_alive())
            self._share = (now, share)
        return share
