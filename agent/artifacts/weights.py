"""This member's artifacts as the rest of the agent sees them (issue 28): what a replica
loads (`need`, the replica controller's `agent.engines.weights.Weights`), what this member's
record says it holds (`holdings`), and where a deployment's weights are in the cluster
(`where`, for `nvpair deploy` and `nvpair explain --deployment`).

The model path an engine gets is the assembled folder, or its one file when the artifact is
a single file (a GGUF for llama.cpp): what `--model` takes in either case.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from agent.artifacts.fetches import RETRY_S, Fetches, FetchRefused
from agent.artifacts.sources import Sources
from agent.cluster.artifacts import Artifacts
from agent.engines.weights import WeightsState
from facts.artifacts import Artifact, Manifest
from facts.records import Holding, NodeRecord

__all__ = ["StoreWeights", "model_path", "where"]

log = logging.getLogger(__name__)

_ABSENT: Final = "absent"
WARM_S: Final = 2.0  # how often the warm set is looked at


def model_path(folder: Path, manifest: Manifest) -> Path:
    """What an engine loads from a resident artifact: its one file, or its folder."""
    return folder / manifest.files[0].path if len(manifest.files) == 1 else folder


class StoreWeights:
    """The artifact facts, this member's store and its fetches, together."""

    def __init__(
        self, artifacts: Artifacts, fetches: Fetches, *, ca_file: Path | None = None
    ) -> None:
        self.artifacts = artifacts
        self.fetches = fetches
        self.sources = Sources(artifacts, fetches, ca_file=ca_file)  # paths, https:// URLs
        # The plane's warm set for this cluster, by digest (`DesiredState.warm`), and each
        # one's plane id and locations (where one the cluster does not know is taken from).
        self.plane_warm: frozenset[str] = frozenset()
        self._plane_entries: list[tuple[str, str, list[str]]] = []

    def set_plane_warm(self, entries: Iterable[tuple[str, str, list[str]]]) -> None:
        """The plane's warm set: (plane artifact id, digest, locations) each."""
        self._plane_entries = [e for e in entries if e[1]]
        self.plane_warm = frozenset(digest for _, digest, _ in self._plane_entries)
        self._said: dict[str, bool] = {}  # digest -> why it is not resident was logged

    def warm(self) -> list[Artifact]:
        """The cluster's warm set: artifacts marked warm (`nvpair artifact warm`) and those
        the plane declares warm, by digest, that the cluster knows."""
        return [a for a in self.artifacts.live() if a.warm or a.digest in self.plane_warm]

    def state_of(self, digest: str) -> tuple[str, float]:
        """`resident`, `fetching` or `missing` here, from the store (verified pieces, not a
        path's existence), with the share of pieces held."""
        store = self.fetches.store
        if store.resident(digest) is not None:
            return "resident", 1.0
        artifact = next((a for a in self.artifacts.live() if a.digest == digest), None)
        progress = self.fetches.progress(digest)
        if artifact is None or progress is None or progress[1]:
            return "missing", 0.0
        return "fetching", progress[0] / max(artifact.pieceCount, 1)

    async def keep_warm(self, interval_s: float = WARM_S) -> None:
        """Until cancelled: every member fetches each artifact of the warm set it lacks, in
        the background (a failed fetch is tried again after `RETRY_S`); one the plane
        declares that the cluster does not know is taken from a location this member
        reaches (`Sources.plane_warm`)."""
        while True:
            for artifact_id, digest, locations in self._plane_entries:
                await self.sources.plane_warm(artifact_id, digest, locations)
            said: dict[str, bool] = {}
            for artifact in self.warm():
                state = await self.need(artifact.digest)
                if state.path is None and state.why and not self._said.get(artifact.digest):
                    log.info("warm artifact %s not resident yet: %s", artifact.name, state.why)
                said[artifact.digest] = bool(state.why)
            self._said = said  # only the warm set's: bounded by it
            await asyncio.sleep(interval_s)  # a cadence, not a sync: the warm set is polled

    async def need(self, digest: str) -> WeightsState:
        """Resident: where (what the engine loads). Else the fetch is started (again after
        `RETRY_S` when it failed) and how far it is."""
        store = self.fetches.store
        ready = await asyncio.to_thread(store.resident, digest)
        manifest = await asyncio.to_thread(store.manifest, digest) if ready else None
        if ready is not None and manifest is not None:
            await asyncio.to_thread(store.touch, digest)  # in use: the last to be evicted
            return WeightsState(
                model_path(ready, manifest), manifest.piece_count, manifest.piece_count
            )
        artifact = next((a for a in self.artifacts.live() if a.digest == digest), None)
        if artifact is None:
            return WeightsState(None, why=f"no artifact {digest[:19]} is known here")
        why = ""
        try:
            await self.fetches.start(digest, artifact.size, retry_s=RETRY_S)
        except FetchRefused as exc:
            why = str(exc)
        progress = self.fetches.progress(digest)
        held, failed = progress if progress is not None else (0, "")
        return WeightsState(None, held, artifact.pieceCount, why or failed)

    def holdings(self) -> list[Holding]:
        """What this member's record says it holds: each known artifact resident here or
        being fetched, with its verified pieces (stat calls only: read every heartbeat)."""
        store, found = self.fetches.store, []
        for artifact in self.artifacts.live():
            if store.resident(artifact.digest) is not None:
                found.append(
                    Holding(
                        digest=artifact.digest, held=artifact.pieceCount, pieces=artifact.pieceCount
                    )
                )
                continue
            progress = self.fetches.progress(artifact.digest)
            if progress is not None and progress[0] > 0:
                held = min(progress[0], artifact.pieceCount)
                found.append(Holding(digest=artifact.digest, held=held, pieces=artifact.pieceCount))
        return sorted(found, key=lambda h: h.digest)


def where(digest: str, records: Iterable[NodeRecord]) -> dict[str, str]:
    """Per member (by name), whether it holds `digest`: `resident`, `fetching 40%` (pieces
    verified) or `absent`, as the members' records say -- `unknown` for a record that says
    nothing of artifacts (the feature is off: a member of 0.1.0 in the cluster)."""
    found: dict[str, str] = {}
    for record in records:
        if not isinstance(record.artifacts, list):
            found[record.name] = "unknown"
            continue
        state = _ABSENT
        for holding in record.artifacts if isinstance(record.artifacts, list) else []:
            if holding.digest != digest:
                continue
            if holding.resident:
                state = "resident"
            else:
                state = f"fetching {100 * holding.held // max(holding.pieces, 1)}%"
        found[record.name] = state
    return found
