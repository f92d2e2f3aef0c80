"""Log lines that name the request they are about, as text or as JSON (issue 31, item 3).

`configure()` sets the process's log up on stderr in one of two formats:

- `text`: `TIME LEVEL LOGGER: MESSAGE`, and when the line was written while a request was
  handled, ` [request=... job=... trace=... span=...]` after it;
- `json`: one object a line for log shippers (Loki, Vector, Fluent Bit, journald's
  forwarders): `time` (UTC, RFC 3339, milliseconds), `level`, `logger`, `message`, the
  request's fields when there are some, and `exception` (its traceback) when there is one.

What a line says of its request comes from the functions given to `add_context()` (the
agent's: the request id and the job; netkit.tracing's trace and span ids when tracing is
on), read only when a line is written: a request that logs nothing pays nothing for it.
The fields are ids and names; a log line never holds a request's content.

The workload manager, a child of the agent, writes the agent's format: the agent passes it
in `NVPAIR_LOG_FORMAT` (`ENV`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Final, Literal, TextIO

import msgspec

from netkit import tracing

__all__ = ["ENV", "FORMATS", "add_context", "configure"]

ENV: Final = "NVPAIR_LOG_FORMAT"
FORMATS: Final = ("text", "json")
LogFormat = Literal["text", "json"]
TEXT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_sources: list[Callable[[], Mapping[str, str]]] = []


def add_context(source: Callable[[], Mapping[str, str]]) -> None:
    """Have every line written from here on carry what `source()` says then (empty values
    are left out)."""
    _sources.append(source)


def _context() -> dict[str, str]:
    fields: dict[str, str] = {}
    for source in _sources:
        fields.update(source())
    ids = tracing.current_ids()
    if ids is not None:
        fields["trace_id"], fields["span_id"] = ids
    return {k: v for k, v in fields.items() if v}


class _Text(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _context()
        if not fields:
            return line
        said = " ".join(f"{k.removesuffix('_id')}={v}" for k, v in fields.items())
        head, newline, rest = line.partition("\n")  # after the message, before a traceback
        return f"{head} [{said}]{newline}{rest}"


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, str] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_context(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return msgspec.json.encode(line).decode()


def configure(level: int, log_format: str = "text", stream: TextIO | None = None) -> None:
    """Log at `level` and above to `stream` (stderr) in `log_format` (`text` or `json`),
    replacing whatever handlers the root logger had."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Json() if log_format == "json" else _Text(TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
