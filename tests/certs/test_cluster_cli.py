"""`nvpair cluster …` as an operator runs it, in a subprocess with its own NVPAIR_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from certs.invites import parse_token


def nvpair(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NVPAIR_HOME": str(home)},
        check=False,
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    done = nvpair(home, "cluster", "init", "--name", "lab", "--node-name", "gpu-a")
    assert done.returncode == 0, done.stderr
    assert "node id: nod_" in done.stdout
    return home


def members(home: Path) -> list[dict[str, str | None]]:
    done = nvpair(home, "cluster", "members", "--json")
    assert done.returncode == 0, done.stderr
    result: list[dict[str, str | None]] = json.loads(done.stdout)
    return result


def test_members_table_and_json(home: Path) -> None:
    table = nvpair(home, "cluster", "members")
    assert table.stdout.splitlines()[0].split() == ["NODE", "ID", "NAME", "PIN", "ADDED", "REMOVED"]
    assert "gpu-a" in table.stdout
    [me] = members(home)
    assert me["name"] == "gpu-a"
    assert me["removed"] is None


def test_issue_unpin_and_pin_again_is_refused(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "b-dir"
    done = nvpair(home, "cluster", "issue", "gpu-b", "--out", str(out))
    assert done.returncode == 0, done.stderr
    [b] = [m for m in members(home) if m["name"] == "gpu-b"]
    assert b["nodeId"] is not None
    assert nvpair(home, "cluster", "unpin", b["nodeId"]).returncode == 0
    assert [m["removed"] is not None for m in members(home) if m["name"] == "gpu-b"] == [True]
    again = nvpair(home, "cluster", "pin", str(out / "node.crt"))
    assert again.returncode == 1
    assert "was removed" in again.stderr


def test_invite_prints_a_token_and_the_expiry(home: Path) -> None:
    done = nvpair(home, "cluster", "invite", "--ttl", "5m")
    assert done.returncode == 0, done.stderr
    invite = parse_token(done.stdout.strip())
    assert len(invite.secret) == 32
    assert "one use, expires" in done.stderr


def test_bad_ttl_and_non_holder_are_clear(home: Path, tmp_path: Path) -> None:
    assert "not a duration" in nvpair(home, "cluster", "invite", "--ttl", "soon").stderr
    other = tmp_path / "other"
    refused = nvpair(other, "cluster", "invite")
    assert refused.returncode == 1
    assert "only a CA holder" in refused.stderr


def test_rotate_from_the_command_line(home: Path) -> None:
    done = nvpair(home, "cluster", "rotate")
    assert done.returncode == 0, done.stderr
    assert "re-issued the certificate of nod_" in done.stdout


def test_loose_key_is_named_with_its_fix(home: Path) -> None:
    key = home / "cluster" / "ca.key"
    os.chmod(key, 0o644)
    done = nvpair(home, "cluster", "invite")
    assert done.returncode == 1
    assert f"{key} is accessible by other users" in done.stderr
    assert f"chmod 600 {key}" in done.stderr
