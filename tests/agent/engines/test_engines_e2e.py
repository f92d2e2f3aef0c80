"""Engines with credentials and identity, and nodes without NVML (issue 15, items 5 and 6),
across two real agents: `a` has no NVML at all (its pynvml raises LibraryNotFound, as on a
machine without the NVIDIA driver) and runs the engines; `b` has one (simulated) GPU and
runs none of them, so every request sent to `b` is forwarded to `a`.

- An engine started with `--api-key` serves through both members once `a` is given its key
  (`[[agent.engines]] api_key_file`); one whose key `a` lacks is refused, said in the log,
  and never listed as serving. A managed replica with a generated key serves too.
- The client's `X-Request-Id` reaches the engine and comes back, locally and forwarded; one
  is minted when the client gives none; the engine's `openai-processing-ms` passes.
- No key ever appears in a log, a record, `/v1/replicas` or `/v1/deployments`.
- `a` serves a `gpus: 0` deployment; a GPU deployment is placed on `b`, never on `a`.
- An Ollama (the mock engine's Ollama flavour) is probed by its own routes and serves.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from tests.workload_manager.cluster_harness import engine_ports, free_port

from ..deploy_harness import engine_pids, kill_engines, post, replicas
from ..harness import Engine, Node, eventually, start_cluster, start_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-engine-e2e-key-0123456789abcdef"
OTHER = "sk-engine-e2e-other-9876543210"
NO_NVML = """\
import sys
from tests.fixtures.fake_pynvml import fake_pynvml
sys.modules[__name__] = fake_pynvml([], library=False)
"""


@dataclass
class NoNvmlNode(Node):
    """A member whose `import pynvml` finds a library that is not there."""

    shim: Path = Path()

    @property
    def env(self) -> dict[str, str]:
        env = super().env
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.shim), env.get("PYTHONPATH")) if p)
        return env


@dataclass
class Pair:
    a: Node
    b: Node
    engines: list[Engine]
    clients: dict[str, openai.AsyncOpenAI]

    def client(self, node: Node) -> openai.AsyncOpenAI:
        return self.clients[node.name]


def _ports() -> dict[str, int]:
    return {k: free_port() for k in ("manager", "node", "api", "facade")}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    root = tmp_path_factory.mktemp("engines")
    shim = root / "no-nvml"
    shim.mkdir()
    (shim / "pynvml.py").write_text(NO_NVML)
    keyed = await start_engine("keyed", "--api-key", KEY)
    locked = await start_engine("locked", "--api-key", OTHER)
    ollama = await start_engine("llama3.2:1b", "--flavour", "ollama")
    a = NoNvmlNode("a", root / "a", _ports(), None, shim=shim)
    b = Node("b", root / "b", _ports(), "l4:1")
    for node in (a, b):
        node.home.mkdir(parents=True)
        low, high = engine_ports()
        (node.home / "nvpair.toml").write_text(
            f'[agent]\nheartbeat_s = 0.5\n[engines]\nport_range = "{low}-{high}"\n'
        )
    (a.home / "engine.key").write_text(KEY + "\n")
    os.chmod(a.home / "engine.key", 0o600)
    with (a.home / "nvpair.toml").open("a") as toml:
        toml.write(
            f'[[agent.engines]]\nkind = "vllm"\nurl = "{keyed.url}"\napi_key_file = "engine.key"\n'
            f'[[agent.engines]]\nkind = "vllm"\nurl = "{locked.url}"\n'
            f'[[agent.engines]]\nkind = "ollama"\nurl = "{ollama.url}"\n'
        )
    clients = {node.name: client(node) for node in (a, b)}
    try:
        async for started in start_cluster([a, b]):
            yield Pair(started[0], started[1], [keyed, locked, ollama], clients)
    finally:
        for each in clients.values():
            await each.close()
        for node in (a, b):
            kill_engines(node.home)
        for engine in (keyed, locked, ollama):
            await engine.stop()


def client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


async def served(pair: Pair, node: Node) -> set[str]:
    models = await pair.client(node).models.list()
    return {m.id for m in models.data}


async def test_a_keyed_engine_serves_through_every_member_with_the_request_id(
    pair: Pair,
) -> None:
    a, b = pair.a, pair.b
    for node in (a, b):  # each member routes from its own view: each must list them
        await eventually(
            lambda n=node: _serves(pair, n, {"keyed", "llama3.2:1b"}),
            f"{node.name} lists a's engines",
        )
    # Listed is not yet routable: b places work on a only once it holds a reachable (a
    # member that just joined lists a's engines from a's record before its first contact).
    await eventually(lambda: _reaches(b, "a"), "b holds a reachable")
    for node in (a, b):  # local on a, forwarded from b
        try:
            raw = await pair.client(node).chat.completions.with_raw_response.create(
                model="keyed",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_headers={"X-Request-Id": f"trace-{node.name}"},
            )
        except openai.NotFoundError as exc:  # seen twice under load: say what the member saw
            seen = [(n["name"], n["reachable"], n["engines"]) for n in await node.get("/v1/nodes")]
            raise AssertionError(f"{node.name} refused keyed ({exc}); it saw {seen}") from exc
        assert raw.headers["x-request-id"] == f"trace-{node.name}"
        assert "openai-processing-ms" in raw.headers  # the engine's header passed through
        completion = raw.parse()
        assert completion.id == f"chatcmpl-trace-{node.name}"  # the engine saw the id
        assert completion.choices[0].message.content == "tok0 tok1"
        minted = await pair.client(node).completions.with_raw_response.create(
            model="keyed", prompt="hi", max_tokens=1
        )
        assert minted.headers["x-request-id"].startswith("req_")
        assert minted.parse().id == "chatcmpl-" + minted.headers["x-request-id"]


async def test_an_engine_whose_key_is_missing_is_refused_and_never_serving(pair: Pair) -> None:
    a, b = pair.a, pair.b
    await eventually(lambda: a.log_count("refuses the probe with 401") > 0, "a says why")
    assert "locked" not in await served(pair, b)
    with pytest.raises(openai.NotFoundError):
        await pair.client(b).chat.completions.create(
            model="locked", messages=[{"role": "user", "content": "hi"}]
        )


async def test_an_ollama_is_probed_its_own_way_and_serves(pair: Pair) -> None:
    (record,) = [r for r in await pair.b.get("/v1/nodes") if r["name"] == "a"]
    (engine,) = [e for e in record["engines"] if e["kind"] == "ollama"]
    assert engine["up"]
    assert engine["models"] == ["llama3.2:1b"]
    text = await pair.client(pair.b).completions.create(
        model="llama3.2:1b", prompt="hi", max_tokens=3
    )
    assert text.choices[0].text == "tok0 tok1 tok2"


async def test_a_node_without_nvml_serves_cpu_work_and_gets_no_gpu_work(pair: Pair) -> None:
    a, b = pair.a, pair.b
    (record,) = [r for r in await b.get("/v1/nodes") if r["name"] == "a"]
    assert record["devices"] == []
    assert "NVML unavailable: NVMLError_LibraryNotFound" in record["gpuNote"]
    cpu = {"name": "cpu-mock", "engine": "mock", "gpus": 0, "engineKey": "generate",
           "constraints": {"node": "a"}}  # fmt: skip
    gpu = {"name": "gpu-mock", "engine": "mock", "gpus": 1}
    for body in (cpu, gpu):
        code, text = await post(b, "/v1/deployments", body)
        assert code == 201, text
    await eventually(lambda: _ready(b, "cpu-mock", "a"), "cpu-mock ready on a", within_s=60)
    await eventually(lambda: _ready(b, "gpu-mock", "b"), "gpu-mock ready on b", within_s=60)
    answer = await pair.client(b).chat.completions.create(  # forwarded to a, a adds the key
        model="cpu-mock", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert answer.choices[0].message.content == "tok0"
    explained = await a.get("/v1/deployments/gpu-mock/explain?node=a")
    assert explained["nodes"][0]["reason"] == "0 free healthy GPU(s), 1 needed"
    # The replica's key is not on its command line: the engine refuses a caller without it.
    (replica,) = await replicas(b, "cpu-mock")
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{replica['port']}/v1/models") as response,
    ):
        assert response.status == 401


async def test_no_key_is_in_a_log_a_record_or_a_listing(pair: Pair) -> None:
    a, b = pair.a, pair.b
    await eventually(lambda: _ready(b, "cpu-mock", "a"), "cpu-mock ready on a", within_s=60)
    allocations = json.loads((a.home / "allocations.json").read_text())
    generated = [x["apiKey"] for x in allocations if x["deployment"] == "cpu-mock"]
    assert generated[0].startswith("sk-nvpair-")
    assert (a.home / "allocations.json").stat().st_mode & 0o077 == 0
    for pid in engine_pids(a.home).values():  # in the engine's environment, not its argv
        assert generated[0].encode() not in _cmdline(pid)
    for secret in (KEY, OTHER, generated[0]):
        for node in (a, b):
            assert node.log is not None
            assert secret.encode() not in node.log.read_bytes()
            for path in ("/v1/nodes", "/v1/replicas", "/v1/deployments", "/v1/members"):
                assert secret not in json.dumps(await node.get(path)), (node.name, path)


async def test_a_restarted_agent_calls_its_adopted_engine_with_the_same_key(pair: Pair) -> None:
    a, b = pair.a, pair.b
    await eventually(lambda: _ready(b, "cpu-mock", "a"), "cpu-mock ready on a", within_s=60)
    (before,) = await replicas(b, "cpu-mock")
    await a.stop()
    await a.start()  # the engine kept running; its key comes back from allocations.json
    await eventually(lambda: a.log_count("adopted pid") > 0, "a adopted its engine")
    # Adopted is not yet ready: a probes the engine before it routes to it again.
    await eventually(lambda: _ready(a, "cpu-mock", "a"), "a's adopted replica ready")
    answer = await pair.client(a).chat.completions.create(
        model="cpu-mock", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert answer.choices[0].message.content == "tok0"
    (after,) = await replicas(a, "cpu-mock")
    assert after["id"] == before["id"]  # the same engine, not a new one


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def _reaches(node: Node, name: str) -> bool:
    return any(n["name"] == name and n["reachable"] for n in await node.get("/v1/nodes"))


async def _serves(pair: Pair, node: Node, models: set[str]) -> bool:
    return models <= await served(pair, node)


async def _ready(node: Node, deployment: str, where: str) -> bool:
    seen: list[dict[str, Any]] = await replicas(node, deployment)
    return [(r["node"], r["state"]) for r in seen] == [(where, "ready")]
