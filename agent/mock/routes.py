"""The mock engine's routes besides chat and completions, in the shapes the real servers
answer: embeddings (OpenAI, `float` or `base64`), rerank (vLLM's, also Jina's and Cohere's:
`results: [{index, relevance_score}]`), score (vLLM's: `data: [{index, object: "score",
score}]`), audio transcriptions and translations (multipart in, `{"text"}` out), speech (a
little WAV, streamed), image generation (`data: [{b64_json}]`, a 1x1 PNG), responses (the
Responses API, its event stream when `stream`) and `GET /v1/models/{id}`.

Nothing here repeats its input -- a test that looks for a prompt marker in nvpair's output
must not find it planted by the engine: vectors and scores are derived from the input,
transcripts only count its bytes, rerank results carry no documents.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import aiohttp
from aiohttp import web

__all__ = ["TINY_PNG", "add_routes", "wav"]

DIMENSIONS: Final = 8  # an embedding's length unless `dimensions` asks otherwise
MAX_DIMENSIONS: Final = 4096
# A valid 1x1 PNG, what every image generation returns.
TINY_PNG: Final = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def wav(samples: int = 800, rate: int = 8000) -> bytes:
    """A mono 16-bit PCM WAV file of `samples` samples of silence."""
    data = bytes(2 * samples)
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", 36 + len(data), b"WAVE", b"fmt ", 16, 1, 1, rate, 2 * rate, 2, 16,
        b"data", len(data),
    )  # fmt: skip
    return header + data


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": None}}, status=status
    )


def _words(value: object) -> int:
    """Tokens, as the mock counts them: words of the strings, or the ids of a token list."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(v) if isinstance(v, (str, list)) else 1 for v in value)
    if isinstance(value, dict):
        return _words(value.get("text") or value.get("content") or "")
    return 0


def _vector(item: object, dimensions: int) -> list[float]:
    """A deterministic unit-free vector in [-1, 1) derived from the input item."""
    seed = json.dumps(item, sort_keys=True).encode()
    out: list[float] = []
    block = 0
    while len(out) < dimensions:
        digest = hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        out.extend(b / 128 - 1 for b in digest[: dimensions - len(out)])
        block += 1
    return out


def _overlap(query: str, document: object) -> float:
    """The share of the query's words in the document: a relevance score in [0, 1]."""
    text = document.get("text", "") if isinstance(document, dict) else document
    words = set(str(query).lower().split())
    found = set(str(text).lower().split())
    return round(len(words & found) / len(words), 6) if words else 0.0


class _Routes:
    def __init__(self, models: Sequence[str]) -> None:
        self.models = models
        self.count = 0

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The body, once it is a JSON object naming a served model; else the error."""
        try:
            body = await request.json()
            model = body["model"]
        except (ValueError, KeyError, TypeError):
            return _error(400, "invalid request body")
        if model not in self.models:
            return _error(404, f"model {model!r} not found")
        self.count += 1
        return dict(body)

    def _usage(self, tokens: int) -> dict[str, int]:
        return {"prompt_tokens": tokens, "total_tokens": tokens}

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        items = body.get("input")
        if isinstance(items, str) or (isinstance(items, list) and items and
                                      isinstance(items[0], int)):  # fmt: skip
            items = [items]  # one input: a string, or one list of token ids
        if not isinstance(items, list) or not items:
            return _error(400, "input must be a string, a list of strings or token ids")
        dimensions = min(int(body.get("dimensions") or DIMENSIONS), MAX_DIMENSIONS)
        data = []
        for index, item in enumerate(items):
            vector: list[float] | str = _vector(item, dimensions)
            if body.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body["model"],
                "usage": self._usage(_words(items)),
            }
        )

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return _error(400, "rerank takes a query and a list of documents")
        scored = [
            {"index": i, "relevance_score": _overlap(query, d)} for i, d in enumerate(documents)
        ]
        scored.sort(key=lambda r: (-float(r["relevance_score"]), r["index"]))
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            scored = scored[:top_n]
        tokens = _words(query) * max(1, len(documents)) + _words(documents)
        return web.json_response(
            {
                "id": f"rerank-{self.count}",
                "model": body["model"],
                "usage": {"total_tokens": tokens},
                "results": scored,
            }
        )

    async def score(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        first, second = body.get("text_1"), body.get("text_2")
        seconds = second if isinstance(second, list) else [second]
        firsts = first if isinstance(first, list) else [first] * len(seconds)
        if len(firsts) != len(seconds) or not all(isinstance(t, str) for t in firsts + seconds):
            return _error(400, "text_1 and text_2 are strings, or lists of one length")
        data = [
            {"index": i, "object": "score", "score": _overlap(a, b)}
            for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
        ]
        tokens = _words(firsts) + _words(seconds)
        return web.json_response(
            {
                "id": f"score-{self.count}",
                "object": "list",
                "created": int(time.time()),
                "model": body["model"],
                "data": data,
                "usage": self._usage(tokens),
            }
        )

    async def transcribe(self, request: web.Request) -> web.StreamResponse:
        # aiohttp's own multipart reader, streaming: the file is counted, never held.
        fields: dict[str, str] = {}
        size = 0
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if isinstance(part, aiohttp.BodyPartReader) and part.name == "file":
                    while chunk := await part.read_chunk():
                        size += len(chunk)
                elif isinstance(part, aiohttp.BodyPartReader) and part.name:
                    fields[part.name] = (await part.read(decode=True)).decode()[:1024]
        except (ValueError, AssertionError, UnicodeDecodeError):
            return _error(400, "the body must be multipart/form-data")
        if "model" not in fields:
            return _error(400, "the form has no model")
        if fields["model"] not in self.models:
            return _error(404, f"model {fields['model']!r} not found")
        self.count += 1
        text = f"{size} bytes of audio"
        if fields.get("response_format") == "text":
            return web.Response(text=text, content_type="text/plain")
        return web.json_response(
            {"text": text, "usage": {"type": "duration", "seconds": max(1, size // 16000)}}
        )

    async def speech(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        audio = wav()
        # Streamed (chunked, no length), as OpenAI's speech endpoint sends audio.
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        await response.prepare(request)
        for start in range(0, len(audio), 512):
            await response.write(audio[start : start + 512])
        await response.write_eof()
        return response

    async def images(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        count = max(1, min(int(body.get("n") or 1), 10))
        image = {"b64_json": base64.b64encode(TINY_PNG).decode()}
        return web.json_response({"created": int(time.time()), "data": [image] * count})

    def _response(self, model: str, words: list[str], done: bool, tokens: int) -> dict[str, Any]:
        text = " ".join(words)
        message = {
            "type": "message", "id": f"msg_mock{self.count}", "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }  # fmt: skip
        usage = {
            "input_tokens": tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(words), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens + len(words),
        }  # fmt: skip
        return {
            "id": f"resp_mock{self.count}", "object": "response", "created_at": int(time.time()),
            "model": model, "status": "completed" if done else "in_progress",
            "output": [message] if done else [], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "usage": usage if done else None,
        }  # fmt: skip

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        model, tokens = str(body["model"]), _words(body.get("input"))
        words = [f"tok{i}" for i in range(max(1, min(int(body.get("max_output_tokens") or 16),
                                                       4096)))]  # fmt: skip
        if not body.get("stream"):
            return web.json_response(self._response(model, words, True, tokens))
        return await self._stream_response(request, model, words, tokens)

    async def _stream_response(
        self, request: web.Request, model: str, words: list[str], tokens: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        sequence = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            await response.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

        final = self._response(model, words, True, tokens)
        item, part = final["output"][0], final["output"][0]["content"][0]
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        await event("response.created", response=self._response(model, [], False, tokens))
        await event("response.output_item.added", output_index=0,
                    item={**item, "status": "in_progress", "content": []})  # fmt: skip
        await event("response.content_part.added", part={**part, "text": ""}, **where)
        for i, word in enumerate(words):
            await event("response.output_text.delta", delta=(" " if i else "") + word,
                        logprobs=[], **where)  # fmt: skip
        await event("response.output_text.done", text=part["text"], logprobs=[], **where)
        await event("response.content_part.done", part=part, **where)
        await event("response.output_item.done", output_index=0, item=item)
        await event("response.completed", response=final)
        await response.write_eof()
        return response

    async def model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in self.models:
            return _error(404, f"model {model!r} not found")
        return web.json_response(
            {"id": model, "object": "model", "created": 0, "owned_by": "nvpair-mock"}
        )


def add_routes(app: web.Application, models: Sequence[str]) -> None:
    """Serve the routes on `app`, for `models`."""
    routes = _Routes(models)
    posts: dict[str, _Handler] = {
        "/v1/embeddings": routes.embeddings,
        "/v1/rerank": routes.rerank,
        "/v2/rerank": routes.rerank,
        "/rerank": routes.rerank,
        "/v1/score": routes.score,
        "/v1/audio/transcriptions": routes.transcribe,
        "/v1/audio/translations": routes.transcribe,
        "/v1/audio/speech": routes.speech,
        "/v1/images/generations": routes.images,
        "/v1/responses": routes.responses,
    }
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
