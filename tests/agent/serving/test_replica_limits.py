"""A replica whose deployment this member does not hold yet: its `maxInFlight` is unknown, so
it is counted at its limit -- the request waits in line -- never sent to with no limit."""

from __future__ import annotations

from agent.serving.routing import choose, replica_views
from facts.deployments import Deployment
from facts.records import NodeRecord, Replica
from scheduler import Cluster, Load, Refusal
from tests.fixtures.records import node_record

ME, THERE = "nod_me", "nod_there"
LIMITED = Deployment(id="dep_" + "0" * 26, name="chat", engine="mock", maxInFlight=1)


def record_with_replica() -> NodeRecord:
    replica = Replica(
        id="rep_" + "1" * 26, deployment="chat", deploymentId=LIMITED.id, spec="s",
        state="ready", port=8000,
    )  # fmt: skip
    return node_record(THERE, replicas=[replica])


def no_nodes() -> tuple[Cluster, Load]:
    raise AssertionError("a deployment's model is placed on its replicas, not by node")


def placed(held: Deployment | None, pending: dict[str, int]) -> object:
    views = replica_views(
        [node_record(ME), record_with_replica()],
        self_id=ME,
        reachable=lambda node: True,
        deployment_of=lambda name: held if name == "chat" else None,
        now_ms=0,
    )
    return choose(
        "chat",
        replicas=views,
        pending=pending,
        nodes=no_nodes,
        origin=ME,
        kind_on=lambda node, model: "mock",
    )


def test_a_replica_of_a_deployment_not_held_here_is_at_its_limit() -> None:
    assert placed(None, {}) is Refusal.QUEUE_FULL  # waits: the limit may be 1


def test_once_the_deployment_is_held_its_limit_counts() -> None:
    first = placed(LIMITED, {})
    assert isinstance(first, list)  # the control: placed
    assert first[0].replica == "rep_" + "1" * 26
    assert placed(LIMITED, {"rep_" + "1" * 26: 1}) is Refusal.QUEUE_FULL  # at maxInFlight 1
