"""Newline framing: whole, byte by byte, any chunking, trailing garbage, oversize lines."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from workload_manager.framing import FrameTooLarge, LineFramer

FRAMES = [b'{"jsonrpc":"2.0","method":"a"}', b"[1,2,3]", b'{"x":"\xc3\xa9"}']
STREAM = b"\n".join(FRAMES) + b"\n"


def feed_chunks(framer: LineFramer, chunks: list[bytes]) -> list[bytes | FrameTooLarge]:
    out: list[bytes | FrameTooLarge] = []
    for chunk in chunks:
        out.extend(framer.feed(chunk))
    out.extend(framer.close())
    return out


def test_whole() -> None:
    assert feed_chunks(LineFramer(), [STREAM]) == FRAMES


def test_byte_by_byte() -> None:
    assert feed_chunks(LineFramer(), [bytes([b]) for b in STREAM]) == FRAMES


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_split_points(cuts: list[int]) -> None:
    points = sorted({0, len(STREAM), *cuts})
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert feed_chunks(LineFramer(), chunks) == FRAMES


def test_trailing_garbage_without_newline_waits_then_ends_as_a_frame() -> None:
    framer = LineFramer()
    assert list(framer.feed(STREAM + b"garb")) == FRAMES
    assert framer.buffered == 4
    assert list(framer.close()) == [b"garb"]


def test_crlf_and_blank_lines() -> None:
    assert feed_chunks(LineFramer(), [b"a\r\n\r\n\n  \nb\n"]) == [b"a", b"b"]


def test_oversize_line_is_skipped_and_the_next_line_survives() -> None:
    framer = LineFramer(max_frame=10)
    out = feed_chunks(framer, [b"x" * 25 + b"\nok\n"])
    assert out == [FrameTooLarge(10), b"ok"]


def test_oversize_line_across_chunks_never_buffers_past_the_limit() -> None:
    framer = LineFramer(max_frame=100)
    out: list[bytes | FrameTooLarge] = []
    for _ in range(1000):
        out.extend(framer.feed(b"y" * 37))
        assert framer.buffered <= 100
    out.extend(framer.feed(b"tail-of-big\nnext\n"))
    assert out == [FrameTooLarge(100), b"next"]


def test_exactly_the_limit_is_accepted() -> None:
    assert feed_chunks(LineFramer(max_frame=5), [b"12345\n123456\n"]) == [
        b"12345",
        FrameTooLarge(5),
    ]


@given(st.binary(max_size=2000), st.integers(min_value=1, max_value=64))
def test_chunking_never_changes_the_frames(data: bytes, chunk: int) -> None:
    whole = feed_chunks(LineFramer(max_frame=50), [data])
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    assert feed_chunks(LineFramer(max_frame=50), pieces) == whole


def expected_frames(stream: bytes, limit: int) -> list[bytes | FrameTooLarge]:
    """What a framer must make of `stream`, however it is chunked: each line over `limit`
    is one `FrameTooLarge`, each other line its stripped self unless blank."""
    out: list[bytes | FrameTooLarge] = []
    for line in stream.split(b"\n"):
        if len(line) > limit:
            out.append(FrameTooLarge(limit))
        elif line.strip(b" \t\r"):
            out.append(line.strip(b" \t\r"))
    return out


@given(
    st.lists(
        st.one_of(st.binary(max_size=24), st.sampled_from([b"", b" \r", b"\r", b"x" * 40])),
        max_size=12,
    ),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    st.integers(min_value=1, max_value=30),
)
def test_any_lines_any_chunking_against_the_rule(
    lines: list[bytes], cuts: list[int], limit: int
) -> None:
    stream = b"\n".join(line.replace(b"\n", b"") for line in lines)
    points = sorted({0, len(stream), *(c for c in cuts if c <= len(stream))})
    chunks = [stream[a:b] for a, b in itertools.pairwise(points)]
    assert feed_chunks(LineFramer(max_frame=limit), chunks) == expected_frames(stream, limit)
