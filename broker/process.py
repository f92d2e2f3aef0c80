"""The plumbing of a supervised child process: its stderr passed through, and stopping it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Mapping, Sequence

from broker.errors import ManagerPortInUse, ManagerStartFailed
from workload_manager.errors import port_in_use_from

__all__ = ["pass_stderr", "spawn_stdio", "start_failure", "stop_process"]

log = logging.getLogger(__name__)


async def spawn_stdio(
    argv: Sequence[str], extra_env: Mapping[str, str]
) -> asyncio.subprocess.Process:
    """Start `argv` with stdin, stdout and stderr piped to us and `extra_env` added."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **extra_env},
    )


def start_failure(code: int, tail: deque[str]) -> ManagerPortInUse | ManagerStartFailed:
    """Why a first child exited with status 2, from its last lines on stderr."""
    line = tail[-1] if tail else ""
    port = next(filter(None, map(port_in_use_from, reversed(tail))), None)
    return ManagerPortInUse(port, line) if port is not None else ManagerStartFailed(code, line)


async def pass_stderr(proc: asyncio.subprocess.Process, tail: deque[str]) -> None:
    """Copy the child's stderr to ours as it comes, keeping its last lines in `tail`.

    Chunks, not lines: a line of any length must not stop the copy, or the child would
    block on a full pipe. The last lines say why it exited (the one line of a port in use).
    """
    assert proc.stderr is not None
    partial = ""
    while chunk := await proc.stderr.read(65536):
        text = chunk.decode(errors="replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        *lines, partial = (partial + text).split("\n")
        partial = partial[-500:]
        tail.extend(line.strip()[:500] for line in lines if line.strip())
    if partial.strip():
        tail.append(partial.strip())


async def stop_process(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace_s`; returns once it is gone."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        async with asyncio.timeout(grace_s):
            await proc.wait()
    except TimeoutError:
        log.warning("pid %d ignored SIGTERM for %.1fs; killing it", proc.pid, grace_s)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
