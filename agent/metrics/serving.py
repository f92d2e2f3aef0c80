"""Gauges of the facade and the replicas for `/metrics`, read at scrape time (issue 17).

Nothing here runs on a request's path: each gauge reads what the facade and the replica
controller already keep (the wait lines, the requests in flight per node, this node's
replicas) when Prometheus scrapes. Label values are bounded by what the cluster knows:
a model or deployment label is a live deployment's name, an engine's model or a model
some request was placed for (`metric_labels`); anything else counts as `other`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.core.metric_labels import OTHER, bounded
from facts.deployments import Deployment
from facts.records import Replica

if TYPE_CHECKING:
    from agent.cluster.deployments import Deployments
    from agent.cluster.scaler import Scaler
    from agent.engines.replicas import ReplicaControl
    from agent.engines.tunnel import Counts
    from agent.serving.facade import Facade
    from agent.serving.view import SchedulingView

__all__ = ["REPLICA_STATES", "ServingMetrics", "scaling_metrics", "serving_metrics"]

REPLICA_STATES: Final = ("fetching", "starting", "ready", "failed", "stopping")


class ServingMetrics(Collector):
    """The wait line per model, our requests in flight per node, replicas by state."""

    def __init__(
        self,
        *,
        waiting: Callable[[], Mapping[str, int]],
        in_flight: Callable[[], Mapping[str, int]],
        replicas: Callable[[], Iterable[Replica]],
        deployments: Callable[[], Iterable[Deployment]],
        models: Callable[[], Iterable[str]] = tuple,
        decisions: Callable[[], Mapping[tuple[str, str], int]] = dict,
        cache: Callable[[], Mapping[str, list[float]]] = dict,
        alone: Callable[[], bool] = lambda: False,
        scaling: Callable[[], Iterator[Metric]] = lambda: iter(()),
        tunnels: Callable[[], Mapping[str, Counts]] = dict,
    ) -> None:
        self._tunnels = tunnels  # part -> bytes through its tunnels here (issue 32)
        self._scaling = scaling  # elastic deployments: bounds, changes, cold starts
        self._alone = alone  # some keys' limits admitted alone: their holder is cut off
        self._decisions = decisions  # (model, reason) -> requests this facade sent
        self._cache = cache  # deployment -> [prompt units looked up, found] by its engines here
        self._models = models  # the engines' models the cluster knows (not deployments)
        self._waiting = waiting  # model -> requests in this member's wait line
        self._in_flight = in_flight  # node id -> requests running there through this facade
        self._replicas = replicas  # this node's replicas as its record says them
        self._deployments = deployments  # the live deployments

    def collect(self) -> Iterator[Metric]:
        through = CounterMetricFamily(
            "nvpair_tunnel_bytes",
            "Bytes through the tunnels of a part of a replica across members, by part: sent"
            " towards the worker's engine, received from it",
            labels=["replica", "direction"],
        )
        for part, counts in sorted(self._tunnels().items()):
            through.add_metric([part, "sent"], counts.sent)
            through.add_metric([part, "received"], counts.received)
        yield through
        live = {d.name: d for d in self._deployments()}
        line = GaugeMetricFamily(
            "nvpair_wait_line_requests",
            "Requests waiting in this member's wait line for capacity, by model",
            labels=["model"],
        )
        known = {*live, *self._models()}  # each with a series, 0 while nobody waits
        waiting = dict.fromkeys(known, 0) | _summed(self._waiting(), known)
        for model, count in sorted(waiting.items()):
            line.add_metric([model], count)
        yield line
        flight = GaugeMetricFamily(
            "nvpair_in_flight_requests",
            "Requests running through this member's facade, by the node running them"
            " (this node's own includes what members forwarded here)",
            labels=["node"],
        )
        for node, count in sorted(self._in_flight().items()):
            flight.add_metric([node], count)
        yield flight
        states: dict[tuple[str, str], int] = {
            (name, state): 0 for name in live for state in REPLICA_STATES
        }
        restarts: dict[str, int] = dict.fromkeys(live, 0)
        for replica in self._replicas():
            name = replica.deployment if replica.deployment in live else OTHER
            states[name, replica.state] = states.get((name, replica.state), 0) + 1
            restarts[name] = restarts.get(name, 0) + replica.restarts
        by_state = GaugeMetricFamily(
            "nvpair_replicas",
            "Replicas this node runs, by deployment and state",
            labels=["deployment", "state"],
        )
        for (name, state), count in sorted(states.items()):
            by_state.add_metric([name, state], count)
        yield by_state
        restarted = GaugeMetricFamily(
            "nvpair_replica_restarts",
            "Engine restarts of the replicas this node runs now, by deployment",
            labels=["deployment"],
        )
        for name, count in sorted(restarts.items()):
            restarted.add_metric([name], count)
        yield restarted
        desired = GaugeMetricFamily(
            "nvpair_deployment_desired_replicas",
            "Replicas each live deployment asks for, cluster-wide (the same on every member)",
            labels=["deployment"],
        )
        for name, deployment in sorted(live.items()):
            desired.add_metric([name], deployment.replicas)
        yield desired
        low = GaugeMetricFamily(
            "nvpair_deployment_min_replicas",
            "The fewest replicas each elastic deployment may have",
            labels=["deployment"],
        )
        high = GaugeMetricFamily(
            "nvpair_deployment_max_replicas",
            "The most replicas each elastic deployment may have",
            labels=["deployment"],
        )
        for name, deployment in sorted(live.items()):
            if (bounds := deployment.scaling) is not None:
                low.add_metric([name], bounds.min)
                high.add_metric([name], bounds.max)
        yield low
        yield high
        yield from self._scaling()
        yield from self._routing(known)
        cut_off = GaugeMetricFamily(
            "nvpair_key_limit_alone",
            "1 while this member admits some API keys' requests out of its share alone:"
            " the member that holds their cluster-wide count does not answer",
        )
        cut_off.add_metric([], 1.0 if self._alone() else 0.0)
        yield cut_off

    def _routing(self, known: set[str]) -> Iterator[Metric]:
        decided = CounterMetricFamily(
            "nvpair_routing_decisions",
            "Requests this member's facade sent, by model and why that replica or node:"
            " prefix (its prompt's replica), session (its session's), load, failover",
            labels=["model", "reason"],
        )
        summed: dict[tuple[str, str], int] = {}
        for (model, reason), count in self._decisions().items():
            key = (bounded(model, known), reason)
            summed[key] = summed.get(key, 0) + count
        for (model, reason), count in sorted(summed.items()):
            decided.add_metric([model, reason], count)
        yield decided
        looked = CounterMetricFamily(
            "nvpair_prefix_cache_prompt_units",
            "Prompt units the engines of this node's replicas looked up in their prefix"
            " cache, by deployment (from the engines' own counters)",
            labels=["model"],
        )
        found = CounterMetricFamily(
            "nvpair_prefix_cache_hit_units",
            "Prompt units the engines of this node's replicas found in their prefix cache",
            labels=["model"],
        )
        share = GaugeMetricFamily(
            "nvpair_prefix_cache_hit_share",
            "Share of the prompt units found in the prefix cache since the agent started,"
            " by deployment, for this node's replicas",
            labels=["model"],
        )
        tallies: dict[str, list[float]] = {}
        for name, (queries, hits) in self._cache().items():
            tally = tallies.setdefault(bounded(name, known), [0.0, 0.0])
            tally[0] += queries
            tally[1] += hits
        for name, (queries, hits) in sorted(tallies.items()):
            looked.add_metric([name], queries)
            found.add_metric([name], hits)
            share.add_metric([name], hits / queries if queries else 0.0)
        yield looked
        yield found
        yield share


def _summed(counts: Mapping[str, int], known: Container[str]) -> dict[str, int]:
    """`counts` by bounded label: names past the bound add up under `other`."""
    out: dict[str, int] = {}
    for name, count in counts.items():
        label = bounded(name, known)
        out[label] = out.get(label, 0) + count
    return out


def scaling_metrics(scaler: Scaler, facade: Facade) -> Iterator[Metric]:
    """Elastic deployments' count changes decided here, and their cold starts."""
    changed = CounterMetricFamily(
        "nvpair_scale_changes",
        "Changes of an elastic deployment's count this member decided, by deployment and"
        " reason (waiting, quiet, idle, no room, bounds)",
        labels=["deployment", "reason"],
    )
    for (name, reason), count in sorted(scaler.changes.items()):
        changed.add_metric([name, reason], count)
    yield changed
    yield scaler.cold_starts.family(
        "nvpair_cold_start_seconds",
        "From a scale-up from zero this member decided to the first replica ready",
    )
    yield facade.cold_waits.family(
        "nvpair_cold_start_wait_seconds",
        "How long requests through this member waited for an elastic deployment with no"
        " replica ready to have one",
    )


def serving_metrics(
    facade: Facade,
    control: ReplicaControl,
    deployments: Deployments,
    view: SchedulingView,
    scaler: Scaler | None = None,
) -> ServingMetrics:
    """The collector over the daemon's parts."""
    return ServingMetrics(
        waiting=facade.waits.line.lengths,
        in_flight=lambda: facade.in_flight,
        replicas=control.replicas,
        deployments=deployments.live,
        models=lambda: view.current()[0].models(),
        decisions=lambda: facade.decisions,
        cache=lambda: control.scraper.cache_totals,
        alone=lambda: facade.keys.cluster is not None and facade.keys.cluster.alone(),
        scaling=(lambda: iter(())) if scaler is None else lambda: scaling_metrics(scaler, facade),
        tunnels=control.tunnels.totals,
    )
