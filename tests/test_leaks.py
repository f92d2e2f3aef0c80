"""The run's check for processes it left behind (tests/fixtures/leaks.py, called at the end
of every run by tests/conftest.py): a process that carries the run's mark is found, with a
control that an unmarked one is not."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures.leaks import MARK, kill, marked_processes


def test_a_process_with_the_runs_mark_is_found_and_one_without_is_not() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    marked = subprocess.Popen(sleep, env={**os.environ, MARK: "leak-check"})
    unmarked = subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != MARK})
    try:
        found = marked_processes("leak-check", spared=set())
        assert [pid for pid, _ in found] == [marked.pid]
        assert "time.sleep(60)" in found[0][1]
        kill([marked.pid])
        marked.wait(timeout=10)
        assert marked_processes("leak-check", spared=set()) == []
    finally:
        for proc in (marked, unmarked):
            proc.kill()
            proc.wait(timeout=10)
