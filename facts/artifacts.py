"""Artifacts: immutable, content-addressed weights (seed 000's Artifact), as cluster facts and
manifests. Sans-I/O.

A **manifest** says what an artifact is, byte for byte: its files (relative POSIX paths,
sorted), each file's size and the SHA-256 of each of its pieces (`pieceSize` bytes, the last
piece of a file shorter). The artifact's **digest** is `sha256:` of the manifest's canonical
encoding (`manifest_digest`), so the digest names the bytes: a member that holds pieces
whose hashes match the manifest whose hash matches the digest holds the artifact, whoever
sent them.

An **artifact fact** (`Artifact`) is small: the name people use, the digest, the total size,
the piece size and the number of files and pieces; a member fetches the manifest itself by
its digest from the members that hold it and checks it against the digest (a manifest of a
100 GB model lists thousands of pieces: it does not ride on every records push). Each
version is a statement signed by the member that made it, kept by the one signed-set
mechanism (`facts.signed_set`): keyed by name (a name points at one digest at a time), a
removal (`nvpair artifact forget`) is a tombstone version.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from facts.signed_set import FactKind, SignedSet

__all__ = [
    "ARTIFACT",
    "MAX_ARTIFACTS",
    "MAX_PIECES",
    "MAX_PIECE_SIZE",
    "PIECE_SIZE",
    "Artifact",
    "ArtifactSet",
    "Held",
    "Layout",
    "Manifest",
    "ManifestFile",
    "Piece",
    "bad_path",
    "evictions",
    "manifest_digest",
    "pieces",
]

MAX_ARTIFACTS: Final = 256  # named at once in one cluster, tombstones included
PIECE_SIZE: Final = 16 * 1024 * 1024  # the default: 16 MiB, 6,400 pieces for 100 GB
MAX_PIECE_SIZE: Final = 64 * 1024 * 1024
MAX_PIECES: Final = 1_000_000  # in one manifest: 16 TB at the default piece size
MAX_FILES: Final = 100_000
TOMBSTONE_MS: Final = 7 * 24 * 3600 * 1000

_Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
_Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
_Name = Annotated[
    str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]
_Count = Annotated[int, Meta(ge=0, le=2**53 - 1)]
_encode: Final = msgspec.json.Encoder().encode


class ManifestFile(Struct, kw_only=True, frozen=True, array_like=True):
    """One file of an artifact: where it goes, its size and its pieces' SHA-256."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    size: _Count
    pieces: Annotated[list[_Hex], Meta(max_length=MAX_PIECES)]


class Manifest(Struct, kw_only=True, frozen=True):
    """What an artifact is, byte for byte (its digest is `manifest_digest`)."""

    # A piece is read, sent and checked whole: at most 64 MiB of memory each.
    pieceSize: Annotated[int, Meta(ge=64 * 1024, le=MAX_PIECE_SIZE)] = PIECE_SIZE
    files: Annotated[list[ManifestFile], Meta(min_length=1, max_length=MAX_FILES)]

    @property
    def size(self) -> int:
        """Bytes in all."""
        return sum(f.size for f in self.files)

    @property
    def piece_count(self) -> int:
        """Pieces in all."""
        return sum(len(f.pieces) for f in self.files)

    def why_not(self) -> str | None:
        """None when the manifest is well formed: paths safe, sorted and unique, each file's
        piece count what its size and the piece size make; else what is wrong."""
        paths = [f.path for f in self.files]
        if paths != sorted(set(paths)):
            return "its files are not sorted by path, each once"
        for f in self.files:
            why = bad_path(f.path)
            if why is not None:
                return f"file {f.path!r}: {why}"
            if len(f.pieces) != -(-f.size // self.pieceSize):
                return f"file {f.path!r}: {len(f.pieces)} pieces for {f.size} bytes"
        if self.piece_count > MAX_PIECES:
            return f"{self.piece_count} pieces (at most {MAX_PIECES})"
        return None


def bad_path(path: str) -> str | None:
    """Why `path` may not name a file of an artifact (None: it may): relative, POSIX, no
    empty, `.` or `..` part, no NUL or backslash -- a manifest can never place a file
    outside the artifact's folder."""
    if "\x00" in path or "\\" in path:
        return "a NUL or a backslash"
    if path.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "an empty, '.' or '..' part"
    return None


def manifest_digest(manifest: Manifest) -> str:
    """`sha256:` of the manifest's canonical encoding (msgspec writes a struct's fields in
    their declared order, files as arrays): the artifact's name for its bytes."""
    return "sha256:" + hashlib.sha256(_encode(manifest)).hexdigest()


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece: its number in the artifact, its file, where in the file, its hash."""

    index: int
    file: int
    offset: int
    length: int
    sha256: str


def pieces(manifest: Manifest) -> Iterator[Piece]:
    """Every piece of the artifact, in order (file by file)."""
    index = 0
    for number, f in enumerate(manifest.files):
        for n, digest in enumerate(f.pieces):
            offset = n * manifest.pieceSize
            yield Piece(index, number, offset, min(manifest.pieceSize, f.size - offset), digest)
            index += 1


class Layout:
    """Where each piece of one manifest is, found in O(log files)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._starts: list[int] = []  # the index of each file's first piece
        first = 0
        for f in manifest.files:
            self._starts.append(first)
            first += len(f.pieces)
        self.count = first

    def piece(self, index: int) -> Piece:
        """Piece `index` (IndexError when the artifact has no such piece)."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        number = bisect.bisect_right(self._starts, index) - 1
        while not self.manifest.files[number].pieces:  # empty files share a start
            number += 1
        entry = self.manifest.files[number]
        n = index - self._starts[number]
        offset = n * self.manifest.pieceSize
        size = min(self.manifest.pieceSize, entry.size - offset)
        return Piece(index, number, offset, size, entry.pieces[n])


@dataclass(frozen=True, slots=True)
class Held:
    """A resident artifact, for eviction: its digest, bytes and when it was last used."""

    digest: str
    size: int
    used_at: float


def evictions(
    held: Iterable[Held], *, budget: int, needed: int, keep: Set[str]
) -> list[str] | None:
    """The resident artifacts to drop, least recently used first, so that `needed` more
    bytes fit in `budget` (0: no budget); None when they cannot fit without dropping one in
    `keep` (used by a replica here, pinned by the warm set, being fetched)."""
    if budget <= 0:
        return []
    ordered = sorted(held, key=lambda h: (h.used_at, h.digest))
    total = sum(h.size for h in ordered)
    dropped: list[str] = []
    for candidate in ordered:
        if total + needed <= budget:
            break
        if candidate.digest in keep:
            continue
        dropped.append(candidate.digest)
        total -= candidate.size
    return dropped if total + needed <= budget else None


class Artifact(Struct, kw_only=True, frozen=True):
    """One version of a named artifact (a signed statement); its manifest is fetched by
    `digest`. Fields of a later release are kept with it as signed (`facts.kept`)."""

    id: Annotated[str, Meta(pattern=r"^art_[0-9a-z]{26}$")]
    name: _Name
    digest: _Digest
    size: _Count = 0  # bytes in all
    pieceSize: Annotated[int, Meta(ge=0)] = PIECE_SIZE
    files: _Count = 0
    pieceCount: _Count = 0
    # In the cluster's warm set: every member keeps it resident (`nvpair artifact warm`).
    warm: bool = False
    deleted: bool = False  # forgotten cluster-wide (a tombstone)
    version: Annotated[int, Meta(ge=1, le=2**53 - 1)] = 1
    updatedAt: _Count = 0  # epoch ms
    by: Annotated[str, Meta(max_length=256)] = ""  # the member that made this version
    byCert: Annotated[str, Meta(max_length=8192)] = ""
    signature: Annotated[str, Meta(max_length=256)] = ""

    def describes(self, manifest: Manifest) -> bool:
        """Whether `manifest` is this artifact's (its digest and totals match)."""
        return (
            manifest_digest(manifest) == self.digest
            and manifest.size == self.size
            and manifest.pieceSize == self.pieceSize
            and len(manifest.files) == self.files
            and manifest.piece_count == self.pieceCount
        )


def _says(a: Artifact) -> str:
    if a.deleted:
        return "forgotten"
    return f"added: {a.digest[:19]}, {a.size} bytes" + (", warm" if a.warm else "")


ARTIFACT: Final[FactKind[Artifact]] = FactKind(
    what="artifact",
    struct=Artifact,
    key=lambda a: a.name,
    is_tombstone=lambda a: a.deleted,
    says=_says,
    capacity=MAX_ARTIFACTS,
    tombstone_ms=TOMBSTONE_MS,
)


class ArtifactSet(SignedSet[Artifact]):
    """The versions of artifacts this member holds, one per name, at most `MAX_ARTIFACTS`."""

    def __init__(self) -> None:
        super().__init__(ARTIFACT)
