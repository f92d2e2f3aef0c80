"""`agent.engines.replica_logs`: whole lines only, within the bounds, and a rotation noticed."""

from __future__ import annotations

from pathlib import Path

from agent.engines import replica_logs
from agent.engines.replica_logs import MAX_BYTES, MAX_LINES, since, tail


def test_tail_gives_the_last_whole_lines_and_the_unfinished_one(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"one\ntwo\r\nthree\nfour")
    chunk = tail(log, 2)
    assert chunk.lines == ["two", "three"]
    assert chunk.partial == "four"
    assert chunk.offset == len(b"one\ntwo\r\nthree\n")
    assert not chunk.truncated


def test_an_empty_log_and_a_log_without_a_newline(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"")
    assert tail(log).lines == []
    assert since(log, 0).offset == 0
    log.write_bytes(b"loading")
    assert (tail(log).lines, tail(log).partial, tail(log).offset) == ([], "loading", 0)
    assert since(log, 0).lines == []  # sent once it is finished


def test_follow_reads_after_the_offset_and_restarts_after_a_truncation(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"a\nb\n")
    first = tail(log)
    with log.open("ab") as out:
        out.write(b"c\nd")
    chunk = since(log, first.offset)
    assert chunk.lines == ["c"]
    with log.open("ab") as out:
        out.write(b"\n")
    assert since(log, chunk.offset).lines == ["d"]
    log.write_bytes(b"x\n")  # copy and truncate: the offset is now past the end
    rotated = since(log, chunk.offset)
    assert rotated.rotated
    assert rotated.lines == ["x"]


def test_no_call_reads_more_than_the_bounds(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    line = b"x" * 199 + b"\n"  # a window holds fewer than MAX_LINES of them
    log.write_bytes(line * (3 * MAX_BYTES // len(line)))
    chunk = tail(log, MAX_LINES)
    assert len(chunk.lines) == MAX_BYTES // len(line)  # the window's whole lines
    assert chunk.truncated
    assert chunk.offset == log.stat().st_size
    follow = since(log, 0)
    assert sum(len(x) + 1 for x in follow.lines) <= MAX_BYTES
    assert follow.offset == len(follow.lines) * len(line)
    many = tmp_path / "many.log"
    many.write_bytes(b"\n" * (2 * MAX_LINES))
    assert len(tail(many, 10 * MAX_LINES).lines) == MAX_LINES
    assert len(since(many, 0).lines) == MAX_LINES
    assert replica_logs.DEFAULT_LINES <= MAX_LINES


def test_one_line_longer_than_the_window_is_still_sent(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"y" * (MAX_BYTES + 10))
    chunk = since(log, 0)
    assert [len(x) for x in chunk.lines] == [MAX_BYTES]
    assert chunk.offset == MAX_BYTES
