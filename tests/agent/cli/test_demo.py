"""`nvpair demo` as a newcomer runs it: three agents, paired, running the demo's models as
deployments (mock engines the agents launch on simulated GPUs), under load, then gone --
the engines too, though agents leave theirs running when they stop.

"Gone" is checked for the processes this demo started and no others (other tests and
other people's agents may run on the same machine): every process the demo starts inherits
its environment, so a marker variable set for this run names them in /proc.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

from ..harness import eventually

MARKER_VAR = "NVPAIR_TEST_DEMO_RUN"


def started_by(marker: str) -> dict[str, list[int]]:
    """Live processes whose environment carries `marker`: agents, engines, all of them."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found: dict[str, list[int]] = {"agent run": [], "mock-engine": [], "other": []}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle not in environ:
            continue
        kind = next((k for k in ("agent run", "mock-engine") if k.encode() in cmdline), "other")
        found[kind].append(int(proc.name))
    return found


async def test_demo_runs_and_cleans_up() -> None:
    marker = uuid.uuid4().hex
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "demo", "--once", "--requests", "12",
        env={**os.environ, MARKER_VAR: marker},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    output = asyncio.create_task(demo.communicate())
    try:
        # The control: while it runs, the marker does find the demo's three agents and
        # engines, so "none left" below is not true merely because the marker finds nothing.
        saw_them = False

        def all_up_or_over() -> bool:
            nonlocal saw_them
            found = started_by(marker)
            saw_them = len(found["agent run"]) >= 3 and len(found["mock-engine"]) >= 3
            return saw_them or output.done()

        await eventually(all_up_or_over, "the demo's agents and engines", within_s=120)
        out_bytes, err_bytes = await asyncio.wait_for(output, 240)
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
    out = out_bytes.decode()
    assert demo.returncode == 0, out + err_bytes.decode()
    assert saw_them, "the demo's agents and engines were never seen running"
    assert "gpu-b: joined over the network with a one-time invite" in out
    assert "gpu-a: 8 x h100-80gb-sxm" in out
    assert "5 replicas ready, the same in every member's view:" in out
    assert "qwen-2-7b   rep_" in out  # a replica row: deployment, id, node, GPUs, port
    assert "AS GPU-A SEES IT  AS GPU-B SEES IT  AS GPU-C SEES IT" in out
    assert "12 jobs; every member shows the same list: yes" in out
    assert started_by(marker) == {"agent run": [], "mock-engine": [], "other": []}
