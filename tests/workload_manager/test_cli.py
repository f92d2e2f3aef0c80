"""The seed's command line, as a user runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from certs import ClusterDir
from workload_manager import VERSION
from workload_manager.cli import build_parser, relay_from_env
from workload_manager.errors import PortInUse, port_in_use_from


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workload_manager", *args],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_version() -> None:
    done = run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == VERSION != "0+unknown"


def test_nvpair_workload_manager_is_the_same_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent", "workload-manager", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.stdout.strip() == VERSION


def test_exactly_the_seed_flags() -> None:
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert options == {
        "-h",
        "--help",
        "--port",
        "--ipc",
        "--cluster-dir",
        "--log-level",
        "--version",
    }


def test_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.port, args.ipc, args.cluster_dir, args.log_level) == (14320, None, None, "info")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "65536"], "port out of range"),
        (["--port", "http"], "not a port number"),
        (["--log-level", "verbose"], "invalid choice"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_flags_are_refused_clearly(args: list[str], message: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert message in done.stderr


def test_log_level_error_is_quiet_on_stderr() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workload_manager", "--log-level", "error"],
        input='{"jsonrpc":"2.0","method":"no:such"}\n',
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout.splitlines()[0] == json.dumps(
        {"jsonrpc": "2.0", "method": "ready", "params": {"version": VERSION}},
        separators=(",", ":"),
    )


def test_retention_and_cap_from_the_environment() -> None:
    relay = relay_from_env({"NVPAIR_WM_RETENTION_S": "60", "NVPAIR_WM_MAX_WORKLOADS": "5"})
    assert (relay.retention_s, relay.max_workloads) == (60.0, 5)
    default = relay_from_env({})
    assert (default.retention_s, default.max_workloads) == (3600.0, 100_000)


@pytest.mark.parametrize(
    "env", [{"NVPAIR_WM_RETENTION_S": "soon"}, {"NVPAIR_WM_MAX_WORKLOADS": "0"}]
)
def test_bad_environment_is_refused_clearly(env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workload_manager"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 2
    assert "NVPAIR_WM_" in done.stderr


def test_stdin_from_dev_null_ends_cleanly() -> None:
    # epoll refuses /dev/null; the manager must still see end of input and exit.
    done = run("--log-level", "error")
    assert done.returncode == 0
    assert done.stdout.splitlines()[0].startswith('{"jsonrpc":"2.0","method":"ready"')


def test_a_port_in_use_is_one_line_and_status_2(tmp_path: Path) -> None:
    cluster = ClusterDir(tmp_path / "cluster")
    cluster.init("t", "a", ["127.0.0.1"])
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "workload_manager",
                "--port",
                str(port),
                "--cluster-dir",
                cluster.path,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "NVPAIR_WM_BIND": "127.0.0.1"},
            stdin=subprocess.DEVNULL,
            check=False,
        )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()  # one line: no traceback, no log noise
    assert line == (
        f"workload_manager: cannot listen on port {port} on 127.0.0.1: it is in use "
        "(another agent may be running; --port changes it)"
    )
    assert port_in_use_from(line) == port
    assert "ready" not in done.stdout  # it never said ready: nothing to supervise


def test_port_in_use_lines_are_read_back() -> None:
    assert port_in_use_from(str(PortInUse(14320))) == 14320
    assert port_in_use_from(str(PortInUse(1, "::1"))) == 1
    assert port_in_use_from("workload_manager: cannot listen on port 80 on x: permission") is None


def test_a_stdin_that_cannot_be_read_is_reported_not_hidden(tmp_path: Path) -> None:
    # A file opened for writing only is a stdin every read of fails (EBADF): the pump that
    # reads it dies, its traceback is logged, and the manager says why it stopped instead
    # of exiting 0 as if the broker had closed the channel.
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workload_manager"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=fd,
            check=False,
        )
    finally:
        os.close(fd)
    assert done.returncode == 1
    assert "stdin-pump failed" in done.stderr
    assert "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "workload_manager: reading stdin failed: OSError: [Errno 9] Bad file descriptor"
    )
