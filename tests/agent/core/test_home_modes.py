"""Private files whatever the umask (issue 12, item 8): `nvpair cluster init` and `agent run`
as real processes under `umask 000` create every directory 0700 and every file 0600, and an
`nvpair.toml` or `NVPAIR_HOME` that other users could read or change is refused at start."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest

from plane.core.ids import new_id
from plane.core.tokens import mint_token
from tests.agent.harness import TIMEOUT, Node, eventually, make_node


def _no_umask() -> None:
    os.umask(0)  # the child creates files as if nobody had narrowed its modes


async def _nvpair(node: Node, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", *args, env=node.env, preexec_fn=_no_umask,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _run_agent(node: Node) -> asyncio.subprocess.Process:
    return await _nvpair(
        node, "agent", "run", "--name", node.name, "--simulate-gpus", "l4:1",
        "--manager-port", str(node.ports["manager"]), "--node-port", str(node.ports["node"]),
        "--api-port", str(node.ports["api"]), "--facade-port", str(node.ports["facade"]),
    )  # fmt: skip


async def _refused(node: Node) -> str:
    # `agent run` that must not start: its exit status and its one line.
    proc = await _run_agent(node)
    _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2, err.decode()
    assert len(lines) == 1, err.decode()
    return lines[0]


def _modes(home: Path) -> dict[str, int]:
    # Every path under (and including) the home, with its permission bits.
    found = {".": stat.S_IMODE(home.stat().st_mode)}
    for path in home.rglob("*"):
        found[str(path.relative_to(home))] = stat.S_IMODE(path.lstat().st_mode)
    return found


async def test_under_umask_000_every_path_is_private_and_keys_in_0600_toml_are_taken(
    tmp_path: Path,
) -> None:
    node = make_node(tmp_path / "made-by-nvpair", "a", "l4:1")  # its parent is created too
    init = await _nvpair(node, "cluster", "init", "--name", "lab", "--node-name", "a")
    _, err = await asyncio.wait_for(init.communicate(), TIMEOUT)
    assert init.returncode == 0, err.decode()
    toml = node.home / "nvpair.toml"
    toml.write_text('[agent]\napi_keys = { team = "sk-private-1" }\n')
    toml.chmod(0o600)  # the control: keys in a file only its owner reads are accepted
    node.proc = await _run_agent(node)
    try:
        await eventually(node.healthy, "the agent is up under umask 000")
        await eventually((node.home / "agent.json").exists, "agent.json is written")
        modes = _modes(node.home)
    finally:
        await node.stop()
    for name in ("cluster/node.key", "cluster/ca.key", "jobs.db", "jobs.db-wal", "agent.json"):
        assert name in modes, sorted(modes)  # what the walk below must have seen
    assert any(name.startswith("cluster/trusted/") for name in modes), sorted(modes)
    wrong = {
        name: f"{mode:04o}"
        for name, mode in modes.items()
        if mode != (0o700 if (node.home / name).is_dir() else 0o600)
    }
    assert wrong == {}
    assert stat.S_IMODE(node.home.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("text", "mode", "why"),
    [
        ('[agent]\napi_keys = { team = "sk-private-1" }\n', 0o644, "holds API keys"),
        ('[plane]\nurl = "http://plane:14330"\ntoken = "hgro1.x"\n', 0o640, "a plane token"),
        ('[agent]\nengines = ["vllm=http://127.0.0.1:9"]\n', 0o606, "written by other users"),
    ],
    ids=["api-keys-readable", "plane-token-readable", "writable"],
)
async def test_a_config_others_can_read_or_change_is_refused(
    tmp_path: Path, text: str, mode: int, why: str
) -> None:
    node = make_node(tmp_path, "a", "l4:1")
    node.home.mkdir(mode=0o700)
    toml = node.home / "nvpair.toml"
    toml.write_text(text)
    toml.chmod(mode)
    line = await _refused(node)
    assert str(toml) in line
    assert why in line
    assert "chmod 600" in line


async def test_a_home_others_can_write_is_refused(tmp_path: Path) -> None:
    node = make_node(tmp_path, "a", "l4:1")
    node.home.mkdir()
    node.home.chmod(0o777)  # anyone could plant its nvpair.toml
    line = await _refused(node)
    assert f"NVPAIR_HOME={node.home}" in line
    assert "chmod 700" in line
    assert not (node.home / "agent.lock").exists()  # refused before anything was written


async def test_plane_join_under_umask_000_keeps_the_token_private(tmp_path: Path) -> None:
    node = make_node(tmp_path / "made-by-nvpair", "a", None)
    join = await _nvpair(node, "plane", "join", "http://127.0.0.1:9", mint_token(new_id("clu")))
    _, err = await asyncio.wait_for(join.communicate(), TIMEOUT)
    assert join.returncode == 0, err.decode()
    assert _modes(node.home) == {".": 0o700, "plane.json": 0o600}
    assert stat.S_IMODE(node.home.parent.stat().st_mode) == 0o700
