"""Artifacts between real agents (issue 28): files added as an artifact on a are learnt by
every member as a signed fact, and fetched by b and then c over the node API, each
byte-identical to the files on a (the test hashes them itself); c fetches from a and b at
once. A deployment that names an artifact is placed on a member without it when it must be:
its replica is `fetching` there, then its engine starts on the assembled copy and serves
through every member; one naming an artifact no member holds is refused."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, engine_pids, post, ready_everywhere, replicas
from ..harness import Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIZES = {
    "config.json": 120,
    "model.safetensors": 5 * 1024 * 1024 + 7,
    "tokenizer/vocab.txt": 70_000,
}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    gpus = dict.fromkeys("abc", "l4:1")
    async for started in engine_cluster(tmp_path_factory.mktemp("artifacts"), gpus):
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


async def test_a_deployment_brings_its_weights_to_the_member_it_runs_on(
    trio: list[Node], tmp_path: Path
) -> None:
    a, b, c = trio
    weights = tmp_path / "chat-weights"
    weights.mkdir()
    (weights / "config.json").write_text('{"model_type": "mock"}')
    (weights / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))
    code, out, err = await a.cli("artifact", "add", str(weights), "--name", "chat-w")
    assert code == 0, err
    digest = (await listed(a, "chat-w") or {})["digest"]
    await eventually(lambda: _is(c, "chat-w", "absent"), "c learns of chat-w")
    # Declared on c, kept on b: b has no copy, so it fetches one before its engine starts.
    code, out, err = await c.cli(
        "deploy", "chat-art", "--artifact", "chat-w", "--engine", "mock", "--node", "b"
    )
    assert code == 0, err
    seen: set[str] = set()

    async def ready() -> bool:
        seen.update(r["state"] for r in await replicas(a, "chat-art"))
        return await ready_everywhere(trio, "chat-art", 1)

    await eventually(ready, "chat-art ready in every member's view", within_s=60)
    assert "fetching" in seen or await _is(b, "chat-w", "resident")
    (rep,) = await replicas(a, "chat-art")
    assert rep["node"] == "b"
    ready_copy = b.home / "artifacts" / "ready" / digest.removeprefix("sha256:")
    assert tree_digest(ready_copy) == tree_digest(weights)
    # The engine was given the assembled copy as its model.
    (pid,) = engine_pids(b.home).values()
    assert str(ready_copy) in _argv(pid)
    for node in trio:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{node.ports['facade']}/v1", api_key="unused"
        )
        async with client:
            answer = await client.chat.completions.create(
                model="chat-art", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert answer.choices[0].message.content
    # `nvpair explain --deployment` says where the weights are.
    code, out, err = await a.cli("explain", "--deployment", "chat-art")
    assert code == 0, err
    assert "WEIGHTS" in out
    assert "resident" in out
    # The members' records say who holds it; `nvpair artifact list` shows each member.
    code, out, err = await a.cli("artifact", "list")
    assert code == 0, err
    assert "b:resident" in out.replace(" ", "")


async def test_a_deployment_of_weights_no_member_holds_is_refused(
    trio: list[Node], tmp_path: Path
) -> None:
    a, b, _ = trio
    weights = tmp_path / "gone"
    weights.write_bytes(os.urandom(1000))
    code, _, err = await a.cli("artifact", "add", str(weights), "--name", "gone-w")
    assert code == 0, err
    await eventually(lambda: _is(b, "gone-w", "absent"), "b learns of gone-w")
    await eventually(lambda: _holds(b, "a", "gone-w"), "b sees a holding gone-w")
    code, _, err = await a.cli("artifact", "rm", "gone-w")  # the only copy
    assert code == 0, err
    await eventually(lambda: _lacks(b, "a", "gone-w"), "b sees a without gone-w")
    body = {"name": "gone-dep", "engine": "mock", "artifact": "gone-w"}
    status, text = await post(b, "/v1/deployments", body)
    assert status == 409, text
    assert "no member holds gone-w" in text
    status, text = await post(b, "/v1/deployments", body | {"artifact": "no-such"})
    assert status == 400, text
    assert "no artifact named 'no-such'" in text
    # The control: one a member holds is taken.
    code, _, err = await a.cli("artifact", "add", str(weights), "--name", "gone-w")
    assert code == 0, err
    await eventually(lambda: _holds(b, "a", "gone-w"), "b sees a holding gone-w", within_s=20)
    status, text = await post(b, "/v1/deployments", body | {"replicas": 0})
    assert status == 201, text


async def _holds(node: Node, member: str, name: str) -> bool:
    found = await listed(node, name)
    return found is not None and found.get("members", {}).get(member) == "resident"


def _argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


async def _lacks(node: Node, member: str, name: str) -> bool:
    found = await listed(node, name)
    return found is not None and found.get("members", {}).get(member) == "absent"


async def test_an_artifact_made_warm_is_fetched_by_every_member_unasked(
    trio: list[Node], tmp_path: Path
) -> None:
    a, b, c = trio
    weights = tmp_path / "warm-w"
    weights.mkdir()
    (weights / "w.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    code, _, err = await a.cli("artifact", "add", str(weights), "--name", "warm-w")
    assert code == 0, err
    # The control: each learns of it and nobody fetches it unasked. (b may learn a push
    # after c: wait for both, never assume the order.)
    for node in (c, b):
        await eventually(lambda n=node: _is(n, "warm-w", "absent"), f"{node.name} learns of warm-w")
    code, out, err = await b.cli("artifact", "warm", "warm-w")
    assert code == 0, err
    assert "warm-w: warm" in out
    for node in (b, c):
        await eventually(
            lambda n=node: _is(n, "warm-w", "resident"), f"{node.name} keeps warm-w resident"
        )
    code, out, err = await c.cli("artifact", "list")
    assert code == 0, err
    assert any("warm-w" in line and " yes " in line for line in out.splitlines())
    code, _, err = await a.cli("artifact", "warm", "--off", "warm-w")
    assert code == 0, err


async def test_bad_artifact_requests_get_clear_errors_and_change_nothing(
    trio: list[Node], tmp_path: Path
) -> None:
    a = trio[0]

    async def catalog() -> list[dict[str, object]]:
        # What a request could change: the signed catalog. Where each member keeps its
        # pieces is that member's own report and may still be settling from the last test.
        listed: list[dict[str, object]] = await a.get("/v1/artifacts")
        return [{k: v for k, v in e.items() if k not in ("here", "members")} for e in listed]

    before = await catalog()
    url = "https://mirror.invalid/m/w.gguf?sig=secret"
    for body, status, says in (
        ({"name": "x"}, 400, "one of them"),
        ({"name": "x", "path": "/tmp", "url": url}, 400, "one of them"),
        ({"name": "x", "path": "relative/w"}, 400, "an absolute path"),
        ({"name": "x", "url": url}, 400, "sha256"),
        ({"name": "x", "url": url, "sha256": "xyz"}, 400, "sha256"),
        ({"name": "x", "url": url.replace("https", "http"), "sha256": "0" * 64}, 400, "https"),
        ({"name": "x", "path": str(tmp_path / "none")}, 400, "no such file"),
        ({"name": "x", "path": "/tmp", "extra": 1}, 400, "extra"),
        ("a string", 400, "object"),
    ):
        status_got, text = await post(a, "/v1/artifacts", body)
        assert (status_got, says in text) == (status, True), (body, text)
        assert "secret" not in text
    code, _, err = await a.cli("artifact", "add", url)  # the CLI asks for the hash first
    assert code != 0
    assert "--sha256" in err
    assert await catalog() == before
