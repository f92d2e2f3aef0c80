"""Agent configuration: `$NVPAIR_HOME/nvpair.toml`, overridden by flags, parsed once.

    [agent]
    name = "gpu-a"              # default: the host name
    advertise = "10.0.0.5"      # the address peers use; default: 127.0.0.1; or with the
                                # ports peers use: "HOST:MANAGER_PORT,NODE_PORT,FACADE_PORT"
    manager_port = 14320
    node_port = 14321
    api_port = 14322            # local API, loopback only
    facade_port = 14323
    simulate_gpus = "h100-80gb-sxm:8,l4:2"
    log_level = "info"
    log_format = "text"         # or "json": one object a line, for log shippers
    heartbeat_s = 2.0
    job_retention_h = 168
    queue_limit = 32
    facade_bind = "0.0.0.0"
    anti_entropy_s = 5.0        # compare Jobs stores with the next member this often
    api_keys = { alice = "sk-..." }
    [[agent.engines]]
    kind = "vllm"
    url = "http://127.0.0.1:8000"

    [plane]                     # or `nvpair plane join` ($NVPAIR_HOME/plane.json)
    url = "https://plane:14330"
    token = "hgro1...."
    ca = "plane-ca.pem"         # verifies an https plane (relative to NVPAIR_HOME)
    interval_s = 2.0            # sync up and fetch the desired state this often

    [tracing]                   # spans of every request (docs/metrics.md, "Tracing")
    otlp_endpoint = "http://collector:4318/v1/traces"
    sample_ratio = 1.0          # of the traces that start here

    [engines]                   # engines the agent launches (docs/engines.md)
    port_range = "18000-18999"
    [templates.mine]            # a custom launch template (agent/engines/config.py)
    argv = ["my-server", "--model", "{model}", "--port", "{port}"]

The file and the flags are decoded together into one typed structure with bounds
(`msgspec.convert`): a wrong type, a value out of bounds, an unknown key or table is refused
with a `ConfigError` naming the file and the dotted key. The daemon gets `AgentConfig` frozen.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from agent.core.advertise import parse_advertise
from agent.core.errors import PortInUse
from agent.core.home import shared_file_problem, shared_home_problem
from agent.engines.auth import EngineCredentials, EngineTable, credentials_by_url
from agent.engines.config import EngineSpec, EnginesTable, LaunchSettings, launch_settings
from agent.engines.gpus import known_device_class, parse_simulation
from agent.engines.templates import TemplateError

__all__ = [
    "ENGINE_KINDS",
    "AgentConfig",
    "ConfigError",
    "EngineSpec",
    "PlaneSettings",
    "TracingTable",
    "load_config",
    "nvpair_home",
    "parse_advertise",
    "port_in_use",
]

ENGINE_KINDS: Final = ("vllm", "sglang", "llamacpp", "ollama", "openai")


class ConfigError(ValueError):
    """The configuration file or a flag is wrong; the message says which key and why."""


def nvpair_home(environ: Mapping[str, str] | None = None) -> Path:
    """`NVPAIR_HOME`, default `~/.nvpair`."""
    env = os.environ if environ is None else environ
    return Path(env.get("NVPAIR_HOME") or Path("~/.nvpair").expanduser())


_Port = Annotated[int, Meta(ge=0, le=65535)]
_Text = Annotated[str, Meta(min_length=1, max_length=256)]
_Url = Annotated[str, Meta(min_length=1, max_length=2048)]


class _AgentTable(Struct, forbid_unknown_fields=True, frozen=True):
    # The `[agent]` table as written; flags are merged in before the conversion.
    name: _Text | None = None
    advertise: _Text = "127.0.0.1"
    manager_port: _Port = 14320
    node_port: _Port = 14321
    api_port: _Port = 14322
    facade_port: _Port = 14323
    simulate_gpus: Annotated[str, Meta(max_length=1024)] | None = None
    log_level: Literal["error", "warn", "info", "debug"] = "info"
    log_format: Literal["text", "json"] = "text"
    heartbeat_s: Annotated[float, Meta(gt=0, le=600)] = 2.0
    job_retention_h: Annotated[float, Meta(gt=0, le=24 * 3650)] = 168.0
    engines: Annotated[list[str | EngineTable], Meta(max_length=64)] = []
    api_keys: Annotated[dict[_Text, Annotated[str, Meta(min_length=8)]], Meta(max_length=1024)] = {}
    queue_limit: Annotated[int, Meta(ge=1, le=100_000)] = 32
    wait_queue: Annotated[int, Meta(ge=0, le=100_000)] = 64  # agent/serving/wait_queue.py
    wait_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    facade_bind: _Text | None = None
    anti_entropy_s: Annotated[float, Meta(ge=0.1, le=3600)] = 5.0
    dial_from: _Text | None = None


class PlaneSettings(Struct, forbid_unknown_fields=True, frozen=True):
    """Where this node syncs into a plane, and with which cluster token."""

    url: _Url
    token: Annotated[str, Meta(min_length=1, max_length=1024)]
    ca: _Text | None = None  # PEM file of the CA an https plane's certificate is verified with
    # How often the node syncs up and fetches its cluster's desired state, in seconds.
    interval_s: Annotated[float, Meta(ge=0.1, le=300)] = 2.0


class ArtifactsTable(Struct, forbid_unknown_fields=True, frozen=True):
    """`[artifacts]`: where this member keeps artifacts and how much disk they may take
    (docs/artifacts.md)."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None  # default: home
    max_bytes: Annotated[int, Meta(ge=0)] = 0  # 0: no budget
    # Bytes a second this member fetches and serves artifact pieces at, each way; 0: no
    # limit. A transfer then leaves the rest of the link to inference traffic.
    max_rate: Annotated[int, Meta(ge=0)] = 0
    # PEM certificates trusted for `https://` downloads instead of the system's (an internal
    # mirror with its own CA); relative paths are to the home.
    ca_file: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None


class RoutingTable(Struct, forbid_unknown_fields=True, frozen=True):
    """`[routing]`: how this member's facade picks among a deployment's replicas
    (docs/inference.md); `nvpair routing --policy` changes it until the agent restarts."""

    policy: Literal["prefix", "load", "round-robin"] = "prefix"


class TracingTable(Struct, forbid_unknown_fields=True, frozen=True):
    """`[tracing]`: a trace of every request, its spans sent to an OpenTelemetry collector
    over OTLP/HTTP (docs/metrics.md, "Tracing"); off without `otlp_endpoint`."""

    otlp_endpoint: _Url | None = None  # http://collector:4318/v1/traces
    sample_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0  # of traces started here
    service_name: _Text = "nvpair-agent"


class _File(Struct, forbid_unknown_fields=True, frozen=True):
    agent: _AgentTable = _AgentTable()
    artifacts: ArtifactsTable = ArtifactsTable()
    routing: RoutingTable = RoutingTable()
    tracing: TracingTable = TracingTable()
    plane: PlaneSettings | None = None
    engines: EnginesTable = EnginesTable()
    templates: Annotated[dict[str, dict[str, Any]], Meta(max_length=256)] = {}


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything `nvpair agent run` needs, checked."""

    home: Path
    name: str = dataclasses.field(default_factory=socket.gethostname)
    advertise_host: str = "127.0.0.1"  # the address in this node's record
    # (manager, node, facade) ports in the record when they differ from the listening ones
    # (NAT, port forwards, containers, a proxy); None: the listening ports.
    advertise_ports: tuple[int, int, int] | None = None
    manager_port: int = 14320
    node_port: int = 14321
    api_port: int = 14322
    facade_port: int = 14323
    simulate_gpus: str | None = None
    log_level: str = "info"
    log_format: str = "text"  # or json: one object a line (netkit.logs)
    heartbeat_s: float = 2.0
    job_retention_h: float = 168.0
    engines: tuple[tuple[str, str, str], ...] = ()  # (name, kind, base URL)
    engine_credentials: tuple[tuple[str, EngineCredentials], ...] = ()  # (base URL, them)
    api_keys: tuple[tuple[str, str], ...] = ()  # (requester name, key)
    queue_limit: int = 32  # pending jobs per node beyond which it takes no more
    wait: tuple[int, float] = (64, 30.0)  # requests waiting per model, for at most seconds
    facade_bind: str | None = None  # default: NVPAIR_BIND, else loopback unless api_keys
    anti_entropy_s: float = 5.0  # a Jobs-store comparison with the next member this often
    # The local address this node's connections to members leave from (a multi-homed host
    # that must use one interface); None: the system's choice.
    dial_from: str | None = None
    plane: PlaneSettings | None = None
    launch: LaunchSettings = dataclasses.field(default_factory=LaunchSettings)  # docs/engines.md
    # [artifacts]: where the store is and its disk budget (docs/artifacts.md)
    artifacts: ArtifactsTable = dataclasses.field(default_factory=ArtifactsTable)
    routing: RoutingTable = dataclasses.field(default_factory=RoutingTable)  # [routing]
    tracing: TracingTable = dataclasses.field(default_factory=TracingTable)  # [tracing]

    @property
    def artifacts_path(self) -> Path:
        """Where the artifact store is (relative paths are to NVPAIR_HOME)."""
        return self.home / (self.artifacts.path or "artifacts")

    @property
    def advertised_ports(self) -> tuple[int, int, int]:
        """(manager, node, facade) ports peers reach this node on."""
        if self.advertise_ports is not None:
            return self.advertise_ports
        return (self.manager_port, self.node_port, self.facade_port)

    @property
    def cluster_dir(self) -> Path:
        """The cluster dir (identity, CA, pins)."""
        return self.home / "cluster"

    @property
    def jobs_db(self) -> Path:
        """The Jobs store."""
        return self.home / "jobs.db"

    @property
    def runs_file(self) -> Path:
        """The run book: the runs this node put its name to (`agent.serving.run_book`)."""
        return self.home / "runs"

    @property
    def state_file(self) -> Path:
        """Where the running agent records its local API address for the CLI."""
        return self.home / "agent.json"

    @property
    def lock_file(self) -> Path:
        """Held for the agent's lifetime: one agent per `NVPAIR_HOME`."""
        return self.home / "agent.lock"


# Flag names that are ports, with what the port is for (for messages).
PORTS: Final = {
    "manager_port": "workload manager",
    "node_port": "node API",
    "api_port": "local API",
    "facade_port": "facade",
}


def port_in_use(setting: str, port: int) -> PortInUse:
    """The error for a port setting (`node_port`, ...) whose port is taken, naming its flag."""
    return PortInUse(port, PORTS[setting], "--" + setting.replace("_", "-"))


def load_config(home: Path, overrides: Mapping[str, Any]) -> AgentConfig:
    """Read `home/nvpair.toml` (if present), apply non-None `overrides`, check everything."""
    path = home / "nvpair.toml"
    data: dict[str, Any] = {}
    _refuse(shared_home_problem(home))
    if path.exists():
        _refuse(shared_file_problem(path, holds_secret=None))
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
    agent = data.get("agent", {})
    flags = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(agent, dict) and flags:
        data["agent"] = {**agent, **flags}
    try:
        parsed = msgspec.convert(data, _File)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_name_the_key(str(exc))}") from None
    table = parsed.agent
    if table.api_keys or parsed.plane:
        secret = "API keys" if table.api_keys else "a plane token"
        _refuse(shared_file_problem(path, holds_secret=secret))
    if table.simulate_gpus:
        _check_simulation(path, table.simulate_gpus)
    try:
        advertise_host, advertise_ports = parse_advertise(table.advertise)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    plane = parsed.plane or _joined_plane(home)
    try:
        credentials = credentials_by_url(home, table.engines)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if plane is not None:
        ca = None if plane.ca is None else str(home / plane.ca)  # relative to NVPAIR_HOME
        plane = msgspec.structs.replace(plane, url=plane.url.rstrip("/"), ca=ca)
    return AgentConfig(
        home=home,
        name=table.name or socket.gethostname(),
        advertise_host=advertise_host,
        advertise_ports=advertise_ports,
        manager_port=table.manager_port,
        node_port=table.node_port,
        api_port=table.api_port,
        facade_port=table.facade_port,
        simulate_gpus=table.simulate_gpus,
        log_level=table.log_level,
        log_format=table.log_format,
        heartbeat_s=float(table.heartbeat_s),
        job_retention_h=float(table.job_retention_h),
        engines=tuple((e.name, e.kind, e.url) for e in _engines(path, table.engines)),
        engine_credentials=credentials,
        api_keys=tuple(table.api_keys.items()),
        queue_limit=table.queue_limit,
        wait=(table.wait_queue, float(table.wait_timeout_s)),
        facade_bind=table.facade_bind,
        anti_entropy_s=float(table.anti_entropy_s),
        dial_from=_ip_address(path, "dial_from", table.dial_from),
        plane=plane,
        launch=_launch_settings(path, parsed),
        artifacts=parsed.artifacts,
        routing=parsed.routing,
        tracing=_tracing(path, parsed.tracing),
    )


def _tracing(path: Path, table: TracingTable) -> TracingTable:
    endpoint = table.otlp_endpoint
    if endpoint is not None and not re.match(r"https?://[^/\s]+", endpoint):
        raise ConfigError(
            f"{path}: tracing.otlp_endpoint: an http:// or https:// URL "
            f"(http://collector:4318/v1/traces), not {endpoint[:64]!r}"
        )
    return table


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise ConfigError(problem)


def _launch_settings(path: Path, parsed: _File) -> LaunchSettings:
    try:
        return launch_settings(parsed.engines, parsed.templates)
    except TemplateError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _ip_address(path: Path, key: str, value: str | None) -> str | None:
    # An address of this host to bind outgoing connections to: a literal IP, not a name.
    if value is None:
        return None
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ConfigError(f"{path}: agent.{key} must be an IP address, not {value!r}") from None


_AT: Final = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN: Final = re.compile(r"^Object contains unknown field `([^`]+)`$")


def _name_the_key(message: str) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.agent.node_port`"; say the key first.
    match = _AT.search(message)
    where = match.group(1) if match else ""
    what = message[: match.start()] if match else message
    unknown = _UNKNOWN.match(what)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"unknown setting {key}" if where else f"unknown table [{key}]"
    if re.fullmatch(r"agent\.[a-z_]+_port", where):
        return f"{where} must be a port number: {what}"
    return f"{where}: {what}" if where else what


def _check_simulation(path: Path, spec: str) -> None:
    try:
        classes = parse_simulation(spec)
    except ValueError as exc:
        raise ConfigError(f"agent.simulate_gpus: {exc}") from None
    for cls, _ in classes:
        if not known_device_class(cls):
            raise ConfigError(
                f"agent.simulate_gpus: unknown device class {cls!r} "
                "(for example h100-80gb-sxm, h200-141gb-sxm, a100-80gb-sxm, l40s, l4)"
            )


def _engines(path: Path, raw: list[str | EngineTable]) -> list[EngineSpec]:
    # [[agent.engines]] tables, or "KIND=URL" strings from --engine.
    result = []
    for n, item in enumerate(raw):
        if isinstance(item, str):
            kind, sep, url = item.partition("=")
            name = f"{kind}-{n}"
        else:
            kind, url, sep = item.kind, item.url, "="
            name = item.name or f"{kind}-{n}"
        if not sep or kind not in ENGINE_KINDS or not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{path}: agent.engines[{n}] {item!r}: kind is one of {', '.join(ENGINE_KINDS)} "
                "and the URL starts with http:// or https://"
            )
        result.append(EngineSpec(name, kind, url.rstrip("/")))
    return result


def _joined_plane(home: Path) -> PlaneSettings | None:
    # Written by `nvpair plane join`; the toml's [plane] table wins when both exist.
    path = home / "plane.json"
    if not path.exists():
        return None
    _refuse(shared_file_problem(path, holds_secret="a plane token"))
    try:
        return msgspec.json.decode(path.read_bytes(), type=PlaneSettings)
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def plane_settings(home: Path) -> tuple[str, str] | None:
    """(url, token) from `nvpair.toml` or `plane.json`; None when neither says."""
    plane = load_config(home, {}).plane
    return (plane.url, plane.token) if plane else None
