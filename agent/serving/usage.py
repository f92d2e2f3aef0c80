"""Token usage, read from the answers the facade passes through: pure functions, no I/O.

For streamed chat and completions the origin asks the engine for usage
(`stream_options.include_usage`, re-encoding the body only when the client did not ask)
and strips the usage-only chunk (`choices: []` with `usage`, vLLM's and OpenAI's last
chunk) from what the client gets when the client did not ask for it. Every answer's
`usage` is read: chat and completions (`prompt_tokens`, `completion_tokens`), embeddings
(`prompt_tokens` only), the Responses API (`input_tokens`, `output_tokens`, at the top or
under `response` in its `response.completed` event).

Cheap on purpose: a stream's bytes are searched for `"usage": {` before any JSON is
decoded, so only the event that carries usage is decoded; a stream is never held whole --
at most its one incomplete event (`MAX_EVENT`), and only while stripping. Inside a JSON
string a quote is escaped (`\\"usage\\"`), so text a model writes cannot match.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct

from agent.core.json_input import BadJson, decode_json

__all__ = [
    "MAX_EVENT",
    "STREAMED_PATHS",
    "Meter",
    "StreamScanner",
    "Usage",
    "ask_for_usage",
    "read_usage",
]

# Routes whose streams carry usage only when asked (`stream_options.include_usage`).
STREAMED_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})
# The most of one incomplete event held back while stripping (a usage chunk is ~200 bytes).
MAX_EVENT: Final = 256 * 1024

_USAGE: Final = re.compile(rb'"usage"\s*:\s*\{')
_BOUNDARY: Final = re.compile(rb"\r?\n\r?\n")
_Count = Annotated[int, Meta(ge=0, le=2**53 - 1)]


class _Counts(Struct):
    prompt_tokens: _Count | None = None
    completion_tokens: _Count | None = None
    input_tokens: _Count | None = None  # the Responses API's names
    output_tokens: _Count | None = None


class _Inner(Struct):
    usage: _Counts | None = None


class _Answer(Struct):
    # msgspec skips every other field without building it (choices, embeddings, output).
    usage: _Counts | None = None
    response: _Inner | None = None  # the Responses API's `response.completed` event
    choices: list[msgspec.Raw] | None = None


_answer: Final = msgspec.json.Decoder(_Answer)
_body: Final = msgspec.json.Decoder(dict[str, Any])


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens one answer reports: the prompt's and the completion's (0 for embeddings)."""

    prompt: int
    completion: int


def _counts(answer: _Answer) -> Usage | None:
    counts = answer.usage or (answer.response.usage if answer.response else None)
    if counts is None:
        return None
    prompt = counts.prompt_tokens if counts.prompt_tokens is not None else counts.input_tokens
    completion = (
        counts.completion_tokens if counts.completion_tokens is not None else counts.output_tokens
    )
    if prompt is None and completion is None:
        return None
    return Usage(prompt or 0, completion or 0)


def read_usage(body: bytes) -> Usage | None:
    """The usage a JSON answer (or one event's data) reports; None without one, or when
    the body is not JSON of that shape (the client still gets it as it is)."""
    if _USAGE.search(body) is None:
        return None
    try:
        return _counts(decode_json(_answer, body))
    except BadJson:
        return None


def ask_for_usage(raw: bytes, path: str) -> tuple[bytes, bool]:
    """The body to send the engine and whether to strip the usage chunk from the answer:
    a streamed chat or completion that does not ask for usage is re-encoded asking for it
    (and its usage chunk is stripped again); every other body passes byte for byte."""
    if path not in STREAMED_PATHS or b'"stream"' not in raw:
        return raw, False
    try:
        body = decode_json(_body, raw)
    except BadJson:
        return raw, False
    if body.get("stream") is not True:
        return raw, False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return raw, False
    if options is not None and not isinstance(options, dict):
        return raw, False  # the engine's to refuse, as the client sent it
    body["stream_options"] = {**(options or {}), "include_usage": True}
    return msgspec.json.encode(body), True


def _last_boundary(data: bytes) -> int:
    """Where the last whole event in `data` ends (-1: none does): after a blank line."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)


def _event_data(event: bytes) -> bytes:
    """The `data:` payload of one SSE event (its lines joined, as the SSE spec has it)."""
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


class StreamScanner:
    """Reads usage from a server-sent event stream fed chunk by chunk, across chunk
    boundaries; with `strip` it also cuts usage-only chunks out of what it hands on."""

    def __init__(self, *, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self.stripped = 0  # usage-only events cut out
        self._tail = b""  # the incomplete event at the end of what was fed
        self._skipping = False  # the incomplete event grew past MAX_EVENT: not read

    def feed(self, chunk: bytes) -> bytes:
        """Take one chunk; returns the bytes to send on (the chunk itself unless stripping)."""
        data = self._tail + chunk if self._tail else chunk
        end = _last_boundary(data)
        if end < 0:  # no event ends in this chunk
            return self._hold(data, chunk)
        complete = data[:end]
        rest = data[end:]
        skipped, self._skipping = self._skipping, False
        out = self._complete(complete, skip_first=skipped)
        if self.strip:
            return out + self._hold(rest, rest)
        self._hold(rest, rest)
        return chunk

    def end(self) -> bytes:
        """The stream ended: what is still held (an event without its blank line)."""
        tail, self._tail = self._tail, b""
        if tail and not self._skipping and self._read(tail):
            return b""  # a usage-only chunk, stripped
        return tail if self.strip else b""

    def _hold(self, data: bytes, chunk: bytes) -> bytes:
        # Keep the incomplete event (bounded); returns what to send on now.
        if len(data) > MAX_EVENT or self._skipping:
            self._skipping = True
            self._tail = b""
            if self.strip:
                return data  # too big to hold back: passed on, not read
            return chunk
        self._tail = data
        return b"" if self.strip else chunk

    def _complete(self, data: bytes, *, skip_first: bool) -> bytes:
        """Read (and, stripping, cut) the usage events among whole events `data`."""
        found = _USAGE.search(data)
        if found is None:
            return data
        start = 0
        kept: list[bytes] = []
        for boundary in _BOUNDARY.finditer(data):
            event = data[start : boundary.end()]
            first, start = start == 0, boundary.end()
            if first and skip_first:
                kept.append(event)  # the end of an event too big to read
                continue
            if _USAGE.search(event) is None or not self._read(event):
                kept.append(event)
        return b"".join(kept) if self.strip else data

    def _read(self, event: bytes) -> bool:
        """Read one event's usage; True when it is a usage-only chunk to strip."""
        data = _event_data(event)
        try:
            answer = decode_json(_answer, data)
        except BadJson:
            return False
        usage = _counts(answer)
        if usage is not None:
            self.usage = usage
        usage_only = usage is not None and answer.choices == []
        if usage_only and self.strip:
            self.stripped += 1
            return True
        return False


@dataclass(slots=True)
class Meter:
    """One request's measure, filled in by the relay: usage, first streamed byte, end."""

    strip: bool = False  # the client did not ask for the usage chunk: cut it out
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None  # streamed answers only: time to first token
    finished: float | None = None
    usage: Usage | None = None
    _scanner: StreamScanner | None = None

    def feed(self, chunk: bytes) -> bytes:
        """One chunk of a streamed answer in; the bytes for the client out (maybe none)."""
        scanner = self._scanner
        if scanner is None:
            self.first_byte = time.monotonic()
            scanner = self._scanner = StreamScanner(strip=self.strip)
        out = scanner.feed(chunk)
        self.usage = scanner.usage
        return out

    def end(self) -> bytes:
        """The streamed answer ended: the bytes still held for the client."""
        if self._scanner is None:
            return b""
        out = self._scanner.end()
        self.usage = self._scanner.usage
        return out

    def read(self, body: bytes) -> None:
        """A whole (not streamed) answer: its usage."""
        self.usage = read_usage(body)

    def finish(self) -> None:
        """The answer is over (sent, failed or cancelled): the total time stops here."""
        if self.finished is None:
            self.finished = time.monotonic()

    def ttft_ms(self) -> int | None:
        """Milliseconds to the first streamed byte (None for an answer that did not stream)."""
        if self.first_byte is None:
            return None
        return round((self.first_byte - self.started) * 1000)

    def total_ms(self) -> int | None:
        """Milliseconds from the request to the end of its answer."""
        if self.finished is None:
            return None
        return round((self.finished - self.started) * 1000)
