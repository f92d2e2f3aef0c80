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
# Stripped from each line's ends: CRLF and blank keep-alive lines are tolerated, and JSON
# itself never needs the whitespace.
_BLANKS: Final = b" \t\r"


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

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes | FrameTooLarge]:
        """Add received bytes; returns every frame they complete.

        The lines a chunk holds whole are split out in one pass (`bytes.split`, in C): a
        chunk from a busy peer or broker holds hundreds.
        """
        if self._closed:
            raise UsageError("feed() after close()")
        out: list[bytes | FrameTooLarge] = []
        limit = self.max_frame
        chunk = bytes(data)
        if self._buf or self._skipping:
            # A line begun in an earlier chunk: it ends at this chunk's first newline.
            newline = chunk.find(b"\n")
            if newline < 0:
                if self._skipping:
                    return out
                if len(self._buf) + len(chunk) > limit:
                    self._buf.clear()
                    self._skipping = True
                    out.append(FrameTooLarge(limit))
                else:
                    self._buf += chunk
                return out
            if self._skipping:
                self._skipping = False
            elif len(self._buf) + newline > limit:
                self._buf.clear()
                out.append(FrameTooLarge(limit))
            else:
                self._buf += chunk[:newline]
                line = _strip_line(bytes(self._buf))
                self._buf.clear()
                if line:
                    out.append(line)
            chunk = chunk[newline + 1 :]
        lines = chunk.split(b"\n")
        tail = lines.pop()  # after the last newline: the start of a line yet to end
        for line in lines:
            if len(line) > limit:
                out.append(FrameTooLarge(limit))
            elif line := line.strip(_BLANKS):
                out.append(line)
        if len(tail) > limit:
            self._skipping = True
            out.append(FrameTooLarge(limit))
        elif tail:
            self._buf += tail
        return out

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
    return line.strip(_BLANKS)
