"""This member's content-addressed store of artifacts (issue 28): manifests, verified pieces,
and artifacts assembled whole for engines to read. Blocking file I/O: callers on the event
loop run it in a thread.

Layout, under `$NVPAIR_HOME/artifacts` (or the configured path; 0700):

- `manifests/<hex>.json` -- a manifest whose digest is `sha256:<hex>`, checked before it is
  written (`put_manifest`);
- `pieces/<hex>/files/...` -- the artifact's files being fetched, at their full sizes
  (sparse until written), each verified piece written in place at its offset
  (`put_piece`, only after its SHA-256 matched the manifest), then marked held by an empty
  `pieces/<hex>/held/<n>`. Pieces are not synced one by one (a sync per piece cost a
  fifth of a fetch's speed): the files are synced once, before they are renamed into
  place. So a mark is trusted only for pieces this process wrote: the first fetch of an
  artifact after a start reads and hashes every marked piece again (`held_checked`, local
  reads only) and drops the marks of any that a crash or a power cut left torn; an
  unmarked piece is fetched again;
- `ready/<hex>/...` -- the artifact's files with the manifest's names, what an engine is
  given as its model path. Once every piece is held, `pieces/<hex>/files` is renamed to
  `ready/<hex>` (`assemble`): an artifact is resident exactly when `ready/<hex>` exists,
  never half of it, and it never takes twice its size on disk (the bytes are written once).
  Files imported from a local path are copied into `ready/.<hex>.partial/` and renamed into
  place the same way.

Nothing in a manifest can place a file outside its folder (`facts.artifacts.bad_path`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Set
from pathlib import Path
from typing import Final

import msgspec

from certs import make_private_dir, write_atomic
from facts.artifacts import (
    MAX_ARTIFACTS,
    PIECE_SIZE,
    Held,
    Layout,
    Manifest,
    ManifestFile,
    Piece,
    evictions,
    manifest_digest,
    pieces,
)

__all__ = ["ArtifactStore", "BadManifest", "StoreError", "describe_files"]

_decode_manifest: Final = msgspec.json.Decoder(Manifest).decode
_CHUNK: Final = 1024 * 1024  # bytes read at a time when hashing or copying


class StoreError(Exception):
    """The store cannot do what was asked (a full disk, an artifact it does not hold)."""


class BadManifest(StoreError):
    """A manifest that is not the one its digest names, or not well formed."""


def describe_files(source: Path, piece_size: int = PIECE_SIZE) -> Manifest:
    """The manifest of the file or folder at `source` (every regular file under a folder,
    by its path relative to it; symbolic links are followed, other kinds refused), hashed
    a piece at a time -- never more than one piece in memory."""
    if source.is_file():
        found = [(source.name, source)]
    elif source.is_dir():
        found = sorted(
            (p.relative_to(source).as_posix(), p) for p in source.rglob("*") if not p.is_dir()
        )
    else:
        raise StoreError(f"{source}: no such file or folder")
    files = []
    for name, path in found:
        if not path.is_file():
            raise StoreError(f"{path}: not a regular file")
        hashes = []
        try:
            with path.open("rb") as f:
                while piece := f.read(piece_size):
                    hashes.append(hashlib.sha256(piece).hexdigest())
                size = f.tell()
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        files.append(ManifestFile(path=name, size=size, pieces=hashes))
    if not files:
        raise StoreError(f"{source}: no files")
    manifest = Manifest(pieceSize=piece_size, files=files)
    why = manifest.why_not()
    if why is not None:
        raise StoreError(f"{source}: {why}")
    return manifest


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """Every byte of `data` at `offset`: a disk that fills up returns a short write first
    (no error), and only the next write fails with ENOSPC."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "no byte written")
        view, offset = view[written:], offset + written


def _sync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (its entry on disk, not only in the cache)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hex(digest: str) -> str:
    algorithm, _, hexed = digest.partition(":")
    if algorithm != "sha256" or len(hexed) != 64 or not all(c in "0123456789abcdef" for c in hexed):
        raise StoreError(f"not an artifact digest: {digest[:80]!r}")
    return hexed


class ArtifactStore:
    """Manifests, pieces and resident artifacts under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for folder in (root, root / "manifests", root / "pieces", root / "ready"):
            make_private_dir(folder)
        for stale in (root / "ready").glob(".*.partial"):  # an import a crash cut short
            shutil.rmtree(stale, ignore_errors=True)
        # Manifests read, by digest hex: a piece is checked against its manifest without
        # reading it again (bounded: cleared when it would pass twice the artifacts held).
        self._layouts: dict[str, Layout] = {}
        # Artifacts whose marked pieces this process wrote or checked (`held_checked`).
        self._checked: set[str] = set()

    # -- manifests ----------------------------------------------------------------------------

    def put_manifest(self, digest: str, raw: bytes) -> Manifest:
        """Keep the manifest `raw` (from anyone) when it is the one `digest` names and well
        formed; BadManifest otherwise, and nothing is kept."""
        hexed = _hex(digest)
        try:
            manifest = _decode_manifest(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadManifest(f"a manifest that does not decode ({exc})") from None
        if manifest_digest(manifest) != digest:
            raise BadManifest(f"a manifest that is not {digest}")
        why = manifest.why_not()
        if why is not None:
            raise BadManifest(f"a malformed manifest: {why}")
        write_atomic(self.root / "manifests" / f"{hexed}.json", msgspec.json.encode(manifest))
        return manifest

    def manifest(self, digest: str) -> Manifest | None:
        """The manifest held for `digest`, or None."""
        layout = self._layout(digest)
        return None if layout is None else layout.manifest

    def _layout(self, digest: str) -> Layout | None:
        hexed = _hex(digest)
        layout = self._layouts.get(hexed)
        if layout is not None:
            return layout
        try:
            manifest = _decode_manifest((self.root / "manifests" / f"{hexed}.json").read_bytes())
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # damaged on disk: fetched again
        if manifest_digest(manifest) != digest or manifest.why_not() is not None:
            return None  # not what its name says: fetched again
        if len(self._layouts) >= 2 * MAX_ARTIFACTS:
            self._layouts.clear()
        layout = self._layouts[hexed] = Layout(manifest)
        return layout

    # -- pieces -------------------------------------------------------------------------------

    def held(self, digest: str) -> set[int]:
        """The pieces of `digest` this store holds (all of them once it is resident)."""
        manifest = self.manifest(digest)
        if manifest is None:
            return set()
        if self.resident(digest) is not None:
            return set(range(manifest.piece_count))
        try:
            names = os.listdir(self._fetching(digest) / "held")
        except FileNotFoundError:
            return set()
        return {int(name) for name in names if name.isdigit() and int(name) < manifest.piece_count}

    def held_checked(self, digest: str) -> set[int]:
        """`held`, with every marked piece a previous process left checked against its hash
        once (read back from disk; a torn one loses its mark and is fetched again)."""
        held = self.held(digest)
        if digest in self._checked or self.resident(digest) is not None:
            return held
        for index in sorted(held):
            data = self.read_piece(digest, index)
            piece = self._piece(digest, index)
            if data is None or hashlib.sha256(data).hexdigest() != piece.sha256:
                (self._fetching(digest) / "held" / str(index)).unlink(missing_ok=True)
                held.discard(index)
        if len(self._checked) >= 2 * MAX_ARTIFACTS:
            self._checked.clear()
        self._checked.add(digest)
        return held

    def _fetching(self, digest: str) -> Path:
        return self.root / "pieces" / _hex(digest)

    def put_piece(self, digest: str, index: int, data: bytes) -> bool:
        """Keep piece `index` of `digest` when its SHA-256 is the manifest's; returns
        whether it was (a piece that fails is not kept). StoreError without the manifest,
        or when the disk refuses it (full: the error says so)."""
        piece = self._piece(digest, index)
        if len(data) != piece.length or hashlib.sha256(data).hexdigest() != piece.sha256:
            return False
        manifest = self.manifest(digest)
        assert manifest is not None  # _piece found it
        entry = manifest.files[piece.file]
        folder = self._fetching(digest)
        target = folder / "files" / entry.path
        try:
            make_private_dir(folder)
            make_private_dir(folder / "held")
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != entry.size:
                    os.ftruncate(fd, entry.size)  # sparse: only written pieces take room
                _write_all(fd, data, piece.offset)  # synced once, when assembled
            finally:
                os.close(fd)
            os.close(os.open(folder / "held" / str(index), os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError as exc:
            raise StoreError(f"cannot write a piece of {digest[:19]}: {exc}") from exc
        return True

    def read_piece(self, digest: str, index: int) -> bytes | None:
        """Piece `index` of `digest`, if held (from the files being fetched, or from the
        resident artifact's)."""
        piece = self._piece(digest, index)
        manifest = self.manifest(digest)
        assert manifest is not None  # _piece found it
        path = manifest.files[piece.file].path
        ready = self.resident(digest)
        if ready is not None:
            where = ready / path
        elif (self._fetching(digest) / "held" / str(index)).exists():
            where = self._fetching(digest) / "files" / path
        else:
            return None
        try:
            with where.open("rb") as f:
                f.seek(piece.offset)
                return f.read(piece.length)
        except FileNotFoundError:
            return None

    def _piece(self, digest: str, index: int) -> Piece:
        layout = self._layout(digest)
        if layout is None:
            raise StoreError(f"no manifest of {digest[:19]} here")
        try:
            return layout.piece(index)
        except IndexError:
            raise StoreError(f"{digest[:19]} has no piece {index}") from None

    # -- resident artifacts -------------------------------------------------------------------

    def resident(self, digest: str) -> Path | None:
        """Where the artifact's files are, when it is resident here."""
        ready = self.root / "ready" / _hex(digest)
        return ready if ready.is_dir() else None

    def _to_make_resident(self, digest: str) -> tuple[Manifest, Path | None]:
        """The manifest of an artifact about to be made resident, and its folder when it
        already is; StoreError without the manifest."""
        manifest = self.manifest(digest)
        if manifest is None:
            raise StoreError(f"no manifest of {digest[:19]} here")
        return manifest, self.resident(digest)

    def assemble(self, digest: str) -> Path:
        """Make the artifact resident once every piece is held: its files (written in
        place, empty ones created) renamed into `ready/` in one step; its folder."""
        manifest, done = self._to_make_resident(digest)
        if done is not None:
            return done
        missing = set(range(manifest.piece_count)) - self.held(digest)
        if missing:
            raise StoreError(f"{digest[:19]} lacks {len(missing)} of its pieces")
        folder = self._fetching(digest)
        files = folder / "files"
        try:
            for entry in manifest.files:  # a file of no bytes has no piece to create it
                if entry.size == 0:
                    (files / entry.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    (files / entry.path).touch(mode=0o600)
                fd = os.open(files / entry.path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # every piece on disk before the artifact is resident
                finally:
                    os.close(fd)
            _sync_dir(files)
            os.replace(files, self.root / "ready" / _hex(digest))
            _sync_dir(self.root / "ready")
        except OSError as exc:
            raise StoreError(f"cannot assemble {digest[:19]}: {exc}") from exc
        shutil.rmtree(folder, ignore_errors=True)
        return self.root / "ready" / _hex(digest)

    def import_files(self, source: Path, digest: str) -> Path:
        """Make `digest` resident from local files at `source` (a file or a folder laid out
        as its manifest says), each piece checked against the manifest as it is read and
        written once, into `ready/.<hex>.partial/`, renamed into place when all match."""
        manifest, done = self._to_make_resident(digest)
        if done is not None:
            return done
        hexed = _hex(digest)
        partial = self.root / "ready" / f".{hexed}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        by_file: dict[int, list[Piece]] = {}
        for piece in pieces(manifest):
            by_file.setdefault(piece.file, []).append(piece)
        try:
            for number, entry in enumerate(manifest.files):
                path = source if source.is_file() else source / entry.path
                target = partial / entry.path
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with path.open("rb") as f, target.open("wb") as out:
                    for piece in by_file.get(number, []):
                        data = f.read(piece.length)
                        if len(data) != piece.length or (
                            hashlib.sha256(data).hexdigest() != piece.sha256
                        ):
                            raise StoreError(
                                f"{path} is not what {digest[:19]} says (piece {piece.index})"
                            )
                        out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
            os.replace(partial, self.root / "ready" / hexed)
            _sync_dir(self.root / "ready")
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise StoreError(f"cannot import {digest[:19]} from {source}: {exc}") from exc
        except StoreError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(self._fetching(digest), ignore_errors=True)
        return self.root / "ready" / hexed

    # -- the disk budget -----------------------------------------------------------------------

    def touch(self, digest: str) -> None:
        """Mark a resident artifact used now (eviction drops the least recently used)."""
        ready = self.resident(digest)
        if ready is not None:
            os.utime(ready)

    def resident_held(self) -> list[Held]:
        """Every resident artifact with its size and when it was last used."""
        found = []
        for entry in os.scandir(self.root / "ready"):
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            digest = f"sha256:{entry.name}"
            manifest = self.manifest(digest)
            size = manifest.size if manifest is not None else 0
            found.append(Held(digest, size, entry.stat().st_mtime))
        return found

    def make_room(self, needed: int, *, budget: int, keep: Set[str]) -> list[str]:
        """Drop least recently used resident artifacts (never one in `keep`) until `needed`
        more bytes fit in `budget` (0: none); the digests dropped. StoreError, dropping
        nothing, when they cannot fit."""
        held = self.resident_held()
        dropped = evictions(held, budget=budget, needed=needed, keep=keep)
        if dropped is None:
            used = sum(h.size for h in held)
            raise StoreError(
                f"the artifact store's budget of {budget} bytes cannot take {needed} more "
                f"({used} held, the rest in use or pinned): raise [artifacts] max_bytes or "
                "remove an artifact"
            )
        for digest in dropped:
            self.remove(digest)
        return dropped

    def remove(self, digest: str) -> None:
        """Drop what is held of `digest` here: its files, pieces and manifest."""
        hexed = _hex(digest)
        for folder in (
            self.root / "ready" / hexed,
            self.root / "ready" / f".{hexed}.partial",
            self.root / "pieces" / hexed,
        ):
            shutil.rmtree(folder, ignore_errors=True)
        (self.root / "manifests" / f"{hexed}.json").unlink(missing_ok=True)
        self._layouts.pop(hexed, None)
