"""Ranking: every filter refuses with its reason, scores prefer idle nodes, ties are stable."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler import (
    Cluster,
    DeviceView,
    EngineView,
    Load,
    NodeView,
    Ranking,
    Refusal,
    Request,
    rank,
    top,
)

GIB = 1024**3


def gpus(
    n: int, *, free: int = 70 * GIB, util: float = 10, domain: str = "d0"
) -> tuple[DeviceView, ...]:
    return tuple(DeviceView(free, 80 * GIB, util, True, domain) for _ in range(n))


def node(
    node_id: str, *, models: tuple[str, ...] = ("llama",), kind: str = "vllm", **kw: object
) -> NodeView:
    engines = (EngineView("e", kind, frozenset(models), up=bool(kw.pop("engine_up", True))),)
    devices = kw.pop("devices", gpus(8))
    return NodeView(node_id, engines=engines, devices=devices, **kw)  # type: ignore[arg-type]


def test_every_refusal_has_its_reason() -> None:
    nodes = [
        node("n0"),
        node("n1", member=False),
        node("n2", reachable=False),
        node("n3", cordoned=True),
        node("n4", models=("mistral",)),
        node("n5", engine_up=False),
        node("n6", devices=(DeviceView(70 * GIB, 80 * GIB, 0, False, "d0"),)),
        node("n7", devices=gpus(8, free=1 * GIB)),
    ]
    ranking = rank(Request("llama", memory_bytes=10 * GIB), Cluster.compile(nodes))
    assert ranking.best == "n0"
    assert dict(ranking.refused()) == {
        "n1": "not a member",
        "n2": "unreachable",
        "n3": "cordoned",
        "n4": "does not serve the model",
        "n5": "its engines for the model are down",
        "n6": "no healthy GPU",
        "n7": Refusal.NO_FITTING_DOMAIN,
    }
    # The reasons are the enum (equal to their words); the topology one says what it needed.
    assert all(isinstance(reason, Refusal) for _, reason in ranking.refused())
    assert ranking.reason("n7") == (
        "no single topology domain with 1 healthy GPU(s) of 10.0 GiB free each"
    )
    assert ranking.reason("n3") == "cordoned"
    assert ranking.reason("n0") is None


def test_tensor_parallel_group_must_fit_one_domain() -> None:
    split = gpus(4, domain="a") + gpus(4, domain="b")
    nodes = [node("split", devices=split), node("whole", devices=gpus(8))]
    ranking = rank(Request("llama", gpus=8, memory_bytes=40 * GIB), Cluster.compile(nodes))
    assert ranking.best == "whole"
    assert "no single topology domain with 8" in (ranking.reason("split") or "")


def test_engine_kind_filter() -> None:
    nodes = [node("a", kind="vllm"), node("b", kind="sglang")]
    assert rank(Request("llama", engine="sglang"), Cluster.compile(nodes)).best == "b"


def test_pending_work_dominates_then_utilisation_then_locality() -> None:
    cluster = Cluster.compile([node("a"), node("b"), node("c")])
    load = Load.of(cluster, {"a": 16, "b": 0, "c": 0})
    ranking = rank(Request("llama", origin="c"), cluster, load)
    assert ranking.best == "c"  # b and c idle; c is local
    assert [n for n, _ in ranking.top()] == ["c", "b", "a"]
    load.add("c", 8)
    assert rank(Request("llama", origin="c"), cluster, load).best == "b"
    busy = Cluster.compile(
        [node("a", devices=gpus(8, util=95)), node("b", devices=gpus(8, util=5))]
    )
    assert rank(Request("llama"), busy).best == "b"


def test_no_candidate() -> None:
    ranking = rank(Request("unknown"), Cluster.compile([node("a")]))
    assert ranking.best is None
    assert ranking.top() == []
    assert ranking.refused() == [("a", "does not serve the model")]


def test_models_union() -> None:
    cluster = Cluster.compile([node("a", models=("llama", "qwen")), node("b", models=("qwen",))])
    assert cluster.models() == {"llama": ["a"], "qwen": ["a", "b"]}


@given(st.permutations(["n3", "n1", "n4", "n0", "n2"]))
def test_ties_go_to_the_lowest_node_id_whatever_the_input_order(order: list[str]) -> None:
    ranking = rank(Request("llama"), Cluster.compile([node(n) for n in order]))
    assert ranking.best == "n0"
    assert [n for n, _ in ranking.top()] == ["n0", "n1", "n2", "n3", "n4"]


@given(
    st.lists(
        st.tuples(st.booleans(), st.booleans(), st.integers(0, 8), st.integers(0, 20)),
        min_size=1,
        max_size=30,
    )
)
def test_the_best_is_eligible_and_no_eligible_node_scores_higher(
    specs: list[tuple[bool, bool, int, int]],
) -> None:
    nodes = [
        node(f"n{i:02d}", reachable=reach, cordoned=cord, devices=gpus(n_gpus))
        for i, (reach, cord, n_gpus, _) in enumerate(specs)
    ]
    cluster = Cluster.compile(nodes)
    load = Load.of(cluster, {f"n{i:02d}": p for i, (*_, p) in enumerate(specs)})
    ranking = rank(Request("llama"), cluster, load)
    refused = dict(ranking.refused())
    if ranking.best is None:
        assert len(refused) == len(nodes)
        return
    assert ranking.best not in refused
    best_score = ranking.top(1)[0][1]
    assert all(score <= best_score for _, score in ranking.top(len(nodes)))
    assert len(refused) + len(ranking.top(len(nodes))) == len(nodes)


def test_each_nodes_queue_limit_refuses_it_when_busy() -> None:
    cluster = Cluster.compile([node("a", queue_limit=32), node("b", queue_limit=32)])
    load = Load.of(cluster, {"a": 32, "b": 31})
    ranking = rank(Request("llama"), cluster, load)
    assert ranking.best == "b"
    assert ranking.reason("a") == "queue full"
    load.add("b", 1)
    assert rank(Request("llama"), cluster, load).best is None


def test_each_refusal_maps_to_its_http_status() -> None:
    assert Refusal.QUEUE_FULL.status == 429
    assert Refusal.MODEL_NOT_SERVED.status == 404
    others = set(Refusal) - {Refusal.QUEUE_FULL, Refusal.MODEL_NOT_SERVED}
    assert {r.status for r in others} == {503}
    # The values are today's words: string comparisons elsewhere keep working.
    assert Refusal("queue full") is Refusal.QUEUE_FULL
    as_text: str = Refusal.QUEUE_FULL
    assert as_text == "queue full"
    assert f"{Refusal.CORDONED}" == "cordoned"


def test_the_refusal_of_a_whole_request() -> None:
    cluster = Cluster.compile(
        [node("a", queue_limit=1), node("b", cordoned=True), node("c", reachable=False)]
    )
    assert rank(Request("llama"), cluster).refusal() is None  # a can take it
    busy = Load.of(cluster, {"a": 1})
    assert rank(Request("llama"), cluster, busy).refusal() is Refusal.QUEUE_FULL
    assert rank(Request("mistral"), cluster).refusal() is Refusal.MODEL_NOT_SERVED
    assert rank(Request("llama"), Cluster.compile([])).refusal() is Refusal.MODEL_NOT_SERVED
    down = Cluster.compile([node("b", cordoned=True), node("c", reachable=False)])
    # The node that got furthest (b passed reachability, failed on cordon) decides: 503.
    assert rank(Request("llama"), down).refusal() is Refusal.CORDONED
    assert Refusal.CORDONED.status == 503


def test_a_node_without_any_gpu_serves_with_its_engines() -> None:
    # No NVML (or no device): its engines run on the CPU (llama.cpp) and answer for
    # themselves. A node whose GPUs are all unhealthy is the control: it serves nothing.
    cpu = node("cpu", devices=())
    broken = node("broken", devices=(DeviceView(70 * GIB, 80 * GIB, 0, False, "d0"),))
    ranking = rank(Request("llama"), Cluster.compile([cpu, broken]))
    assert ranking.best == "cpu"
    assert ranking.refused() == [("broken", Refusal.NO_HEALTHY_GPU)]
    # It still obeys every other filter, its queue limit included.
    busy = Load.of(Cluster.compile([node("cpu", devices=(), queue_limit=1)]), {"cpu": 1})
    full = rank(Request("llama"), Cluster.compile([node("cpu", devices=(), queue_limit=1)]), busy)
    assert full.refused() == [("cpu", Refusal.QUEUE_FULL)]


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 8), st.integers(0, 40)), min_size=1, max_size=12
    ),
    st.lists(st.dictionaries(st.integers(0, 11), st.integers(0, 40)), min_size=1, max_size=6),
)
def test_the_remembered_best_nodes_are_what_ranking_says_for_every_load(
    specs: list[tuple[bool, int, int]], loads: list[dict[int, int]]
) -> None:
    # `top` is asked for every request the facade places; it remembers per kind of request
    # and load. Whatever the loads and their order, it answers as `rank` would, now.
    nodes = [
        node(f"n{i:02d}", reachable=reach, devices=gpus(n_gpus), queue_limit=32)
        for i, (reach, n_gpus, _) in enumerate(specs)
    ]
    cluster = Cluster.compile(nodes)
    for pending in [*loads, *loads]:  # each load twice: the second from memory
        load = Load.of(cluster, {f"n{i:02d}": count for i, count in pending.items()})
        ranking = rank(Request("llama", origin="n00"), cluster, load)
        best = top(Request("llama", origin="n00"), cluster, load, 2)
        if ranking.top(2):
            assert best == ranking.top(2)
        else:
            assert isinstance(best, Ranking)
            assert best.refusal() == ranking.refusal()
