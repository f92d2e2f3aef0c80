"""Declaring a deployment that scales on load (issue 30, item 1), in memory: its bounds and
policy travel in the signed fact, its count starts at the bounds' low end and stays within
them, a fixed deployment carries no `elastic` field at all (members of 0.1.0 refuse one they
do not know), and scaling never changes what a replica was started from."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from agent.cluster.deployments import DeploymentRefused, DeploymentRequest, Deployments
from facts.deployments import Deployment, spec_digest


def _unsigned(d: Deployment) -> Deployment:
    return msgspec.structs.replace(d, by="nod_x", signature="")


def _store(tmp_path: Path) -> Deployments:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Deployments(tmp_path, sign=_unsigned)


def _ask(**kw: object) -> DeploymentRequest:
    return DeploymentRequest(name="chat", engine="mock", source="m", **kw)  # type: ignore[arg-type]


def test_a_fixed_deployment_has_no_elastic_field_on_the_wire(tmp_path: Path) -> None:
    made = _store(tmp_path).declare(_ask(replicas=2))
    assert made.scaling is None
    assert b"elastic" not in msgspec.json.encode(made)  # a 0.1.0 member still reads it
    assert made.replicas == 2
    assert _store(tmp_path / "b").declare(_ask()).replicas == 1  # the default stays 1


def test_bounds_start_at_min_and_travel_in_the_fact(tmp_path: Path) -> None:
    made = _store(tmp_path).declare(
        _ask(minReplicas=1, maxReplicas=4, targetWaiting=2, scaleDownAfterS=60, idleToZeroS=600)
    )
    bounds = made.scaling
    assert bounds is not None
    assert (bounds.min, bounds.max, bounds.targetWaiting) == (1, 4, 2)
    assert (bounds.scaleDownAfterS, bounds.idleToZeroS, bounds.reason) == (60, 600, "declared")
    assert made.replicas == 1
    again = msgspec.json.decode(msgspec.json.encode(made), type=Deployment)
    assert again.scaling == bounds


def test_min_zero_starts_with_no_replica_and_max_defaults_to_min(tmp_path: Path) -> None:
    assert _store(tmp_path).declare(_ask(minReplicas=0, maxReplicas=2)).replicas == 0
    only_min = _store(tmp_path / "b").declare(_ask(minReplicas=3))
    assert only_min.scaling is not None
    assert (only_min.scaling.min, only_min.scaling.max, only_min.replicas) == (3, 3, 3)


@pytest.mark.parametrize(
    ("asked", "words"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "more than maxReplicas"),
        ({"minReplicas": 1, "maxReplicas": 2, "replicas": 5}, "outside 1..2"),
        ({"minReplicas": -1, "maxReplicas": 2}, "bad bounds"),
        ({"minReplicas": 0, "maxReplicas": 2000}, "bad bounds"),
        ({"minReplicas": 0, "maxReplicas": 2, "scaleDownAfterS": 0}, "bad bounds"),
        ({"minReplicas": 0, "maxReplicas": 2, "targetWaiting": -1}, "bad bounds"),
    ],
)
def test_bad_bounds_are_refused_with_why(
    tmp_path: Path, asked: dict[str, object], words: str
) -> None:
    store = _store(tmp_path)
    with pytest.raises(DeploymentRefused, match=words):
        store.declare(_ask(**asked))
    assert store.get("chat") is None  # nothing was made


def test_scaling_stays_within_bounds_says_why_and_restarts_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    made = store.declare(_ask(minReplicas=0, maxReplicas=3))
    grown = store.scale("chat", 2, reason="waiting")
    assert grown.replicas == 2
    assert grown.scaling is not None
    assert grown.scaling.reason == "waiting"
    assert grown.version == made.version + 1
    assert spec_digest(grown) == spec_digest(made)  # no replica is replaced for a count
    with pytest.raises(DeploymentRefused, match="between 0 and 3"):
        store.scale("chat", 4)
    assert store.get("chat") == grown  # the refusal changed nothing
    # A redeclaration (other engine args, say) keeps the count it has now, within bounds.
    kept = store.declare(_ask(minReplicas=0, maxReplicas=3, args=["--x"]))
    assert kept.replicas == 2
    narrowed = store.declare(_ask(minReplicas=0, maxReplicas=1))
    assert narrowed.replicas == 1
