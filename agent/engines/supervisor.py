"""The engine supervisor: one model-server process per replica on this node (docs/engines.md).

`launch(spec)` renders the replica's template, picks a port, spawns the engine with
`CUDA_VISIBLE_DEVICES` set to its GPUs' UUIDs in its own session with its output in
`$NVPAIR_HOME/replicas/<replica>/engine.log`, and waits until its readiness path answers 200
from the engine's own socket (`engine_ready.py`: `starting -> ready`). A port another process
took -- before the start, or answering there meanwhile, or so the engine could not bind it
-- is left for another free one, and the replica starts again there (`starting`, its
status saying why). An engine that exits after it was ready is restarted with the
workload manager's backoff (`broker.restarts`); five exits within a minute is a crash loop,
and the replica is `failed` with its log's last lines, not restarted forever. One that never
becomes ready, or exits before it ever was, is `failed` at once: a wrong model path or flag
is not fixed by starting it again. `stop()` sends SIGTERM to the engine's process group and
SIGKILL after the grace.

Engines outlive the agent: `aclose()` only stops watching them, and `adopt()` in the next
agent takes back every engine whose `proc.json` names a live process (same pid, start time
and boot), cleaning up the rest; the caller then says which replicas should exist
(`retain()`). A replica id already running is never started twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from agent.engines.ports import PortPool, port_free
from agent.engines.proc_files import (
    KEEP_STOPPED,
    ProcRecord,
    ReplicaFiles,
    prune_stopped,
    replica_dirs,
)
from agent.engines.proc_os import (
    Exit,
    ProcessId,
    exit_of,
    is_alive,
    replica_marks,
    signal_group,
    spawn,
    terminate,
    unrecorded_processes,
)
from agent.engines.proc_state import (
    NoFreePort,
    ReplicaRun,
    ReplicaState,
    ReplicaStatus,
    TooManyReplicas,
    UnknownTemplate,
    check_transition,
)
from agent.engines.ready import PortTaken, ReadinessProbe, Ready
from agent.engines.templates import (
    BUILTIN_TEMPLATES,
    LaunchSpec,
    LaunchTemplate,
    TemplateError,
    check_replica_id,
    for_part,
    render,
)
from broker.restarts import CRASH_LOOP_EXITS, CRASH_WINDOW_S, RestartPolicy

__all__ = ["EngineSupervisor", "LaunchSpec", "ReplicaState", "ReplicaStatus"]

log = logging.getLogger(__name__)

MAX_REPLICAS: Final = 64  # per node: more GPUs than any node has
MAX_RESTARTS: Final = 100  # over a replica's life, even when each crash is a minute apart
POLL_S: Final = 0.2
# A loading engine is probed this often: its port opening is the last step of a cold start
# that requests wait on (issue 30), and a probe of a closed local port costs next to nothing.
READY_POLL_S: Final = 0.1
MAX_MOVES: Final = 10  # ports in a row found taken before it is ready: something else is wrong

_S = ReplicaState


@dataclass(frozen=True, slots=True)
class _NotReady:
    waited_s: float  # the ready timeout it ran past (`ready_timeout_s`)
    why: str | None  # what the last probe found, when something answered


class EngineSupervisor:
    """This node's engine processes, one per replica; `aclose()` leaves them running."""

    def __init__(
        self,
        home: Path,
        *,
        templates: Mapping[str, LaunchTemplate] = BUILTIN_TEMPLATES,
        port_range: tuple[int, int] = (18000, 18999),
        stop_grace_s: float = 30.0,
        restart_base_s: float = 0.5,
        max_replicas: int = MAX_REPLICAS,
        on_change: Callable[[], None] = lambda: None,
        poll_s: float = POLL_S,
        keep_stopped: int = KEEP_STOPPED,
    ) -> None:
        self.home = home
        self._templates = dict(templates)
        self._ports = PortPool(*port_range)
        self._grace_s = stop_grace_s
        self._restart_base_s = restart_base_s
        self._max_replicas = max_replicas
        self._on_change = on_change
        self._poll_s = poll_s
        self._keep_stopped = keep_stopped
        self._replicas: dict[str, ReplicaRun] = {}
        self._probe = ReadinessProbe()

    # -- what callers see

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica this supervisor holds, by id."""
        return [r.status() for _, r in sorted(self._replicas.items())]

    def status(self, replica_id: str) -> ReplicaStatus | None:
        """One replica, or None when it is not here."""
        replica = self._replicas.get(replica_id)
        return None if replica is None else replica.status()

    def template(self, kind: str) -> LaunchTemplate | None:
        """The template of engines of `kind`, or None."""
        return self._templates.get(kind)

    def logs(self, replica_id: str) -> Path:
        """The replica's `engine.log` (kept after it stops; rotated to `engine.log.1..3`)."""
        return self._files(replica_id).log

    # -- what callers ask

    def launch(self, spec: LaunchSpec) -> ReplicaStatus:
        """Start the replica's engine; a replica already here (in any state) is left as is.

        Raises `UnknownTemplate`, `TooManyReplicas` or `NoFreePort`, before anything runs.
        """
        existing = self._replicas.get(spec.replica_id)
        if existing is not None:
            return existing.status()
        template = self._templates.get(spec.kind)
        if template is None:
            known = ", ".join(sorted(self._templates))
            raise UnknownTemplate(f"{spec.replica_id}: no template {spec.kind!r} ({known})")
        try:
            template = for_part(template, spec)
        except TemplateError as exc:
            raise UnknownTemplate(f"{spec.replica_id}: {exc}") from None
        if len(self._replicas) >= self._max_replicas:
            raise TooManyReplicas(f"this node runs {self._max_replicas} replicas already")
        port = self._ports.take(spec.replica_id, spec.port)
        running = {*self._replicas, spec.replica_id}
        prune_stopped(self.home, keep=self._keep_stopped, running=running)
        replica = self._add(msgspec.structs.replace(spec, port=port), template, adopted=False)
        replica.task = asyncio.create_task(self._run(replica, None), name=spec.replica_id)
        self._changed()
        return replica.status()

    def adopt(self) -> list[str]:
        """Take back the engines a previous agent left running; clean up the other records.

        Call once at start, before `launch()`. Returns the ids adopted.
        """
        adopted = []
        for files in replica_dirs(self.home):
            record = files.read_record()
            process = None if record is None else record.process()
            if record is None or process is None or record.spec.replica_id != files.replica_id:
                log.warning("%s: unreadable proc.json; removing it", files.record)
                files.remove_record()
            elif not is_alive(process):
                log.info("%s: pid %d is gone; removing its record", files.replica_id, record.pid)
                signal_group(process, signal.SIGKILL)  # anything it forked and left behind
                files.remove_record()
            elif files.replica_id not in self._replicas:
                self._adopt_one(files, record, process)
                adopted.append(files.replica_id)
        # An engine started in the instant before its proc.json was written, or whose record
        # was lost, is known by the marks in its environment: stopped, never duplicated.
        for pid in unrecorded_processes(self.home, keep=set(self._replicas)):
            log.warning("pid %d runs a replica of this home without a record; killing it", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if adopted:
            self._changed()
        return adopted

    async def stop(self, replica_id: str) -> None:
        """SIGTERM the replica's process group, SIGKILL after the grace; returns once gone."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        if replica.state is _S.STOPPING:
            await replica.gone.wait()
            return
        self._set(replica, _S.STOPPING)
        if replica.task is not None:
            replica.task.cancel()
            await asyncio.wait([replica.task])
        if replica.process is not None:
            await terminate(replica.process, self._grace_s, self._poll_s)
        replica.files.remove_record()
        self._ports.release(replica_id)
        self._replicas.pop(replica_id, None)
        replica.gone.set()
        log.info("%s: stopped", replica_id)
        self._changed()

    async def retain(self, replica_ids: Iterable[str]) -> list[str]:
        """Stop every replica not in `replica_ids` (at once); returns the ids stopped."""
        keep = set(replica_ids)
        extra = [rid for rid in self._replicas if rid not in keep]
        await asyncio.gather(*(self.stop(rid) for rid in extra))
        return extra

    async def aclose(self) -> None:
        """Stop watching; the engines keep running and the next `adopt()` finds them."""
        tasks = [r.task for r in self._replicas.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._replicas.clear()
        await self._probe.aclose()

    # -- one replica's life

    async def _run(self, replica: ReplicaRun, process: ProcessId | None) -> None:
        ever_ready = process is not None  # an adopted engine was serving before
        while True:
            if process is None:
                process = self._spawn(replica)
                if process is None:
                    return
            started = time.monotonic()
            outcome = await self._until_ready(replica, process)
            if outcome is None:
                ever_ready = True
                replica.moves, replica.not_ready = 0, None
                self._set(replica, _S.READY)
                outcome = await self._until_exit(replica, process)
            if isinstance(outcome, _NotReady):
                await terminate(process, self._grace_s, self._poll_s)
                path = replica.template.ready_path
                why = f": {outcome.why}" if outcome.why else ""
                self._fail(replica, f"not ready within {outcome.waited_s:g}s (GET {path}){why}")
                return
            if not ever_ready and isinstance(outcome, Exit):  # could it not bind its port?
                outcome = self._probe.taken(replica.spec.port, process.pid) or outcome
            if isinstance(outcome, PortTaken):  # its engine cannot serve there: another port
                await terminate(process, self._grace_s, self._poll_s)
                replica.process = process = None
                if not self._move(replica, outcome.why):
                    return
                continue
            signal_group(process, signal.SIGKILL)  # what it forked goes with it
            replica.process = None
            why = f"the engine {outcome.describe()}"
            if not ever_ready:
                self._fail(replica, f"{why} before it was ever ready")
                return
            if replica.spec.nodes > 1:  # its partners lost it: the whole replica restarts
                self._fail(replica, f"{why}; a part restarts only with its whole replica")
                return
            step = replica.policy.exited(started=started, now=time.monotonic())
            if step.crash_loop or replica.restarts >= MAX_RESTARTS:
                loop = f"{CRASH_LOOP_EXITS} exits within {CRASH_WINDOW_S:g}s"
                self._fail(replica, f"crash loop: {why} ({loop}; {replica.restarts} restarts)")
                return
            replica.restarts += 1
            replica.last_error = why
            log.warning("%s: %s; restart %d in %.1fs", replica.spec.replica_id, why,
                        replica.restarts, step.delay_s)  # fmt: skip
            self._set(replica, _S.STARTING)
            await asyncio.sleep(step.delay_s)  # the backoff itself, not a synchronisation
            process = None

    def _spawn(self, replica: ReplicaRun) -> ProcessId | None:
        spec = replica.spec
        if not replica.template.argv:  # adopted, and its template left nvpair.toml since
            self._fail(replica, f"no template {spec.kind!r} to start it with")
            return None
        if not port_free(spec.port):  # taken since it was chosen, or since the last start
            if not self._move(replica, f"port {spec.port} is in use by another program"):
                return None
            spec = replica.spec
        argv, extra_env = render(replica.template, spec)
        env = {**os.environ, **extra_env}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)  # "" hides every GPU
        env.update(replica_marks(self.home, spec.replica_id))  # finds it without proc.json
        fd = replica.files.open_log()
        try:
            os.write(fd, f"--- nvpair: starting {spec.replica_id}: {argv!r}\n".encode())
            process = spawn(argv, env, fd)
        except OSError as exc:
            self._fail(replica, f"could not start {argv[0]!r}: {exc.strerror or exc}")
            return None
        finally:
            os.close(fd)
        replica.process = process
        replica.files.write_record(
            ProcRecord.of(process, replica.spec, replica.template.ready_path, replica.restarts)
        )
        log.info("%s: started pid %d on port %d", spec.replica_id, process.pid, spec.port)
        self._changed()
        return process

    async def _until_ready(
        self, replica: ReplicaRun, process: ProcessId
    ) -> Exit | _NotReady | PortTaken | None:
        # None once ready; the exit when it ended first; PortTaken when another process
        # listens on its port; _NotReady after the timeout.
        started = time.monotonic()
        while True:
            if (ended := exit_of(process)) is not None:
                return ended
            verdict = await self._probe.check(replica.spec, replica.template, process)
            if isinstance(verdict, Ready):
                return None
            if isinstance(verdict, PortTaken):
                return verdict
            if verdict.why is not None and verdict.why != replica.not_ready:
                replica.not_ready = verdict.why  # until it is ready, or another reason
                self._changed()
            if time.monotonic() - started > replica.template.ready_timeout_s:
                # The limit it did not make, as configured: the time measured past it says
                # only how busy this machine was (2.1 s for a 2 s limit).
                return _NotReady(replica.template.ready_timeout_s, verdict.why)
            replica.files.rotate_if_large()
            await asyncio.sleep(min(self._poll_s, READY_POLL_S))

    async def _until_exit(self, replica: ReplicaRun, process: ProcessId) -> Exit:
        while (ended := exit_of(process)) is None:
            replica.files.rotate_if_large()
            await asyncio.sleep(self._poll_s)
        return ended

    # -- bookkeeping

    def _add(self, spec: LaunchSpec, template: LaunchTemplate, *, adopted: bool) -> ReplicaRun:
        replica = ReplicaRun(
            spec=spec,
            template=template,
            files=self._files(spec.replica_id),
            policy=RestartPolicy(base_s=self._restart_base_s),
            adopted=adopted,
        )
        self._replicas[spec.replica_id] = replica
        return replica

    def _adopt_one(self, files: ReplicaFiles, record: ProcRecord, process: ProcessId) -> None:
        spec = record.spec
        # The template it was started with may be gone from nvpair.toml: readiness is
        # checked on the path recorded at its start.
        template = self._templates.get(spec.kind) or LaunchTemplate(spec.kind, ())
        with contextlib.suppress(TemplateError):  # a template that cannot span: readiness only
            template = for_part(template, spec)
        template = dataclasses.replace(template, ready_path=record.ready_path)
        self._ports.claim(spec.replica_id, record.port)
        replica = self._add(spec, template, adopted=True)
        replica.process, replica.restarts = process, record.restarts
        replica.task = asyncio.create_task(self._run(replica, process), name=spec.replica_id)
        log.info("%s: adopted pid %d on port %d", spec.replica_id, process.pid, record.port)

    def _files(self, replica_id: str) -> ReplicaFiles:
        return ReplicaFiles(self.home / "replicas" / check_replica_id(replica_id))

    def _set(self, replica: ReplicaRun, state: ReplicaState) -> None:
        check_transition(replica.state, state)
        replica.state = state
        self._changed()

    def _move(self, replica: ReplicaRun, why: str) -> bool:
        # Another process has its port: another free one (False: failed, none is).
        replica.moves += 1
        try:
            if replica.moves > MAX_MOVES:
                raise NoFreePort(f"{MAX_MOVES} ports in a row were taken before it was ready")
            port = self._ports.move(replica.spec.replica_id)
        except NoFreePort as exc:
            self._fail(replica, f"{why}; {exc}")
            return False
        replica.spec = msgspec.structs.replace(replica.spec, port=port)
        replica.last_error = replica.not_ready = f"{why}; moved to port {port}"
        log.warning("%s: %s", replica.spec.replica_id, replica.last_error)
        self._changed()
        return True

    def _fail(self, replica: ReplicaRun, why: str) -> None:
        replica.process = None
        replica.last_error = why
        replica.log_tail = replica.files.tail()
        replica.files.remove_record()  # no process: nothing for the next agent to adopt
        log.error("%s: failed: %s", replica.spec.replica_id, why)
        self._set(replica, _S.FAILED)

    def _changed(self) -> None:
        try:
            self._on_change()
        except Exception:  # an observer's bug must not stop the supervision
            log.exception("on_change raised")
