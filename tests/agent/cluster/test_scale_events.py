"""What elastic deployments did, as a member saw it (`agent.cluster.scale_events`): each
version taken with another count than the one it replaced is a scale-up or scale-down
stamped with the version's own time, reason and signer -- fed from the deployments' store
as versions are taken, so none is missed between two sampling rounds; a member's first
version of a deployment is none; a count that left zero is timed until the first round
that sees a replica ready (a cold start); one that went back to zero first is not; the list
is bounded, the newest kept; what this member signed goes to the plane's event reports
once, what another member signed does not."""

from __future__ import annotations

from pathlib import Path

from agent.cluster.deployments import DeploymentRequest, Deployments
from agent.cluster.scale_events import ScaleEvents
from agent.plane_link.events import EventReports
from certs.ids import new_node_id
from facts.deployments import Deployment, Elastic
from tests.fixtures.records import node_record

HERE, THERE = new_node_id(), new_node_id()


def version(
    n: int, replicas: int, *, at_s: float, reason: str = "waiting", by: str = HERE
) -> Deployment:
    return Deployment(
        id="dep_" + "1" * 26, name="lazy", engine="mock", replicas=replicas, version=n,
        elastic=Elastic(min=0, max=3, reason=reason), updatedAt=int(at_s * 1000), by=by,
    )  # fmt: skip


def play(events: ScaleEvents, *versions: Deployment) -> None:
    before = None
    for taken in versions:
        events.changed(before, taken)
        before = taken


def test_changes_are_told_with_the_versions_time_reason_and_signer() -> None:
    events = ScaleEvents()
    v1 = version(1, 0, at_s=100, reason="declared")
    events.changed(None, v1)
    assert list(events.events) == []  # a first version here is not a change
    v2 = version(2, 1, at_s=110)
    events.changed(v1, v2)
    events.saw(v2, ready=0, now_s=112)
    assert [(e.kind, e.previous, e.replicas, e.reason, e.at) for e in events.events] == [
        ("scale-up", 0, 1, "waiting", 110_000)
    ]
    events.saw(v2, ready=1, now_s=114.25)  # ready: the cold start ends
    cold = events.events[-1]
    assert (cold.kind, cold.seconds, cold.by, cold.reason) == ("cold-start", 4.25, HERE, "waiting")
    events.saw(v2, ready=1, now_s=115)  # once
    v3 = version(3, 3, at_s=120, by=THERE)
    events.changed(v2, v3)  # 1 -> 3: not cold
    events.saw(v3, ready=3, now_s=125)
    events.changed(v3, version(4, 1, at_s=130, reason="quiet", by=THERE))
    events.changed(version(4, 1, at_s=130), version(5, 1, at_s=131, reason="bounds"))  # same
    assert [(e.kind, e.previous, e.replicas, e.by == THERE) for e in events.events] == [
        ("scale-up", 0, 1, False),
        ("cold-start", 0, 1, False),
        ("scale-up", 1, 3, True),
        ("scale-down", 3, 1, True),
    ]
    assert [e.seq for e in events.since(2)] == [3, 4]
    assert events.events[-1].message() == "lazy: 3 -> 1 replica(s) (quiet)"
    assert cold.message() == "lazy: a replica ready 4.2s after a scale-up from 0"


def test_back_to_zero_before_a_replica_came_up_is_no_cold_start() -> None:
    events = ScaleEvents()
    play(
        events,
        version(1, 0, at_s=0),
        version(2, 1, at_s=2),
        version(3, 0, at_s=4, reason="idle"),
    )
    events.saw(version(3, 0, at_s=4), ready=1, now_s=6)  # a late ready reading
    assert [e.kind for e in events.events] == ["scale-up", "scale-down"]
    play(events, version(4, 1, at_s=10))  # a first version again: nothing
    events.forget("lazy")  # undeployed meanwhile: no cold start pending
    events.saw(version(4, 1, at_s=10), ready=1, now_s=11)
    assert len(events.events) == 2


def test_the_list_is_bounded_and_keeps_the_newest() -> None:
    events = ScaleEvents(limit=4)
    play(events, *(version(n, n % 2, at_s=n) for n in range(1, 12)))
    assert len(events.events) == 4
    assert [e.at for e in events.events] == [8_000, 9_000, 10_000, 11_000]


def test_the_store_hands_over_every_version_it_takes_with_the_one_it_replaced(
    tmp_path: Path,
) -> None:
    store = Deployments(tmp_path, sign=lambda d: d)
    seen = ScaleEvents()
    store.on_version = seen.changed
    ask = DeploymentRequest(name="lazy", engine="mock", gpus=0, minReplicas=0, maxReplicas=2)
    store.declare(ask)
    store.scale("lazy", 2, "waiting")
    store.scale("lazy", 1, "quiet")
    (tmp_path / "other").mkdir()
    other = Deployments(tmp_path / "other", sign=lambda d: d)  # a member merging them
    told = ScaleEvents()
    other.on_version = told.changed
    other.merge(store.all())  # its first version: nothing
    store.scale("lazy", 0, "idle")
    other.merge(store.all())
    assert [(e.kind, e.replicas) for e in seen.events] == [
        ("scale-up", 2), ("scale-down", 1), ("scale-down", 0),
    ]  # fmt: skip
    assert [(e.kind, e.replicas, e.reason) for e in told.events] == [("scale-down", 0, "idle")]


def test_the_plane_hears_what_this_member_signed_once(tmp_path: Path) -> None:
    seen = ScaleEvents()
    reports = EventReports(home=tmp_path, plane_url="http://plane", node_id=HERE,
                           scale_events=seen)  # fmt: skip

    def batch(gen: int) -> list[tuple[str, str, str]]:
        sent = reports.fields(node_record(HERE, gen)).get("events", [])
        return [(e.kind, e.about, e.message) for e in sent if e.kind != "node-joined"]

    v2 = version(2, 2, at_s=1)  # signed here
    play(seen, version(1, 0, at_s=0), v2, version(3, 1, at_s=2, reason="quiet", by=THERE))
    assert batch(1) == [("scale-up", "lazy", "lazy: 0 -> 2 replica(s) (waiting)")]
    reports.sent()
    assert batch(2) == []  # accepted: not again; the control: THERE's scale-down never
    seen.saw(v2, ready=1, now_s=3.5)
    assert batch(3) == [
        ("cold-start", "lazy", "lazy: a replica ready 2.5s after a scale-up from 0")
    ]
