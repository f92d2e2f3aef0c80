"""How busy each engine is, read from its Prometheus `/metrics` (issue 13, item 5).

`parse_engine_load(text, at_ms)` is pure: it reads the running and waiting request counts and
the KV-cache share from vLLM, SGLang or llama.cpp text into an `EngineLoad`. Series of one
metric are summed (one per `model_name`, or per engine core in vLLM's data-parallel mode);
the KV share is the largest of them, since one full cache is what stalls its requests.
`LoadScraper` polls a set of engines about once a second, all at once, each with its own
timeout, and keeps the last load each answered; an engine that stops answering keeps its
old load, whose `at_ms` ages until the ranker treats it as unknown. `ReplicaLoad` is the
compact form a node record carries to the other members.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Final

import aiohttp
from msgspec import Meta, Struct
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.auth import EngineAuth

__all__ = [
    "DIALECTS",
    "EngineLoad",
    "EngineMetricsError",
    "LoadScraper",
    "ReplicaLoad",
    "parse_engine_load",
]

log = logging.getLogger(__name__)

MAX_METRICS_BYTES: Final = 2 * 1024 * 1024  # vLLM with every histogram is ~100-300 KB
SCRAPE_S: Final = 1.0
SCRAPE_TIMEOUT_S: Final = 0.8  # under SCRAPE_S, so a hung engine never delays a round
MAX_CONCURRENT_SCRAPES: Final = 64
MAX_TARGETS: Final = 4096


class EngineMetricsError(ValueError):
    """The engine's `/metrics` could not be read as load: the engine's doing, not ours."""


@dataclass(frozen=True, slots=True)
class Dialect:
    """One engine family's metric names for the same three figures."""

    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # first one present wins (vLLM renamed its gauge)
    # Prompt units looked up in the prefix cache (the sum of these counters) and found
    # there, counted since the engine started (none: the engine does not count them).
    cache_queries: tuple[str, ...] = ()
    cache_hits: str = ""


DIALECTS: Final = {
    "vllm": Dialect(
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("vllm:prefix_cache_queries_total",),
        "vllm:prefix_cache_hits_total",
    ),
    "sglang": Dialect("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    # Current llama-server builds no longer export the KV ratio; older ones did.
    # Its prompt tokens: those evaluated, and those reused from a slot's cache.
    "llamacpp": Dialect(
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        ("llamacpp:kv_cache_usage_ratio",),
        ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
        "llamacpp:prompt_tokens_cached_total",
    ),
}
_WANTED: Final = frozenset(
    name
    for d in DIALECTS.values()
    for name in (d.running, d.waiting, *d.kv_usage, *d.cache_queries, d.cache_hits)
    if name
)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Requests running and waiting in one engine, its KV-cache share (0-1, None when the
    engine does not say), and when it was read (epoch ms); and its prefix-cache counters
    (prompt units looked up, and found), None when it does not count them."""

    running: float
    waiting: float
    kv_usage: float | None
    at_ms: int
    cache_queries: float | None = None
    cache_hits: float | None = None


def parse_engine_load(text: str | bytes, *, at_ms: int) -> EngineLoad:
    """The load in one `/metrics` answer; `EngineMetricsError` for anything unreadable."""
    if len(text) > MAX_METRICS_BYTES:
        raise EngineMetricsError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EngineMetricsError("metrics are not UTF-8") from exc
    values = _wanted_samples(text)
    for dialect in DIALECTS.values():
        if dialect.running in values or dialect.waiting in values:
            kv = next((values[n] for n in dialect.kv_usage if n in values), None)
            return EngineLoad(
                running=sum(values.get(dialect.running, [])),
                waiting=sum(values.get(dialect.waiting, [])),
                kv_usage=min(1.0, max(kv)) if kv else None,
                at_ms=at_ms,
                cache_queries=_summed(values, *dialect.cache_queries),
                cache_hits=_summed(values, dialect.cache_hits),
            )
    raise EngineMetricsError("no load metrics (expected one of " + ", ".join(sorted(_WANTED)) + ")")


def _summed(values: dict[str, list[float]], *names: str) -> float | None:
    # Every series of every name, or None when one of them (or all: none named) is missing.
    if not names or not all(name in values for name in names):
        return None
    return sum(sum(values[name]) for name in names)


def _wanted_samples(text: str) -> dict[str, list[float]]:
    """Every value of the metrics we read, by name. Only their lines reach the parser: an
    engine's hundreds of histogram lines cost nothing, and garbage in a series we do not
    read cannot hide the ones we do."""
    lines = [line for line in text.splitlines() if _is_wanted(line)]
    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in _WANTED:
                    found.setdefault(sample.name, []).append(_count(sample.name, sample.value))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise EngineMetricsError(f"unreadable metrics: {exc}") from exc
    return found


def _is_wanted(line: str) -> bool:
    name, _, _ = line.lstrip().partition("{")
    return name.split(" ", 1)[0].split("\t", 1)[0] in _WANTED


def _count(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise EngineMetricsError(f"{name} is {value}, not a count")
    return float(value)


class ReplicaLoad(Struct, kw_only=True, frozen=True):
    """One replica's engine load as a node record carries it to the other members."""

    replicaId: Annotated[str, Meta(min_length=1, max_length=256)]
    running: Annotated[float, Meta(ge=0)]
    waiting: Annotated[float, Meta(ge=0)]
    kvUsage: Annotated[float, Meta(ge=0, le=1)] | None = None
    atMs: Annotated[int, Meta(ge=0)]  # epoch ms the engine was read

    @classmethod
    def of(cls, replica_id: str, load: EngineLoad) -> ReplicaLoad:
        """The record form of `load`."""
        return cls(
            replicaId=replica_id,
            running=load.running,
            waiting=load.waiting,
            kvUsage=load.kv_usage,
            atMs=load.at_ms,
        )

    def engine_load(self) -> EngineLoad:
        """Back to the form the ranker reads."""
        return EngineLoad(self.running, self.waiting, self.kvUsage, self.atMs)


def _epoch_ms() -> int:
    return int(time.time() * 1000)


class LoadScraper:
    """Polls `targets()` (replica id -> engine base URL) every `SCRAPE_S`: `scrape()` runs
    one round, `run()` runs them forever, `current()` is the last load each engine gave."""

    def __init__(
        self,
        targets: Callable[[], Mapping[str, str]],
        *,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        clock_ms: Callable[[], int] = _epoch_ms,
        auth: EngineAuth | None = None,
        label_of: Callable[[str], str] = str,
    ) -> None:
        self._auth = auth or EngineAuth()
        # Prefix-cache counters summed by label (a replica's deployment): what each engine
        # counted since the last read, an engine that restarted counting from zero.
        self._label_of = label_of
        self._cache_seen: dict[str, tuple[float, float]] = {}  # replica -> last (q, h)
        self.cache_totals: dict[str, list[float]] = {}  # label -> [queries, hits]
        self._targets = targets
        self._timeout_s = timeout_s
        self._clock_ms = clock_ms
        self._loads: dict[str, EngineLoad] = {}
        self.failures: dict[str, str] = {}  # replica id -> why its last scrape failed
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_SCRAPES)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LoadScraper:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def current(self) -> dict[str, EngineLoad]:
        """The last load read from each target (a copy); a target never read is absent."""
        return dict(self._loads)

    async def run(self, interval_s: float = SCRAPE_S) -> None:
        """Scrape every `interval_s`, forever (cancel to stop)."""
        while True:
            started = time.monotonic()
            await self.scrape()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def scrape(self) -> None:
        """Read every target's `/metrics` at once; each is bounded by its own timeout."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                connector=aiohttp.TCPConnector(limit=MAX_CONCURRENT_SCRAPES),
                middlewares=(self._auth.middleware,),  # an engine's API key, if it has one
            )
        targets = dict(list(self._targets().items())[:MAX_TARGETS])
        for gone in self._loads.keys() - targets.keys():
            del self._loads[gone]
        for gone in self.failures.keys() - targets.keys():
            del self.failures[gone]
        for gone in self._cache_seen.keys() - targets.keys():
            del self._cache_seen[gone]
        await asyncio.gather(*(self._scrape_one(rid, url) for rid, url in targets.items()))

    async def _scrape_one(self, replica_id: str, url: str) -> None:
        assert self._session is not None
        async with self._limit:
            try:
                async with asyncio.timeout(self._timeout_s):
                    text = await self._fetch(url.rstrip("/") + "/metrics")
                load = parse_engine_load(text, at_ms=self._clock_ms())
            except (aiohttp.ClientError, TimeoutError, OSError, EngineMetricsError) as exc:
                why = str(exc) or type(exc).__name__
                if self.failures.get(replica_id) != why:
                    log.info("engine load of %s unknown: %s", replica_id, why)
                self.failures[replica_id] = why
                return
        self._loads[replica_id] = load
        self.failures.pop(replica_id, None)
        if load.cache_queries is not None and load.cache_hits is not None:
            self._count_cache(replica_id, load.cache_queries, load.cache_hits)

    def _count_cache(self, replica_id: str, queries: float, hits: float) -> None:
        last_q, last_h = self._cache_seen.get(replica_id, (0.0, 0.0))
        self._cache_seen[replica_id] = (queries, hits)
        if queries < last_q or hits < last_h:  # the engine restarted: its count from zero
            last_q = last_h = 0.0
        label = self._label_of(replica_id)
        totals = self.cache_totals.get(label)
        if totals is None:
            if len(self.cache_totals) >= MAX_TARGETS:
                return
            totals = self.cache_totals[label] = [0.0, 0.0]
        totals[0] += queries - last_q
        totals[1] += min(hits - last_h, queries - last_q)

    async def _fetch(self, url: str) -> bytes:
        assert self._session is not None
        async with self._session.get(url) as response:
            if response.status != 200:
                raise EngineMetricsError(f"/metrics answered {response.status}")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > MAX_METRICS_BYTES:
                    raise EngineMetricsError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
