"""This node's copy of the cluster's deployments: declared here or learnt from members,
kept in `$NVPAIR_HOME/deployments.json` (0600), pushed with every records push.

Declaring, scaling and undeploying sign a new version with this node's key
(`broker.deployments` says how versions converge). A file that cannot be read is set aside
as `deployments.json.corrupt` and the node starts with none: the members push theirs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

import msgspec

from broker.deployments import Constraints, Deployment, DeploymentSet, deployments_decoder
from certs import write_atomic
from plane.ids import new_id

from .errors import AgentError

__all__ = ["DEPLOYMENTS_FILE", "DeploymentRefused", "DeploymentRequest", "Deployments"]

log = logging.getLogger(__name__)

DEPLOYMENTS_FILE: Final = "deployments.json"
_encode: Final = msgspec.json.Encoder().encode


class DeploymentRefused(AgentError):
    """A declaration that cannot be taken (no such deployment, a bad request)."""


class DeploymentRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of `POST /v1/deployments` (`nvpair deploy`): a deployment, less what the
    cluster adds (id, version, signature)."""

    name: str
    engine: str
    source: str = ""
    args: list[str] = []
    gpus: int = 1
    tp: int = 0  # 0: as many as GPUs per replica
    replicas: int = 1
    maxInFlight: int = 0  # 0: no limit
    constraints: Constraints = Constraints()
    authority: str = "managed"
    url: str = ""
    engineKey: str = ""  # "", "generate" or "file:PATH" (broker.deployments)


class Deployments:
    """Declared deployments, persisted; `on_change` runs when the set changes."""

    def __init__(
        self,
        home: Path,
        *,
        sign: Callable[[Deployment], Deployment],
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = home / DEPLOYMENTS_FILE
        self._sign = sign
        self._on_change = on_change
        self._clock = clock
        self.held = DeploymentSet()
        for deployment in self._load():
            self.held.offer(deployment)

    def _load(self) -> list[Deployment]:
        try:
            return deployments_decoder.decode(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.warning("setting %s aside as %s: %s", self.path, aside.name, exc)
            self.path.replace(aside)
            return []

    def _save(self) -> None:
        write_atomic(self.path, _encode(self.held.all()))

    # -- reads --------------------------------------------------------------------------------

    def all(self) -> list[Deployment]:
        """Every version held, tombstones included (what a push carries)."""
        return self.held.all()

    def live(self) -> list[Deployment]:
        """The deployments declared now."""
        return self.held.live()

    def get(self, name: str) -> Deployment | None:
        """The live deployment `name`, or None."""
        held = self.held.get(name)
        return None if held is None or held.deleted else held

    # -- changes ------------------------------------------------------------------------------

    def merge(self, offered: Iterable[Deployment]) -> list[Deployment]:
        """Take the newer versions a member pushed (signatures checked by the caller)."""
        taken = [d for d in offered if self.held.offer(d)]
        if taken:
            self._save()
            for d in taken:
                log.info(
                    "deployment %s %s (version %d, by %s)",
                    d.name,
                    "undeployed" if d.deleted else f"declared: {d.replicas} replica(s)",
                    d.version,
                    d.by,
                )
            self._on_change()
        return taken

    def declare(self, request: DeploymentRequest, *, id: str | None = None) -> Deployment:
        """Declare (or redeclare) a deployment; the version made here. `id`: the plane's
        deployment id (else the held one's, or a fresh one)."""
        held = self.held.get(request.name)
        if id is None:
            id = held.id if held is not None and not held.deleted else new_id("dep")
        try:
            fresh = Deployment(
                id=id,
                name=request.name,
                engine=request.engine,
                source=request.source,
                args=request.args,
                gpus=request.gpus,
                tp=request.tp or max(1, request.gpus),
                replicas=request.replicas,
                maxInFlight=request.maxInFlight,
                constraints=request.constraints,
                authority=request.authority,  # type: ignore[arg-type]  # checked just below
                url=request.url,
                engineKey=request.engineKey,
            )
            fresh = msgspec.convert(msgspec.to_builtins(fresh), Deployment)  # the wire's checks
        except msgspec.ValidationError as exc:
            raise DeploymentRefused(f"bad deployment: {exc}") from None
        if fresh.authority == "observed" and not fresh.url:
            raise DeploymentRefused("an observed deployment names the engine's url")
        return self._commit(fresh)

    def scale(self, name: str, replicas: int) -> Deployment:
        """Change a deployment's replicas only."""
        held = self._live(name)
        if not 0 <= replicas <= 1024:
            raise DeploymentRefused("replicas: between 0 and 1024")
        return self._commit(msgspec.structs.replace(held, replicas=replicas))

    def undeploy(self, name: str) -> Deployment:
        """Undeploy: a tombstone version; its replicas stop everywhere."""
        return self._commit(msgspec.structs.replace(self._live(name), deleted=True))

    def _live(self, name: str) -> Deployment:
        held = self.get(name)
        if held is None:
            raise DeploymentRefused(f"no deployment named {name!r}")
        return held

    def _commit(self, deployment: Deployment) -> Deployment:
        version = msgspec.structs.replace(
            deployment,
            version=self.held.next_version(deployment.name),
            updatedAt=max(int(self._clock() * 1000), self._after(deployment.name)),
        )
        signed = self._sign(version)
        if not self.held.offer(signed):  # cannot happen: the version is the next one
            raise DeploymentRefused(f"{deployment.name}: a newer version arrived meanwhile")
        self._save()
        self._on_change()
        return signed

    def _after(self, name: str) -> int:
        held = self.held.get(name)
        return 0 if held is None else held.updatedAt
