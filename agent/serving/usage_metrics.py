"""Requests, tokens, latency and TTFT of the jobs this member originated, for `/metrics`.

`UsageMetrics.count` runs on the request path (the facade's `on_usage`, through
`usage_book`), so it only increments series it already holds.

Every series of a model, key and outcome the member knows exists at zero before its first
request (issue 25): Prometheus' `rate()` and `increase()` take the first sample of a series
as its start, so a series born at the end of a burst of 50 requests loses those 50.
`follow(known)` says what the member knows -- the models it can place (live deployments,
engines' models) and the requesters a request can carry (usable API keys, static keys,
`none` while no key is needed) -- and `sync()` creates the series of each and removes
those of a model or key that went. It runs when a deployment, a key or a member's record
changes, and before each scrape.

Labels are bounded (`metric_labels`): at most `MAX_LABELS` models and keys each, past
them `other`. `requests` and `tokens` are per (model, key) pair, but a cluster with many
keys and models need not pay for every pair it never uses: at most `ZERO_PAIRS` pairs
are held when pairs are created ahead (a scoped key's pairs only with its models);
beyond that a pair's series start at its first request, all of its outcomes at once.
Latency and TTFT are per model only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Final

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.core.metric_aliases import deprecated_gauge
from agent.core.metric_labels import MAX_LABELS, OTHER, FirstSeen
from agent.serving.usage import Meter
from agent.serving.usage_store import UsageStore
from workload_manager.workload import Workload, WorkloadState

if TYPE_CHECKING:
    from agent.cluster.deployments import Deployments
    from agent.serving.key_check import KeyCheck
    from agent.serving.view import SchedulingView

__all__ = [
    "NO_KEY",
    "OUTCOMES",
    "TOKEN_KINDS",
    "ZERO_PAIRS",
    "Known",
    "Scopes",
    "UsageMetrics",
    "known_to",
]

# How a job the facade took ends: the terminal states of seed 002, nothing else.
OUTCOMES: Final = tuple(state for state in WorkloadState if state.is_terminal)
TOKEN_KINDS: Final = ("prompt", "completion")
NO_KEY: Final = "none"  # the requester of a job when the facade needs no key
ZERO_PAIRS: Final = 1024  # (model, key) pairs held at most when creating pairs ahead

Scopes = Mapping[str, frozenset[str] | None]  # requester -> the models it may use (None: any)
Known = Callable[[], tuple[Collection[str], Scopes]]  # (models, requesters) the member knows

# Seconds, tens of ms to minutes: a fast first token on a small model, a long prefill
# after a wait in line, a long generation.
_TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def known_to(deployments: Deployments, view: SchedulingView, keys: KeyCheck) -> Known:
    """What a member knows: the models it can place (its live deployments, the engines'
    models in the records), and its requesters (`none` alone while no key is needed)."""

    def known() -> tuple[Collection[str], Scopes]:
        models = {d.name for d in deployments.live()} | view.current()[0].models().keys()
        return models, keys.scopes() if keys.in_use() else {NO_KEY: None}

    return known


class _Pair:
    """The series of one (model, key): a request counter per outcome, the two token kinds.
    Held so that a job's count does not take `labels()`' lock and tuple (~9 us against ~2)."""

    __slots__ = ("completion", "prompt", "requests")

    def __init__(self, requests: Counter, tokens: Counter, model: str, key: str) -> None:
        self.requests = {state: requests.labels(model, key, state.value) for state in OUTCOMES}
        self.prompt = tokens.labels(model, key, "prompt")
        self.completion = tokens.labels(model, key, "completion")


class UsageMetrics(Collector):
    """Tokens and requests per model and key, TTFT and duration per model."""

    def __init__(self, *, limit: int = MAX_LABELS, zero_pairs: int = ZERO_PAIRS) -> None:
        # registry=None: registered with the local API's registry by the daemon.
        self.tokens = Counter(
            "nvpair_tokens",
            "Tokens the engines reported for jobs this member originated",
            ["model", "key", "kind"],
            registry=None,
        )
        self.requests = Counter(
            "nvpair_requests",
            "Jobs this member originated, by how they ended",
            ["model", "key", "outcome"],
            registry=None,
        )
        self.ttft = Histogram(
            "nvpair_time_to_first_token_seconds",
            "Time to the first streamed byte of an answer, at the origin",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=None,
        )
        self.duration = Histogram(
            "nvpair_request_duration_seconds",
            "Time from a request to the end of its answer, at the origin",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=None,
        )
        self._model = FirstSeen(limit)
        self._key = FirstSeen(limit)
        self._zero_pairs = zero_pairs
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._timed: dict[str, tuple[Histogram, Histogram]] = {}  # model -> (ttft, duration)
        self._known: Known | None = None
        self._synced: object = None  # what the last sync saw, to skip one that changes nothing
        self.store: UsageStore | None = None  # its buffer's gauges, once open

    # -- the known label sets --------------------------------------------------------------

    def follow(self, known: Known) -> None:
        """Hold a series at zero for each model and requester `known()` names, and none for
        one it stops naming (from now on, at each `sync`)."""
        self._known = known
        self.sync()

    def sync(self) -> None:
        """Create the series of what the member knows now; remove those of what went."""
        if self._known is None:
            return
        models, scopes = self._known()
        seen = (frozenset(models), frozenset(scopes.items()))
        if seen == self._synced:
            return
        self._synced = seen
        self._retire(seen[0], scopes)
        labels = [*sorted({self._model(m) for m in sorted(models)} - {OTHER}), OTHER]
        for model in labels:
            self._timed_series(model)
        keys = sorted({self._key(k) if k != NO_KEY else k for k in sorted(scopes)} - {OTHER})
        for model in labels:
            for key in keys:
                if len(self._pairs) >= self._zero_pairs:
                    return
                scope = scopes[key]
                if scope is None or model in scope or model == OTHER:
                    self._pair(model, key)

    def _retire(self, models: Collection[str], keys: Collection[str]) -> None:
        """Remove the series of every model and key not in `models` and `keys`."""
        gone_models = {*self._model.retain(models)}
        gone_keys = {*self._key.retain(keys)}
        for model, key in list(self._pairs):
            if model in gone_models or key in gone_keys or (key == NO_KEY and key not in keys):
                for state in OUTCOMES:
                    self.requests.remove(model, key, state.value)
                for kind in TOKEN_KINDS:
                    self.tokens.remove(model, key, kind)
                del self._pairs[model, key]
        for model in gone_models & self._timed.keys():
            self.ttft.remove(model)
            self.duration.remove(model)
            del self._timed[model]

    def _pair(self, model: str, key: str) -> _Pair:
        pair = self._pairs.get((model, key))
        if pair is None:
            pair = self._pairs[model, key] = _Pair(self.requests, self.tokens, model, key)
        return pair

    def _timed_series(self, model: str) -> tuple[Histogram, Histogram]:
        timed = self._timed.get(model)
        if timed is None:
            timed = self._timed[model] = (self.ttft.labels(model), self.duration.labels(model))
        return timed

    # -- the request path ------------------------------------------------------------------

    def count(self, job: Workload, meter: Meter) -> None:
        """Count one finished job (its state one of `OUTCOMES`)."""
        model = self._model(job.model) if isinstance(job.scheduledOn, str) else OTHER
        key = self._key(job.requesterId) if isinstance(job.requesterId, str) else NO_KEY
        pair = self._pairs.get((model, key))
        timed = self._timed.get(model)
        if pair is None or timed is None:
            pair, timed = self._pair(model, key), self._timed_series(model)
            self._synced = None  # series no sync made: the next one checks they are known
        ttft_series, duration = timed
        pair.requests[job.state].inc()
        if meter.usage is not None:
            pair.prompt.inc(meter.usage.prompt)
            pair.completion.inc(meter.usage.completion)
        ttft, total = meter.ttft_ms(), meter.total_ms()
        if ttft is not None and job.state is WorkloadState.COMPLETED:
            ttft_series.observe(ttft / 1000)
        if total is not None:
            duration.observe(total / 1000)

    # -- the scrape ------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        self.sync()  # an expired key, a record that changed the served models
        for metric in (self.tokens, self.requests, self.ttft, self.duration):
            yield from metric.collect()
        if self.store is not None:
            pending = GaugeMetricFamily(
                "nvpair_usage_rows_pending", "Usage rows buffered, not yet written to usage.db"
            )
            pending.add_metric([], self.store.pending)
            yield pending
            dropped = CounterMetricFamily(
                "nvpair_usage_rows_dropped",
                "Usage rows dropped since the agent started: the buffer was full",
            )
            dropped.add_metric([], self.store.dropped)
            yield dropped
            yield deprecated_gauge("nvpair_usage_rows_dropped", [([], self.store.dropped)])
