"""Artifact transfers through crashes and a lying member (issue 28), with four real agents:

- **The only source killed mid-transfer.** b holds about half of an artifact (its fetch was
  killed with `kill -9`: the fetcher's crash). c fetches it from a and b; rarest first, it
  takes the pieces only a holds from a. Once c holds those, a is killed with `kill -9` --
  c does not hold the artifact yet -- and c's fetch completes from b alone.
- **A killed fetcher resumes.** b, restarted, fetches the rest: it fetches exactly the
  pieces it lacked (the test counts them on disk before, and b's own counter after), never
  one it had verified before it was killed.
- **A member that corrupts what it serves** (d, `NVPAIR_TEST_CORRUPT_PIECES=1`): c fetches
  another artifact from a and d; every piece d sends fails its hash, is refused, counted
  against d and fetched from a; no member ever holds a corrupt copy.

- **A full disk mid-fetch** (e, whose store is a 3 MiB tmpfs): a fetch of 4 MiB fails with
  the disk's own error on the artifact; the agent keeps answering, keeps its pieces for a
  later try, and a fetch that fits succeeds (the control).

The rates make the crashes land mid-transfer: a serves 4 pieces a second and b, once
restarted, 1 (`[artifacts] max_rate`), so the test waits on what each member holds on disk,
never on time.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.agent.harness import Node, eventually, join, make_node, start_cluster

from .disk import SmallDisk

pytestmark = [pytest.mark.reliability, pytest.mark.quick, pytest.mark.asyncio(loop_scope="module")]

PIECE = 64 * 1024
PIECES = 32


def settings(rate: int) -> str:
    return f"[agent]\nheartbeat_s = 0.5\n[artifacts]\nmax_rate = {rate}\n"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def four(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("artifact-faults")
    nodes = [make_node(root, name, None) for name in "abcd"]
    rates = {"a": 4 * PIECE, "b": 4 * PIECE, "c": 0, "d": 0}
    for node in nodes:
        node.home.mkdir(parents=True)
        (node.home / "nvpair.toml").write_text(settings(rates[node.name]))
    nodes[3].extra_env["NVPAIR_TEST_CORRUPT_PIECES"] = "1"
    async for started in start_cluster(nodes):
        yield started


def files(root: Path, name: str) -> Path:
    """An artifact of PIECES pieces of random bytes in two files."""
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_bytes(os.urandom(PIECE))  # one piece
    (folder / "model.safetensors").write_bytes(os.urandom((PIECES - 1) * PIECE))
    return folder


def pieces_on_disk(node: Node, digest: str) -> set[int]:
    """The verified pieces `node` holds of a fetch in progress (each marked, under its
    number, once its hash matched and its bytes are on disk)."""
    folder = node.home / "artifacts" / "pieces" / digest.removeprefix("sha256:") / "held"
    try:
        return {int(n) for n in os.listdir(folder) if n.isdigit()}
    except FileNotFoundError:
        return set()


def ready(node: Node, digest: str) -> Path:
    store = node.home.parent / "store" if node.name == "e" else node.home / "artifacts"
    return store / "ready" / digest.removeprefix("sha256:")


def tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


async def add(node: Node, folder: Path, name: str) -> str:
    code, out, err = await node.cli("artifact", "add", str(folder), "--name", name,
                                    "--piece-size", str(PIECE))  # fmt: skip
    assert code == 0, err
    return out.split()[2]  # "NAME: art_… sha256:… (size)"


async def known(node: Node, name: str) -> bool:
    return any(a["name"] == name for a in await node.get("/v1/artifacts"))


async def kill(node: Node) -> None:
    assert node.proc is not None
    node.proc.kill()
    await node.proc.wait()


async def test_the_only_source_killed_mid_transfer_and_a_killed_fetcher_resuming(
    four: list[Node], tmp_path: Path
) -> None:
    a, b, c, _ = four
    weights = files(tmp_path, "halves")
    digest = await add(a, weights, "halves")
    for node in (b, c):
        await eventually(lambda n=node: known(n, "halves"), f"{node.name} learns of it")
    # b fetches at a's 4 pieces a second and is killed (-9) halfway.
    code, _, err = await b.cli("artifact", "fetch", "halves")
    assert code == 0, err
    await eventually(lambda: len(pieces_on_disk(b, digest)) >= PIECES // 2, "b holds half")
    await kill(b)
    held_by_b = pieces_on_disk(b, digest)
    assert 0 < len(held_by_b) < PIECES
    assert not ready(b, digest).exists()
    # b comes back serving slowly (1 piece a second); it does not fetch on its own.
    (b.home / "nvpair.toml").write_text(settings(PIECE))
    await b.start()
    only_a = set(range(PIECES)) - held_by_b
    fetching = asyncio.create_task(c.cli("artifact", "fetch", "halves", "--wait"))
    await eventually(lambda: only_a <= pieces_on_disk(c, digest), "c holds every piece only a had")
    await kill(a)  # the only source that held it whole
    assert not ready(c, digest).exists(), "c finished before a was killed: nothing was tested"
    held_by_c = pieces_on_disk(c, digest)
    assert len(held_by_c) < PIECES
    code, out, err = await asyncio.wait_for(fetching, 120)
    assert code == 0, err
    assert "halves: resident" in out
    assert tree(ready(c, digest)) == tree(weights)
    from_b = await c.metric("nvpair_artifact_fetched_bytes_total", peer=await b.node_id())
    assert from_b >= (PIECES - len(held_by_c)) * PIECE  # the rest came from b
    # b resumes: it fetches what it lacked, from c, and nothing it had verified.
    code, out, err = await b.cli("artifact", "fetch", "halves", "--wait")
    assert code == 0, err
    assert tree(ready(b, digest)) == tree(weights)
    fetched = await b.metric("nvpair_artifact_pieces_verified_total")
    assert fetched == PIECES - len(held_by_b)
    assert await b.metric("nvpair_artifact_fetches_total", outcome="resident") == 1
    await a.start()  # back for the next test


async def test_a_member_that_corrupts_pieces_is_refused_and_counted(
    four: list[Node], tmp_path: Path
) -> None:
    a, _, c, d = four
    weights = files(tmp_path, "honest")
    digest = await add(a, weights, "honest")
    await eventually(lambda: known(d, "honest"), "d learns of it")
    code, _, err = await d.cli(
        "artifact", "fetch", "honest", "--wait"
    )  # from a: d keeps good bytes
    assert code == 0, err
    assert tree(ready(d, digest)) == tree(weights)
    await eventually(lambda: known(c, "honest"), "c learns of it")
    a_id, d_id = await a.node_id(), await d.node_id()
    from_a = await c.metric("nvpair_artifact_fetched_bytes_total", peer=a_id)
    # c fetches from a (4 pieces a second), b (none) and d (fast, and every piece corrupt).
    code, _, err = await c.cli("artifact", "fetch", "honest", "--wait")
    assert code == 0, err
    assert tree(ready(c, digest)) == tree(weights)
    refused = await c.metric("nvpair_artifact_pieces_refused_total", peer=d_id)
    assert refused >= 1
    assert c.log_count(f"from {d_id} failed its hash") >= 1
    assert await c.metric("nvpair_artifact_fetched_bytes_total", peer=d_id) == 0
    # The control: every byte c kept came from a, the honest member.
    now_from_a = await c.metric("nvpair_artifact_fetched_bytes_total", peer=a_id)
    assert now_from_a - from_a == PIECES * PIECE


async def test_a_full_disk_mid_fetch_is_an_error_on_the_artifact_and_the_agent_serves_on(
    four: list[Node], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    a = four[0]
    e = make_node(tmp_path_factory.mktemp("full-disk"), "e", None)
    disk = SmallDisk(e.home.parent / "store", "3m")
    disk.mount()
    try:
        e.home.mkdir()
        (e.home / "nvpair.toml").write_text(
            f'[agent]\nheartbeat_s = 0.5\n[artifacts]\npath = "{disk.path}"\n'
        )
        await join(a, e)
        await e.start()
        big = tmp_path / "big"
        big.mkdir()
        (big / "model.safetensors").write_bytes(os.urandom(2 * PIECES * PIECE))  # 4 MiB
        await add(a, big, "big")
        await eventually(lambda: known(e, "big"), "e learns of it")
        code, _, err = await e.cli("artifact", "fetch", "big", "--wait")
        assert code != 0
        assert "No space left on device" in err
        (listed,) = [x for x in await e.get("/v1/artifacts") if x["name"] == "big"]
        assert listed["here"] == "failed"
        assert "No space left on device" in listed["why"]
        assert 0 < listed["held"] < 2 * PIECES  # what fitted is kept, for a later try
        assert await e.healthy()
        a_sees = [n for n in await a.get("/v1/nodes") if n["name"] == "e"]
        assert a_sees[0]["reachable"]
        # The control: after its copy is dropped, an artifact that fits is fetched.
        code, _, err = await e.cli("artifact", "rm", "big")
        assert code == 0, err
        small = files(tmp_path, "small")
        digest = await add(a, small, "small")
        await eventually(lambda: known(e, "small"), "e learns of small")
        code, _, err = await e.cli("artifact", "fetch", "small", "--wait")
        assert code == 0, err
        assert tree(ready(e, digest)) == tree(small)
    finally:
        await e.stop()
        disk.unmount()
