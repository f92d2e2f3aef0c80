"""Newline framing with an explicit maximum frame size, sans-I/O.

Feed bytes as they arrive, in chunks of any size; take complete frames out. A line longer
than the maximum is not buffered: its bytes are skipped up to the next newline and one
`FrameTooLarge` stands in its place, so a sender cannot grow our memory and the channel
goes on with the next line (the asyncio stream default of 64 KiB per line is exactly the
kind of hidden limit this replaces).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from workload_manager.errors import ConfigurationError, UsageError

__all__ = ["DEFAULT_MAX_FRAME", "FrameTooLarge", "LineFramer"]

DEFAULT_MAX_FRAME: Final = 1024 * 1024


@dataclass(frozen=True, slots=True)
class FrameTooLarge:
    """A line that exceeded the maximum; its content was discarded."""

    limit: int


class LineFramer:
    """Splits a byte stream into newline-terminated frames of at most `max_frame` bytes."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1:
            raise ConfigurationError("max_frame must be at least 1")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._skipping = False  # inside an oversized line, discarding up to its newline
        self._closed = False

    @property
    def buffered(self) -> int:
        """Bytes held waiting for a newline (never more than `max_frame`)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[bytes | FrameTooLarge]:
        """Add received bytes and yield every frame they complete."""
        if self._closed:
            raise UsageError("feed() after close()")
        chunk = bytes(data)
        pos, end = 0, len(chunk)
        while pos < end:
            newline = chunk.find(b"\n", pos)
            if self._skipping:
                if newline < 0:
                    return
                self._skipping = False
                pos = newline + 1
                continue
            if newline < 0:
                if len(self._buf) + end - pos > self.max_frame:
                    self._buf.clear()
                    self._skipping = True
                    yield FrameTooLarge(self.max_frame)
                else:
                    self._buf += chunk[pos:]
                return
            if len(self._buf) + newline - pos > self.max_frame:
                self._buf.clear()
                yield FrameTooLarge(self.max_frame)
            else:
                if self._buf:
                    self._buf += chunk[pos:newline]
                    line = bytes(self._buf)
                    self._buf.clear()
                else:
                    line = chunk[pos:newline]
                frame = _strip_line(line)
                if frame:
                    yield frame
            pos = newline + 1

    def close(self) -> Iterator[bytes | FrameTooLarge]:
        """End of stream: a last line without its newline is still a frame."""
        self._closed = True
        if self._skipping:
            return
        line = _strip_line(bytes(self._buf))
        self._buf.clear()
        if line:
            yield line


def _strip_line(line: bytes) -> bytes:
    # Tolerate CRLF and blank keep-alive lines; JSON itself never needs the whitespace.
    return line.strip(b" \t\r")
