"""Observed deployments: an engine that already runs (started by someone else, or given with
`--engine` before deployments existed) is recorded as a replica and watched, never started,
restarted or stopped by nvpair.

The node that observes it is the deployment's `constraints.node` (id or name), else the
member that declared it. Its replica id is derived from the deployment's id and the node's,
so it is the same across agent restarts with nothing written down. Its state is what the
engine answers: `ready` while `GET /v1/models` answers 200, `failed` after `DOWN_AFTER`
probes in a row fail (it comes back to `ready` on its own when the engine does), `starting`
before the first answer.

Drift (`drifts()`, reported up to the plane) says how what runs differs from the
declaration: the engine does not answer, or the models it lists (`/v1/models`) name neither
the declared name nor the declared source. "" when it serves what was declared.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import aiohttp

from agent.engines.auth import EngineAuth
from agent.engines.gpus import stable_id
from agent.engines.kinds import ready_path
from facts.deployments import Deployment, spec_digest
from facts.records import Replica

__all__ = ["ObservedEngines"]

DOWN_AFTER: Final = 3
PROBE_TIMEOUT: Final = aiohttp.ClientTimeout(total=2)
MAX_OBSERVED: Final = 64
MAX_LISTING: Final = 1 << 20  # bytes of a `/v1/models` answer read


@dataclass
class _Watched:
    deployment: Deployment
    replica: str
    state: str = "starting"
    misses: int = 0
    since_ms: int = 0
    drift: str = ""


class ObservedEngines:
    """This node's observed replicas: `probe()` each round, `replicas()` for the record."""

    def __init__(self, *, self_id: str, self_name: str, auth: EngineAuth | None = None) -> None:
        self.auth = auth or EngineAuth()
        self.self_id = self_id
        self.self_name = self_name
        self._watched: dict[str, _Watched] = {}  # deployment name -> what we watch
        self._session: aiohttp.ClientSession | None = None

    def mine(self, deployments: Iterable[Deployment]) -> list[Deployment]:
        """The observed deployments this node watches."""
        out = []
        for d in deployments:
            if d.authority != "observed" or not d.url:
                continue
            where = d.constraints.node
            if where in (self.self_id, self.self_name) or (not where and d.by == self.self_id):
                out.append(d)
        return out[:MAX_OBSERVED]

    async def probe(self, deployments: Iterable[Deployment], now_ms: int) -> bool:
        """Follow the declared set and ask each engine once; whether anything changed."""
        wanted = {d.name: d for d in self.mine(deployments)}
        changed = False
        for name in list(self._watched):
            held = self._watched[name]
            if name not in wanted or spec_digest(wanted[name]) != spec_digest(held.deployment):
                del self._watched[name]
                changed = True
        for name, d in wanted.items():
            if name not in self._watched:
                rid = stable_id("rep", d.id, self.self_id)
                self._watched[name] = _Watched(d, rid, since_ms=now_ms)
                changed = True
            else:
                self._watched[name].deployment = d
        if not self._watched:
            return changed
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=PROBE_TIMEOUT, middlewares=(self.auth.middleware,)
            )
        watched_now = list(self._watched.values())
        answers = await asyncio.gather(*(self._answers(w.deployment) for w in watched_now))
        for watched, (up, served) in zip(watched_now, answers, strict=True):
            before = watched.state
            watched.drift = _drift(watched.deployment, served) if up else watched.drift
            watched.misses = 0 if up else watched.misses + 1
            if up:
                watched.state = "ready"
            elif watched.misses >= DOWN_AFTER:
                watched.state = "failed"
                watched.drift = "the engine does not answer"
            changed |= watched.state != before
        return changed

    async def _answers(self, deployment: Deployment) -> tuple[bool, list[str] | None]:
        """(whether it answers, the model ids it lists when it lists them)."""
        assert self._session is not None
        url = deployment.url.rstrip("/") + ready_path(deployment.engine)
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    return False, None
                body = await response.content.read(MAX_LISTING)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False, None
        return True, _listed(body)

    async def aclose(self) -> None:
        """Close the probe session (the engines are not ours to stop)."""
        if self._session is not None:
            await self._session.close()

    def replicas(self) -> list[Replica]:
        """The observed replicas as this node's record says them."""
        return [
            Replica(
                id=w.replica,
                deployment=w.deployment.name,
                deploymentId=w.deployment.id,
                spec=spec_digest(w.deployment),
                port=urllib.parse.urlsplit(w.deployment.url).port or 0,
                state=w.state,  # type: ignore[arg-type]  # one of the four
                error="the engine does not answer" if w.state == "failed" else "",
                createdAt=w.since_ms,
            )
            for _, w in sorted(self._watched.items())
        ]

    def drifts(self) -> dict[str, str]:
        """Replica id -> how what runs differs from its declaration ("" not at all)."""
        return {w.replica: w.drift for w in self._watched.values()}

    def url_of(self, replica_id: str) -> str | None:
        """The engine of a ready observed replica."""
        for w in self._watched.values():
            if w.replica == replica_id and w.state == "ready":
                return w.deployment.url.rstrip("/")
        return None

    def urls(self) -> dict[str, str]:
        """Replica id -> engine URL, for the load scraper."""
        return {w.replica: w.deployment.url.rstrip("/") for w in self._watched.values()}


def _listed(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI `/v1/models` answer; None when it is not one."""
    try:
        listing = json.loads(body)
    except ValueError:
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    return [str(m["id"]) for m in data[:MAX_OBSERVED] if isinstance(m, dict) and "id" in m]


def _drift(deployment: Deployment, served: list[str] | None) -> str:
    """How the models an engine lists differ from its declaration ("" when they do not)."""
    if served is None:
        return ""  # an engine that lists no models (ollama's version probe): nothing to compare
    declared = {deployment.name, deployment.source} - {""}
    if declared & set(served):
        return ""
    shown = ", ".join(sorted(served)[:4]) or "no model"
    return f"the engine serves {shown}, not {deployment.source or deployment.name}"[:256]
