"""Placement decisions/s over 1,000 clusters with quotas and policies (issue 16, goal >= 1,000/s).

A fleet of 1,000 clusters in four regions and three residencies, each with 1 to 8 nodes of
8 GPUs of one of four classes (in two NVLink domains of 4, or one of 8); some devices held
by running replicas, some reserved by deployments not yet running, a tenth of the clusters
full, a twentieth cordoned off by a cluster policy, costs from 1 to 6 per device-hour. 200
workloads of five tenants (each with its region or cost policy), 1 to 8 GPUs per replica, a
third of them one-domain, 1 to 24 replicas, some scaling from current shares; quotas
fleet-wide and per cluster.

- subject: `plane.placement.decide.decide` over one `Snapshot` built from the device rows once
  (capacity per class, node and domain indexed, fit counts and policy verdicts kept), with
  its screens (every cluster's verdict for one kind of ask) kept across decisions, and
  cleared before each decision (the conservative figure, and the last `ratio:`);
- baseline: the same decisions, each rebuilding every cluster's capacity from the raw device
  rows first (a naive placement with no index).

Rounds alternate (A B C, C B A, ...); each `ratio:` is subject / baseline decisions/s.

    python bench/placement.py [--clusters 1000] [--decisions 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from _interleave import report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plane.placement.decide import (
    Ask,
    ClusterCapacity,
    Policy,
    Quota,
    Reservation,
    Snapshot,
    decide,
)

CLASSES = ("h100-80gb-sxm", "a100-80gb", "l40s-48gb", "h200-141gb")
REGIONS = ("eu-west", "us-east", "us-west", "ap-south")
RESIDENCY = ("eu", "us", "apac")
GIB = 1 << 30

Raw = list[tuple[dict[str, object], list[tuple[str, str, int, str | None]], list[Reservation]]]


def fleet(n: int, rng: random.Random) -> Raw:
    """Every cluster's attributes, free device rows and reservations, as SQL would read."""
    raw: Raw = []
    for i in range(n):
        cid = f"clu_{i:026d}"
        cls = CLASSES[rng.randrange(len(CLASSES))]
        region = REGIONS[i % len(REGIONS)]
        attrs: dict[str, object] = {
            "id": cid,
            "name": f"c{i}",
            "region": region,
            "residency": RESIDENCY[min(i % len(REGIONS), 2)],
            "cost_per_device_hour": rng.choice((1.0, 2.0, 3.5, 6.0)),
            "policies": (),
        }
        if i % 20 == 7:  # cordoned off for one tenant by the admin
            attrs["policies"] = (Policy.from_spec(f"plc_c{i}", {"deviceClasses": ["none"]}),)
        rows: list[tuple[str, str, int, str | None]] = []
        full = i % 10 == 3
        for node in range(rng.randint(1, 8)):
            split = rng.random() < 0.5
            for dev in range(8):
                if full or rng.random() < 0.3:
                    continue  # held by a running replica (allocations): not free
                domain = f"tpd_{i}_{node}_{dev // 4 if split else 0}"
                rows.append((f"nod_{i}_{node}", cls, 80 * GIB, domain))
        reserved = [Reservation(cls, 2, False, rng.randint(0, 2))] if rng.random() < 0.3 else []
        raw.append((attrs, rows, reserved))
    return raw


def build(raw: Raw) -> list[ClusterCapacity]:
    return [
        ClusterCapacity.build(
            id=str(a["id"]),
            name=str(a["name"]),
            region=str(a["region"]),
            residency=str(a["residency"]),
            cost_per_device_hour=float(a["cost_per_device_hour"]),  # type: ignore[arg-type]
            policies=a["policies"],  # type: ignore[arg-type]
            devices=rows,
            reserved=reserved,
        )
        for a, rows, reserved in raw
    ]


def asks(n: int, clusters: list[ClusterCapacity], rng: random.Random) -> list[Ask]:
    tenants = [
        (Policy.from_spec("plc_t0", {"regions": ["eu-west", "us-east"]}),),
        (Policy.from_spec("plc_t1", {"maxCostPerDeviceHour": 3.5}),),
        (Policy.from_spec("plc_t2", {"residency": ["us"], "denyClusters": ["c5", "c9"]}),),
        (Policy.from_spec("plc_t3", {"deviceClasses": list(CLASSES[:2])}),),
        (),
    ]
    out = []
    for i in range(n):
        gpus = rng.choice((1, 2, 4, 8))
        current: dict[str, int] = {}
        if rng.random() < 0.3:  # a scale change from shares it has
            for c in rng.sample(clusters, 3):
                current[c.id] = rng.randint(1, 3)
        out.append(
            Ask(
                workload_id=f"wkl_{i}",
                project_id=f"prj_{i % 40}",
                replicas=rng.randint(1, 24),
                device_class=CLASSES[rng.randrange(len(CLASSES))],
                gpus=gpus,
                one_domain=gpus > 1 and rng.random() < 0.35,
                policies=tenants[i % len(tenants)],
                current=current,
            )
        )
    return out


def quotas(clusters: list[ClusterCapacity], rng: random.Random) -> list[Quota]:
    out = []
    for p in range(40):
        for cls in CLASSES:
            out.append(
                Quota(
                    f"qta_f{p}_{cls}",
                    f"prj_{p}",
                    cls,
                    None,
                    rng.randint(16, 400),
                    rng.randint(0, 64),
                )
            )
            c = rng.choice(clusters)
            out.append(
                Quota(
                    f"qta_c{p}_{cls}", f"prj_{p}", cls, c.id, rng.randint(0, 16), rng.randint(0, 8)
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(16)
    raw = fleet(args.clusters, rng)
    indexed = build(raw)
    limits = quotas(indexed, rng)
    work = asks(200, indexed, rng)
    snapshot = Snapshot(indexed, limits)
    outcomes = [decide(a, snapshot) for a in work]
    placed = sum(1 for d in outcomes if d.refusal is None)
    by_kind = {
        k: sum(1 for d in outcomes if d.refusal and d.refusal.kind == k)
        for k in ("quota", "capacity")
    }
    print(
        f"{args.clusters} clusters, {sum(len(r) for _, r, _ in raw)} free devices, "
        f"{len(limits)} quotas; "
        f"of {len(work)} workloads {placed} placed, {by_kind['quota']} past a quota, "
        f"{by_kind['capacity']} short of capacity"
    )
    # The baseline's decisions must be the subject's: same shares, same refusals.
    for a, d in zip(work[:20], outcomes, strict=False):
        assert decide(a, Snapshot(build(raw), limits)).shares == d.shares

    decisions: int = args.decisions

    def subject() -> float:
        for a in work:  # screens kept: as a long-lived snapshot has them
            decide(a, snapshot)
        start = time.perf_counter()
        for i in range(decisions):
            decide(work[i % len(work)], snapshot)
        return decisions / (time.perf_counter() - start)

    def cold() -> float:
        # The index kept, the screens not: every decision screens all clusters again.
        start = time.perf_counter()
        for i in range(decisions // 4):
            snapshot.screens.clear()
            decide(work[i % len(work)], snapshot)
        return (decisions // 4) / (time.perf_counter() - start)

    def baseline() -> float:
        n = max(1, decisions // 100)  # each naive decision is slow: fewer of them
        start = time.perf_counter()
        for i in range(n):
            decide(work[i % len(work)], Snapshot(build(raw), limits))
        return n / (time.perf_counter() - start)

    # Rounds alternate the order (A B C, C B A, ...); two reports over the same rounds, the
    # conservative one (screens cleared) last.
    base_rates: list[float] = []
    hot_rates: list[float] = []
    cold_rates: list[float] = []
    sides = [(baseline, base_rates), (cold, cold_rates), (subject, hot_rates)]
    for i in range(args.rounds):
        for run, rates in sides if i % 2 == 0 else sides[::-1]:
            rates.append(run())
    report(base_rates, hot_rates, unit="decisions/s", label="screens kept:")
    report(base_rates, cold_rates, unit="decisions/s", label="screens cleared:")


if __name__ == "__main__":
    main()
