"""A replica's files under `$NVPAIR_HOME/replicas/<replica>/`: its state file and its log.

`proc.json` says which process runs the replica (pid, start time, boot id, port, spec); it is
written atomically when the engine starts and removed when it stops, so the next agent
finds exactly the engines the last one left running. `engine.log` gets the engine's stdout
and stderr straight from the process (no pipe through the agent, so the engine outlives
it); it is rotated on size with copy-and-truncate (`engine.log.1` .. `.3`), because the
engine keeps its file open in append mode: a line written between the copy and the
truncation is lost, the price of an engine that does not depend on the agent to log.
Every directory is 0700 and every file 0600, whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from agent.engines.proc_os import ProcessId
from agent.engines.templates import LaunchSpec
from certs import make_private_dir, write_atomic

__all__ = [
    "KEEP_STOPPED",
    "LOG_BYTES",
    "LOG_KEEP",
    "ProcRecord",
    "ReplicaFiles",
    "prune_stopped",
    "replica_dirs",
]

LOG_BYTES: Final = 10 * 1024 * 1024  # rotate engine.log past this size
LOG_KEEP: Final = 3  # engine.log.1 .. engine.log.3
TAIL_LINES: Final = 20
TAIL_BYTES: Final = 4096
MAX_RECORD_BYTES: Final = 256 * 1024
KEEP_STOPPED: Final = 64  # stopped replicas whose logs stay for `nvpair logs`


class ProcRecord(msgspec.Struct, kw_only=True, frozen=True):
    """`proc.json`: the process that runs one replica, and what it was started for."""

    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22
    boot_id: str
    port: int
    ready_path: str
    spec: LaunchSpec
    restarts: int = 0

    @classmethod
    def of(cls, process: ProcessId, spec: LaunchSpec, ready_path: str, restarts: int) -> ProcRecord:
        """The record of `spec`'s engine running as `process`."""
        return cls(
            pid=process.pid,
            start_ticks=process.start_ticks,
            boot_id=process.boot_id,
            port=spec.port,
            ready_path=ready_path,
            spec=spec,
            restarts=restarts,
        )

    def process(self) -> ProcessId | None:
        """The process it names; None for a pid no engine can have."""
        if self.pid <= 1 or self.start_ticks < 0:
            return None
        return ProcessId(self.pid, self.start_ticks, self.boot_id)


_decode_record = msgspec.json.Decoder(ProcRecord).decode


@dataclass(frozen=True, slots=True)
class ReplicaFiles:
    """The paths of one replica's files."""

    directory: Path

    @property
    def replica_id(self) -> str:
        """The replica this directory belongs to."""
        return self.directory.name

    @property
    def log(self) -> Path:
        """`engine.log`: what `nvpair logs` shows."""
        return self.directory / "engine.log"

    @property
    def record(self) -> Path:
        """`proc.json`."""
        return self.directory / "proc.json"

    def write_record(self, record: ProcRecord) -> None:
        """Write `proc.json` atomically (0600), creating the directory (0700)."""
        make_private_dir(self.directory)
        write_atomic(self.record, msgspec.json.encode(record))

    def read_record(self) -> ProcRecord | None:
        """`proc.json`, or None when it is missing, too large or unreadable."""
        try:
            with self.record.open("rb") as file:
                data = file.read(MAX_RECORD_BYTES + 1)
        except OSError:
            return None
        if len(data) > MAX_RECORD_BYTES:
            return None
        try:
            return _decode_record(data)
        except (msgspec.DecodeError, ValueError):
            return None

    def remove_record(self) -> None:
        """Forget the process: the replica has stopped (its logs stay)."""
        self.record.unlink(missing_ok=True)

    def open_log(self) -> int:
        """An append-only descriptor on `engine.log` (0600) for the engine to write into."""
        make_private_dir(self.directory)
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # the umask may have narrowed it, or an old file had another
        return fd

    def rotate_if_large(self, limit: int = LOG_BYTES) -> bool:
        """Rotate `engine.log` when it is over `limit` bytes; True when it did."""
        try:
            if self.log.stat().st_size <= limit:
                return False
        except FileNotFoundError:
            return False
        for n in range(LOG_KEEP - 1, 0, -1):
            older = self.log.with_name(f"engine.log.{n}")
            with contextlib.suppress(FileNotFoundError):
                os.replace(older, self.log.with_name(f"engine.log.{n + 1}"))
        with self.log.open("rb") as live:
            live.seek(max(0, live.seek(0, os.SEEK_END) - limit))  # its newest `limit` bytes
            data = live.read(limit)
        write_atomic(self.log.with_name("engine.log.1"), data)
        os.truncate(self.log, 0)
        return True

    def tail(self, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> tuple[str, ...]:
        """The log's last `lines` non-empty lines, at most `max_bytes` in all."""
        try:
            with self.log.open("rb") as file:
                file.seek(0, os.SEEK_END)
                size = file.tell()
                file.seek(max(0, size - max_bytes))
                data = file.read(max_bytes)
        except OSError:
            return ()
        text = data.decode(errors="replace")
        if len(data) == max_bytes and size > max_bytes:
            text = text.partition("\n")[2]  # the first line was cut: drop its end
        return tuple(line for line in text.splitlines() if line.strip())[-lines:]


def replica_dirs(home: Path) -> Iterator[ReplicaFiles]:
    """Every replica directory under `home/replicas/` that holds a `proc.json`."""
    root = home / "replicas"
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        files = ReplicaFiles(entry)
        if entry.is_dir() and files.record.exists():
            yield files


def prune_stopped(home: Path, *, keep: int, running: set[str]) -> list[str]:
    """Remove the directories of stopped replicas (no `proc.json`, not `running`) beyond the
    `keep` most recently changed: each holds up to 40 MiB of logs, and ids are not reused."""
    root = home / "replicas"
    try:
        entries = [e for e in root.iterdir() if e.is_dir() and e.name not in running]
    except FileNotFoundError:
        return []
    stopped = [e for e in entries if not ReplicaFiles(e).record.exists()]
    stopped.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
    removed = []
    for entry in stopped[keep:]:
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed
