"""Fixtures every test package shares.

The helpers themselves live in `tests/fixtures/` so harness modules can import them
(a conftest is not for importing): `eventually` (wait for an observable condition, with a
deadline and a description -- never a sleep), `FakeClock`, and the workload record
builders. Tests take the fake clock as the `fake_clock` fixture.
"""

from __future__ import annotations

import os
import re
import uuid
from functools import cache
from pathlib import Path

import pytest
from hypothesis import settings

from tests.fixtures import forkserver
from tests.fixtures.clock import FakeClock
from tests.fixtures.leaks import MARK, kill, marked_processes
from tests.fixtures.records import lifecycle_event, workload, workload_record
from tests.fixtures.waiting import eventually

__all__ = ["FakeClock", "eventually", "lifecycle_event", "workload", "workload_record"]

# No property test has a deadline: Hypothesis' default (200 ms an example) is an absolute
# time, and on a loaded two-core machine an example that takes 20 ms can take 250 (a
# `DeadlineExceeded`, then `Flaky` when the replay is fast). A test never asserts a time.
settings.register_profile("nvpair", deadline=None)
settings.load_profile("nvpair")


@pytest.fixture
def fake_clock() -> FakeClock:
    """A clock at a fixed instant that moves only by `advance()`."""
    return FakeClock()


def pytest_configure(config: pytest.Config) -> None:
    # The run's mark, set before any worker or process starts, so all of them inherit it
    # (an xdist worker has `workerinput` and the controller's environment).
    if not hasattr(config, "workerinput"):
        os.environ[MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No process the suite starts trusts the public CAs: every TLS peer in it is a
        # cluster's or a test's own, named by its CA file. An empty default store spares
        # each of them parsing the system's bundle, which aiohttp does at import for its
        # default context (70-110 ms of CPU in every agent, manager, engine and CLI call:
        # about 40 of the suite's 580 CPU-seconds). Someone's own SSL_CERT_FILE is kept.
        os.environ.setdefault("SSL_CERT_FILE", os.devnull)


# What makes a test module slow: the real processes it starts (agents, clusters, engines, a
# plane). The workers take modules in collection order, so the heaviest go first and the
# in-memory ones fill the end (longest first: otherwise a three-agent module collected last
# runs alone while the other workers idle). Only the order changes, never what runs.
_STARTS = re.compile(
    r"start_cluster\(|engine_cluster\(|make_node\(|start_engine\(|PlaneProcess|"
    r"create_subprocess_exec|subprocess\.(?:run|Popen)|agents\.start\("
)


@cache
def _weight(path: Path) -> int:
    try:
        return len(_STARTS.findall(path.read_text()))
    except OSError:
        return 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that start the most processes first (a stable sort: a module's tests stay
    together and in their order)."""
    items.sort(key=lambda item: -_weight(item.path))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process it started outlives it (killing it): every test that starts
    an agent, a manager or an engine must stop it -- engines outlive their agents by design."""
    forkserver.shutdown()  # this process's fork server (tests/fixtures/forkserver.py), if any
    if hasattr(session.config, "workerinput") or MARK not in os.environ:
        return  # the controller checks, once every worker is done
    left = marked_processes(os.environ[MARK], spared={os.getpid()})
    if not left:
        return
    kill([pid for pid, _ in left])
    lines = "\n".join(f"  {pid}: {command[:200]}" for pid, command in left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(f"processes this run started outlived it (killed now):\n{lines}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
