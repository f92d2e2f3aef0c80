"""`nvpair agent run` as a daemon: one agent per `NVPAIR_HOME`, clear start-up failures,
and a stop on SIGTERM or SIGINT at any moment, start-up included.

Exit statuses: 0 after a requested stop; 1 when the node has no cluster identity; 2 when it
cannot start as configured (a port in use, another agent on this home, an unusable home, a
bad configuration) -- always with one line on stderr that says what to change, never a
traceback. A restart loop (systemd `Restart=on-failure`) therefore sees 2 and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final, TextIO

from agent.config import AgentConfig
from agent.core.errors import AgentLocked, HomeUnusable, StartupError
from broker.errors import BrokerError
from certs import CertsError, make_private_dir

__all__ = ["hold_home", "run_agent"]

log = logging.getLogger(__name__)

STOP_BOUND_S: Final = 10.0  # after a stop is asked, the process ends within this


def run_agent(config: AgentConfig, *, err: TextIO = sys.stderr) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit status."""
    try:
        with hold_home(config.home):
            return asyncio.run(_serve(config))
    except StartupError as exc:
        print(f"nvpair: {exc}", file=err)
        return 2
    except CertsError as exc:
        print(f"nvpair: {exc}", file=err)
        return 1
    except BrokerError as exc:  # the workload manager could not start
        print(f"nvpair: {exc}", file=err)
        return 2


@contextlib.contextmanager
def hold_home(home: Path) -> Iterator[None]:
    """Create `home` if needed and hold its lock file for the agent's lifetime.

    The lock is an `flock`: the kernel drops it when the process dies, however it dies, so
    a lock file left by a killed agent is recognised as stale and taken over.
    """
    lock_path = home / "agent.lock"
    try:
        make_private_dir(home)  # 0700 whatever the umask, as is every file written in it
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
    except OSError as exc:
        raise HomeUnusable(str(home), exc.strerror or str(exc)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentLocked(str(home), _read_pid(fd)) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            raise HomeUnusable(str(home), exc.strerror or str(exc)) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None


async def _serve(config: AgentConfig) -> int:
    from agent.app.daemon import Agent  # the daemon imports every part; the CLI need not

    agent = Agent(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    stopping = asyncio.create_task(stop.wait())
    starting = asyncio.create_task(agent.start())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        # Asked to stop while starting: cancel the start; it stops what it started.
        log.info("stop requested during start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(STOP_BOUND_S):
                await starting
        return 0
    stopping.cancel()
    starting.result()  # a start-up failure: raised to run_agent (the start cleaned up)
    # What start-up made lives as long as the agent: out of the collector's way, so a full
    # collection under load scans what requests made, not every module and part (at 2,000
    # requests/s its collections took 18 us a request, 3 us after; issue 33).
    gc.freeze()
    await stop.wait()
    log.info("stopping")
    await agent.aclose()
    return 0
