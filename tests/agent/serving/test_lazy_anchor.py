"""A request's prompt is hashed for prefix routing only when a replica ranking asks for its
anchor: a model served by a member's `--engine`s is placed on load and never hashes it."""

from __future__ import annotations

from agent.serving.routing import Anchor, choose, lazy_anchor, replica_views
from facts.deployments import Deployment
from facts.records import Replica
from scheduler import Cluster, DeviceView, EngineView, Load, NodeView
from scheduler.prefix import anchor_of
from tests.fixtures.records import node_record

ME = "nod_me"
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hello there"}]}
DEPLOYED = Deployment(id="dep_" + "0" * 26, name="chat", engine="mock", maxInFlight=4)


def engines_here() -> tuple[Cluster, Load]:
    device = DeviceView(70 << 30, 80 << 30, 10, True, "d0")
    here = NodeView(ME, engines=(EngineView("e", "vllm", frozenset({"chat"})),), devices=(device,))
    cluster = Cluster.compile([here])
    return cluster, Load.of(cluster, {})


def placed(replicas: bool, asked: list[int]) -> object:
    def anchor() -> Anchor:
        asked.append(1)
        return Anchor(b"\x01" * 32)

    records = [node_record(ME)]
    if replicas:
        replica = Replica(
            id="rep_" + "1" * 26, deployment="chat", deploymentId=DEPLOYED.id, spec="s",
            state="ready", port=8000,
        )  # fmt: skip
        records = [node_record(ME, replicas=[replica])]
    views = replica_views(
        records, self_id=ME, reachable=lambda n: True, deployment_of=lambda n: DEPLOYED, now_ms=0
    )
    return choose(
        "chat", replicas=views, pending={}, nodes=engines_here, origin=ME,
        kind_on=lambda node, model: "vllm", anchor=anchor, policy="prefix",
    )  # fmt: skip


def test_a_model_served_by_engines_is_placed_without_hashing_the_prompt() -> None:
    asked: list[int] = []
    targets = placed(replicas=False, asked=asked)
    assert isinstance(targets, list)
    assert targets[0].node_id == ME
    assert asked == []


def test_a_replica_ranking_asks_for_the_anchor_once() -> None:
    asked: list[int] = []
    targets = placed(replicas=True, asked=asked)  # the control: it is asked here
    assert isinstance(targets, list)
    assert targets[0].replica == "rep_" + "1" * 26
    assert targets[0].reason == "prefix"
    assert asked == [1]


def test_a_lazy_anchor_is_the_prompts_anchor_made_once() -> None:
    key = b"k" * 32
    anchor = lazy_anchor(BODY, key, "")
    first = anchor()
    assert first == Anchor(*anchor_of(BODY, key))
    assert anchor() is first
