"""Placement, pure (`plane.placement.decide`): policy and device-class filtering, capacity per node
and per topology domain, reservations, quotas fleet-wide and per cluster, delta-only scale."""

from __future__ import annotations

from collections.abc import Iterable

from plane.placement.decide import (
    Ask,
    ClusterCapacity,
    Decision,
    Policy,
    Quota,
    Reservation,
    Snapshot,
    decide,
)

H100 = "h100-80gb-sxm"
GIB = 1 << 30


def cluster(
    cid: str,
    *nodes: dict[str | None, int],
    device_class: str = H100,
    region: str = "eu-west",
    policies: Iterable[Policy] = (),
    reserved: Iterable[Reservation] = (),
    cost: float = 2.0,
) -> ClusterCapacity:
    """A cluster whose nodes have, per domain id (None: no domain), that many free devices."""
    rows = [
        (f"{cid}-n{i}", device_class, 80 * GIB, domain)
        for i, node in enumerate(nodes)
        for domain, count in node.items()
        for _ in range(count)
    ]
    return ClusterCapacity.build(
        id=cid,
        name=cid.removeprefix("clu_"),
        region=region,
        cost_per_device_hour=cost,
        policies=policies,
        devices=rows,
        reserved=reserved,
    )


def ask(replicas: int, **kw: object) -> Ask:
    base: dict[str, object] = {"workload_id": "wkl_x", "project_id": "prj_p", "device_class": H100}
    return Ask(replicas=replicas, **(base | kw))  # type: ignore[arg-type]


def verdicts(decision: Decision) -> dict[str, tuple[int, str | None, str | None]]:
    return {v.cluster_id: (v.share, v.field, v.reason) for v in decision.verdicts}


def test_policies_of_workload_tenant_and_cluster_all_must_allow() -> None:
    eu_only = Policy.from_spec("plc_eu", {"regions": ["eu-west"]})
    no_c = Policy.from_spec("plc_deny", {"denyClusters": ["c"]})  # by name
    cheap = Policy.from_spec("plc_cheap", {"maxCostPerDeviceHour": 3})
    snapshot = Snapshot(
        [
            cluster("clu_a", {"d": 8}),
            cluster("clu_b", {"d": 8}, region="us-east"),
            cluster("clu_c", {"d": 8}),
            cluster("clu_d", {"d": 8}, cost=4.5),
            # A cluster's own policy: only workloads asking for another class may come.
            cluster(
                "clu_e", {"d": 8}, policies=[Policy.from_spec("plc_e", {"deviceClasses": ["a100"]})]
            ),
        ]
    )
    decision = decide(ask(4, gpus=1, policies=(eu_only, no_c, cheap)), snapshot)
    seen = verdicts(decision)
    assert decision.refusal is None
    assert decision.shares == {"clu_a": 4}  # the control: the one cluster every policy allows
    assert seen["clu_b"][1] == "policy plc_eu"
    assert "'us-east'" in str(seen["clu_b"][2])
    assert seen["clu_c"][1] == "policy plc_deny"
    assert seen["clu_d"][1] == "policy plc_cheap"
    assert "4.5" in str(seen["clu_d"][2])
    assert seen["clu_e"][1] == "policy plc_e"
    # Without the workload's policies the same snapshot spreads it (clu_e still refuses).
    assert set(decide(ask(4, gpus=1), snapshot).shares) == {"clu_a", "clu_b", "clu_c", "clu_d"}


def test_device_class_and_constraints() -> None:
    snapshot = Snapshot(
        [cluster("clu_a", {"d": 8}, device_class="a100"), cluster("clu_b", {"d": 8})]
    )
    seen = verdicts(decide(ask(2), snapshot))
    assert seen["clu_a"][:2] == (0, "deviceClass")
    assert seen["clu_b"][0] == 2
    pinned = decide(ask(1, device_class="a100", clusters=frozenset({"b"})), snapshot)
    assert verdicts(pinned)["clu_a"][1] == "constraints.clusters"
    assert pinned.refusal is not None
    assert pinned.refusal.kind == "capacity"


def test_one_domain_tp4_never_where_no_domain_has_4_free() -> None:
    # clu_a: 4 free devices on one node, but 2 + 2 in two domains; clu_b: 4 in one domain,
    # 2 of them reserved by a one-domain deployment not running yet; clu_c: one domain of 4.
    snapshot = Snapshot(
        [
            cluster("clu_a", {"tpd_1": 2, "tpd_2": 2}),
            cluster("clu_b", {"tpd_3": 4, "tpd_4": 2}, reserved=[Reservation(H100, 2, True, 1)]),
            cluster("clu_c", {"tpd_5": 4}),
        ]
    )
    decision = decide(ask(1, gpus=4, one_domain=True), snapshot)
    seen = verdicts(decision)
    assert decision.shares == {"clu_c": 1}
    assert seen["clu_a"][1] == "constraints.oneDomain"
    assert "the most in one: 2" in str(seen["clu_a"][2])
    # The reservation takes the fuller domain's devices: what is left is 2 and 2.
    assert seen["clu_b"][1] == "constraints.oneDomain"
    # The control: spread over domains, the same 4 devices on clu_a's node do fit.
    assert decide(ask(1, gpus=4), Snapshot(snapshot.clusters[:1])).shares == {"clu_a": 1}
    # And a second TP-4 replica fits nowhere: refused, saying what fits.
    refused = decide(ask(2, gpus=4, one_domain=True), snapshot)
    assert refused.refusal is not None
    assert "1 fit" in refused.refusal.message


def test_a_replica_is_on_one_node() -> None:
    two_nodes = Snapshot([cluster("clu_a", {None: 3}, {None: 3})])
    assert decide(ask(1, gpus=4), two_nodes).refusal is not None
    assert decide(ask(2, gpus=3), two_nodes).shares == {"clu_a": 2}


def test_fleet_quota_refusal_names_the_quota() -> None:
    snapshot = Snapshot(
        [cluster("clu_a", {"d": 8}), cluster("clu_b", {"d": 8})],
        [Quota("qta_fleet", "prj_p", H100, None, max_devices=8, in_use=4)],
    )
    refused = decide(ask(2, gpus=4), snapshot)
    assert refused.refusal is not None
    assert refused.refusal.kind == "quota"
    message = refused.refusal.message
    for part in ("qta_fleet", "prj_p", H100, "scope fleet", "limit 8", "in use 4", "asked 8"):
        assert part in message
    assert refused.shares == {}
    assert decide(ask(1, gpus=4), snapshot).refusal is None  # within it: placed
    # Another project's or another class's quota does not bind this one.
    other = Snapshot(
        snapshot.clusters,
        [Quota("qta_o", "prj_o", H100, None, 0), Quota("qta_c", "prj_p", "a100", None, 0)],
    )
    assert decide(ask(2, gpus=4), other).refusal is None


def test_per_cluster_quota_bounds_that_clusters_share() -> None:
    a, b = cluster("clu_a", {"d": 8}), cluster("clu_b", {"d": 8})
    capped = Quota("qta_a", "prj_p", H100, "clu_a", max_devices=4, in_use=2)
    decision = decide(ask(4, gpus=2), Snapshot([a, b], [capped]))
    assert decision.shares == {"clu_a": 1, "clu_b": 3}  # clu_a's share is held to 1
    assert verdicts(decision)["clu_a"][1] == "quota qta_a"
    # Alone, the rest fits nowhere: refused, naming the quota that binds.
    alone = decide(ask(4, gpus=2), Snapshot([a], [capped]))
    assert alone.refusal is not None
    assert alone.refusal.kind == "capacity"
    assert "qta_a" in alone.refusal.message
    assert "1 fit" in alone.refusal.message


def test_scale_changes_move_only_the_delta() -> None:
    snapshot = Snapshot(
        [cluster("clu_a", {"d": 8}), cluster("clu_b", {"d": 2}), cluster("clu_c", {"d": 4})]
    )
    first = decide(ask(6), snapshot)
    assert first.shares == {"clu_a": 3, "clu_b": 1, "clu_c": 2}  # Webster over 8, 2, 4
    # The current shares' devices are reserved in a real snapshot; here they are not, so the
    # weights are the same and only the added replicas are apportioned.
    up = decide(ask(8, current=first.shares), snapshot)
    assert up.shares == {"clu_a": 4, "clu_b": 1, "clu_c": 3}
    assert up.changed == {"clu_a", "clu_c"}
    down = decide(ask(3, current=first.shares), snapshot)
    assert down.shares == {"clu_a": 1, "clu_b": 1, "clu_c": 1}
    same = decide(ask(6, current=first.shares), snapshot)
    assert same.shares == first.shares
    assert not same.changed
    # A scale down never asks the quota.
    over = Snapshot(snapshot.clusters, [Quota("qta_f", "prj_p", H100, None, 0, in_use=6)])
    assert decide(ask(3, current=first.shares), over).refusal is None
