"""Deployments: declared, cluster-wide, signed by the member that declared them. Sans-I/O.

A `Deployment` says what should run: the model name clients use, the engine kind and what
it loads, extra engine arguments, GPUs per replica, replicas, the requests a replica takes
at once (`maxInFlight`, for routing: the facade's wait line), where they may go, and who
starts the engines (`managed`: the agents; `observed`: an engine that already runs, watched
and never restarted). Any member may declare, scale or undeploy one (the operator of any
machine owns the cluster, as with removals); each version is a statement signed by the
member that made it (`broker.record_signing.sign_statement`), so members check it against
the cluster CA alone, whoever relays it.

**Convergence.** Deployments are keyed by name. Every edit at a member sets `version` to one
more than the highest it holds for that name; a member takes a version when it is higher in
`(version, updatedAt, by)` order than the one it holds -- the same total order everywhere,
so concurrent edits at two members converge to one of them on every member, whichever
arrives first. An undeploy is a version with `deleted` set (a tombstone: a late copy of an
older version cannot bring the deployment back); tombstones older than `TOMBSTONE_MS` are
forgotten, by then every member has long taken them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "MAX_DEPLOYMENTS",
    "Constraints",
    "Deployment",
    "DeploymentSet",
    "newer",
    "spec_digest",
]

MAX_DEPLOYMENTS: Final = 256  # declared at once in one cluster, tombstones included
TOMBSTONE_MS: Final = 7 * 24 * 3600 * 1000

_Name = Annotated[
    str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]
_Arg = Annotated[str, Meta(max_length=4096)]
Authority = Literal["managed", "observed"]


class Constraints(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where a deployment's replicas may go."""

    node: Annotated[str, Meta(max_length=256)] = ""  # a node id or name; "" anywhere
    deviceClass: Annotated[str, Meta(max_length=64)] = ""  # e.g. h100-80gb-sxm; "" any
    oneDomain: bool = False  # every GPU of a replica in one topology domain
    minMemory: Annotated[int, Meta(ge=0)] = 0  # bytes of memory each GPU must have


class Deployment(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One version of a declared deployment (a signed statement)."""

    id: Annotated[str, Meta(pattern=r"^dep_[0-9a-z]{26}$")]
    name: _Name  # the model name clients use; unique in the cluster
    engine: Annotated[str, Meta(min_length=1, max_length=64)]  # a template: vllm, sglang, ...
    source: Annotated[str, Meta(max_length=4096)] = ""  # what the engine loads: path or id
    args: Annotated[list[_Arg], Meta(max_length=256)] = []
    gpus: Annotated[int, Meta(ge=0, le=64)] = 1  # per replica
    tp: Annotated[int, Meta(ge=1, le=64)] = 1  # tensor-parallel size
    replicas: Annotated[int, Meta(ge=0, le=1024)] = 1
    maxInFlight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0  # per replica; 0: no limit
    constraints: Constraints = Constraints()
    authority: Authority = "managed"
    url: Annotated[str, Meta(max_length=2048)] = ""  # observed: the engine that runs
    # The engine's API key, by reference only (never the key): "" none, "generate" a fresh
    # one per replica, "file:PATH" read on the node that runs it (relative to NVPAIR_HOME).
    engineKey: Annotated[str, Meta(max_length=1024, pattern=r"^(generate|file:[^\x00]+)?$")] = ""
    deleted: bool = False
    version: Annotated[int, Meta(ge=1, le=2**53 - 1)] = 1
    updatedAt: Annotated[int, Meta(ge=0)] = 0  # epoch ms
    by: Annotated[str, Meta(max_length=256)] = ""  # the member that made this version
    byCert: Annotated[str, Meta(max_length=8192)] = ""
    signature: Annotated[str, Meta(max_length=256)] = ""


def _order(d: Deployment) -> tuple[int, int, str]:
    return (d.version, d.updatedAt, d.by)


def newer(candidate: Deployment, held: Deployment | None) -> bool:
    """Whether `candidate` wins over `held` (the convergence order)."""
    return held is None or _order(candidate) > _order(held)


@dataclass
class DeploymentSet:
    """The versions this member holds, one per name."""

    _by_name: dict[str, Deployment] = field(default_factory=dict)

    def offer(self, deployment: Deployment) -> bool:
        """Take `deployment` when it is newer than the version held; returns if taken."""
        held = self._by_name.get(deployment.name)
        if not newer(deployment, held):
            return False
        if held is None and len(self._by_name) >= MAX_DEPLOYMENTS and not self._make_room():
            return False
        self._by_name[deployment.name] = deployment
        return True

    def _make_room(self) -> bool:
        tombstones = [d for d in self._by_name.values() if d.deleted]
        if not tombstones:
            return False
        oldest = min(tombstones, key=lambda d: d.updatedAt)
        del self._by_name[oldest.name]
        return True

    def get(self, name: str) -> Deployment | None:
        """The version held for `name`, tombstones included."""
        return self._by_name.get(name)

    def live(self) -> list[Deployment]:
        """Every declared deployment that is not undeployed, by name."""
        return [d for _, d in sorted(self._by_name.items()) if not d.deleted]

    def all(self) -> list[Deployment]:
        """Every version held, tombstones included, by name (what a push carries)."""
        return [d for _, d in sorted(self._by_name.items())]

    def next_version(self, name: str) -> int:
        """The version an edit of `name` made here gets."""
        held = self._by_name.get(name)
        return 1 if held is None else held.version + 1

    def forget_old_tombstones(self, now_ms: int) -> list[str]:
        """Drop tombstones older than `TOMBSTONE_MS`; the names dropped."""
        old = [
            n for n, d in self._by_name.items() if d.deleted and now_ms - d.updatedAt > TOMBSTONE_MS
        ]
        for name in old:
            del self._by_name[name]
        return old


def spec_digest(deployment: Deployment) -> str:
    """What a replica was started from: engine, source, arguments, GPUs and TP (not the
    replica count -- scaling must not restart anything). A replica whose digest differs
    from its deployment's is replaced."""
    spec: tuple[object, ...] = (
        deployment.id,
        deployment.engine,
        deployment.source,
        deployment.args,
        deployment.gpus,
        deployment.tp,
        deployment.authority,
        deployment.url,
    )
    if deployment.engineKey:  # appended only when set: digests made before it stay the same
        spec = (*spec, deployment.engineKey)
    return hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:16]


def merge(held: DeploymentSet, offered: Iterable[Deployment]) -> list[Deployment]:
    """Offer every deployment; the ones taken."""
    return [d for d in offered if held.offer(d)]


deployments_decoder: Final = msgspec.json.Decoder(list[Deployment])
