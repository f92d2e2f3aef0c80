"""Reading a replica's `engine.log` for `nvpair logs`, within bounds.

An engine's log may be gigabytes of its own words (vLLM logs requests, prompts included), so
no call reads more than `MAX_BYTES` or returns more than `MAX_LINES` lines: `tail` reads the
end of the file, `since` what was written after an offset a previous call returned (how
`--follow` polls). Both hand back whole lines and the offset just after the last one, so a
line the engine is still writing is sent once, when it is complete. The supervisor rotates
the file by copy and truncate (docs/engines.md): an offset past the end means the file was
truncated, and reading starts again at its beginning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_LINES", "MAX_BYTES", "MAX_LINES", "LogChunk", "since", "tail"]

MAX_BYTES: Final = 1024 * 1024
MAX_LINES: Final = 10_000
DEFAULT_LINES: Final = 100


@dataclass(frozen=True, slots=True)
class LogChunk:
    """Whole lines of the log, where the next read starts, and what the bounds left out."""

    lines: list[str]
    offset: int  # just after the last whole line returned
    partial: str = ""  # the last line, not yet ended by a newline (tail only)
    truncated: bool = False  # lines asked for were left out by the bounds
    rotated: bool = False  # the file was truncated since the offset given


def tail(path: Path, lines: int = DEFAULT_LINES) -> LogChunk:
    """The last `lines` lines (at most `MAX_LINES`, from the last `MAX_BYTES`)."""
    wanted = max(1, min(lines, MAX_LINES))
    with path.open("rb") as log:
        size = log.seek(0, 2)
        start = max(0, size - MAX_BYTES)
        log.seek(start)
        data = log.read(size - start)
    whole, _, partial = data.rpartition(b"\n")
    found = _split(whole + b"\n") if whole or data.startswith(b"\n") else []
    cut = start > 0
    if cut and found:
        found = found[1:]  # the first line began before the window
    truncated = (cut and len(found) < wanted) or lines > MAX_LINES  # the bounds, not `lines`
    offset = start + (len(whole) + 1 if b"\n" in data else 0)
    return LogChunk(found[-wanted:], offset, _text(partial), truncated)


def since(path: Path, offset: int) -> LogChunk:
    """The whole lines written after `offset`: at most `MAX_LINES` lines and `MAX_BYTES`, the
    first ones, so a follower that asks again from the returned offset misses none."""
    with path.open("rb") as log:
        size = log.seek(0, 2)
        rotated = offset > size
        start = 0 if rotated else max(0, offset)
        log.seek(start)
        data = log.read(min(size - start, MAX_BYTES))
    parts = data.split(b"\n")[:-1][:MAX_LINES]  # each ended by a newline
    if not parts and len(data) == MAX_BYTES:
        # One line longer than the window: sent as it is, or it never would be.
        return LogChunk([_text(data)], start + len(data), rotated=rotated)
    used = sum(len(part) + 1 for part in parts)
    return LogChunk([_text(part) for part in parts], start + used, rotated=rotated)


def _split(data: bytes) -> list[str]:
    return [_text(line) for line in data.split(b"\n")[:-1]]


def _text(line: bytes) -> str:
    # An engine's output is bytes: undecodable ones are shown, not an error.
    return line.rstrip(b"\r").decode(errors="replace")
