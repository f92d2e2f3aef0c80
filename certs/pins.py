"""The pin store over `trusted/`: which keys belong to current members.

One PEM certificate per pinned member, named `<node id>.pem`. The pin is the SHA-256 of the
certificate's SubjectPublicKeyInfo, so re-issuing a member's certificate with the same key
(`nvpair cluster rotate`) keeps it pinned. Removal deletes the PEM and writes a tombstone in
`removed/<node id>.json`; a tombstoned node id or key can never be pinned again, so a stale
record cannot bring a removed member back.

Pins are re-read per request, cached on the (inode, mtime, size) of the directory and each
file: a check costs a few `stat` calls. A change less than two seconds old is not trusted
to the cache (a rewrite within one coarse mtime tick would otherwise go unseen), so the
store reads the files again until the change has settled.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509

from ._files import write_atomic
from .errors import PinRefused
from .identity import cert_pem, describe, load_cert, spki_sha256_of_der, verify_issued_by

__all__ = ["Member", "PinStore"]

_SETTLE_NS: Final = 2_000_000_000


@dataclass(frozen=True, slots=True)
class Member:
    """A pinned or removed member, as `nvpair cluster members` lists it."""

    node_id: str
    name: str
    pin: str  # hex SHA-256 of the SPKI
    added: datetime.datetime | None
    removed: datetime.datetime | None


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
        self._stamp: tuple[object, ...] | None = None
        self._view = _View({}, {}, frozenset())
        self.reloads = 0

    # -- checks -------------------------------------------------------------------------------

    def is_pinned(self, pin: bytes) -> bool:
        """Whether this SPKI SHA-256 belongs to a current member."""
        return pin in self._current().by_pin

    def node_id_of(self, pin: bytes) -> str | None:
        """The node id of the member with this pin, or None."""
        return self._current().by_pin.get(pin)

    def node_id_of_cert_der(self, der: bytes) -> str | None:
        """The node id of the member presenting this DER certificate, or None."""
        try:
            pin = spki_sha256_of_der(der)
        except ValueError:
            return None
        return self.node_id_of(pin)

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
        self.trusted.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(self.trusted / f"{info.node_id}.pem", cert_pem(cert))
        return self._current().members[info.node_id]

    def unpin(self, node_id: str, *, now: float | None = None) -> Member:
        """Remove a member: delete its pin and leave a tombstone. Idempotent."""
        path = self.trusted / f"{node_id}.pem"
        existing = self._current().members.get(node_id)
        if existing is None:
            raise PinRefused(f"{node_id} is not a member")
        self.removed.mkdir(mode=0o700, parents=True, exist_ok=True)
        tombstone = self.removed / f"{node_id}.json"
        if not tombstone.exists():
            record = {
                "nodeId": node_id,
                "name": existing.name,
                "pin": existing.pin,
                "removedAt": now if now is not None else time.time(),
            }
            write_atomic(tombstone, json.dumps(record).encode())
        path.unlink(missing_ok=True)
        return self._current().members[node_id]

    def pems(self) -> list[bytes]:
        """The PEM of every current member, for handing to a new member."""
        self._current()
        return [
            (self.trusted / f"{m.node_id}.pem").read_bytes()
            for m in self.members()
            if m.removed is None
        ]

    # -- the cache ----------------------------------------------------------------------------

    def _current(self) -> _View:
        stamp = self._stamp_now()
        if stamp != self._stamp:
            self._view, settled = self._load()
            self._stamp = stamp if settled else None
            self.reloads += 1
        return self._view

    def _stamp_now(self) -> tuple[object, ...]:
        parts: list[object] = []
        for directory in (self.trusted, self.removed):
            try:
                st = directory.stat()
            except FileNotFoundError:
                parts.append(None)
                continue
            parts.append((st.st_ino, st.st_mtime_ns))
            with os.scandir(directory) as entries:
                for entry in entries:
                    est = entry.stat()
                    parts.append((entry.name, est.st_ino, est.st_mtime_ns, est.st_size))
        return tuple(parts)

    def _load(self) -> tuple[_View, bool]:
        by_pin: dict[bytes, str] = {}
        members: dict[str, Member] = {}
        removed_pins: set[bytes] = set()
        newest = 0
        for directory in (self.trusted, self.removed):
            if directory.exists():
                newest = max(newest, directory.stat().st_mtime_ns)
        for path in sorted(self.removed.glob("*.json")) if self.removed.exists() else []:
            newest = max(newest, path.stat().st_mtime_ns)
            try:
                record = json.loads(path.read_bytes())
                pin = bytes.fromhex(record["pin"])
                member = Member(
                    node_id=record["nodeId"],
                    name=record["name"],
                    pin=record["pin"],
                    added=None,
                    removed=datetime.datetime.fromtimestamp(record["removedAt"], datetime.UTC),
                )
            except (ValueError, KeyError, TypeError):
                # A damaged tombstone still removes the node its file name names.
                member = Member(path.stem, path.stem, "", None, datetime.datetime.now(datetime.UTC))
                pin = b""
            removed_pins.add(pin)
            members[member.node_id] = member
        for path in sorted(self.trusted.glob("*.pem")) if self.trusted.exists() else []:
            st = path.stat()
            newest = max(newest, st.st_mtime_ns)
            try:
                info = describe(load_cert(path.read_bytes()))
            except (ValueError, PinRefused):
                continue  # not a node certificate: pins nothing
            if info.node_id in members or info.pin in removed_pins:
                continue  # a tombstone wins over a stale pin file
            by_pin[info.pin] = info.node_id
            members[info.node_id] = Member(
                node_id=info.node_id,
                name=info.name,
                pin=info.pin.hex(),
                added=datetime.datetime.fromtimestamp(st.st_mtime, datetime.UTC),
                removed=None,
            )
        settled = time.time_ns() - newest > _SETTLE_NS
        return _View(by_pin, members, frozenset(removed_pins)), settled
