"""Supervising the workload manager child process.

The broker starts `python -m workload_manager` with the node's port and cluster dir and talks
to it over stdio (newline-delimited JSON-RPC). What each frame means is the `BrokerChannel`'s
business (`broker/channel.py`); this module only moves bytes and carries out its actions:

- on `ready {version}` it sends `peers:set` from the node records (again on every change);
- it answers `workloads:snapshot` from the Jobs store, in pages bounded by bytes
  (`broker/snapshot.py`) so each fits in a frame the manager takes;
- it hands every `workloads:upsert` / `workloads:remove` to the Jobs writer (group commit);
  while the writer is full it stops reading, so the manager's buffer fills and it answers
  its peers 503 instead of dropping anything;
- it passes the child's stderr through to ours, keeping the last lines;
- it restarts the child when it exits, with backoff (`broker/restarts.py`); five exits
  within a minute is a crash loop, reported in `status()` and logged, not hidden; a first
  child that exits with status 2 (a port in use, a bad flag) is not restarted: `start()`
  raises `ManagerPortInUse` / `ManagerStartFailed`;
- it checks the child's liveness (`broker/liveness.py`): one that does not answer
  `manager:status` within the deadline, or could not take its input, is killed and
  restarted, and `problem()` says why; frames it could not hand over are counted
  (`dropped`) and logged once per burst;
- on `aclose()`, it sends SIGTERM and, after a grace period, SIGKILL.

The child trusts the cluster's CA only (seed 002: peers are pinned members): it is started
without the system's CA store (`NO_SYSTEM_TRUST`), which no connection of its own uses and
which aiohttp would otherwise load at import -- a fifth of the child's start-up CPU.

Its tasks (the loop, the stderr pump) belong to its own task group; a loop that dies is
logged with its traceback and reported (`failure`, `on_failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from broker.channel import (
    Answered,
    BrokerChannel,
    ChannelAction,
    ManagerReady,
    Refused,
    SendToManager,
    SnapshotWanted,
    StoreRemove,
    StoreUpsert,
)
from broker.errors import (
    ManagerRefused,
    ManagerUnavailable,
)
from broker.event_hold import EventHold
from broker.frame_batch import FrameBatch
from broker.jobs import JobsStore, JobsWriter
from broker.liveness import Drops, Liveness, watch
from broker.process import pass_stderr, spawn_stdio, start_failure, stop_process
from broker.restarts import RestartPolicy
from broker.snapshot import answer_snapshot
from netkit.tasks import FailureHandler, describe, reporting
from workload_manager.framing import LineFramer
from workload_manager.manager import Peer
from workload_manager.workload import Workload, WorkloadRemoval

__all__ = ["ManagerSupervisor"]

# OpenSSL's default verify paths, pointed at nothing: `ssl.create_default_context()` in the
# child (aiohttp makes two at import) then loads no CA; the child's own contexts load the
# cluster CA explicitly.
NO_SYSTEM_TRUST: Final = {"SSL_CERT_FILE": "/nonexistent", "SSL_CERT_DIR": "/nonexistent"}

log = logging.getLogger(__name__)

PART: Final = "workload-manager"
MAX_UNREAD: Final = 16 * 1024 * 1024
MAX_FRAME: Final = 16 * 1024 * 1024
REQUEST_TIMEOUT_S: Final = 5.0
STDERR_DRAIN_S: Final = 1.0  # a grandchild may hold the pipe open after the child exits
USAGE_EXIT: Final = 2  # the manager's status for what restarting cannot fix (its cli.py)


class ManagerSupervisor:
    """Runs the workload manager child; `start()` / `aclose()` own its lifetime."""

    def __init__(
        self,
        *,
        store: JobsStore,
        writer: JobsWriter,
        port: int,
        cluster_dir: Path,
        log_level: str = "info",
        extra_env: dict[str, str] | None = None,
        argv: Sequence[str] | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        grace_s: float = 5.0,
        liveness: Liveness | None = None,
        on_failure: FailureHandler | None = None,
    ) -> None:
        self.liveness = liveness or Liveness()
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.grace_s = grace_s
        self.store = store
        self.writer = writer
        self.port = port
        self.cluster_dir = cluster_dir
        self.log_level = log_level
        self.extra_env = extra_env or {}
        self.argv = list(argv) if argv else [sys.executable, "-m", "workload_manager"]
        self.on_failure = on_failure
        self.peers: tuple[Peer, ...] = ()
        self.version: str | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self.state = "starting"
        self.failure: str | None = None  # why the supervising loop died, if it did
        self.stderr_tail: deque[str] = deque(maxlen=8)  # the child's last lines on stderr
        self.drops = Drops()  # frames not handed to the child: not reading, or not running
        self.hung: str | None = None  # why the last child was declared hung, until a ready
        self._policy = RestartPolicy()
        self._proc: asyncio.subprocess.Process | None = None
        self._batch = FrameBatch(lambda: self._proc, self.drops, MAX_UNREAD)
        # A job's events, the latest of each, held a moment (broker.event_hold).
        self.held = EventHold(
            lambda method, record: self._batch.send(
                self._proc, BrokerChannel.event_frame(method, record)
            )
        )
        self._channel: BrokerChannel | None = None
        self._ready = asyncio.Event()
        self._started: asyncio.Future[None] | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._running: set[asyncio.Task[None]] = set()  # ours, in `_tasks`, until done
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._watch: asyncio.Task[None] | None = None  # the running child's liveness check
        self._stopping = False

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the child and keep it running; returns once it said `ready`.

        Raises `ManagerPortInUse` (its port is taken) or `ManagerStartFailed` (another exit
        with status 2) when the first child ends that way, `ManagerUnavailable` when it is
        stopped first; then, as when start() is cancelled, nothing is left running.
        """
        self._started = asyncio.get_running_loop().create_future()
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        self._spawn(PART, reporting(PART, self._supervise(), self._died))
        try:
            await self._started
        except BaseException:  # refused, failed, or cancelled (a signal during start-up)
            self._started.cancel()  # a no-op when done; else nobody is left to await it
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop the child: SIGTERM, then SIGKILL after the grace period; end every task."""
        self._stopping = True
        self.held.flush()  # the last events, while the child still runs
        if self._started is not None and not self._started.done():
            self._started.set_exception(ManagerUnavailable("stopped before it was ready"))
        await self._stop_child()
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            for task in self._running:
                task.cancel()
            await tasks.__aexit__(None, None, None)
        self.state = "stopped"

    @property
    def dropped(self) -> int:
        """Frames not handed to the child (it was not reading, or not running)."""
        return self.drops.total

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def problem(self) -> str | None:
        """Why the manager is not serving, for a health report; None while it runs."""
        if self.failure is not None:
            return self.failure
        if self.state == "running":
            return None
        last = f"; it said: {self.stderr_tail[-1]}" if self.stderr_tail else ""
        hung = f"; it hung: {self.hung}" if self.hung else ""
        return f"the workload manager is {self.state} (last exit {self.last_exit}){hung}{last}"

    def status(self) -> dict[str, Any]:
        """For the local API and metrics."""
        return {
            "state": self.state,
            "pid": self.pid,
            "version": self.version,
            "restarts": self.restarts,
            "lastExit": self.last_exit,
            "dropped": self.drops.total,
            "redundant": self.writer.redundant,
            "hung": self.hung,
        }

    # -- talking to the child -------------------------------------------------------------------

    def set_peers(self, peers: Sequence[Peer]) -> None:
        """Replace the peer list, now if the child is up, else at its next `ready`."""
        self.peers = tuple(peers)
        if self._ready.is_set():
            self._send(BrokerChannel.peers_frame(self.peers))

    def send_event(self, method: str, record: Workload) -> None:
        """A local lifecycle event (from the facade) for the manager to broadcast: held a
        moment, so a job that ends meanwhile goes out once, as it ended (`EventHold`)."""
        self.held.put(method, record)

    def send_removal(self, removal: WorkloadRemoval) -> None:
        """A local removal for the manager to broadcast."""
        self._send(BrokerChannel.removal_frame(removal))

    async def request(
        self, method: str, params: Any = None, *, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> Any:
        """Call a manager method (e.g. `manager:status`) and return its decoded result.

        Raises `ManagerRefused` when it answers with an error and `ManagerUnavailable` when
        it is not running, exits meanwhile or does not answer within `timeout_s`.
        """
        channel = self._channel
        if channel is None or not self._ready.is_set():
            raise ManagerUnavailable(f"the workload manager is {self.state}")
        request_id, frame = channel.request(method, msgspec.UNSET if params is None else params)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            if not self._send(frame):
                raise ManagerUnavailable("the workload manager is not reading its input")
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise ManagerUnavailable(
                f"the workload manager did not answer {method[:64]} within {timeout_s:g}s"
            ) from None
        finally:
            self._pending.pop(request_id, None)
            channel.forget(request_id)

    def _send(self, frame: bytes) -> bool:
        self.held.flush()  # what is held goes first: a removal never overtakes its job
        return self._batch.send(self._proc, frame)

    def _declare_hung(self, proc: asyncio.subprocess.Process, why: str) -> None:
        if proc.returncode is not None or self._stopping:
            return  # it exited meanwhile: the restart is already coming
        self.hung = why
        self.state = "hung"
        log.error("the workload manager (pid %d) is hung: %s; killing it", proc.pid, why)
        proc.kill()

    # -- the loop -----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        while True:
            started = time.monotonic()
            code = await self._run_child()
            self.last_exit = code
            if self._stopping:
                return
            if code == USAGE_EXIT and self._first_start_failed(code):
                return
            self.restarts += 1
            policy = self._policy
            policy.base_s, policy.cap_s = self.backoff_base_s, self.backoff_cap_s
            step = policy.exited(started=started, now=time.monotonic())
            self.state = "crash-loop" if step.crash_loop else "restarting"
            log.log(
                logging.ERROR if step.crash_loop else logging.WARNING,
                "workload manager exited with %s%s; restarting in %.1fs",
                code,
                " (5 exits within 60s: crash loop)" if step.crash_loop else "",
                step.delay_s,
            )
            await asyncio.sleep(step.delay_s)

    def _first_start_failed(self, code: int) -> bool:
        # Status 2 before any `ready`: the port is taken or the flags are wrong, and starting
        # the same command again cannot help; start() says why instead of a crash loop.
        started = self._started
        if started is None or started.done():
            return False
        self.state = "failed"
        started.set_exception(start_failure(code, self.stderr_tail))
        return True

    async def _run_child(self) -> int:
        self._ready.clear()
        self._channel = BrokerChannel()
        flags = ["--port", str(self.port), "--cluster-dir", str(self.cluster_dir)]
        flags += ["--log-level", self.log_level]
        env = {**NO_SYSTEM_TRUST, **self.extra_env}
        self._proc = proc = await spawn_stdio([*self.argv, *flags], env)
        log.info("workload manager started (pid %d)", proc.pid)
        stderr = self._spawn(
            f"{PART}-stderr", reporting(f"{PART}-stderr", pass_stderr(proc, self.stderr_tail))
        )
        self.drops.unread = 0
        try:
            await self._read(proc, self._channel)
        finally:
            if self._watch is not None:
                self._watch.cancel()
            code = await proc.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stderr), STDERR_DRAIN_S)
            stderr.cancel()
            self._channel.abandon()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(
                        ManagerUnavailable(f"the workload manager exited with status {code}")
                    )
        return code

    def _start_watch(self) -> None:
        proc = self._proc
        assert proc is not None
        if self._watch is not None:
            self._watch.cancel()  # a second `ready` from the same child: one watch is enough
        work = watch(
            functools.partial(self.request, "manager:status", timeout_s=self.liveness.deadline_s),
            lambda: self.drops.unread,
            self.liveness,
            functools.partial(self._declare_hung, proc),
        )
        self._watch = self._spawn(f"{PART}-liveness", reporting(f"{PART}-liveness", work))

    def _spawn(self, name: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        assert self._tasks is not None, "the supervisor is not started"
        task = self._tasks.create_task(work, name=name)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def _read(self, proc: asyncio.subprocess.Process, channel: BrokerChannel) -> None:
        assert proc.stdout is not None
        framer = LineFramer(MAX_FRAME)
        while chunk := await proc.stdout.read(65536):
            upsert_of = channel.upsert_of
            for frame in framer.feed(chunk):
                if isinstance(frame, bytes):
                    record = upsert_of(frame)  # the common frame, taken without a dispatch
                    if record is not None:
                        self.writer.upsert(record, relayed=True)
                        continue
                    for action in channel.receive(frame):
                        await self._carry_out(action, channel)
                else:
                    log.warning(
                        "skipped a frame over %d bytes from the workload manager", frame.limit
                    )
            if not self.writer.has_room():
                await self.writer.wait_for_room()  # backpressure: stop reading until written

    async def _carry_out(self, action: ChannelAction, channel: BrokerChannel) -> None:
        match action:
            case StoreUpsert(record):
                self.writer.upsert(record, relayed=True)
            case StoreRemove(removal):
                self.writer.remove(removal)
            case SendToManager(frame):
                self._send(frame)
            case ManagerReady(version):
                self.version = version
                self.state = "running"
                self.hung = None
                self._ready.set()
                self._start_watch()
                self._send(BrokerChannel.peers_frame(self.peers))
                if self._started is not None and not self._started.done():
                    self._started.set_result(None)
            case SnapshotWanted():
                self._send(await answer_snapshot(self.store, self.writer, action, channel))
            case Answered(request_id, result):
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result(msgspec.json.decode(result))
            case Refused(request_id, method, error):
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    refused = ManagerRefused(method, error.code, error.message, error.data or None)
                    future.set_exception(refused)

    def _died(self, part: str, exc: BaseException) -> None:
        self.failure = describe(exc)
        self.state = "failed"
        if self._started is not None and not self._started.done():
            self._started.set_exception(ManagerUnavailable(f"{part} failed: {self.failure}"))
        if self.on_failure is not None:
            self.on_failure(part, exc)

    async def _stop_child(self) -> None:
        if self._proc is not None:
            await stop_process(self._proc, self.grace_s)
