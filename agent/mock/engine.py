"""`nvpair mock-engine`: a small OpenAI-compatible model server for demos and tests.

`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, non-streaming and
streaming (server-sent events, ending `data: [DONE]`; with `stream_options.include_usage`
a last chunk with no choices carries the usage, as vLLM sends it; a prompt's tokens are
its words). It answers with `max_tokens` tokens
(default 16) after `--latency-ms`, at `--tokens-per-s`, and fails a `--fail-rate` share of
requests with `--fail-status` (500). The reply never repeats the prompt -- a test that looks
for a prompt marker in nvpair's output must not find it planted by the engine -- except with
`--echo-errors`: a failure then quotes the whole request body in every field of its error
(`message`, `type`, `code`, `param`) and beside it, as an engine that echoes the prompt does.

`--max-concurrency N` lets N requests run at once and queues the rest, as vLLM's scheduler
does, and `GET /metrics` reports that real load under vLLM's own names
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, one
series per `model_name`), so the agent's load scraper is tested against the real format.

`--prefix-cache-blocks N` gives it a prefix cache, modelled (`agent.mock.prefix_cache`):
a prompt's words in blocks of `--block-units`, an LRU of N chained block hashes; the time
to first token is `--ttft-base-ms` plus `--prefill-ms-per-unit` for every word not cached,
the engine's prefills taking turns as one GPU's compute does (a busy engine queues them);
`usage.prompt_tokens_details.cached_tokens` says what was reused, and `/metrics` has vLLM's
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (in words).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from agent.mock.flavours import FLAVOURS, KEY_ENV, add_flavour, completion_id, middlewares
from agent.mock.prefix_cache import PrefixCache
from agent.mock.routes import add_routes
from agent.mock.rpc import RpcHead, parse_endpoints
from netkit import tracing
from netkit.sites import start_runner
from workload_manager import VERSION

__all__ = ["MockEngine", "add_command"]

# KV-cache blocks a request holds while it runs when there is no concurrency limit: the
# modelled share is running / KV_SLOTS (an unlimited mock still fills up under load).
KV_SLOTS = 256


class MockEngine:
    """The server; `start()` binds, `aclose()` stops."""

    def __init__(
        self,
        *,
        model: str,
        port: int = 0,
        host: str = "127.0.0.1",
        tokens_per_s: float = 0.0,  # 0: as fast as possible
        latency_ms: float = 0.0,
        fail_rate: float = 0.0,
        fail_status: int = 500,
        echo_errors: bool = False,
        max_concurrency: int = 0,  # 0: unlimited
        seed: int | None = None,
        api_key: str = "",  # agent/mock/flavours.py: 401 without it
        flavour: str = "openai",
        prefix_cache_blocks: int = 0,  # agent/mock/prefix_cache.py; 0: no cache
        block_units: int = 16,
        ttft_base_ms: float = 0.0,  # before the first token, always
        prefill_ms_per_unit: float = 0.0,  # and this per prompt unit not cached
        rpc: RpcHead | None = None,  # workers of a replica across members (agent/mock/rpc.py)
    ) -> None:
        self.rpc = rpc
        self.models = [m for m in model.split(",") if m]
        self.host = host
        self.port = port
        self.tokens_per_s = tokens_per_s
        self.latency_s = latency_ms / 1000
        self.fail_rate = fail_rate
        self.fail_status = fail_status
        self.echo_errors = echo_errors
        self.random = random.Random(seed)
        self.requests = 0
        self.succeeded: dict[str, int] = dict.fromkeys(self.models, 0)  # answered, per model
        self.in_flight = 0
        self.max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
        self._prefilling = asyncio.Lock()  # the uncached part of prompts, one at a time
        self.cache = PrefixCache(prefix_cache_blocks, block_units)
        self.ttft_base_s = ttft_base_ms / 1000
        self.prefill_s_per_unit = prefill_ms_per_unit / 1000
        self.prefix_queries = dict.fromkeys(self.models, 0)  # model -> prompt units looked up
        self.prefix_hits = dict.fromkeys(self.models, 0)  # model -> of those, cached
        self.running = dict.fromkeys(self.models, 0)  # model -> requests holding a slot
        self.waiting = dict.fromkeys(self.models, 0)  # model -> requests queued for one
        app = web.Application(client_max_size=8 * 1024 * 1024, middlewares=middlewares(api_key))
        add_flavour(app, flavour, self.models)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        add_routes(app, self.models)  # embeddings, rerank, audio, images, responses, ...
        self._app = app
        self._runner: web.AppRunner | None = None  # while serving

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind (port 0: any free port, then `self.port` holds the one bound) and serve."""
        # A client that goes away cancels its generation, as vLLM and llama.cpp abort it.
        # Idle connections are kept as aiohttp keeps them (an engine's, not a listener's).
        self._runner, self.port = await start_runner(
            self._app, self.host, self.port, bound_idle=False, handler_cancellation=True
        )

    async def aclose(self) -> None:
        """Stop serving and close connections."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"nvpair-mock {VERSION}"})

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "nvpair-mock"}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    def kv_usage(self) -> float:
        """The modelled KV-cache share in use: running / max concurrency (or `KV_SLOTS`)."""
        running = sum(self.running.values())
        return min(1.0, running / (self.max_concurrency or KV_SLOTS))

    async def _metrics(self, request: web.Request) -> web.Response:
        registry = CollectorRegistry()
        labels = ["model_name"]
        running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=registry,
        )
        waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=registry,
        )
        kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=registry,
        )
        queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=registry,
        )
        hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=registry,
        )
        done = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        usage = self.kv_usage()
        for model in self.models:
            done.labels(model, "length").inc(self.succeeded[model])
            running.labels(model).set(self.running[model])
            waiting.labels(model).set(self.waiting[model])
            kv.labels(model).set(usage)
            queries.labels(model).inc(self.prefix_queries[model])
            hits.labels(model).inc(self.prefix_hits[model])
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    @contextlib.asynccontextmanager
    async def _slot(self, model: str) -> AsyncIterator[None]:
        """Hold one of `max_concurrency` slots (waiting for it, counted, when all are taken)."""
        self.waiting[model] += 1
        try:
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            self.waiting[model] -= 1
        self.running[model] += 1
        try:
            yield
        finally:
            self.running[model] -= 1
            if self._slots is not None:
                self._slots.release()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            model = body["model"]
            tokens = int(body.get("max_tokens") or 16)
        except (ValueError, KeyError, TypeError):
            return _error(400, "invalid request body", "invalid_request_error")
        if model not in self.models:
            return _error(404, f"model {model!r} not found", "invalid_request_error")
        self.requests += 1
        self.in_flight += 1
        # As vLLM with --otlp-traces-endpoint: a span of the caller's trace (`traceparent`).
        parent = tracing.extracted(request.headers)
        attributes = {"gen_ai.request.model": model, "gen_ai.request.max_tokens": tokens}
        try:
            with tracing.span("llm_request", kind="server", parent=parent, attributes=attributes):
                async with self._slot(model):
                    if self.rpc is not None:
                        await self.rpc.step(model.encode())
                    answer = await self._answer(request, body, model, tokens, chat=chat)
            if answer.status < 400:
                self.succeeded[model] += 1
            return answer
        finally:
            self.in_flight -= 1

    async def _answer(
        self, request: web.Request, body: dict[str, Any], model: str, tokens: int, *, chat: bool
    ) -> web.StreamResponse:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.fail_rate and self.random.random() < self.fail_rate:
            return self._failure(json.dumps(body))
        words = [f"tok{i}" for i in range(max(1, min(tokens, 4096)))]
        created = int(time.time())
        units = _prompt_units(body)
        prompt = max(1, len(units))
        cached = await self._prefill(model, units)
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return await self._stream(
                request, model, words, created, chat=chat, usage=(prompt, cached) if usage else None
            )
        await self._pace(len(words))
        text = " ".join(words)
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": completion_id(request, self.requests),
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": self._usage(prompt, len(words), cached),
            }
        )

    async def _prefill(self, model: str, units: list[str]) -> int:
        """The prompt's prefill, modelled: its cached units (0 without a cache), after
        `ttft_base_ms` and `prefill_ms_per_unit` for each unit not cached."""
        cached = self.cache.admit(units) if self.cache.capacity else 0
        self.prefix_queries[model] += len(units)
        self.prefix_hits[model] += cached
        if self.ttft_base_s > 0:
            await asyncio.sleep(self.ttft_base_s)  # the modelled first step
        compute = self.prefill_s_per_unit * (len(units) - cached)
        if compute > 0:
            async with self._prefilling:  # one GPU: prefills take turns (a queue forms)
                await asyncio.sleep(compute)  # the modelled prefill, not a synchronisation
        return cached

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = _usage(prompt, completion)
        if self.cache.capacity:  # as vLLM and OpenAI report what was reused
            usage["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt)}
        return usage

    def _failure(self, request_text: str) -> web.Response:
        if not self.echo_errors:
            return _error(self.fail_status, "mock engine failure", "server_error")
        echoed = dict.fromkeys(("message", "type", "code", "param"), request_text)
        return web.json_response({"error": echoed, "detail": request_text}, status=self.fail_status)

    async def _pace(self, count: int) -> None:
        if self.tokens_per_s:
            await asyncio.sleep(count / self.tokens_per_s)

    async def _stream(
        self,
        request: web.Request,
        model: str,
        words: list[str],
        created: int,
        *,
        chat: bool,
        # (the prompt's tokens, of them cached): send the usage chunk (include_usage)
        usage: tuple[int, int] | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for i, word in enumerate(words):
            await self._pace(1)
            if chat:
                delta: dict[str, Any] = {"content": (" " if i else "") + word}
                if i == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
                kind = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": (" " if i else "") + word, "finish_reason": None}
                kind = "text_completion"
            chunk = {
                "id": completion_id(request, self.requests),
                "object": kind,
                "created": created,
                "model": model,
                "choices": [choice],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        final["delta" if chat else "text"] = {} if chat else ""
        last = {
            "id": completion_id(request, self.requests),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [final],
        }
        await response.write(f"data: {json.dumps(last)}\n\n".encode())
        if usage is not None:  # vLLM's: a last chunk with no choices and the usage
            tail = {**last, "choices": [], "usage": self._usage(usage[0], len(words), usage[1])}
            await response.write(f"data: {json.dumps(tail)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _prompt_units(body: dict[str, Any]) -> list[str]:
    """The prompt's "tokens": its words, the messages' in order (so a conversation's next
    turn begins with the last one's), so tests can tell prompts apart."""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    return text.split()


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": None}}, status=status
    )


def add_command(commands: Any) -> None:
    """Register `nvpair mock-engine`."""
    parser = commands.add_parser("mock-engine", help="a small OpenAI-compatible server for demos")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", required=True, help="model name (comma-separated for several)")
    parser.add_argument(
        "--weights",
        default="",
        help="what a real engine would load (a path or a model id): said in its first line, "
        "with whether such a path exists; the mock loads nothing",
    )
    parser.add_argument("--tokens-per-s", type=float, default=0.0)
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="a modelled prefix cache of this many blocks (0: none)",
    )
    parser.add_argument("--block-units", type=int, default=16, help="prompt words per block")
    parser.add_argument(
        "--ttft-base-ms", type=float, default=0.0, help="time to first token, always"
    )
    parser.add_argument(
        "--prefill-ms-per-unit",
        type=float,
        default=0.0,
        help="and this much more per prompt word not cached",
    )
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument(
        "--startup-s",
        type=float,
        default=0.0,
        help="the port opens this long after the process started, as a real engine's once "
        "it has imported itself and loaded its weights (its own start-up counts)",
    )
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="requests that run at once; the rest wait (0: unlimited)",
    )
    parser.add_argument("--fail-status", type=int, default=500, help="the status of a failure")
    parser.add_argument(
        "--echo-errors", action="store_true", help="failures quote the request in every field"
    )
    parser.add_argument("--api-key", default=os.environ.get(KEY_ENV, ""), help="401 without it")
    parser.add_argument("--flavour", choices=FLAVOURS, default="openai", help="ollama: its routes")
    parser.add_argument(
        "--rpc", default="", help="host:port,... of its workers (mock-rpc-worker), as llama.cpp's"
    )
    parser.add_argument(
        "--rpc-weights-bytes", type=int, default=1 << 20, help="sent to each worker at start"
    )
    parser.add_argument(
        "--otlp-traces-endpoint", help="spans of requests to this OTLP/HTTP URL, as vLLM's flag"
    )
    parser.set_defaults(run=_run)


def _since_start() -> float:
    """Seconds since this process started (Linux: /proc), or 0 where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


def _weights_said(weights: str) -> str:
    """What the first line says of `--weights`: the path, and whether it exists."""
    if not weights:
        return ""
    there = os.path.exists(weights) if weights.startswith("/") else None
    return f" (weights: {weights}{ {True: '', False: ', absent', None: ', a model id'}[there] })"


def _run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.fail_rate <= 1.0:
        print("nvpair: --fail-rate is between 0 and 1", file=sys.stderr)
        return 2
    if args.max_concurrency < 0:
        print("nvpair: --max-concurrency is 0 (unlimited) or more", file=sys.stderr)
        return 2
    if not 400 <= args.fail_status <= 599:
        print("nvpair: --fail-status is between 400 and 599", file=sys.stderr)
        return 2
    if not 0.0 <= args.startup_s <= 3600:
        print("nvpair: --startup-s is between 0 and 3600", file=sys.stderr)
        return 2
    if args.prefix_cache_blocks < 0 or args.block_units < 1:
        print("nvpair: --prefix-cache-blocks >= 0 and --block-units >= 1", file=sys.stderr)
        return 2
    rpc = None
    if args.rpc:
        try:
            rpc = RpcHead(parse_endpoints(args.rpc), max(0, args.rpc_weights_bytes))
        except ValueError as exc:
            print(f"nvpair: {exc}", file=sys.stderr)
            return 2

    async def serve() -> None:
        if args.startup_s:
            print(f"mock engine loading for {args.startup_s:g}s", flush=True)
            # The modelled load, from the process's start: nothing listens meanwhile.
            await asyncio.sleep(max(0.0, args.startup_s - _since_start()))
        if rpc is not None:
            await rpc.connect()  # before the port opens: ready means its workers hold it
        engine = MockEngine(
            model=args.model,
            port=args.port,
            host=args.host,
            tokens_per_s=args.tokens_per_s,
            latency_ms=args.latency_ms,
            fail_rate=args.fail_rate,
            fail_status=args.fail_status,
            echo_errors=args.echo_errors,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
            flavour=args.flavour,
            prefix_cache_blocks=args.prefix_cache_blocks,
            block_units=args.block_units,
            ttft_base_ms=args.ttft_base_ms,
            prefill_ms_per_unit=args.prefill_ms_per_unit,
            rpc=rpc,
        )
        await engine.start()
        if args.otlp_traces_endpoint:
            where = f"{engine.host}:{engine.port}"
            tracing.configure(args.otlp_traces_endpoint, service="mock-engine", instance=where)
        loads = _weights_said(args.weights)
        print(f"mock engine serving {engine.models} on {engine.url}{loads}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await engine.aclose()
            await asyncio.to_thread(tracing.shutdown)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0
