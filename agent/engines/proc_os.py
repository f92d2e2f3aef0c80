"""The operating-system side of engine processes: spawning one in its own session, telling
whether a pid is still the process we started, and signalling its group (ports:
`engine_ports.py`).

An engine must outlive the agent (a `kill -9` of the agent, or an upgrade, must not take the
models down), so it is spawned with `setsid` (its own session and process group: the
agent's death sends it no signal, and a stop signals every process the engine forked) with
its output going straight to a file, not through a pipe the agent would have to keep
reading. It is still our child while we live, so exits are reaped with `waitpid`; once the
agent is gone its children belong to init, and the next agent watches them through `/proc`.

A pid is only an identity together with the process's start time (`/proc/<pid>/stat` field
22, clock ticks since boot) and the boot id: a pid reused by another program after a crash
or a reboot is never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

__all__ = [
    "Exit",
    "ProcessId",
    "exit_of",
    "is_alive",
    "replica_marks",
    "signal_group",
    "spawn",
    "terminate",
    "unrecorded_processes",
]

_PROC: Final = Path("/proc")
KILL_WAIT_S: Final = 10.0  # after SIGKILL, for the kernel to take the process down


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as we know it: its pid, when it started, and on which boot."""

    pid: int
    start_ticks: int
    boot_id: str


@dataclass(frozen=True, slots=True)
class Exit:
    """A process that is gone: its exit status when it was our child, else None."""

    code: int | None

    def describe(self) -> str:
        """ "exited with status 1", "was killed by SIGKILL" or "is gone"."""
        if self.code is None:
            return "is gone (not our child: its status is unknown)"
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"was killed by {name}"
        return f"exited with status {self.code}"


def boot_id() -> str:
    """This boot's id (a pid and start time only name a process within one boot)."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    # (state, start time in ticks) from /proc/<pid>/stat; the command name is in parentheses
    # and may hold spaces or ')' itself, so the fields start after the *last* ')'.
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])  # field 3 (state) and field 22 (starttime)


def identify(pid: int) -> ProcessId | None:
    """The identity of a running process, or None when there is no such pid."""
    stat = _stat(pid)
    return None if stat is None else ProcessId(pid, stat[1], boot_id())


def is_alive(process: ProcessId) -> bool:
    """The process is running (not a zombie) and is the one that started at `start_ticks`."""
    stat = _stat(process.pid)
    if stat is None or process.boot_id != boot_id():
        return False
    state, start_ticks = stat
    return start_ticks == process.start_ticks and state not in ("Z", "X")


def exit_of(process: ProcessId) -> Exit | None:
    """None while the process runs; its `Exit` once it is gone (reaped if it was our child)."""
    try:
        pid, status = os.waitpid(process.pid, os.WNOHANG)
    except ChildProcessError:
        return None if is_alive(process) else Exit(None)  # adopted: init reaps it
    if pid == 0:
        return None
    return Exit(os.waitstatus_to_exitcode(status))


def signal_group(process: ProcessId, signum: int) -> None:
    """Send `signum` to the engine's process group (its pid: it leads its own session).

    The group outlives its leader when the engine forked workers (vLLM's tensor-parallel
    ranks), so a group whose leader is gone is still signalled: a group id is never reused
    while a process is in it, so this reaches only what the engine started.
    """
    if process.boot_id != boot_id():
        return
    stat = _stat(process.pid)
    if stat is not None and stat[1] != process.start_ticks:
        return  # the pid is someone else's now; their group is not ours to signal
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


async def terminate(process: ProcessId, grace_s: float, poll_s: float) -> None:
    """SIGTERM the engine's process group, SIGKILL after `grace_s`; returns once the leader
    is gone and then, SIGKILLed again, whatever it left behind in its group (bounded)."""
    signal_group(process, signal.SIGTERM)
    if not await _gone_within(process, grace_s, poll_s):
        log.warning("pid %d ignored SIGTERM for %.1fs; killing it", process.pid, grace_s)
        signal_group(process, signal.SIGKILL)
        await _gone_within(process, KILL_WAIT_S, poll_s)
    signal_group(process, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while True:  # SIGKILL is sent, not yet acted on by every process of the group
        if not _group_runs(process.pid) or time.monotonic() > deadline:
            return
        await asyncio.sleep(min(poll_s, 0.05))


def _group_runs(pgid: int) -> bool:
    # Whether any process of group `pgid` still runs (a zombie does not: it holds no GPU
    # memory and no port, and init reaps it when it will).
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


async def _gone_within(process: ProcessId, seconds: float, poll_s: float) -> bool:
    deadline = time.monotonic() + seconds
    while exit_of(process) is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(min(poll_s, 0.05))  # polling /proc: a group has no exit event
    return True


def replica_marks(home: Path, replica_id: str) -> dict[str, str]:
    """The environment variables that say which home's replica a process runs (`ps e`)."""
    return {"NVPAIR_REPLICA": replica_id, "NVPAIR_REPLICA_HOME": str(home)}


def unrecorded_processes(home: Path, *, keep: set[str]) -> list[int]:
    """Processes of ours marked as running a replica of `home` that is not in `keep`.

    Forked workers carry their engine's marks too, so this finds a whole engine.
    """
    wanted = f"NVPAIR_REPLICA_HOME={home}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if wanted not in environ:
            continue
        replica = next((v[15:] for v in environ if v.startswith(b"NVPAIR_REPLICA=")), b"")
        if replica.decode(errors="replace") not in keep:
            found.append(int(entry.name))
    return found


def spawn(argv: Sequence[str], env: Mapping[str, str], log_fd: int) -> ProcessId:
    """Start `argv` in a new session, stdin from /dev/null, stdout and stderr into `log_fd`.

    `posix_spawnp` rather than a `Process` object: nothing in the agent holds the child's
    pipes or warns when it is left running, which is what an engine does when the agent
    stops. A program that is not found raises `FileNotFoundError` here, at once.
    """
    pid = os.posix_spawnp(
        argv[0],
        list(argv),
        dict(env),
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log_fd, 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2),
        ],
        setsid=True,
    )
    found = identify(pid)
    # A child that has already exited is still a zombie with its stat until it is reaped.
    return found if found is not None else ProcessId(pid, -1, boot_id())
