"""The scale benches run for real (bench/scale.py at four members, bench/_scale_agents.py at
three agents): many processes at once, so they run in the fault tier beside the other
many-process scenarios, not in the suite (whose wall time they doubled on two cores). Their
arithmetic is tested in the suite (tests/workload_manager/test_scale_bench.py,
test_scale_agents_bench.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_at_three_agents_prints_every_line() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "bench/_scale_agents.py",
            "--agents",
            "3",
            "--heartbeat-s",
            "0.5",
            "--beats",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    num = r"(\d[\d,]*(?:\.\d+)?)"
    expected = [
        rf"^agents N=3: formed: every member lists 3 reachable {num} s after the last joiner$",
        rf"^agents N=3: heartbeat: {num} B per member per beat with nothing changing, "
        rf"median beat {num} B \({num} B on the node ports over 3 beats of 0\.5 s\)$",
        rf"^agents N=3: new member: up {num} s after its invite; its record at all 4 {num} s "
        rf"after it was up, reachable at all {num} s after$",
        rf"^agents N=3: killed \(kill -9\): unreachable at all 3 others {num} s after$",
    ]
    for pattern in expected:
        assert re.search(pattern, done.stdout, re.M), (pattern, done.stdout)
    # Heartbeats and probes crossed the node ports while nothing changed.
    beat = re.search(r"heartbeat: ([\d,]+) B", done.stdout)
    assert beat is not None
    assert int(beat.group(1).replace(",", "")) > 0, done.stdout


def test_a_short_run_at_four_members_prints_its_line_and_ratio() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "bench/scale.py",
            "--sizes",
            "4",
            "--seconds",
            "2",
            "--rate",
            "10",
            "--idle-seconds",
            "0.5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    # Both relays at the one size, in turn. Flood: the origin sends to 3 peers, each relays
    # to the 2 others, up to 9. Ring: the origin sends to 3 peers, each forwards to one
    # successor, up to 6. Plus one duplicate per batch a loaded machine timed out and sent
    # again.
    for relay, most in (("flood", 9), ("ring", 6)):
        line = re.search(
            rf"^N=4 {relay}: 20 events .*deliveries/event ([\d.]+) .*$", done.stdout, re.M
        )
        assert line is not None, done.stdout
        retried = re.search(r"batches retried (\d+)", line.group(0))
        assert retried is not None, line.group(0)
        assert 3 <= float(line.group(1)) <= most + int(retried.group(1)), line.group(0)
        assert "never told" not in line.group(0)
    assert re.search(r"^ratio: \d+\.\d\d$", done.stdout, re.M), done.stdout
