"""The cluster's desired state, fetched down from the plane (`GET /v1/desired`) and kept.

Every ~2 s each enrolled node asks the plane for its cluster's `DesiredState`, with the
ETag of the one it holds (`If-None-Match`): an unchanged state is a 304, one small answer.
A new state is written to `$NVPAIR_HOME/plane-desired.json` (0600, atomically) before it
is handed, in order, to each of `PlaneLink.on_desired` (the deployments' converger first);
at start the persisted one is handed over before the first fetch, so a node that restarts
while the plane is away still has what the plane last wanted. A file that cannot be read is
set aside as `plane-desired.json.corrupt` (the next fetch brings the state back).

The file also remembers the ids of every deployment the plane ever placed here (`placed`):
the converger undeploys a cluster deployment of such an id once the plane lists it no more,
and leaves any other alone.

TLS, the cluster token and the retries are `PlaneSync`'s: an https plane's certificate is
verified against `[plane] ca` (else the system's CAs), failures back off with full jitter up
to 5 s. A body past `MAX_DESIRED` is refused (counted, retried), never read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import aiohttp
import msgspec
from msgspec import Meta, Struct

from agent.config import PlaneSettings
from agent.plane_link.sync import PlaneRefused
from certs import write_atomic
from netkit import tracing
from netkit.backoff import Backoff
from plane.desired.state import DesiredState

__all__ = ["DESIRED_FILE", "MAX_DESIRED", "MAX_PLACED", "PlaneDown"]

log = logging.getLogger(__name__)

DESIRED_FILE: Final = "plane-desired.json"
MAX_DESIRED: Final = 32 * 1024 * 1024  # bytes of one document (65,536 routes fit)
MAX_PLACED: Final = 4096  # deployment ids remembered as the plane's, newest kept

Handler = Callable[[DesiredState], Awaitable[None]]


class _Persisted(Struct, kw_only=True):
    """What `plane-desired.json` holds."""

    state: DesiredState | None = None
    etag: Annotated[str, Meta(max_length=256)] = ""
    placed: Annotated[list[str], Meta(max_length=MAX_PLACED)] = []


_persisted_decoder: Final = msgspec.json.Decoder(_Persisted)


class PlaneDown:
    """The fetch loop of one agent: `run()` until cancelled."""

    def __init__(
        self,
        settings: PlaneSettings,
        *,
        home: Path,
        handlers: Sequence[Handler],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = settings.url + "/v1/desired"
        self.interval_s = settings.interval_s
        self._ca = settings.ca
        self._token = settings.token
        self.path = home / DESIRED_FILE
        self._handlers = handlers  # PlaneLink.on_desired: read each time, filled after
        self._sleep = sleep
        self._clock = clock
        self.backoff = Backoff(base_s=0.5, cap_s=5.0)
        self.failures = 0  # fetches failed in a row
        self.fetched = 0  # new states taken since start
        self.fetched_at = 0.0  # epoch s of the last answer (200 or 304); 0: none yet
        self.last_error: str | None = None
        held = self._load()
        self.state = held.state
        self.etag = held.etag
        self._placed = dict.fromkeys(held.placed)  # ordered: the oldest first

    # -- the persisted state ------------------------------------------------------------------

    def _load(self) -> _Persisted:
        try:
            return _persisted_decoder.decode(self.path.read_bytes())
        except FileNotFoundError:
            return _Persisted()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.warning("setting %s aside as %s: %s", self.path, aside.name, exc)
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            return _Persisted()

    def placed(self) -> frozenset[str]:
        """The ids of every deployment the plane placed on this cluster (remembered)."""
        return frozenset(self._placed)

    def _take(self, state: DesiredState, etag: str) -> None:
        for d in state.deployments:
            self._placed.pop(d.id, None)
            self._placed[d.id] = None
        while len(self._placed) > MAX_PLACED:
            del self._placed[next(iter(self._placed))]
        self.state, self.etag = state, etag
        body = _Persisted(state=state, etag=etag, placed=list(self._placed))
        write_atomic(self.path, msgspec.json.encode(body))

    # -- the loop -----------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """What `nvpair status` and `/metrics` show of the fetch."""
        state = self.state
        return {
            "desiredFailures": self.failures,
            "desiredFetched": self.fetched,
            "desiredAt": int(self.fetched_at * 1000),
            "desiredGeneration": 0 if state is None else state.generation,
            "desiredDeployments": 0 if state is None else len(state.deployments),
            "desiredError": self.last_error,
        }

    def _tls(self) -> ssl.SSLContext | bool:
        if not self.url.startswith("https://"):
            return True
        if self._ca is None:
            return ssl.create_default_context()
        return ssl.create_default_context(cafile=self._ca)

    async def run(self) -> None:
        """Hand the persisted state over, then fetch every `interval_s` (`[plane]`)."""
        if self.state is not None:
            await self._hand(self.state)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            tls: ssl.SSLContext | bool | None = None
            while True:
                try:
                    tls = self._tls() if tls is None else tls
                    fresh = await self._fetch(session, tls)
                    self.failures = 0
                    self.last_error = None
                    self.fetched_at = self._clock()
                    delay = self.interval_s
                except (aiohttp.ClientError, TimeoutError, OSError, PlaneRefused) as exc:
                    fresh = None
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                    delay = max(0.2, self.backoff.delay(self.failures, random.random))
                    log.info(
                        "plane desired fetch failed (%s); retry in %.1fs", self.last_error, delay
                    )
                if fresh is not None:
                    await self._hand(fresh)
                await self._sleep(delay)

    async def _fetch(
        self, session: aiohttp.ClientSession, tls: ssl.SSLContext | bool
    ) -> DesiredState | None:
        """The new state, or None when the plane says it is the one held (304); a trace of
        its own (docs/metrics.md, "Tracing")."""
        with tracing.span("nvpair.plane.desired", kind="client") as span:
            state = await self._fetch_traced(session, tls)
            if span is not None:
                span.set_attribute("nvpair.plane.changed", state is not None)
            return state

    async def _fetch_traced(
        self, session: aiohttp.ClientSession, tls: ssl.SSLContext | bool
    ) -> DesiredState | None:
        headers = {"Authorization": f"Bearer {self._token}", **tracing.injected()}
        if self.etag and self.state is not None:
            headers["If-None-Match"] = self.etag
        async with session.get(self.url, headers=headers, ssl=tls) as response:
            if response.status == 304:
                return None
            if response.status != 200:
                answer = await response.content.read(200)
                raise PlaneRefused(f"plane answered {response.status}: {answer!r}")
            if (response.content_length or 0) > MAX_DESIRED:
                raise PlaneRefused(f"desired state past {MAX_DESIRED} bytes")
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_DESIRED:
                    raise PlaneRefused(f"desired state past {MAX_DESIRED} bytes")
            etag = response.headers.get("ETag", "")[:256]
        try:
            state = msgspec.json.decode(bytes(body), type=DesiredState)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PlaneRefused(f"the plane's desired state does not decode: {exc}") from None
        self._take(state, etag)
        self.fetched += 1
        return state

    async def _hand(self, state: DesiredState) -> None:
        """Each handler in order; one that fails is logged and the others still run."""
        for handler in list(self._handlers):
            try:
                await handler(state)
            except Exception:  # a handler's bug must not stop the channel
                log.exception("a desired-state handler failed")
