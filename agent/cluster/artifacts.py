"""This node's copy of the cluster's artifacts (issue 28): the signed facts that name weights
by digest, kept in `$NVPAIR_HOME/artifacts.json` (0600) and pushed with every records
push, as deployments are (`agent.cluster.signed_facts`). The weights themselves are in the
store (`agent.artifacts.store`); a member fetches them from the members that hold them.
"""

from __future__ import annotations

from typing import Final

import msgspec

from agent.cluster.signed_facts import FactRefused, SignedFacts
from facts.artifacts import Artifact, ArtifactSet, Manifest, manifest_digest
from plane.core.ids import new_id

__all__ = ["ARTIFACTS_FILE", "ArtifactRefused", "Artifacts"]

ARTIFACTS_FILE: Final = "artifacts.json"


class ArtifactRefused(FactRefused):
    """An artifact that cannot be named or forgotten (a bad name, no such artifact)."""


class Artifacts(SignedFacts[Artifact]):
    """Named artifacts, persisted (`SignedFacts`); adding and forgetting make signed
    versions."""

    file = ARTIFACTS_FILE
    refused = ArtifactRefused

    def new_set(self) -> ArtifactSet:
        """An empty set of artifacts."""
        return ArtifactSet()

    def get(self, name_or_id: str) -> Artifact | None:
        """The live artifact of that name (or id), or None."""
        held = self.held.get(name_or_id)
        if held is None:
            held = next((a for a in self.held.live() if a.id == name_or_id), None)
        return None if held is None or held.deleted else held

    def add(self, name: str, manifest: Manifest) -> Artifact:
        """Name the artifact `manifest` describes `name`; the version made here. A name
        already held for the same digest is answered with what is held."""
        digest = manifest_digest(manifest)
        held = self.get(name)
        if held is not None and held.digest == digest:
            return held
        try:
            fresh = Artifact(
                id=new_id("art"),
                name=name,
                digest=digest,
                size=manifest.size,
                pieceSize=manifest.pieceSize,
                files=len(manifest.files),
                pieceCount=manifest.piece_count,
            )
            fresh = msgspec.convert(msgspec.to_builtins(fresh), Artifact)  # the wire's checks
        except msgspec.ValidationError as exc:
            raise ArtifactRefused(f"bad artifact: {exc}") from None
        return self.commit(fresh)

    def warm(self, name: str, on: bool) -> Artifact:
        """Put the artifact in the cluster's warm set (every member keeps it resident) or
        take it out; the version made here (the held one when nothing changes)."""
        held = self.get(name)
        if held is None:
            raise ArtifactRefused(f"no artifact named {name!r}")
        return held if held.warm == on else self.commit(msgspec.structs.replace(held, warm=on))

    def forget(self, name: str) -> Artifact:
        """Forget the artifact cluster-wide: a tombstone version (members drop their copies
        unless a replica uses them)."""
        held = self.get(name)
        if held is None:
            raise ArtifactRefused(f"no artifact named {name!r}")
        return self.commit(msgspec.structs.replace(held, deleted=True))
