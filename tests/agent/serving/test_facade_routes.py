"""Every OpenAI route through a member that does not run the engine: two real agents, the
real mock engine on b only, the real `openai` client (and plain HTTP for rerank and score)
on a -- so each request is forwarded over the node API, multipart audio included. A
prompt marker in every input reaches no job, log, database or metric."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from agent.mock.routes import TINY_PNG

from ..harness import Engine, Node, eventually, make_node, module_engine, start_cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")

MARKER = "PROMPT-MARKER-r0ute5"
MODEL = "org/all-routes"  # a slash, as Hugging Face names go: models.retrieve must keep it
AUDIO = b"RIFF" + MARKER.encode() + bytes(12 * 1024 * 1024)  # over JSON's 8 MiB limit


engine = module_engine(MODEL)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> AsyncIterator[list[Node]]:
    root = tmp_path_factory.mktemp("routes")
    a, b = make_node(root, "a", "l4:1"), make_node(root, "b", "l4:1")
    b.extra = ["--engine", f"vllm={engine.url}"]
    async for started in start_cluster([a, b]):

        async def a_sees_b_serve() -> bool:
            models = (await a.get_facade("/v1/models"))["data"]
            return [m["id"] for m in models] == [MODEL]

        await eventually(a_sees_b_serve, "a sees the model b's engine serves")
        yield started


def client(node: Node) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{node.ports['facade']}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


async def post(
    node: Node, path: str, body: bytes | dict[str, Any], content_type: str = "application/json"
) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{node.ports['facade']}{path}"
    data = io.BytesIO(json.dumps(body).encode() if isinstance(body, dict) else body)
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers={"Content-Type": content_type}) as response,
    ):
        return response.status, await response.json()


async def test_every_route_through_a_member_without_the_engine(cluster: list[Node]) -> None:
    a, b = cluster
    before, before_b = await a.job_keys(), await b.job_keys()
    async with client(a) as oa:
        embedded = await oa.embeddings.create(model=MODEL, input=["hello world", MARKER])
        assert [len(e.embedding) for e in embedded.data] == [8, 8]
        assert embedded.data[0].embedding != embedded.data[1].embedding
        assert embedded.usage.prompt_tokens == 3
        again = await oa.embeddings.create(model=MODEL, input="hello world")
        assert again.data[0].embedding == embedded.data[0].embedding  # derived from the input

        documents = ["Berlin is in Germany", "Paris is the capital of France", MARKER]
        rerank = {"model": MODEL, "query": "capital of France", "documents": documents}
        for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
            status, ranked = await post(a, path, rerank)
            assert status == 200, ranked
            assert [r["index"] for r in ranked["results"]] == [1, 0, 2]
        score = {"model": MODEL, "text_1": "capital of France", "text_2": documents[:2]}
        status, scored = await post(a, "/v1/score", score)
        assert status == 200
        assert [d["score"] for d in scored["data"]] == [0.0, 1.0]

        # Multipart, 12 MiB: routed by the form's model field, the same bytes sent on.
        heard = await oa.audio.transcriptions.create(model=MODEL, file=("a.wav", AUDIO))
        assert heard.text == f"{len(AUDIO)} bytes of audio"
        # The client's translations are deprecated: aiohttp's encoder, the model last.
        form = aiohttp.FormData()
        form.add_field("file", AUDIO[:99], filename="b.wav")
        form.add_field("model", MODEL)
        url = f"http://127.0.0.1:{a.ports['facade']}/v1/audio/translations"
        async with aiohttp.ClientSession() as session, session.post(url, data=form) as reply:
            assert reply.status == 200
            assert (await reply.json())["text"] == "99 bytes of audio"
        speech = await oa.audio.speech.create(model=MODEL, voice="alloy", input=MARKER)
        assert speech.response.headers["Content-Type"] == "audio/wav"
        assert "Content-Length" not in speech.response.headers  # streamed as the engine did
        assert speech.content[:4] == b"RIFF"
        assert len(speech.content) == 44 + 1600

        image = await oa.images.generate(model=MODEL, prompt=MARKER)
        assert image.data is not None
        assert base64.b64decode(image.data[0].b64_json or "") == TINY_PNG

        answer = await oa.responses.create(model=MODEL, input=MARKER, max_output_tokens=3)
        assert answer.output_text == "tok0 tok1 tok2"
        assert answer.usage is not None
        assert answer.usage.output_tokens == 3
        events = [
            event
            async for event in await oa.responses.create(
                model=MODEL, input="hi", max_output_tokens=3, stream=True
            )
        ]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "tok0 tok1 tok2"
        assert events[-1].type == "response.completed"

        messages: list[Any] = [{"role": "user", "content": MARKER}]
        stream = await oa.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, stream=True
        )
        chunks = [chunk.choices[0].delta.content or "" async for chunk in stream]
        assert "".join(chunks) == "tok0 tok1 tok2"

        retrieved = await oa.models.retrieve(MODEL)
        assert retrieved.id == MODEL
        with pytest.raises(openai.NotFoundError) as missing:
            await oa.models.retrieve("nope")
        assert missing.value.code == "model_not_found"

    # Locally too (b runs the engine): the form's Content-Type reaches the engine.
    async with client(b) as ob:
        heard = await ob.audio.transcriptions.create(model=MODEL, file=("c.wav", b"12345"))
        assert heard.text == "5 bytes of audio"

    b_id = await b.node_id()
    # Every POST: one job, 13 taken by a and one by b, listed by both.
    jobs = await a.get_settled_jobs(14, since=before)
    assert {(j["state"], j["scheduledOn"], j["model"]) for j in jobs} == {
        ("completed", b_id, MODEL)
    }
    assert sum(j["originatedFrom"] == b_id for j in jobs) == 1
    await b.get_settled_jobs(14, since=before_b)
    await _nowhere(cluster, MARKER)


async def _nowhere(cluster: list[Node], marker: str) -> None:
    for node in cluster:
        assert marker not in str(await node.jobs())
        async with aiohttp.ClientSession() as session, session.get(node.api + "/metrics") as r:
            assert marker not in await r.text()
        assert node.log is not None
        assert node.log_count(marker) == 0
        stored = [p for p in node.home.iterdir() if p.name.startswith("jobs.db")]
        assert stored
        assert all(marker.encode() not in p.read_bytes() for p in stored)


async def test_bad_bodies_and_routes_are_openai_errors_and_no_jobs(cluster: list[Node]) -> None:
    a = cluster[0]
    before = await a.job_keys()
    boundary = "xyz"
    form = f"multipart/form-data; boundary={boundary}"
    no_model = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"\r\nRIFF\r\n--{boundary}--\r\n"
    ).encode()
    cases = [
        ("/v1/audio/transcriptions", no_model, form, 400, "no model"),
        ("/v1/audio/transcriptions", no_model, "multipart/form-data", 400, "boundary"),
        ("/v1/audio/translations", no_model[:-8], form, 400, "malformed"),
        ("/v1/audio/transcriptions", b'{"model": "m"}', "application/json", 400, "multipart"),
        ("/v1/audio/transcriptions", bytes(25 * 1024 * 1024 + 1), form, 413, "over"),
        (
            "/v1/embeddings",
            b'{"model": "m"}' + bytes(8 * 1024 * 1024),
            "application/json",
            413,
            "over",
        ),
        ("/v1/responses", b'{"input": "x"}', "application/json", 400, "JSON with a model"),
    ]
    for path, body, content_type, status, says in cases:
        got, error = await post(a, path, body, content_type)
        assert (got, error["error"]["type"]) == (status, "invalid_request_error"), path
        assert says in error["error"]["message"]

    # Chunked, with no Content-Length: refused once the body passes the limit.
    async def chunked() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "input": "'
        for _ in range(9):
            yield b"x" * 1024 * 1024

    url = f"http://127.0.0.1:{a.ports['facade']}/v1/embeddings"
    async with aiohttp.ClientSession() as session, session.post(url, data=chunked()) as reply:
        assert reply.status == 413
        assert (await reply.json())["error"]["code"] == "request_too_large"
    # The control: the same route with a model is served.
    status, _ = await post(a, "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 200
    url = f"http://127.0.0.1:{a.ports['facade']}"
    async with aiohttp.ClientSession() as session:
        for method, path, status in (
            ("POST", "/v1/images/edits", 404),
            ("POST", "/v1/rerank/x", 404),
            ("GET", "/v1/embeddings", 405),
            ("DELETE", "/v1/models/x", 405),
        ):
            async with session.request(method, url + path) as response:
                assert response.status == status
                code = (await response.json())["error"]["code"]
                assert code == ("unknown_url" if status == 404 else "method_not_allowed")
    await a.get_settled_jobs(1, since=before)  # the control's only
