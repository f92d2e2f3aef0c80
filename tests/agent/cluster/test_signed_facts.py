"""The agent's shell around the signed set (`agent.cluster.signed_facts`), on a kind made up for it
(`tests.fixtures.notes`) and real files: a corrupt file is set aside and the node starts
without, instead of not starting; an edit is the next version, signed, bounded and saved
(0600) where a restart reads it back."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import msgspec
import pytest

from agent.cluster.signed_facts import FactRefused, SignedFacts
from facts.signed_set import SignedSet
from tests.fixtures.clock import FakeClock
from tests.fixtures.notes import CAPACITY, NOTE, Note


class NoteRefused(FactRefused):
    """A note that cannot be said."""


class Notes(SignedFacts[Note]):
    """Notes, persisted in `notes.json`."""

    file = "notes.json"
    refused = NoteRefused

    def new_set(self) -> SignedSet[Note]:
        """An empty set of notes."""
        return SignedSet(NOTE)


def signed_here(note: Note) -> Note:
    return msgspec.structs.replace(note, by="nod_here")


def test_a_corrupt_file_is_set_aside_and_the_node_starts_without(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "notes.json").write_bytes(b'[{"name": "a", "version": "one"}]')
    with caplog.at_level(logging.WARNING):
        notes = Notes(tmp_path, sign=signed_here)
    assert notes.all() == []
    assert notes.lost
    assert (tmp_path / "notes.json.corrupt").read_bytes() == b'[{"name": "a", "version": "one"}]'
    assert not (tmp_path / "notes.json").exists()
    assert "setting" in caplog.text
    assert "notes.json.corrupt" in caplog.text
    pushed = Note(name="a", version=3, updatedAt=5, by="nod_b")
    assert notes.merge([pushed]) == [pushed]
    assert not notes.lost  # a member's push brings what was lost back
    assert Notes(tmp_path, sign=signed_here).all() == [pushed]  # saved, read back


def test_a_missing_file_is_no_loss(tmp_path: Path) -> None:
    notes = Notes(tmp_path, sign=signed_here)
    assert notes.all() == []
    assert not notes.lost
    assert not (tmp_path / "notes.json.corrupt").exists()


def test_an_edit_is_the_next_version_signed_and_saved_0600(tmp_path: Path) -> None:
    clock = FakeClock(now=10.0)
    changed: list[int] = []
    notes = Notes(
        tmp_path, sign=signed_here, on_change=lambda: changed.append(notes.changes), clock=clock
    )
    first = notes.commit(Note(name="a"))
    assert (first.version, first.updatedAt, first.by) == (1, 10_000, "nod_here")
    # A member's version dated ahead of this clock: the next edit here still outranks it.
    notes.merge([Note(name="a", version=4, updatedAt=99_000, by="nod_b")])
    second = notes.commit(msgspec.structs.replace(first, gone=True))
    assert (second.version, second.updatedAt, second.gone) == (5, 99_000, True)
    assert changed == [1, 2, 3]
    assert stat.S_IMODE((tmp_path / "notes.json").stat().st_mode) == 0o600
    assert Notes(tmp_path, sign=signed_here).all() == [second]


def test_an_edit_that_finds_the_cluster_full_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    clock = FakeClock(now=0.0)
    notes = Notes(tmp_path, sign=signed_here, clock=clock)
    for name in "abcd"[:CAPACITY]:
        notes.commit(Note(name=name, expiresAt=5_000 if name == "a" else 0))
    clock.now = 10.0
    notes.commit(Note(name="e"))  # "a" has expired: it made room
    assert [n.name for n in notes.all()] == ["b", "c", "d", "e"]
    saved = (tmp_path / "notes.json").read_bytes()
    with pytest.raises(NoteRefused, match=f"holds {CAPACITY} notes"):
        notes.commit(Note(name="f"))
    assert (tmp_path / "notes.json").read_bytes() == saved
    assert [n.name for n in notes.all()] == ["b", "c", "d", "e"]
    # A file holding more than the kind's bound (written by hand) is read only up to it.
    many = [Note(name=name) for name in "uvwxyz"]
    (tmp_path / "notes.json").write_bytes(msgspec.json.encode(many))
    assert [n.name for n in Notes(tmp_path, sign=signed_here).all()] == list("uvwx")
