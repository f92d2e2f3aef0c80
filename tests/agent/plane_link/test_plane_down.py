"""The desired-state channel's agent side, in memory: the converger's `plan()` (pure), and
`PlaneDown`'s persisted state (handed over at start, a corrupt file set aside)."""

from __future__ import annotations

import stat
from pathlib import Path

import msgspec
import pytest

from agent.cluster.deployments import Deployments
from agent.config import PlaneSettings
from agent.engines.observed import _drift
from agent.plane_link.deployments import Declare, PlaneConverger, Scale, Undeploy, plan, request_for
from agent.plane_link.down import DESIRED_FILE, PlaneDown
from facts.deployments import Deployment
from plane.core.ids import new_id
from plane.desired.state import DesiredDeployment, DesiredState


def _desired(name: str, replicas: int = 2, **kw: object) -> DesiredDeployment:
    return msgspec.convert(
        {
            "id": new_id("dep"),
            "workload": new_id("wkl"),
            "name": name,
            "engine": "mock",
            "gpus": 0,
            "replicas": replicas,
            **kw,
        },
        DesiredDeployment,
    )


def _state(*deployments: DesiredDeployment) -> DesiredState:
    return DesiredState(cluster=new_id("clu"), generation=1, deployments=list(deployments))


def _unsigned(d: Deployment) -> Deployment:
    return d


async def test_converging_declares_scales_undeploys_and_then_makes_no_version(
    tmp_path: Path,
) -> None:
    store = Deployments(tmp_path, sign=_unsigned)
    chat, embed = _desired("chat", 2), _desired("embed", 1)
    placed = {chat.id, embed.id}
    converge = PlaneConverger(store, placed=lambda: placed)
    await converge(_state(chat, embed))
    assert {d.name: (d.id, d.replicas) for d in store.live()} == {
        "chat": (chat.id, 2),
        "embed": (embed.id, 1),
    }
    versions = [d.version for d in store.all()]
    await converge(_state(chat, embed))  # converged: nothing new
    assert [d.version for d in store.all()] == versions
    assert converge.applied == 2
    # Scale chat only; embed no longer listed: undeployed (the plane placed it).
    scaled = msgspec.structs.replace(chat, replicas=3)
    actions, conflicts = plan([scaled], store.live(), placed)
    assert (actions, conflicts) == ([Scale("chat", 3), Undeploy("embed")], {})
    await converge(_state(scaled))
    assert {d.name: d.replicas for d in store.live()} == {"chat": 3}
    # Paused: 0 replicas, the declaration stays.
    await converge(_state(msgspec.structs.replace(scaled, paused=True)))
    assert store.get("chat") is not None
    assert store.get("chat").replicas == 0  # type: ignore[union-attr]


async def test_a_cluster_edit_of_a_plane_deployment_is_undone_on_the_next_round(
    tmp_path: Path,
) -> None:
    store = Deployments(tmp_path, sign=_unsigned)
    chat = _desired("chat", 2)
    state = _state(chat)
    converge = PlaneConverger(store, placed=lambda: {chat.id})
    await converge(state)
    store.scale("chat", 7)  # `nvpair scale` in the cluster
    rounds = 0

    async def one_round(delay: float) -> None:
        nonlocal rounds
        rounds += 1
        if rounds > 1:
            raise StopAsyncIteration

    with pytest.raises(StopAsyncIteration):
        await converge.run(lambda: state, one_round)
    assert store.get("chat").replicas == 2  # type: ignore[union-attr]


async def test_a_workload_on_load_is_declared_with_its_shares_as_bounds_and_its_count_left(
    tmp_path: Path,
) -> None:
    store = Deployments(tmp_path, sign=_unsigned)
    lazy = _desired("lazy", 3, minReplicas=1)  # this cluster's shares: max 3, min 1
    gate = {"open": False}
    converge = PlaneConverger(store, placed=lambda: {lazy.id}, elastic=lambda: gate["open"])
    await converge(_state(lazy))
    held = store.get("lazy")
    assert held is not None
    assert (held.scaling, held.replicas) == (None, 3)  # a member without bounds: its max
    gate["open"] = True
    await converge(_state(lazy))
    held = store.get("lazy")
    assert held is not None
    assert held.scaling is not None
    assert (held.scaling.min, held.scaling.max, held.replicas) == (1, 3, 3)
    store.scale("lazy", 1, "quiet")  # the cluster's decider, on load
    versions = [d.version for d in store.all()]
    await converge(_state(lazy))  # the count is the cluster's now: no version
    assert [d.version for d in store.all()] == versions
    assert store.get("lazy").replicas == 1  # type: ignore[union-attr]
    # New shares are new bounds; the count moves inside them.
    actions, _ = plan([msgspec.structs.replace(lazy, minReplicas=2)], store.live(), {lazy.id},
                      elastic=True)  # fmt: skip
    assert [type(a) for a in actions] == [Declare]
    await converge(_state(msgspec.structs.replace(lazy, minReplicas=2)))
    held = store.get("lazy")
    assert held is not None
    assert held.scaling is not None
    assert (held.scaling.min, held.scaling.max, held.replicas) == (2, 3, 2)
    # Paused: a fixed 0, as any paused deployment; a fixed workload never gets bounds.
    assert request_for(msgspec.structs.replace(lazy, paused=True), elastic=True).replicas == 0
    assert request_for(_desired("fixed", 2), elastic=True).minReplicas is None


def test_a_cluster_deployment_not_from_the_plane_is_left_alone_and_reported(
    tmp_path: Path,
) -> None:
    store = Deployments(tmp_path, sign=_unsigned)
    ours = _desired("chat")
    local = store.declare(request_for(_desired("chat", 5)))  # declared in the cluster
    other = store.declare(request_for(_desired("other", 1)))  # never the plane's
    actions, conflicts = plan([ours], store.live(), placed={ours.id})
    assert actions == []
    assert local.id in conflicts["chat"]
    # Control: once the local one is undeployed, the plane's is declared.
    store.undeploy("chat")
    actions, _ = plan([ours], store.live(), placed={ours.id})
    assert actions == [Declare(ours.id, request_for(ours))]
    assert other.name not in {a.name for a in actions if isinstance(a, Undeploy)}


def test_an_observed_deployment_is_declared_with_its_url_on_its_node() -> None:
    d = _desired("seen", 1, authority="observed", url="http://127.0.0.1:9", node="e1")
    request = request_for(d)
    assert (request.authority, request.url, request.constraints.node) == (
        "observed",
        "http://127.0.0.1:9",
        "e1",
    )


def test_drift_names_what_the_engine_serves() -> None:
    d = Deployment(id=new_id("dep"), name="chat", engine="mock", source="org/chat")
    assert _drift(d, ["org/chat"]) == ""
    assert _drift(d, ["chat"]) == ""
    assert _drift(d, None) == ""
    assert _drift(d, ["org/other"]) == "the engine serves org/other, not org/chat"


SETTINGS = PlaneSettings(url="http://127.0.0.1:9", token="hgro1.x")


async def test_the_persisted_state_is_handed_over_at_start_and_a_corrupt_one_set_aside(
    tmp_path: Path,
) -> None:
    handed: list[DesiredState] = []

    async def take(state: DesiredState) -> None:
        handed.append(state)

    down = PlaneDown(SETTINGS, home=tmp_path, handlers=[take])
    state = _state(_desired("chat"))
    down._take(state, '"e1"')
    path = tmp_path / DESIRED_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = PlaneDown(SETTINGS, home=tmp_path, handlers=[take])
    assert (again.state, again.etag) == (state, '"e1"')
    assert again.placed() == {state.deployments[0].id}

    async def no_sleep(delay: float) -> None:
        raise StopAsyncIteration  # one round only: the plane at port 9 does not answer

    again._sleep = no_sleep
    with pytest.raises(StopAsyncIteration):
        await again.run()
    assert handed == [state]  # handed before the first fetch, which failed
    assert again.failures == 1
    path.write_bytes(b"{not json")
    fresh = PlaneDown(SETTINGS, home=tmp_path, handlers=[take])
    assert fresh.state is None
    assert (tmp_path / (DESIRED_FILE + ".corrupt")).read_bytes() == b"{not json"
