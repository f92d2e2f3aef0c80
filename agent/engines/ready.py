"""Is a replica's engine ready: its readiness path answers 200, and the answer is its own.

A 200 on `127.0.0.1:{port}` proves only that *some* process answers there. Three agents on
one host with one `[engines] port_range`, an engine left running from before, any other
service: whatever holds the port would pass for the replica's engine, and traffic for the
deployment would reach it. So `ReadinessProbe.check()` says `Ready` only when

1. every socket listening on the port (where 127.0.0.1 reaches) belongs to the engine's
   process group, as `/proc` shows (`engine_ports.check_port`); another process's listener
   is `PortTaken`, with who holds it, and the supervisor moves the replica to another port;
2. the readiness path answers 200 (503 while llama.cpp loads: not yet);
3. when the template names `{served}` (vLLM's `--served-model-name`, llama.cpp's `--alias`,
   the mock's `--model`), `GET /v1/models` lists that name (with the replica's API key).

While nothing listens on the port (vLLM loads its weights before it listens), each probe
costs one read of `/proc/net/tcp` and `tcp6`; the engine's sockets are looked up only once
something listens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import aiohttp

from agent.engines.kinds import model_ids
from agent.engines.ports import PortCheck, check_port, holders_of
from agent.engines.proc_os import ProcessId, is_alive
from agent.engines.templates import LaunchSpec, LaunchTemplate, names_served

__all__ = [
    "PortTaken",
    "ReadinessProbe",
    "Ready",
    "Verdict",
    "Waiting",
    "describe_taken",
    "serving_verdict",
]

PROBE_TIMEOUT: Final = aiohttp.ClientTimeout(total=2)
MODELS_PATH: Final = "/v1/models"
MAX_NAMES: Final = 4  # of the models an engine serves, quoted in a reason
MAX_KNOWN: Final = 256  # engines whose sockets are remembered between probes


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine answers, on its own socket, serving its model."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """Not ready yet; `why` when something answers that is not yet the replica's engine."""

    why: str | None = None


@dataclass(frozen=True, slots=True)
class PortTaken:
    """Another process listens on the replica's port: the engine cannot serve there."""

    why: str


Verdict = Ready | Waiting | PortTaken


def describe_taken(check: PortCheck, holders: list[tuple[int, str]]) -> str:
    """Why the port is not the engine's, naming who holds it when this agent can see it."""
    who = ", ".join(f"pid {pid} {name}" for pid, name in holders)
    return (
        f"port {check.port} is held by another process ({who or 'of another user'}), "
        "not this replica's engine"
    )


def serving_verdict(served: str, status: int, models: list[str]) -> Verdict:
    """Ready when the engine's `GET /v1/models` (answering `status`) lists `served`."""
    if status != 200:
        return Waiting(f"GET {MODELS_PATH} answered {status}")
    if served in models:
        return Ready()
    listed = ", ".join(repr(m) for m in models[:MAX_NAMES])
    if len(models) > MAX_NAMES:
        listed += ", ..."
    return Waiting(f"it serves [{listed}], not {served!r} (GET {MODELS_PATH})")


class ReadinessProbe:
    """Asks engines whether they are ready (`check`); `aclose()` closes its HTTP session."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._known: dict[tuple[int, int], frozenset[int]] = {}  # (pid, port) -> its sockets

    async def check(
        self, spec: LaunchSpec, template: LaunchTemplate, process: ProcessId
    ) -> Verdict:
        """The verdict on the engine `process` (leading its process group) for `spec`."""
        # Whose socket first, then the question: an engine that answers and exits at once
        # (a crash) was still ready, and nothing is asked while nothing listens.
        if template.ready_path == "*":  # a worker part that serves nothing: it runs
            return Ready()
        key = (process.pid, spec.port)
        check = check_port(spec.port, process.pid, self._known.pop(key, frozenset()))
        if check.taken:
            if not is_alive(process):  # dying: its own socket, held by no process we can see
                return Waiting()
            return PortTaken(describe_taken(check, holders_of(check.foreign)))
        if not check.engines:
            return Waiting()
        if not template.ready_path:  # a worker part's RPC server: its own listener is enough
            return Ready()
        if await self._status(spec.port, template.ready_path) != 200:
            if len(self._known) >= MAX_KNOWN:
                self._known.clear()
            self._known[key] = frozenset(check.ours)  # llama.cpp's 503s: no second look-up
            return Waiting()
        if not names_served(template):
            return Ready()
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        try:
            async with self._open().get(
                f"http://127.0.0.1:{spec.port}{MODELS_PATH}", headers=headers
            ) as response:
                listed = await response.json(content_type=None) if response.ok else {}
                return serving_verdict(spec.served, response.status, model_ids(listed))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return Waiting()

    def taken(self, port: int, leader: int) -> PortTaken | None:
        """After the engine exited before it was ready: does another process we can see hold
        its port (so the engine could not bind it)? A socket no process holds is the dead
        engine's own, still closing."""
        check = check_port(port, leader)
        holders = holders_of(check.foreign) if check.taken else []
        return PortTaken(describe_taken(check, holders)) if holders else None

    async def aclose(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=PROBE_TIMEOUT)
        return self._session

    async def _status(self, port: int, path: str) -> int:
        # 0: no HTTP answer (it closed the connection, or took too long).
        try:
            async with self._open().get(
                f"http://127.0.0.1:{port}{path}", allow_redirects=False
            ) as response:
                return response.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0
