"""The pin store over `trusted/`: which keys belong to current members.

One PEM certificate per pinned member, named `<node id>.pem`. The pin is the SHA-256 of the
certificate's SubjectPublicKeyInfo, so re-issuing a member's certificate with the same key
(`nvpair cluster rotate`) keeps it pinned. Removal deletes the PEM and writes a tombstone in
`removed/<node id>.json`; a tombstoned node id or key can never be pinned again, so a stale
record cannot bring a removed member back.

Pins are re-read per request, cached on the (inode, mtime, size) of the two directories
and of each file. Every check stats the directories, so adding or removing a member takes
effect on the next request; the files are stat'ed at most every 100 ms, so an edit in place
takes effect within that. A change less than two seconds old is not trusted to the cache (a
rewrite within one coarse mtime tick would otherwise go unseen): until it settles, the files
are read again at each 100 ms check.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs._files import make_private_dir, write_atomic
from certs.errors import PinRefused
from certs.identity import (
    NodeCert,
    cert_pem,
    describe,
    load_cert,
    spki_sha256_of_der,
    verify_issued_by,
)

__all__ = ["Member", "PinStore"]


@functools.lru_cache(maxsize=256)
def _describe_pem(pem: bytes) -> NodeCert | None:
    # Re-reading an unchanged file must not mean re-parsing it: reads are cheap, X.509 is not.
    try:
        return describe(load_cert(pem))
    except (ValueError, PinRefused):
        return None


_SETTLE_NS: Final = 2_000_000_000
DEEP_CHECK_S: Final = 0.1

_Stamp = tuple[int, int, int]
_DirStamps = tuple[_Stamp | None, _Stamp | None]
_FileStamps = tuple[_Stamp | None, ...]


@dataclass(frozen=True, slots=True)
class Member:
    """A pinned or removed member, as `nvpair cluster members` lists it."""

    node_id: str
    name: str
    pin: str  # hex SHA-256 of the SPKI
    added: datetime.datetime | None
    removed: datetime.datetime | None
    # The removal as its remover signed it (JSON of `facts.records.Removal`; "" for a
    # tombstone written before removals were signed): what this member pushes on.
    statement: str = ""


@dataclass(frozen=True, slots=True)
class _View:
    by_pin: dict[bytes, str]  # pin -> node id
    members: dict[str, Member]  # node id -> member (pinned and removed)
    removed_pins: frozenset[bytes]


class PinStore:
    """`is_pinned(spki)` and `node_id_of(spki)` over `trusted/`, with tombstones."""

    def __init__(self, trusted: Path, removed: Path) -> None:
        self.trusted = trusted
        self.removed = removed
        self._view = _View({}, {}, frozenset())
        self._keys: dict[str, ec.EllipticCurvePublicKey] = {}  # pin (hex) -> its key
        self._view_files: list[Path] = []
        self._dirs: _DirStamps | None = None
        self._files: _FileStamps = ()
        self._settled = False
        self._next_deep_check = 0.0
        self.reloads = 0

    # -- checks -------------------------------------------------------------------------------

    def is_pinned(self, pin: bytes) -> bool:
        """Whether this SPKI SHA-256 belongs to a current member."""
        return pin in self._current().by_pin

    def node_id_of(self, pin: bytes) -> str | None:
        """The node id of the member with this pin, or None."""
        return self._current().by_pin.get(pin)

    def is_member(self, node_id: str) -> bool:
        """Whether `node_id` is pinned now (and not removed)."""
        member = self._current().members.get(node_id)
        return member is not None and member.removed is None

    def node_id_of_cert_der(self, der: bytes) -> str | None:
        """The node id of the member presenting this DER certificate, or None."""
        try:
            pin = spki_sha256_of_der(der)
        except ValueError:
            return None
        return self.node_id_of(pin)

    def public_key_of(self, node_id: str) -> ec.EllipticCurvePublicKey | None:
        """The key of current member `node_id` (what its records are signed with), or None."""
        member = self._current().members.get(node_id)
        if member is None or member.removed is not None or not member.pin:
            return None
        cached = self._keys.get(member.pin)
        if cached is None:
            try:
                key = load_cert((self.trusted / f"{node_id}.pem").read_bytes()).public_key()
            except (OSError, ValueError):
                return None
            if not isinstance(key, ec.EllipticCurvePublicKey):
                return None
            if len(self._keys) > 1024:
                self._keys.clear()
            self._keys[member.pin] = cached = key
        return cached

    def members(self) -> list[Member]:
        """Every member, pinned and removed, by node id."""
        return sorted(self._current().members.values(), key=lambda m: m.node_id)

    def is_removed(self, node_id: str) -> bool:
        """Whether a tombstone names this node id."""
        return (self.removed / f"{node_id}.json").exists()

    # -- changes ------------------------------------------------------------------------------

    def pin(self, cert: x509.Certificate, *, ca: x509.Certificate | None = None) -> Member:
        """Pin a member's certificate; refused for a removed member or a foreign CA."""
        info = describe(cert)
        if ca is not None and not verify_issued_by(cert, ca):
            raise PinRefused(f"{info.node_id}: certificate is not signed by this cluster's CA")
        if self.is_removed(info.node_id) or info.pin in self._current().removed_pins:
            raise PinRefused(
                f"{info.node_id} was removed from the cluster; a removed member cannot come "
                "back with the same identity (issue it a new one)"
            )
        make_private_dir(self.trusted)
        write_atomic(self.trusted / f"{info.node_id}.pem", cert_pem(cert))
        return self._current().members[info.node_id]

    def unpin(self, node_id: str, *, now: float | None = None, statement: str = "") -> Member:
        """Remove a member: delete its pin and leave a tombstone (with the signed
        `statement` of the removal). Idempotent."""
        path = self.trusted / f"{node_id}.pem"
        existing = self._current().members.get(node_id)
        if existing is None:
            raise PinRefused(f"{node_id} is not a member")
        make_private_dir(self.removed)
        tombstone = self.removed / f"{node_id}.json"
        if not tombstone.exists():
            record = {
                "nodeId": node_id,
                "name": existing.name,
                "pin": existing.pin,
                "removedAt": now if now is not None else time.time(),
                "statement": statement,
            }
            write_atomic(tombstone, json.dumps(record).encode())
        path.unlink(missing_ok=True)
        return self._current().members[node_id]

    def tombstone(
        self, node_id: str, *, name: str, pin: str, at: float, statement: str = ""
    ) -> None:
        """Record a removal learned from another member (a push, a joiner's admitter): the
        node is removed here too, whether or not it was ever pinned here."""
        make_private_dir(self.removed)
        tombstone = self.removed / f"{node_id}.json"
        if not tombstone.exists():
            record = {
                "nodeId": node_id,
                "name": name,
                "pin": pin,
                "removedAt": at,
                "statement": statement,
            }
            write_atomic(tombstone, json.dumps(record).encode())
        (self.trusted / f"{node_id}.pem").unlink(missing_ok=True)

    def pems(self) -> list[bytes]:
        """The PEM of every current member, for handing to a new member."""
        self._current()
        return [
            (self.trusted / f"{m.node_id}.pem").read_bytes()
            for m in self.members()
            if m.removed is None
        ]

    def pems_of(self, node_ids: Iterable[str]) -> list[bytes]:
        """The PEM of those of `node_ids` that are current members (a records delta)."""
        wanted = set(node_ids)
        return [
            (self.trusted / f"{m.node_id}.pem").read_bytes()
            for m in self.members()
            if m.removed is None and m.node_id in wanted
        ]

    # -- the cache ----------------------------------------------------------------------------

    def _current(self) -> _View:
        # Every check stats the two directories: adding, removing or renaming a file (all
        # that the nvpair commands do, and `rm`) takes effect on the very next check. The
        # files themselves are stat'ed at most every DEEP_CHECK_S, which catches an edit in
        # place; while a change is younger than the settle window the files are re-read then
        # too, in case an edit landed within one mtime tick of our last read.
        dirs = (_stamp(self.trusted), _stamp(self.removed))
        now = time.monotonic()
        if dirs == self._dirs and now < self._next_deep_check:
            return self._view
        self._next_deep_check = now + DEEP_CHECK_S
        files = self._file_stamps()
        if dirs != self._dirs or files != self._files or not self._settled:
            self._view, self._settled, self._dirs, self._files = self._load()
            self.reloads += 1
        return self._view

    def _file_stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        return tuple(_stamp(path) for path in self._view_files)

    def _load(self) -> tuple[_View, bool, _DirStamps, _FileStamps]:
        # Stamp first, then read: a change during the read shows as a new stamp next time.
        dir_stamps = (_stamp(self.trusted), _stamp(self.removed))
        by_pin: dict[bytes, str] = {}
        members: dict[str, Member] = {}
        removed_pins: set[bytes] = set()
        files: list[Path] = []
        file_stamps: list[tuple[int, int, int] | None] = []

        def stamped(directory: Path, suffix: str) -> Iterator[tuple[Path, _Stamp]]:
            # Each file of the listing with its stamp, remembered for the next check.
            for path in _listing(directory, suffix):
                stamp = _stamp(path)
                if stamp is not None:
                    files.append(path)
                    file_stamps.append(stamp)
                    yield path, stamp

        for path, _ in stamped(self.removed, ".json"):
            try:
                record = json.loads(path.read_bytes())
                pin = bytes.fromhex(record["pin"])
                member = Member(
                    node_id=record["nodeId"],
                    name=record["name"],
                    pin=record["pin"],
                    added=None,
                    removed=datetime.datetime.fromtimestamp(record["removedAt"], datetime.UTC),
                    statement=str(record.get("statement", "")),
                )
            except (ValueError, KeyError, TypeError, OSError):
                # A damaged tombstone still removes the node its file name names.
                member = Member(path.stem, path.stem, "", None, datetime.datetime.now(datetime.UTC))
                pin = b""
            removed_pins.add(pin)
            members[member.node_id] = member
        for path, stamp in stamped(self.trusted, ".pem"):
            try:
                info = _describe_pem(path.read_bytes())
            except OSError:
                info = None
            if info is None:
                continue  # not a node certificate: pins nothing
            if info.node_id in members or info.pin in removed_pins:
                continue  # a tombstone wins over a stale pin file
            by_pin[info.pin] = info.node_id
            members[info.node_id] = Member(
                node_id=info.node_id,
                name=info.name,
                pin=info.pin.hex(),
                added=datetime.datetime.fromtimestamp(stamp[1] / 1e9, datetime.UTC),
                removed=None,
            )
        self._view_files = files
        newest = max((s[1] for s in (*dir_stamps, *file_stamps) if s is not None), default=0)
        settled = time.time_ns() - newest > _SETTLE_NS
        view = _View(by_pin, members, frozenset(removed_pins))
        return view, settled, dir_stamps, tuple(file_stamps)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _listing(directory: Path, suffix: str) -> list[Path]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [directory / name for name in sorted(names) if name.endswith(suffix)]
