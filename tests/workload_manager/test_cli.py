"""The seed's command line, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workload_manager import VERSION
from workload_manager.cli import build_parser, relay_from_env


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
