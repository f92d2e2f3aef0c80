"""Launch templates: how each kind of engine is started, and when it counts as ready.

A template is an argv with placeholders, an environment and a readiness path. `render()`
fills in one replica's values (a pure function: no I/O), then appends the deployment's extra
arguments, so the same template serves every replica on every node:

    {model}   what the engine loads: a path or a model id (nvpair never downloads it)
    {served}  the model name clients ask for
    {port}    the port picked for this replica from `[engines] port_range`
    {tp}      the tensor-parallel size
    {gpus}    the replica's GPU UUIDs, comma-separated (also in CUDA_VISIBLE_DEVICES)

and, for a part of a replica that spans members (issue 32, `SpanRoles`):

    {rank}       the part's rank: 0 the head, 1.. the workers
    {nodes}      how many members the replica spans
    {world}      the replica's GPUs on all its members (its GPUs here times {nodes})
    {workers}    where the head reaches the workers' engines, `host:port,...` in rank order
                 (loopback ends of the agents' mTLS tunnels, for a `tunnel` channel)
    {head_addr}  the head member's address, as the other members reach it
    {dist_port}  a port on the head member for the engine's own rendezvous

`{{` and `}}` are literal braces. Any other placeholder, a format spec (`{port:d}`) or an
attribute (`{model.x}`) is refused when the template is loaded (`TemplateError`), so a typo
in `nvpair.toml` stops the agent at start instead of failing one replica at launch time.
An engine is ready when `GET http://127.0.0.1:{port}{ready_path}` answers 200; anything else
(llama.cpp's 503 while it loads) means not yet. The ready path is asked without an API key
(vLLM's, SGLang's and llama.cpp's `/health` answer without one). The answer counts only
when it comes from the engine itself, and, for a template that names `{served}`, once the
engine's `GET /v1/models` lists that name (`engine_ready.py`).

A replica with an API key (a deployment's `engineKey`) hands it to its engine the way the
template says: in an environment variable (`key_env`: vLLM's `VLLM_API_KEY`, llama.cpp's
`LLAMA_API_KEY`), so other users of the machine cannot read it from the process list, else
as a flag (`key_flag`: SGLang's `--api-key`). A template with neither runs its engine
without the key.
"""

from __future__ import annotations

import re
import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Final, Literal

from msgspec import Meta, Struct

__all__ = [
    "BUILTIN_TEMPLATES",
    "PLACEHOLDERS",
    "LaunchSpec",
    "LaunchTemplate",
    "SpanRoles",
    "TemplateError",
    "check_replica_id",
    "custom_template",
    "for_part",
    "names_served",
    "render",
]

PLACEHOLDERS: Final = frozenset(
    {
        "model",
        "served",
        "port",
        "tp",
        "gpus",
        "rank",
        "nodes",
        "world",
        "workers",
        "head_addr",
        "dist_port",
    }
)
REAL_ENGINE_READY_S: Final = 600.0  # loading a large model's weights takes minutes
MOCK_READY_S: Final = 30.0
MAX_ARGV: Final = 256
MAX_ARG_CHARS: Final = 4096
MAX_ENV: Final = 64

_REPLICA_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_TEMPLATE_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


class TemplateError(ValueError):
    """A template (a `[templates.NAME]` table) is wrong; the message names it and says why."""


_Arg = Annotated[str, Meta(max_length=MAX_ARG_CHARS)]


class LaunchSpec(Struct, kw_only=True, frozen=True):
    """One replica's engine: which template, what it loads, on which GPUs, on which port.

    `port` 0 means "pick one from the port range"; the supervisor fills it in. The replica id
    names a directory under `$NVPAIR_HOME/replicas/`, so it is checked here, once.
    """

    replica_id: str
    kind: str
    model: _Arg
    served: _Arg
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    gpu_uuids: tuple[_Arg, ...] = ()
    extra_args: Annotated[tuple[_Arg, ...], Meta(max_length=MAX_ARGV)] = ()
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    api_key: Annotated[str, Meta(max_length=4096)] = ""  # "" none; never logged
    # A part of a spanning replica (issue 32): its rank, the members the replica spans, and
    # the rendezvous values its template may name (`SpanRoles`).
    rank: Annotated[int, Meta(ge=0, le=63)] = 0
    nodes: Annotated[int, Meta(ge=1, le=64)] = 1
    workers: _Arg = ""
    head_addr: _Arg = ""
    dist_port: Annotated[int, Meta(ge=0, le=65535)] = 0

    def __post_init__(self) -> None:
        check_replica_id(self.replica_id)
        if any("," in uuid or not uuid for uuid in self.gpu_uuids):
            raise ValueError(f"{self.replica_id}: a GPU UUID is non-empty and has no comma")


def check_replica_id(replica_id: str) -> str:
    """`replica_id` when it can name a directory (1-64 letters, digits, _ and -)."""
    if not _REPLICA_ID.fullmatch(replica_id):
        raise ValueError(f"replica id {replica_id[:80]!r}: 1 to 64 letters, digits, _ and -")
    return replica_id


@dataclass(frozen=True, slots=True)
class SpanRoles:
    """How one kind of engine runs one replica over several members (issue 32).

    `channel` says how the head reaches the workers: `tunnel` -- each worker's engine listens
    on its loopback and the head reaches it through the agents' mTLS tunnel (llama.cpp's
    RPC); `network` -- the engine's own traffic (NCCL, Ray, torch.distributed) crosses the
    network between the members directly, which nvpair cannot tunnel at speed: refused unless
    the operator says the network is trusted (`[engines] trusted_network`)."""

    worker_argv: tuple[str, ...]  # a worker part's command line (placeholders as above)
    head_args: tuple[str, ...] = ()  # appended to the head part's argv
    # A worker's readiness: a path on {port}; "" its own listener on {port}; "*" its process
    # runs (SGLang's and vLLM's workers serve nothing themselves).
    worker_ready: str = ""
    head_waits: bool = True  # the head starts once every worker part is ready
    channel: Literal["tunnel", "network"] = "tunnel"


@dataclass(frozen=True, slots=True)
class LaunchTemplate:
    """How to start one kind of engine: argv and env with placeholders, and readiness."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    ready_path: str = "/v1/models"
    ready_timeout_s: float = REAL_ENGINE_READY_S
    builtin: bool = field(default=False, compare=False)
    key_env: str = ""  # the variable the engine reads its API key from
    key_flag: str = ""  # else the flag it takes it with
    span: SpanRoles | None = None  # how it spans members; None: it does not


def for_part(template: LaunchTemplate, spec: LaunchSpec) -> LaunchTemplate:
    """The template a part of a spanning replica runs: the worker's command line and
    readiness for a worker, the head's extra arguments for the head; `template` itself for a
    replica of its own. A template that cannot span has no parts (`TemplateError`)."""
    if spec.nodes == 1:
        return template
    if template.span is None:
        raise TemplateError(f"the {template.name!r} engine cannot span members")
    if spec.rank == 0:
        return replace(template, argv=(*template.argv, *template.span.head_args))
    return replace(
        template,
        argv=template.span.worker_argv,
        env=(),
        ready_path=template.span.worker_ready,
        key_env="",
        key_flag="",
    )


def render(template: LaunchTemplate, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """The argv (extra args appended) and the environment additions for one replica."""
    values = {
        "model": spec.model,
        "served": spec.served,
        "port": str(spec.port),
        "tp": str(spec.tp),
        "gpus": ",".join(spec.gpu_uuids),
        "rank": str(spec.rank),
        "nodes": str(spec.nodes),
        "world": str(max(1, len(spec.gpu_uuids)) * spec.nodes),
        "workers": spec.workers,
        "head_addr": spec.head_addr,
        "dist_port": str(spec.dist_port or spec.port + 1),  # a head's: its own port + 1
    }
    argv = [part.format_map(values) for part in template.argv]
    env = {name: value.format_map(values) for name, value in template.env}
    if spec.api_key and template.key_env:
        env[template.key_env] = spec.api_key
    elif spec.api_key and template.key_flag:
        argv += [template.key_flag, spec.api_key]
    return [*argv, *spec.extra_args], env


def names_served(template: LaunchTemplate) -> bool:
    """The template tells its engine the name to serve (`{served}` in its argv or env): the
    engine is then ready only once its `GET /v1/models` lists that name."""
    parts = [*template.argv, *(value for _, value in template.env)]
    return any(f == "served" for part in parts for _, f, _, _ in string.Formatter().parse(part))


def custom_template(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    ready: str = "/v1/models",
    ready_timeout_s: float = REAL_ENGINE_READY_S,
    key_env: str = "",
    key_flag: str = "",
) -> LaunchTemplate:
    """A template from `[templates.NAME]`, checked; `TemplateError` naming the table."""
    where = f"templates.{name}"
    if not _TEMPLATE_NAME.fullmatch(name):
        raise TemplateError(f"[{where}]: a template name is lower-case letters, digits, _ and -")
    if name in BUILTIN_TEMPLATES:
        raise TemplateError(f"[{where}]: {name!r} is a built-in template; choose another name")
    if not argv or not argv[0].strip():
        raise TemplateError(f"[{where}]: argv names the program to run (a non-empty list)")
    if len(argv) > MAX_ARGV or any(len(part) > MAX_ARG_CHARS for part in argv):
        raise TemplateError(f"[{where}]: argv has at most {MAX_ARGV} parts of {MAX_ARG_CHARS}")
    if len(env) > MAX_ENV:
        raise TemplateError(f"[{where}]: env has at most {MAX_ENV} variables")
    for part in argv:
        _check_placeholders(where, "argv", part)
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key) or key == "CUDA_VISIBLE_DEVICES":
            raise TemplateError(
                f"[{where}]: env {key[:80]!r} is not a variable name one may set "
                "(CUDA_VISIBLE_DEVICES is set by nvpair from the replica's GPUs)"
            )
        _check_placeholders(where, f"env.{key}", value)
    if not ready.startswith("/") or len(ready) > 1024 or any(c.isspace() for c in ready):
        raise TemplateError(f"[{where}]: ready is a URL path starting with / ({ready[:80]!r})")
    if not 0 < ready_timeout_s <= 86_400:
        raise TemplateError(f"[{where}]: ready_timeout_s is from 0 to 86400 seconds")
    if key_env and not _ENV_NAME.fullmatch(key_env):
        raise TemplateError(f"[{where}]: api_key_env {key_env[:80]!r} is not a variable name")
    if key_flag and not re.fullmatch(r"--?[A-Za-z0-9][A-Za-z0-9_-]{0,63}", key_flag):
        raise TemplateError(f"[{where}]: api_key_flag {key_flag[:80]!r} is not a flag")
    timeout = float(ready_timeout_s)
    return LaunchTemplate(
        name, tuple(argv), tuple(env.items()), ready, timeout, key_env=key_env, key_flag=key_flag
    )


def _check_placeholders(where: str, key: str, text: str) -> None:
    # string.Formatter's own parser: exactly what format_map() will accept later.
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(text)]
    except ValueError as exc:
        why = f"{key} {text[:80]!r}: {exc} (write {{{{ for a brace)"
        raise TemplateError(f"[{where}]: {why}") from None
    for name, spec, conversion in fields:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conversion:
            known = " ".join(f"{{{p}}}" for p in sorted(PLACEHOLDERS))
            raise TemplateError(
                f"[{where}]: {key} {text[:80]!r}: unknown placeholder {{{name}}}; "
                f"the placeholders are {known}"
            )


def _builtin(
    name: str,
    line: str,
    ready: str,
    timeout_s: float,
    *,
    program: str | None = None,
    env: tuple[tuple[str, str], ...] = (),
    key_env: str = "",
    key_flag: str = "",
    span: SpanRoles | None = None,
) -> LaunchTemplate:
    # A command line written as one would type it; no part of it holds a space.
    argv = ([program] if program else []) + line.split()
    return LaunchTemplate(
        name, tuple(argv), env, ready, timeout_s, True, key_env=key_env, key_flag=key_flag,
        span=span,
    )  # fmt: skip


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


_LOCAL: Final = " --host 127.0.0.1 --port {port}"
_VLLM_NODES: Final = " --nnodes {nodes} --master-addr {head_addr} --master-port {dist_port}"
_SGLANG_NODES: Final = " --nnodes {nodes} --dist-init-addr {head_addr}:{dist_port}"

# Real command lines (flags as each project documents them). Engines listen on loopback
# only: clients reach them through the agent's facade, which authenticates and routes.
BUILTIN_TEMPLATES: Final[Mapping[str, LaunchTemplate]] = {
    t.name: t
    for t in (
        _builtin(
            "vllm",
            f"vllm serve {{model}} --served-model-name {{served}}{_LOCAL}"
            " --tensor-parallel-size {tp}",
            "/health",
            REAL_ENGINE_READY_S,
            key_env="VLLM_API_KEY",
            # vLLM's own multi-node launch (0.11.1 on; its `mp` executor, no Ray cluster):
            # tensor-parallel within a member, a pipeline stage per member, the workers
            # headless; its NCCL and control traffic crosses the network.
            span=SpanRoles(
                worker_argv=tuple(
                    "vllm serve {model} --tensor-parallel-size {tp} --pipeline-parallel-size"
                    f" {{nodes}}{_VLLM_NODES} --node-rank {{rank}} --headless".split()
                ),
                head_args=tuple(
                    f"--pipeline-parallel-size {{nodes}}{_VLLM_NODES} --node-rank 0".split()
                ),
                worker_ready="*",
                head_waits=False,
                channel="network",
            ),
        ),
        _builtin(
            "sglang",
            "python -m sglang.launch_server --model-path {model} --served-model-name {served}"
            f"{_LOCAL} --tp-size {{tp}}",
            "/health",
            REAL_ENGINE_READY_S,
            key_flag="--api-key",
            # SGLang's multi-node launch: one tensor-parallel group over every member's
            # GPUs (`{world}`), rank 0 serving HTTP; NCCL crosses the network.
            span=SpanRoles(
                worker_argv=tuple(
                    "python -m sglang.launch_server --model-path {model} --tp-size {world}"
                    f"{_SGLANG_NODES} --node-rank {{rank}}".split()
                ),
                head_args=tuple(f"--tp-size {{world}}{_SGLANG_NODES} --node-rank 0".split()),
                worker_ready="*",
                head_waits=False,
                channel="network",
            ),
        ),
        _builtin(
            "llamacpp",
            f"llama-server -m {{model}} --alias {{served}}{_LOCAL} --metrics",
            "/health",  # 503 while the model loads, 200 once it serves
            REAL_ENGINE_READY_S,
            key_env="LLAMA_API_KEY",
            # Its RPC backend: each worker's ggml-rpc-server on its loopback (it has no
            # authentication), reached from the head through the agents' tunnels; the
            # layers offloaded to every device, the workers' included (the head's own
            # deployment arguments come after and may say otherwise).
            span=SpanRoles(
                worker_argv=("ggml-rpc-server", "-H", "127.0.0.1", "-p", "{port}"),
                head_args=("--rpc", "{workers}", "-ngl", "999"),
            ),
        ),
        # Ollama serves every model it has pulled (into OLLAMA_MODELS; nvpair pulls none) and
        # loads one on its first request: {model} is not on its command line. No API key.
        _builtin(
            "ollama",
            "ollama serve",
            "/api/version",
            REAL_ENGINE_READY_S,
            env=(("OLLAMA_HOST", "127.0.0.1:{port}"),),
        ),
        _builtin(
            "mock",
            "-m agent.mock mock-engine --model {served} --weights {model} --port {port}",
            "/health",
            MOCK_READY_S,
            program=_literal(sys.executable),  # this Python: the mock is part of nvpair
            key_env="NVPAIR_MOCK_API_KEY",
            # As llama.cpp's: workers hold what the head sends, over the agents' tunnels.
            span=SpanRoles(
                worker_argv=(
                    _literal(sys.executable),
                    *("-m", "agent.mock", "mock-rpc-worker", "--port", "{port}"),
                ),
                head_args=("--rpc", "{workers}"),
            ),
        ),
    )
}
