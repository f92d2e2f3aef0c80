"""Supervising the workload manager child process.

The broker starts `python -m workload_manager` with the node's port and cluster dir, talks
to it over stdio (newline-delimited JSON-RPC), and:

- waits for `ready {version}`, then sends `peers:set` from the node records (and again on
  every change);
- answers `workloads:snapshot` from the Jobs store, page by page;
- hands every `workloads:upsert` / `workloads:remove` to the Jobs writer (group commit);
  while the writer is full it stops reading, so the manager's buffer fills and it answers
  its peers 503 instead of dropping anything;
- restarts the child when it exits, with exponential backoff (0.5 s doubling to 30 s); five
  exits within a minute is a crash loop, reported in `status()` and logged, not hidden;
- on `aclose()`, sends SIGTERM and, after a grace period, SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from workload_manager.framing import LineFramer
from workload_manager.jsonrpc import (
    ErrorObject,
    Notification,
    Request,
    Response,
    encode_error,
    encode_notification,
    encode_result,
    parse_payload,
)
from workload_manager.manager import Peer
from workload_manager.workload import LifecycleParams, Workload, WorkloadRemoval

from .jobs import JobsStore, JobsWriter

__all__ = ["ManagerSupervisor"]

log = logging.getLogger(__name__)

MAX_UNREAD: Final = 16 * 1024 * 1024
REQUEST_TIMEOUT_S: Final = 5.0
CRASH_WINDOW_S: Final = 60.0
CRASH_LOOP_EXITS: Final = 5

_upsert_params: Final = msgspec.json.Decoder(LifecycleParams)
_remove_params: Final = msgspec.json.Decoder(WorkloadRemoval)
_snapshot_params: Final = msgspec.json.Decoder(dict[str, Any])


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
    ) -> None:
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
        self.peers: tuple[Peer, ...] = ()
        self.version: str | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self.state = "starting"
        self._exits: deque[float] = deque(maxlen=CRASH_LOOP_EXITS)
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._requests = 0
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._stopping = False
        self.dropped = 0  # frames not sent because the child was not reading

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the child and keep it running; returns once it said `ready`."""
        self._task = asyncio.create_task(self._supervise(), name="workload-manager")
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            ready.cancel()
            self._task.result()  # raises what stopped the supervisor

    async def aclose(self) -> None:
        """Stop the child: SIGTERM, then SIGKILL after the grace period."""
        self._stopping = True
        await self._stop_child()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.state = "stopped"

    @property
    def pid(self) -> int | None:
        """The child's pid while it runs."""
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    def status(self) -> dict[str, Any]:
        """For the local API and metrics."""
        return {
            "state": self.state,
            "pid": self.pid,
            "version": self.version,
            "restarts": self.restarts,
            "lastExit": self.last_exit,
        }

    # -- talking to the child -------------------------------------------------------------------

    def set_peers(self, peers: Sequence[Peer]) -> None:
        """Replace the peer list, now if the child is up, else at its next `ready`."""
        self.peers = tuple(peers)
        if self._ready.is_set():
            self._send(encode_notification("peers:set", {"peers": list(self.peers)}))

    def send_event(self, method: str, record: Workload) -> None:
        """A local lifecycle event (from the facade) for the manager to broadcast."""
        self._send(encode_notification(method, LifecycleParams(workloadInfo=record)))

    def send_removal(self, removal: WorkloadRemoval) -> None:
        """A local removal for the manager to broadcast."""
        self._send(encode_notification("workloads:remove", removal))

    async def request(self, method: str, params: Any = None) -> Any:
        """Call a manager method (e.g. `manager:status`) and return its result."""
        self._requests += 1
        request_id = f"b{self._requests}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        frame: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            frame["params"] = params
        self._send(msgspec.json.encode(frame))
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                return await future
        finally:
            self._pending.pop(request_id, None)

    def _send(self, frame: bytes) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return  # the child is restarting; it catches up through its snapshot and peers
        if proc.stdin.transport.get_write_buffer_size() > MAX_UNREAD:
            # A child that does not read is stuck; what it misses it gets back from the
            # Jobs store (its snapshot) after the restart that follows.
            self.dropped += 1
            return
        proc.stdin.write(frame + b"\n")

    # -- the loop -----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        while True:
            started = time.monotonic()
            code = await self._run_child()
            self.last_exit = code
            if self._stopping:
                return
            now = time.monotonic()
            self._exits.append(now)
            self.restarts += 1
            crash_loop = (
                len(self._exits) == CRASH_LOOP_EXITS and now - self._exits[0] < CRASH_WINDOW_S
            )
            healthy_for = now - started
            failures = (
                0
                if healthy_for > CRASH_WINDOW_S
                else sum(1 for t in self._exits if now - t < CRASH_WINDOW_S)
            )
            delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** max(0, failures - 1))
            self.state = "crash-loop" if crash_loop else "restarting"
            level = logging.ERROR if crash_loop else logging.WARNING
            log.log(
                level,
                "workload manager exited with %s%s; restarting in %.1fs",
                code,
                f" ({CRASH_LOOP_EXITS} exits within {CRASH_WINDOW_S:.0f}s: crash loop)"
                if crash_loop
                else "",
                delay,
            )
            await asyncio.sleep(delay)

    async def _run_child(self) -> int:
        self._ready.clear()
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            "--port",
            str(self.port),
            "--cluster-dir",
            str(self.cluster_dir),
            "--log-level",
            self.log_level,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **self.extra_env},
        )
        log.info("workload manager started (pid %d)", self._proc.pid)
        try:
            await self._read(self._proc)
        finally:
            code = await self._proc.wait()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the workload manager exited"))
        return code

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        framer = LineFramer(16 * 1024 * 1024)
        while chunk := await proc.stdout.read(65536):
            for frame in framer.feed(chunk):
                if isinstance(frame, bytes):
                    await self._on_frame(frame)
            if not self.writer.has_room():
                await self.writer.wait_for_room()  # backpressure: stop reading until written

    async def _on_frame(self, frame: bytes) -> None:
        message = parse_payload(frame)
        if isinstance(message, Notification):
            self._on_notification(message)
        elif isinstance(message, Request):
            await self._on_request(message)
        elif isinstance(message, Response):
            future = self._pending.get(str(message.id))
            if future is None or future.done():
                return
            if isinstance(message.result, msgspec.Raw):
                future.set_result(msgspec.json.decode(message.result))
            else:
                future.set_exception(RuntimeError(f"the workload manager refused: {message.error}"))
        else:
            log.warning("ignoring a frame from the workload manager that is not one message")

    def _on_notification(self, message: Notification) -> None:
        if message.params is msgspec.UNSET:
            params: Any = b"null"
        else:
            params = message.params
        try:
            if message.method == "workloads:upsert":
                self.writer.upsert(_upsert_params.decode(params).workloadInfo)
            elif message.method == "workloads:remove":
                self.writer.remove(_remove_params.decode(params))
            elif message.method == "ready":
                self.version = msgspec.json.decode(params).get("version")
                self.state = "running"
                self._ready.set()
                self._send(encode_notification("peers:set", {"peers": list(self.peers)}))
            else:
                log.debug("ignoring %s from the workload manager", message.method[:64])
        except (msgspec.ValidationError, msgspec.DecodeError, AttributeError) as exc:
            log.warning("bad %s from the workload manager: %s", message.method[:64], exc)

    async def _on_request(self, message: Request) -> None:
        if message.method != "workloads:snapshot":
            self._send(
                encode_error(message.id, ErrorObject(code=-32601, message="Method not found"))
            )
            return
        try:
            params = (
                _snapshot_params.decode(message.params)
                if message.params is not msgspec.UNSET
                else {}
            )
            limit = max(1, min(int(params.get("limit", 2000)), 10_000))
            await self.writer.flush()  # the view includes everything written so far
            page = await self.store.view(cursor=params.get("cursor"), limit=limit)
        except Exception as exc:
            log.warning("workloads:snapshot failed: %s", exc)
            self._send(encode_error(message.id, ErrorObject(code=-32603, message="Internal error")))
            return
        result: dict[str, Any] = {
            "workloads": page.workloads,
            "removed": page.removed,
        }
        if page.next is not None:
            result["next"] = page.next
        self._send(encode_result(message.id, result))

    async def _stop_child(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(self.grace_s):
                await proc.wait()
        except TimeoutError:
            log.warning("workload manager ignored SIGTERM for %.1fs; killing it", self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
