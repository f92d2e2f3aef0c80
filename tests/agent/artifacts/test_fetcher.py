"""Fetching an artifact from several members at once (`agent.artifacts.fetcher`, issue 28),
against sources that are other members' stores: the artifact ends byte-identical from a
full and a half source together; a source that sends corrupt pieces never makes a corrupt
artifact resident and is counted; a source that dies mid-transfer is replaced; a restarted
fetch fetches only what it lacks; with no source for a piece the fetch fails, saying so."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from agent.artifacts.fetcher import FetchFailed, FetchFigures, fetch
from agent.artifacts.store import ArtifactStore, describe_files
from agent.core.errors import MemberRefused, MemberUnreachable
from facts.artifacts import Manifest, manifest_digest

PIECE = 64 * 1024


@dataclass
class Members:
    """Other members, each its own store; some misbehave."""

    stores: dict[str, ArtifactStore]
    corrupt: set[str] = field(default_factory=set)  # send every piece with a byte flipped
    dies_after: dict[str, int] = field(default_factory=dict)  # pieces sent, then unreachable
    sent: dict[str, int] = field(default_factory=dict)

    async def artifact_manifest(self, node_id: str, digest: str) -> bytes:
        manifest = self.stores[node_id].manifest(digest)
        if manifest is None:
            raise MemberRefused(node_id, 404)
        return msgspec.json.encode(manifest)

    async def artifact_held(self, node_id: str, digest: str, count: int) -> set[int]:
        self._alive(node_id)
        return self.stores[node_id].held(digest)

    async def artifact_piece(self, node_id: str, digest: str, index: int) -> bytes:
        self._alive(node_id)
        data = self.stores[node_id].read_piece(digest, index)
        if data is None:
            raise MemberRefused(node_id, 404)
        self.sent[node_id] = self.sent.get(node_id, 0) + 1
        if node_id in self.corrupt:
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def _alive(self, node_id: str) -> None:
        if self.sent.get(node_id, 0) >= self.dies_after.get(node_id, 1 << 30):
            raise MemberUnreachable(f"{node_id}: gone")


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, Manifest, str]:
    source = tmp_path / "weights"
    source.mkdir()
    (source / "config.json").write_bytes(b'{"layers": 2}')
    (source / "model.bin").write_bytes(os.urandom(12 * PIECE + 99))
    manifest = describe_files(source, PIECE)
    return source, manifest, manifest_digest(manifest)


def holder(
    root: Path, weights: tuple[Path, Manifest, str], pieces: set[int] | None = None
) -> ArtifactStore:
    """A member's store holding all of the artifact, or only `pieces` of it."""
    source, manifest, digest = weights
    store = ArtifactStore(root)
    store.put_manifest(digest, msgspec.json.encode(manifest))
    full = ArtifactStore(root.with_name(root.name + "-full"))
    full.put_manifest(digest, msgspec.json.encode(manifest))
    full.import_files(source, digest)
    for index in range(manifest.piece_count) if pieces is None else pieces:
        data = full.read_piece(digest, index)
        assert data is not None
        assert store.put_piece(digest, index, data)
    if pieces is None:
        store.assemble(digest)
    return store


def same_files(ready: Path, source: Path) -> bool:
    return all((ready / p.name).read_bytes() == p.read_bytes() for p in source.iterdir())


async def test_a_full_and_a_half_source_together_make_it_whole(
    tmp_path: Path, weights: tuple[Path, Manifest, str]
) -> None:
    source, manifest, digest = weights
    members = Members(
        {
            "a": holder(tmp_path / "a", weights),
            "c": holder(tmp_path / "c", weights, set(range(0, manifest.piece_count, 2))),
        }
    )
    figures = FetchFigures()
    mine = ArtifactStore(tmp_path / "b")
    ready = await fetch(mine, digest, lambda: ["a", "c"], members, per_source=2, figures=figures)
    assert same_files(ready, source)
    assert figures.pieces_fetched == manifest.piece_count
    assert set(figures.bytes_from) == {"a", "c"}  # both served


async def test_a_corrupting_source_is_counted_and_nothing_corrupt_is_kept(
    tmp_path: Path, weights: tuple[Path, Manifest, str]
) -> None:
    source, _, digest = weights
    members = Members(
        {"a": holder(tmp_path / "a", weights), "liar": holder(tmp_path / "liar", weights)},
        corrupt={"liar"},
    )
    figures = FetchFigures()
    ready = await fetch(
        ArtifactStore(tmp_path / "b"), digest, lambda: ["liar", "a"], members, figures=figures
    )
    assert same_files(ready, source)
    assert figures.pieces_refused["liar"] >= 1
    assert "liar" not in figures.bytes_from  # nothing it sent was kept
    # Alone, the liar never makes it resident: the fetch fails, saying why.
    only_liar = Members({"liar": members.stores["liar"]}, corrupt={"liar"})
    alone = ArtifactStore(tmp_path / "d")
    with pytest.raises(FetchFailed, match="held by no member"):
        await fetch(alone, digest, lambda: ["liar"], only_liar, rescan_s=0.01, give_up_s=0.1)
    assert alone.resident(digest) is None


async def test_a_source_that_dies_mid_transfer_is_replaced(
    tmp_path: Path, weights: tuple[Path, Manifest, str]
) -> None:
    source, _, digest = weights
    members = Members(
        {"a": holder(tmp_path / "a", weights), "c": holder(tmp_path / "c", weights)},
        dies_after={"a": 3},
    )
    ready = await fetch(
        ArtifactStore(tmp_path / "b"), digest, lambda: ["a", "c"], members, rescan_s=0.01
    )
    assert same_files(ready, source)
    assert members.sent["a"] == 3


async def test_a_restarted_fetch_fetches_only_what_it_lacks(
    tmp_path: Path, weights: tuple[Path, Manifest, str]
) -> None:
    _, manifest, digest = weights
    members = Members({"a": holder(tmp_path / "a", weights)}, dies_after={"a": 5})
    mine = ArtifactStore(tmp_path / "b")
    with pytest.raises(FetchFailed):  # its only source goes after 5 pieces: the fetch stops
        await fetch(mine, digest, lambda: ["a"], members, in_flight=1, rescan_s=0.01, give_up_s=0.1)
    assert len(mine.held(digest)) == 5
    members.dies_after.clear()
    figures = FetchFigures()
    await fetch(ArtifactStore(tmp_path / "b"), digest, lambda: ["a"], members, figures=figures)
    assert figures.pieces_held_before == 5
    assert figures.pieces_fetched == manifest.piece_count - 5  # none fetched twice


async def test_no_member_with_the_manifest_fails_saying_so(
    tmp_path: Path, weights: tuple[Path, Manifest, str]
) -> None:
    _, _, digest = weights
    members = Members({"a": ArtifactStore(tmp_path / "a")})
    with pytest.raises(FetchFailed, match="no member has the manifest"):
        await fetch(ArtifactStore(tmp_path / "b"), digest, lambda: ["a"], members)
