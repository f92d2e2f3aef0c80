"""Replica ranking on engine load: every refusal has its reason, a queue gets less new work,
stale reports count as unknown, and no chosen replica is dominated by an eligible one."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import Refusal, ReplicaView, ReportedLoad, rank_replicas


def replica(
    rid: str, *, load: ReportedLoad | None = None, age: float = 0, **kw: object
) -> ReplicaView:
    fields: dict[str, object] = {"node_id": f"node-{rid}", "model": "llama", "kind": "vllm"}
    fields.update(kw)
    # mypy cannot see that `fields` holds ReplicaView's keyword arguments
    return ReplicaView(rid, load=load, load_age_ms=age if load else None, **fields)  # type: ignore[arg-type]


def test_every_refusal_has_its_reason() -> None:
    replicas = [
        replica("r0"),
        replica("r1", model="mistral", reachable=False),
        replica("r2", reachable=False),
        replica("r3", cordoned=True),
        replica("r4", state="starting"),
        replica("r5", kind="sglang"),
    ]
    ranking = rank_replicas("llama", replicas, {}, engine="vllm")
    assert ranking.best == ("r0", "node-r0")
    assert dict(ranking.refused) == {
        "r1": Refusal.MODEL_NOT_SERVED,  # another model: refused for that before its node
        "r2": Refusal.UNREACHABLE,
        "r3": Refusal.CORDONED,
        "r4": Refusal.REPLICA_NOT_READY,
        "r5": Refusal.MODEL_NOT_SERVED,  # not the engine kind asked for
    }
    assert ranking.refusal() is None


def test_the_whole_request_is_refused_with_the_reason_that_got_furthest() -> None:
    none_ready = rank_replicas(
        "llama", [replica("a", state="failed"), replica("b", cordoned=True)], {}
    )
    assert none_ready.best is None
    assert none_ready.refusal() is Refusal.REPLICA_NOT_READY
    assert Refusal.REPLICA_NOT_READY.status == 503
    nobody = rank_replicas("gpt-9", [replica("a")], {})
    assert nobody.refusal() is Refusal.MODEL_NOT_SERVED
    assert Refusal.MODEL_NOT_SERVED.status == 404
    assert rank_replicas("llama", [], {}).refusal() is Refusal.MODEL_NOT_SERVED


def test_a_replica_reporting_a_long_waiting_queue_gets_less_new_work() -> None:
    replicas = {
        "busy": ReportedLoad(running=4, waiting=30, kv_usage=0.9),
        "calm1": ReportedLoad(running=4, waiting=0, kv_usage=0.3),
        "calm2": ReportedLoad(running=3, waiting=0, kv_usage=0.3),
    }
    pending: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    for _ in range(60):  # the report stays as it was; only this member's pending moves
        views = [replica(rid, load=load, age=200) for rid, load in replicas.items()]
        best = rank_replicas("llama", views, pending).best
        assert best is not None
        pending[best[0]] += 1
        sent[best[0]] += 1
    assert sent["busy"] < sent["calm1"] / 4
    assert sent["calm1"] + sent["calm2"] + sent["busy"] == 60
    assert abs(sent["calm1"] - sent["calm2"]) <= 1  # pending spreads the rest evenly


def test_waiting_weighs_more_than_running() -> None:
    running = replica("a", load=ReportedLoad(running=6, waiting=0))
    queued = replica("b", load=ReportedLoad(running=3, waiting=3))
    assert rank_replicas("llama", [running, queued], {}).best == ("a", "node-a")


def test_a_high_kv_usage_is_avoided_when_the_rest_is_equal() -> None:
    full = replica("a", load=ReportedLoad(running=2, waiting=0, kv_usage=0.98))
    roomy = replica("b", load=ReportedLoad(running=2, waiting=0, kv_usage=0.2))
    assert rank_replicas("llama", [full, roomy], {}).best == ("b", "node-b")


def test_capacity_divides_the_work() -> None:
    big = replica("a", capacity=4.0, load=ReportedLoad(running=8, waiting=0))
    small = replica("b", load=ReportedLoad(running=3, waiting=0))
    assert rank_replicas("llama", [big, small], {}).best == ("a", "node-a")
    with pytest.raises(ValueError, match="capacity"):
        replica("c", capacity=0.0)


def test_a_stale_report_is_unknown_not_zero_and_pending_decides() -> None:
    # A replica whose engine stopped answering an hour ago said it was idle then: that
    # must not make it the favourite, nor should its old queue keep it avoided forever.
    stale_idle = replica("a", load=ReportedLoad(0, 0, 0.0), age=3_600_000)
    stale_busy = replica("b", load=ReportedLoad(5, 40, 1.0), age=3_600_000)
    fresh = replica("c", load=ReportedLoad(running=2, waiting=0), age=900)
    ranking = rank_replicas("llama", [stale_idle, stale_busy, fresh], {"a": 1})
    scores = {rid: score for rid, _, score in ranking.ranked}
    assert scores["b"] == scores["c"]  # unknown: the mean of the fresh reports
    assert scores["a"] < scores["b"]  # then its pending counts
    assert [rid for rid, _, _ in ranking.ranked] == ["b", "c", "a"]  # ties by replica id
    only_stale = rank_replicas("llama", [stale_idle, stale_busy], {"b": 2})
    assert only_stale.best == ("a", "node-a")  # nothing fresh: pending alone


def test_the_same_inputs_always_give_the_same_order() -> None:
    views = [replica(f"r{i}") for i in (3, 1, 2)]
    assert [r for r, _, _ in rank_replicas("llama", views, {}).ranked] == ["r1", "r2", "r3"]
    assert rank_replicas("llama", views, {}) == rank_replicas("llama", views[::-1], {})


def test_report_invariants_are_checked_where_it_is_built() -> None:
    with pytest.raises(ValueError, match="negative"):
        ReportedLoad(running=-1, waiting=0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        ReportedLoad(running=0, waiting=0, kv_usage=1.5)


counts = st.integers(min_value=0, max_value=50)
loads = st.builds(
    ReportedLoad,
    running=counts.map(float),
    waiting=counts.map(float),
    kv_usage=st.none() | st.floats(min_value=0.0, max_value=1.0),
)
views = st.lists(
    st.tuples(
        st.sampled_from(["llama", "mistral"]),
        st.sampled_from(["ready", "ready", "starting", "failed"]),
        st.booleans(),
        st.none() | loads,
        st.sampled_from([0.0, 1_000.0, 60_000.0]),
        counts,
    ),
    min_size=1,
    max_size=12,
)


def dominates(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and a != b


@given(views)
def test_the_chosen_replica_is_never_dominated_by_an_eligible_alternative(
    specs: list[tuple[str, str, bool, ReportedLoad | None, float, int]],
) -> None:
    replicas = [
        replica(f"r{i:02d}", model=model, state=state, reachable=reachable, load=load, age=age)
        for i, (model, state, reachable, load, age, _) in enumerate(specs)
    ]
    pending = {f"r{i:02d}": spec[5] for i, spec in enumerate(specs)}
    ranking = rank_replicas("llama", replicas, pending)
    by_id = {r.replica_id: r for r in replicas}
    ranked_ids = {rid for rid, _, _ in ranking.ranked}
    assert ranked_ids | {rid for rid, _ in ranking.refused} == set(by_id)  # all accounted for
    assert not ranked_ids & {rid for rid, _ in ranking.refused}
    for rid in ranked_ids:
        view = by_id[rid]
        assert (view.model, view.state, view.reachable) == ("llama", "ready", True)
    if ranking.best is None:
        return
    chosen = by_id[ranking.best[0]]

    def figures(view: ReplicaView) -> tuple[float, float, float, float]:
        load = view.fresh_load(5_000)
        assert load is not None
        kv = load.kv_usage if load.kv_usage is not None else 0.0
        return (pending[view.replica_id], load.running, load.waiting, kv)

    if chosen.fresh_load(5_000) is None:
        return  # dominance is about known figures
    for rid in ranked_ids - {chosen.replica_id}:
        if by_id[rid].fresh_load(5_000) is not None:
            assert not dominates(figures(by_id[rid]), figures(chosen)), (rid, chosen.replica_id)


small = st.integers(min_value=0, max_value=4)
fresh_specs = st.lists(
    st.tuples(small, small, small, st.none() | st.sampled_from([0.0, 0.5, 1.0])),
    min_size=2,
    max_size=8,
)


@given(fresh_specs)
def test_among_fresh_reports_the_chosen_one_never_has_a_strictly_worse_queue(
    specs: list[tuple[int, int, int, float | None]],
) -> None:
    # Small figures, all eligible and fresh, so dominated alternatives come up often.
    replicas = [
        replica(f"r{i:02d}", load=ReportedLoad(running, waiting, kv), age=100)
        for i, (_, running, waiting, kv) in enumerate(specs)
    ]
    pending = {f"r{i:02d}": spec[0] for i, spec in enumerate(specs)}
    best = rank_replicas("llama", replicas, pending).best
    assert best is not None

    def figures(i: int) -> tuple[float, float, float, float]:
        sent, running, waiting, kv = specs[i]
        return (sent, running, waiting, kv or 0.0)

    chosen = int(best[0][1:])
    for i in range(len(specs)):
        assert not dominates(figures(i), figures(chosen)), (specs, i, chosen)


def test_a_replica_at_its_max_in_flight_is_full_and_only_full_ones_make_a_429() -> None:
    # Ours pending, or the fresh report when it shows more (others' requests); stale: ours.
    limited = [
        replica("a", max_in_flight=4),
        replica("b", max_in_flight=4, load=ReportedLoad(running=3, waiting=1)),
        replica("c", max_in_flight=4, load=ReportedLoad(running=4, waiting=0), age=60_000),
    ]
    ranking = rank_replicas("llama", limited, {"a": 4, "b": 2, "c": 3})
    assert dict(ranking.refused) == {"a": Refusal.QUEUE_FULL, "b": Refusal.QUEUE_FULL}
    assert ranking.best == ("c", "node-c")  # its stale report is unknown: its 3 pending count
    full = rank_replicas("llama", limited, {"a": 4, "b": 2, "c": 4})
    assert full.best is None
    assert full.refusal() is Refusal.QUEUE_FULL
    assert Refusal.QUEUE_FULL.status == 429
    # Full beats a replica that is not ready: the request can wait for the full one.
    mixed = rank_replicas("llama", [limited[0], replica("d", state="starting")], {"a": 4})
    assert mixed.refusal() is Refusal.QUEUE_FULL
    # The control: no limit (0) is never full, whatever it holds.
    free = rank_replicas("llama", [replica("e", load=ReportedLoad(running=900, waiting=0))], {})
    assert free.best == ("e", "node-e")
    with pytest.raises(ValueError, match="max_in_flight"):
        replica("f", max_in_flight=-1)


def test_our_requests_that_ended_since_the_report_free_their_slots_at_once() -> None:
    # The report (read 800 ms ago) saw 4 running: ours then. 3 of ours ended since.
    report = replica("a", max_in_flight=4, load=ReportedLoad(running=4, waiting=0), age=800)
    ranking = rank_replicas("llama", [report], {"a": 1}, pending_then=lambda rid, age: 4)
    assert ranking.best == ("a", "node-a")  # 1 of ours + 0 others: 3 slots free
    # Without what we had then, the report's 4 could be anyone's: full until the next one.
    assert rank_replicas("llama", [report], {"a": 1}).refusal() is Refusal.QUEUE_FULL
    # Others' requests in the report still count: 2 were not ours.
    busy = replica("b", max_in_flight=4, load=ReportedLoad(running=4, waiting=2), age=800)
    crowded = rank_replicas("llama", [busy], {"b": 2}, pending_then=lambda rid, age: 4)
    assert crowded.refusal() is Refusal.QUEUE_FULL  # 2 ours + 2 others = 4
