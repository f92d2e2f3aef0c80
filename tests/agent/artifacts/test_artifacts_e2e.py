"""Artifacts between real agents (issue 28): files added as an artifact on a are learnt by
every member as a signed fact, and fetched by b and then c over the node API, each
byte-identical to the files on a (the test hashes them itself); c fetches from a and b at
once."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ..harness import Node, eventually, make_node, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIZES = {
    "config.json": 120,
    "model.safetensors": 5 * 1024 * 1024 + 7,
    "tokenizer/vocab.txt": 70_000,
}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("artifacts")
    nodes = [make_node(root, name, None) for name in "abc"]
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text("[agent]\nheartbeat_s = 0.5\n")
    async for started in start_cluster(nodes):
        yield started


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights") / "tiny-model"
    for name, size in SIZES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(os.urandom(size))
    return root


def tree_digest(root: Path) -> dict[str, str]:
    """Each file's SHA-256, by path: what the test checks, computed by the test."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


async def listed(node: Node, name: str) -> dict[str, Any] | None:
    return next((a for a in await node.get("/v1/artifacts") if a["name"] == name), None)


async def test_an_artifact_added_on_a_is_fetched_by_b_and_c_byte_identical(
    trio: list[Node], weights: Path
) -> None:
    a, b, c = trio
    code, out, err = await a.cli("artifact", "add", str(weights), "--name", "tiny")
    assert code == 0, err
    assert "tiny: art_" in out
    here = await listed(a, "tiny")
    assert here is not None
    assert here["here"] == "resident"
    digest = here["digest"]
    for node in (b, c):  # every member learns the fact; none holds the weights yet
        await eventually(lambda n=node: _is(n, "tiny", "absent"), f"{node.name} learns of it")
    code, out, err = await b.cli("artifact", "fetch", "tiny", "--wait")
    assert code == 0, err
    assert "tiny: resident" in out
    code, out, err = await c.cli("artifact", "fetch", "tiny", "--wait")  # from a and b
    assert code == 0, err
    for node in (b, c):
        ready = node.home / "artifacts" / "ready" / digest.removeprefix("sha256:")
        assert tree_digest(ready) == tree_digest(weights), node.name
    code, out, err = await c.cli("artifact", "list")
    assert code == 0, err
    assert "tiny" in out
    assert "resident" in out
    # c drops its copy; the others keep theirs, and c can fetch it again.
    code, out, err = await c.cli("artifact", "rm", "tiny")
    assert code == 0, err
    assert "tiny: absent here" in out
    assert not (c.home / "artifacts" / "ready" / digest.removeprefix("sha256:")).exists()
    assert await _is(b, "tiny", "resident")


async def test_fetching_an_unknown_artifact_is_refused(trio: list[Node]) -> None:
    code, _, err = await trio[1].cli("artifact", "fetch", "nothing-like-it")
    assert code != 0
    assert "no artifact named 'nothing-like-it'" in err


async def _is(node: Node, name: str, here: str) -> bool:
    found = await listed(node, name)
    return found is not None and found["here"] == here
