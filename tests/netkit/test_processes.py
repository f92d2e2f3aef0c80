"""`netkit.processes.alive`: a running process is, a reaped one and a zombie are not."""

from __future__ import annotations

import os
import subprocess
import sys

from netkit.processes import alive
from tests.fixtures.waiting import TIMEOUT_S


def test_a_running_process_is_alive_a_zombie_and_a_reaped_one_are_not() -> None:
    assert alive(os.getpid())
    assert not alive(0)
    assert not alive(-1)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert alive(child.pid)  # the control: running
        assert child.stdin is not None
        child.stdin.close()  # it exits; not reaped yet, it is a zombie
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still unreaped
        assert not alive(child.pid)
    finally:
        child.wait(timeout=TIMEOUT_S)
    assert not alive(child.pid)  # reaped: no such process
