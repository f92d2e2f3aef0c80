"""The content-addressed store (`agent.artifacts.store`, issue 28): a manifest is kept only
when it is the one its digest names, a piece only when its hash is the manifest's, an
artifact is resident only whole (assembled, renamed into place in one step), and local
files are imported only when every piece matches."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from agent.artifacts.fetcher import Sources
from agent.artifacts.fetches import Fetches, FetchRefused
from agent.artifacts.store import ArtifactStore, BadManifest, StoreError, describe_files
from facts.artifacts import Manifest, ManifestFile, manifest_digest, pieces

PIECE = 64 * 1024


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A model folder as a Hugging Face snapshot lays it out: several files, one empty."""
    root = tmp_path / "snapshot"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_bytes(b'{"layers": 2}')
    (root / "model.safetensors").write_bytes(os.urandom(3 * PIECE + 123))
    (root / "tokenizer" / "vocab.txt").write_bytes(os.urandom(PIECE))
    (root / "tokenizer" / "empty").write_bytes(b"")
    return root


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_is_described_piece_by_piece(snapshot: Path) -> None:
    manifest = describe_files(snapshot, PIECE)
    assert [f.path for f in manifest.files] == [
        "config.json",
        "model.safetensors",
        "tokenizer/empty",
        "tokenizer/vocab.txt",
    ]
    assert manifest.size == sum(len(b) for b in files_of(snapshot).values())
    assert manifest.piece_count == 1 + 4 + 0 + 1
    assert manifest.why_not() is None
    with pytest.raises(StoreError, match="no such file"):
        describe_files(snapshot / "nothing", PIECE)


def test_pieces_fetched_in_any_order_make_the_artifact_whole(
    snapshot: Path, tmp_path: Path
) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    here = ArtifactStore(tmp_path / "here")  # what the source member's store holds
    here.put_manifest(digest, msgspec.json.encode(manifest))
    assert here.import_files(snapshot, digest) == here.resident(digest)
    there = ArtifactStore(tmp_path / "there")
    there.put_manifest(digest, msgspec.json.encode(manifest))
    order = sorted(range(manifest.piece_count), reverse=True)
    for index in order[:-1]:
        data = here.read_piece(digest, index)
        assert data is not None
        assert there.put_piece(digest, index, data)
    with pytest.raises(StoreError, match="lacks 1 of its pieces"):
        there.assemble(digest)
    assert there.resident(digest) is None  # never half of it
    last = here.read_piece(digest, order[-1])
    assert last is not None
    assert there.put_piece(digest, order[-1], last)
    ready = there.assemble(digest)
    assert files_of(ready) == files_of(snapshot)  # byte-identical, names and all
    assert there.held(digest) == set(range(manifest.piece_count))
    assert not (tmp_path / "there" / "pieces" / digest[7:]).exists()  # read from the files now


def test_a_corrupt_or_short_piece_is_not_kept(snapshot: Path, tmp_path: Path) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    store = ArtifactStore(tmp_path / "store")
    store.put_manifest(digest, msgspec.json.encode(manifest))
    piece = next(p for p in pieces(manifest) if p.length == PIECE)
    path = snapshot / manifest.files[piece.file].path
    good = path.read_bytes()[piece.offset : piece.offset + piece.length]
    flipped = bytes([good[0] ^ 1]) + good[1:]
    assert not store.put_piece(digest, piece.index, flipped)
    assert not store.put_piece(digest, piece.index, good[:-1])
    assert store.held(digest) == set()
    assert store.put_piece(digest, piece.index, good)  # the control
    assert store.held(digest) == {piece.index}


def test_a_manifest_is_kept_only_when_it_is_the_one_its_digest_names(
    snapshot: Path, tmp_path: Path
) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    store = ArtifactStore(tmp_path / "store")
    other = describe_files(snapshot / "config.json", PIECE)
    escaping = Manifest(
        pieceSize=PIECE, files=[ManifestFile(path="../../etc/x", size=1, pieces=["0" * 64])]
    )
    for bad, why in (
        (msgspec.json.encode(other), "not sha256"),
        (b"{", "does not decode"),
        (msgspec.json.encode(escaping), "not sha256"),
    ):
        with pytest.raises(BadManifest, match=why):
            store.put_manifest(digest, bad)
    with pytest.raises(BadManifest, match="malformed"):
        store.put_manifest(manifest_digest(escaping), msgspec.json.encode(escaping))
    assert store.manifest(digest) is None
    with pytest.raises(StoreError, match="not an artifact digest"):
        store.put_manifest("sha256:../../x", msgspec.json.encode(manifest))
    assert store.put_manifest(digest, msgspec.json.encode(manifest)) == manifest  # control
    assert ArtifactStore(tmp_path / "store").manifest(digest) == manifest  # read back


def test_local_files_that_differ_from_the_manifest_are_not_imported(
    snapshot: Path, tmp_path: Path
) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    store = ArtifactStore(tmp_path / "store")
    store.put_manifest(digest, msgspec.json.encode(manifest))
    (snapshot / "config.json").write_bytes(b'{"layers": 3}')
    with pytest.raises(StoreError, match="is not what"):
        store.import_files(snapshot, digest)
    assert store.resident(digest) is None


def test_what_a_crash_leaves_is_never_taken_for_a_resident_artifact(
    snapshot: Path, tmp_path: Path
) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    store = ArtifactStore(tmp_path / "store")
    store.put_manifest(digest, msgspec.json.encode(manifest))
    for piece in pieces(manifest):
        path = snapshot / manifest.files[piece.file].path
        data = path.read_bytes()[piece.offset : piece.offset + piece.length]
        assert store.put_piece(digest, piece.index, data)
    # A crash during an import leaves a partial folder; one mid-fetch, a piece written but
    # not yet marked held (its bytes in place, its mark missing) -- and a stray file.
    partial = tmp_path / "store" / "ready" / f".{digest[7:]}.partial"
    (partial / "tokenizer").mkdir(parents=True)
    (partial / "config.json").write_bytes(b"{")
    (tmp_path / "store" / "pieces" / digest[7:] / "held" / ".tmp").write_bytes(b"x")
    (tmp_path / "store" / "pieces" / digest[7:] / "held" / "0").unlink()
    again = ArtifactStore(tmp_path / "store")  # the restarted agent
    assert not partial.exists()  # an import cut short is dropped: no one finishes it
    assert again.resident(digest) is None
    assert again.held(digest) == set(range(1, manifest.piece_count))
    assert again.read_piece(digest, 0) is None  # not held: never served
    with pytest.raises(StoreError, match="lacks 1 of its pieces"):
        again.assemble(digest)
    first = next(pieces(manifest))
    data = (snapshot / manifest.files[first.file].path).read_bytes()[: first.length]
    assert again.put_piece(digest, 0, data)
    assert files_of(again.assemble(digest)) == files_of(snapshot)


def test_the_store_is_the_owners_alone_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = ArtifactStore(tmp_path / "store")
    finally:
        os.umask(old)
    for folder in ("", "manifests", "pieces", "ready"):
        mode = stat.S_IMODE((store.root / folder).stat().st_mode)
        assert mode == 0o700, (folder, oct(mode))


def resident_in_turn(store: ArtifactStore, root: Path, count: int) -> list[str]:
    """`count` resident artifacts of one piece each, last used in that order; digests."""
    digests = []
    for n in range(count):
        folder = root / f"m{n}"
        folder.mkdir()
        (folder / "w.bin").write_bytes(os.urandom(PIECE))
        manifest = describe_files(folder, PIECE)
        digest = manifest_digest(manifest)
        store.put_manifest(digest, msgspec.json.encode(manifest))
        store.import_files(folder, digest)
        os.utime(store.root / "ready" / digest[7:], (1000 + n, 1000 + n))
        digests.append(digest)
    return digests


def test_the_budget_drops_the_least_recently_used_and_never_a_kept_one(
    snapshot: Path, tmp_path: Path
) -> None:
    store = ArtifactStore(tmp_path / "store")
    digests = resident_in_turn(store, tmp_path, 3)  # three artifacts, used in turn
    store.touch(digests[0])  # the oldest is used again: now the newest
    assert store.make_room(PIECE, budget=3 * PIECE, keep=set()) == [digests[1]]
    assert store.resident(digests[1]) is None
    with pytest.raises(StoreError, match="budget"):
        store.make_room(3 * PIECE, budget=3 * PIECE, keep={digests[0]})
    assert store.resident(digests[0]) is not None  # nothing dropped when it cannot fit
    assert store.resident(digests[2]) is not None
    assert store.make_room(10**12, budget=0, keep=set()) == []  # no budget: no eviction


def test_a_short_write_on_a_full_disk_is_an_error_and_the_piece_is_not_held(
    snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = describe_files(snapshot, PIECE)
    digest = manifest_digest(manifest)
    store = ArtifactStore(tmp_path / "store")
    store.put_manifest(digest, msgspec.json.encode(manifest))
    piece = next(p for p in pieces(manifest) if p.length == PIECE)
    data = (snapshot / manifest.files[piece.file].path).read_bytes()
    good = data[piece.offset : piece.offset + piece.length]
    real = os.pwrite
    calls: list[int] = []

    def filling(fd: int, chunk: bytes | memoryview, offset: int) -> int:
        calls.append(len(chunk))
        if len(calls) == 1:
            return real(fd, bytes(chunk[:100]), offset)  # what the disk had room for
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", filling)
    with pytest.raises(StoreError, match="No space left on device"):
        store.put_piece(digest, piece.index, good)
    assert calls == [PIECE, PIECE - 100]  # the rest was asked for, not taken as written
    assert store.held(digest) == set()
    assert store.read_piece(digest, piece.index) is None
    monkeypatch.setattr(os, "pwrite", real)
    assert store.put_piece(digest, piece.index, good)  # room again: the control
    assert store.read_piece(digest, piece.index) == good


async def test_eviction_never_drops_what_a_replica_uses(snapshot: Path, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    digests = resident_in_turn(store, tmp_path, 2)
    fetches = Fetches(store, list, cast(Sources, None), _no_spawn, budget=2 * PIECE)
    fetches.pinned = lambda: {digests[0]}  # the older one is a replica's
    assert fetches.make_room(PIECE) == [digests[1]]  # the newer, unpinned one goes
    with pytest.raises(FetchRefused, match="budget"):
        fetches.make_room(2 * PIECE)  # only the pinned one is left: it stays
    assert store.resident(digests[0]) is not None


def _no_spawn(name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    coro.close()
    raise AssertionError("nothing is fetched here")
