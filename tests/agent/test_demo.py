"""`nvpair demo` as a newcomer runs it: three agents, paired, under load, then gone."""

from __future__ import annotations

import subprocess
import sys


def running(pattern: str) -> int:
    done = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return len(done.stdout.split())


def test_demo_runs_and_cleans_up() -> None:
    before = running("agent agent run") + running("agent mock-engine")
    done = subprocess.run(
        [sys.executable, "-m", "agent", "demo", "--once", "--requests", "12"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "gpu-b: joined over the network with a one-time invite" in out
    assert "gpu-a: 8 x h100-80gb-sxm" in out
    assert "AS GPU-A SEES IT  AS GPU-B SEES IT  AS GPU-C SEES IT" in out
    assert "12 jobs; every member shows the same list: yes" in out
    assert running("agent agent run") + running("agent mock-engine") == before
