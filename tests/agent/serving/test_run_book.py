"""The run book (`agent.serving.run_book`): the runs a node put its name to, on disk in a file of
their own, so a node whose `jobs.db` is lost still knows which of its rows to ask back."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from agent.core.errors import StartupError
from agent.serving.run_book import RunBook, RunNotRecorded, open_run_book
from broker.jobs import JobsStore, JobsWriter
from tests.fixtures.records import workload


def test_a_recorded_run_is_held_after_reopening(tmp_path: Path) -> None:
    path = tmp_path / "runs"
    book = RunBook.open(path)
    assert not book.holds("run-a")  # the control: nothing before it is recorded
    book.record("run-a")
    book.record("run-b", "run-a")  # one already held costs nothing and is not doubled
    again = RunBook.open(path)
    assert (again.holds("run-a"), again.holds("run-b"), again.holds("run-c")) == (True, True, False)
    assert path.read_bytes() == b'"run-a"\n"run-b"\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_line_that_is_not_a_run_is_skipped_and_the_next_run_still_lands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "runs"
    # A hand edit, a run id longer than any record's, and a last line a crash cut short.
    path.write_bytes(b'"kept"\ngarbage\n7\n"' + b"x" * 300 + b'"\n"torn')
    book = RunBook.open(path)
    assert "skipped 4 line(s)" in caplog.text
    assert book.holds("kept")
    assert not book.holds("torn")
    book.record("after")
    again = RunBook.open(path)
    assert again.holds("after")  # on a line of its own, not glued to the torn one
    assert again.holds("kept")


def test_the_book_keeps_the_newest_runs(tmp_path: Path) -> None:
    path = tmp_path / "runs"
    book = RunBook.open(path, keep=3)
    for n in range(6):
        book.record(f"run-{n}")
    assert path.read_bytes().count(b"\n") == 6  # up to twice the bound, appended
    book.record("run-6")  # past it: rewritten to the newest three
    assert path.read_bytes() == b'"run-4"\n"run-5"\n"run-6"\n'
    again = RunBook.open(path, keep=3)
    assert [again.holds(f"run-{n}") for n in range(7)] == [False] * 4 + [True] * 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_run_that_cannot_be_written_is_refused_and_not_held(tmp_path: Path) -> None:
    book = RunBook.open(tmp_path / "gone" / "runs")  # a home whose directory is missing
    with pytest.raises(RunNotRecorded, match="cannot record run 'run-a': No such file"):
        book.record("run-a")
    assert not book.holds("run-a")


async def test_a_new_book_starts_with_the_runs_of_the_nodes_own_rows(tmp_path: Path) -> None:
    store = await JobsStore.open(tmp_path / "jobs.db")
    try:
        async with JobsWriter(store) as writer:
            writer.upsert(workload("1", origin="nod_me", run="old-run"))
            writer.upsert(workload("2", origin="nod_other", run="their-run"))
            await writer.flush()
            path = tmp_path / "runs"
            book = await open_run_book(path, store, "nod_me", "facade-run")
            held = {run: book.holds(run) for run in ("old-run", "facade-run", "their-run")}
            assert held == {"old-run": True, "facade-run": True, "their-run": False}
            # A book that exists is not seeded again: what the store holds now is no proof.
            writer.upsert(workload("3", origin="nod_me", run="later-run"))
            await writer.flush()
            assert not (await open_run_book(path, store, "nod_me")).holds("later-run")
            # One that cannot be written stops the start, in one line.
            with pytest.raises(StartupError, match=r"run book cannot record run .*: No such file"):
                await open_run_book(tmp_path / "gone" / "runs", store, "nod_me", "facade-run")
    finally:
        await store.close()
