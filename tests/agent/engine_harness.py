"""Real engine processes for the supervisor's tests: templates that run nvpair's mock engine
and `fake_engine.py`, supervisors on one home, and a clean-up that kills whatever a failing
test left running (found by the NVPAIR_REPLICA variable every engine gets)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

from agent.engines.supervisor import EngineSupervisor, LaunchSpec, ReplicaStatus
from agent.engines.templates import BUILTIN_TEMPLATES, LaunchTemplate, custom_template
from tests.workload_manager.cluster_harness import engine_ports

__all__ = ["Harness", "open_harness", "serves", "state_of"]

FAKE = str(Path(__file__).with_name("fake_engine.py"))
PY = sys.executable.replace("{", "{{").replace("}", "}}")


def _templates(tmp_path: Path) -> dict[str, LaunchTemplate]:
    marker = str(tmp_path / "term-marker")
    custom = [
        custom_template("fake", [PY, FAKE, "{port}", "--marker", marker], {}, "/health", 20),
        custom_template("stubborn", [PY, FAKE, "{port}", "--ignore-term"], {}, "/health", 20),
        custom_template("workers", [PY, FAKE, "{port}", "--worker"], {}, "/health", 20),
        custom_template(
            "late", [PY, FAKE, "{port}", "--bind-when", str(tmp_path / "loaded")], {}, "/health", 20
        ),
        custom_template(
            "impostor",
            [PY, FAKE, "{port}", "--serves", "other"],
            {"SERVED": "{served}"},
            "/health",
            3,
        ),
        custom_template("llama", [PY, FAKE, "{port}", "--loading", "5"], {}, "/health", 20),
        custom_template("flaky", [PY, FAKE, "{port}", "--exit-after-first"], {}, "/health", 20),
        custom_template(
            "loader",
            [PY, "-c", "import time; print('loading weights', flush=True); time.sleep(60)"],
            {},
            "/v1/models",
            1.5,
        ),
        custom_template(
            "crasher", [PY, "-c", "import sys; print('bad flag --tp', flush=True); sys.exit(3)"], {}
        ),
    ]
    return {**BUILTIN_TEMPLATES, **{t.name: t for t in custom}}


def _replica_pids(tag: str) -> dict[int, str]:
    # Every process on the host whose environment says it runs one of this test's replicas:
    # the ground truth for "no duplicate, no orphan", whatever the supervisor believes.
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"NVPAIR_REPLICA=rep_" + tag.encode()):
                found[int(entry.name)] = item.partition(b"=")[2].decode()
    return found


class Harness:
    """Supervisors on one home, replica ids unique to this test, and a clean-up that kills
    whatever a failing test left running."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.tag = secrets.token_hex(4)
        self.port_range = engine_ports(41)
        self.templates = _templates(home)
        self.supervisors: list[EngineSupervisor] = []
        self.changes = 0

    def supervisor(self, **options: Any) -> EngineSupervisor:
        def changed() -> None:
            self.changes += 1

        options = {
            "templates": self.templates,
            "port_range": self.port_range,
            "stop_grace_s": 5.0,
            "restart_base_s": 0.05,
            "on_change": changed,
            "poll_s": 0.05,
            **options,
        }
        supervisor = EngineSupervisor(self.home, **options)
        self.supervisors.append(supervisor)
        return supervisor

    def spec(self, name: str, kind: str, **fields: Any) -> LaunchSpec:
        values = {"model": "tiny", "served": f"model-{name}", **fields}
        return LaunchSpec(replica_id=f"rep_{self.tag}_{name}", kind=kind, **values)

    def pids(self) -> dict[int, str]:
        return _replica_pids(self.tag)


def state_of(supervisor: EngineSupervisor, spec: LaunchSpec) -> Callable[[], ReplicaStatus]:
    def current() -> ReplicaStatus:
        status = supervisor.status(spec.replica_id)
        assert status is not None, f"{spec.replica_id} is not listed"
        return status

    return current


async def serves(url: str, model: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
        listed = await response.json()
    return model in [m["id"] for m in listed["data"]]


@contextlib.asynccontextmanager
async def open_harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness on `tmp_path/home`; on exit its supervisors close and its engines die."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    harness = Harness(home)
    try:
        yield harness
    finally:
        for supervisor in harness.supervisors:
            await supervisor.aclose()
        for pid in harness.pids():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
