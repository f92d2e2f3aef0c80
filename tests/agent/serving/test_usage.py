"""The usage functions in memory: asking for usage, reading it from every answer's shape,
and the stream scanner fed whole, byte by byte and cut anywhere; the usage store's batches."""

from __future__ import annotations

import itertools
import json
import sqlite3
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.serving.usage import MAX_EVENT, StreamScanner, Usage, ask_for_usage, read_usage
from agent.serving.usage_store import UsageRow, UsageStore, UsageUnavailable

CHAT = "/v1/chat/completions"


def chunk(content: str) -> bytes:
    event = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0,
             "delta": {"content": content}, "finish_reason": None}]}  # fmt: skip
    return f"data: {json.dumps(event)}\n\n".encode()


USAGE_CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
)
# A model writing `"usage": {` in its text: escaped inside the JSON string, so not usage.
TRICKY = chunk('say "usage": {"prompt_tokens": 99}')
STREAM = chunk("Hello") + TRICKY + chunk(" world") + USAGE_CHUNK + b"data: [DONE]\n\n"


def test_ask_for_usage_rewrites_only_a_stream_that_did_not_ask() -> None:
    plain = b'{"model":"m","stream":true,"messages":[]}'
    raw, strip = ask_for_usage(plain, CHAT)
    assert strip
    assert json.loads(raw)["stream_options"] == {"include_usage": True}
    # Asked already, not streamed, another route: the very bytes pass.
    asked = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'
    for body, path in (
        (asked, CHAT),
        (b'{"model":"m","messages":[]}', CHAT),
        (b'{"model":"m","stream":false}', CHAT),
        (plain, "/v1/embeddings"),
    ):
        out, strip = ask_for_usage(body, path)
        assert out is body
        assert not strip
    # Other stream options are kept.
    raw, _ = ask_for_usage(b'{"model":"m","stream":true,"stream_options":{"x":1}}', CHAT)
    assert json.loads(raw)["stream_options"] == {"x": 1, "include_usage": True}


def test_read_usage_of_every_shape() -> None:
    chat = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 5,
            "completion_tokens": 2, "total_tokens": 7}}  # fmt: skip
    embeddings = {"data": [{"embedding": [0.1] * 8}], "usage": {"prompt_tokens": 4,
                  "total_tokens": 4}}  # fmt: skip
    responses = {"output": [], "usage": {"input_tokens": 6, "output_tokens": 9}}
    completed = {"type": "response.completed", "response": {"usage": {"input_tokens": 1,
                 "output_tokens": 2}}}  # fmt: skip
    assert read_usage(json.dumps(chat).encode()) == Usage(5, 2)
    assert read_usage(json.dumps(embeddings).encode()) == Usage(4, 0)
    assert read_usage(json.dumps(responses).encode()) == Usage(6, 9)
    assert read_usage(json.dumps(completed).encode()) == Usage(1, 2)
    for body in (b"{}", b"not json", b'{"usage": {"prompt_tokens": -1}}', b'{"usage":null}'):
        assert read_usage(body) is None


def scan(parts: list[bytes], *, strip: bool) -> tuple[bytes, StreamScanner]:
    scanner = StreamScanner(strip=strip)
    out = b"".join(scanner.feed(p) for p in parts) + scanner.end()
    return out, scanner


def test_scanner_whole_and_byte_by_byte() -> None:
    for parts in ([STREAM], [STREAM[i : i + 1] for i in range(len(STREAM))]):
        out, scanner = scan(parts, strip=False)
        assert out == STREAM  # the client asked: every byte passes
        assert scanner.usage == Usage(7, 3)
        out, scanner = scan(parts, strip=True)
        assert out == STREAM.replace(USAGE_CHUNK, b"")
        assert scanner.usage == Usage(7, 3)
        assert scanner.stripped == 1


def test_scanner_reads_crlf_events() -> None:
    stream = STREAM.replace(b"\n\n", b"\r\n\r\n")
    out, scanner = scan([stream[i : i + 7] for i in range(0, len(stream), 7)], strip=True)
    assert scanner.usage == Usage(7, 3)
    assert out == stream.replace(USAGE_CHUNK.replace(b"\n\n", b"\r\n\r\n"), b"")


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12), st.booleans())
def test_scanner_cut_anywhere(cuts: list[int], strip: bool) -> None:
    edges = [0, *sorted(cuts), len(STREAM)]
    parts = [STREAM[a:b] for a, b in itertools.pairwise(edges)]
    out, scanner = scan(parts, strip=strip)
    assert scanner.usage == Usage(7, 3)
    assert out == (STREAM.replace(USAGE_CHUNK, b"") if strip else STREAM)


def test_scanner_holds_at_most_one_bounded_event() -> None:
    # An event larger than MAX_EVENT is passed on unread, and the usage after it still read.
    huge = chunk("x" * (MAX_EVENT + 10))
    stream = huge + USAGE_CHUNK
    parts = [stream[i : i + 4096] for i in range(0, len(stream), 4096)]
    scanner = StreamScanner(strip=True)
    out = b""
    for part in parts:
        out += scanner.feed(part)
        assert len(scanner._tail) <= MAX_EVENT
    out += scanner.end()
    assert out == huge
    assert scanner.usage == Usage(7, 3)


def row(n: int) -> UsageRow:
    return UsageRow("run", str(n), "m", None, n, 2 * n, None, 10, 1_000 + n)


async def test_store_writes_in_batches_and_reads_back(tmp_path: Path) -> None:
    store = await UsageStore.open(tmp_path / "usage.db")
    try:
        for n in range(1200):
            store.add(row(n))
        await store.flush()
        assert store.transactions == 1  # 1,200 rows, one transaction
        assert store.pending == 0
        store.add(row(5000))
        found = await store.of([("run", "5000"), ("run", "7"), ("run", "nope")])
        assert store.transactions == 2  # reading flushed what was buffered
        assert found[("run", "7")] == row(7)
        assert set(found) == {("run", "5000"), ("run", "7")}
        assert msgspec.to_builtins(found[("run", "7")].wire()) == {
            "runId": "run",
            "id": "7",
            "promptTokens": 7,
            "completionTokens": 14,
            "ttftMs": None,
            "totalMs": 10,
        }
        await store.prune(1_100)
        assert set(await store.of([("run", "7"), ("run", "150")])) == {("run", "150")}
    finally:
        await store.close()
    assert (tmp_path / "usage.db").stat().st_mode & 0o777 == 0o600


async def test_store_keeps_rows_the_database_refused(tmp_path: Path) -> None:
    store = await UsageStore.open(tmp_path / "usage.db")
    blocker = sqlite3.connect(tmp_path / "usage.db", isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the file: locked
        store.add(row(1))
        with pytest.raises(UsageUnavailable):
            await store.flush()
        assert store.pending == 1  # kept, not lost
        blocker.execute("ROLLBACK")
        await store.flush()  # the control: once free, the same row is written
        assert store.pending == 0
        assert set(await store.of([("run", "1")])) == {("run", "1")}
    finally:
        blocker.close()
        await store.close()
