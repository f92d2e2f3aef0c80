"""Agent configuration: `$NVPAIR_HOME/nvpair.toml`, overridden by flags.

[agent]
name = "gpu-a"              # default: the host name
advertise = "10.0.0.5"      # the address peers use; default: 127.0.0.1
manager_port = 14320
node_port = 14321
api_port = 14322            # local API, loopback only
facade_port = 14323
simulate_gpus = "h100-80gb-sxm:8,l4:2"
log_level = "info"
heartbeat_s = 2.0
job_retention_h = 168
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["AgentConfig", "ConfigError", "load_config", "nvpair_home"]


class ConfigError(ValueError):
    """The configuration file or a flag is wrong; the message says which and why."""


def nvpair_home(environ: dict[str, str] | None = None) -> Path:
    """`NVPAIR_HOME`, default `~/.nvpair`."""
    env = os.environ if environ is None else environ
    return Path(env.get("NVPAIR_HOME") or Path("~/.nvpair").expanduser())


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything `nvpair agent run` needs."""

    home: Path
    name: str = dataclasses.field(default_factory=socket.gethostname)
    advertise: str = "127.0.0.1"
    manager_port: int = 14320
    node_port: int = 14321
    api_port: int = 14322
    facade_port: int = 14323
    simulate_gpus: str | None = None
    log_level: str = "info"
    heartbeat_s: float = 2.0
    job_retention_h: float = 168.0
    engines: tuple[tuple[str, str, str], ...] = ()  # (name, kind, base URL)
    api_keys: tuple[tuple[str, str], ...] = ()  # (requester name, key)
    queue_limit: int = 32  # pending jobs per node beyond which it takes no more
    facade_bind: str | None = None  # default: NVPAIR_BIND, else every interface

    @property
    def cluster_dir(self) -> Path:
        return self.home / "cluster"

    @property
    def jobs_db(self) -> Path:
        return self.home / "jobs.db"

    @property
    def state_file(self) -> Path:
        """Where the running agent records its local API address for the CLI."""
        return self.home / "agent.json"


_FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig) if f.name != "home"}


def load_config(home: Path, overrides: dict[str, Any]) -> AgentConfig:
    """Read `home/nvpair.toml` (if present) and apply non-None `overrides`."""
    values: dict[str, Any] = {}
    path = home / "nvpair.toml"
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        section = data.get("agent", {})
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: [agent] must be a table")
        for key, value in section.items():
            if key not in _FIELDS:
                raise ConfigError(f"{path}: unknown setting agent.{key}")
            values[key] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["engines"] = _engines(values.get("engines", ()))
    keys = values.get("api_keys", {})
    if isinstance(keys, dict):
        values["api_keys"] = tuple((str(name), str(key)) for name, key in keys.items())
    for key, value in values.items():
        expected = _FIELDS[key].type
        if key.endswith("_port") and (not isinstance(value, int) or not 0 <= value <= 65535):
            raise ConfigError(f"agent.{key} must be a port number, got {value!r}")
        if expected in ("float",) and not isinstance(value, int | float):
            raise ConfigError(f"agent.{key} must be a number, got {value!r}")
    if values.get("log_level", "info") not in ("error", "warn", "info", "debug"):
        raise ConfigError("agent.log_level is one of error, warn, info, debug")
    return AgentConfig(home=home, **values)


ENGINE_KINDS = ("vllm", "sglang", "llamacpp", "ollama", "openai")


def _engines(raw: Any) -> tuple[tuple[str, str, str], ...]:
    # [[agent.engines]] tables, or "KIND=URL" strings from --engine.
    result = []
    for n, item in enumerate(raw):
        if isinstance(item, str):
            kind, sep, url = item.partition("=")
            name = f"{kind}-{n}"
        elif isinstance(item, dict):
            kind, url, sep = str(item.get("kind", "")), str(item.get("url", "")), "="
            name = str(item.get("name") or f"{kind}-{n}")
        else:
            raise ConfigError(f"an engine is KIND=URL or a table, got {item!r}")
        if not sep or kind not in ENGINE_KINDS or not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"engine {item!r}: kind is one of {', '.join(ENGINE_KINDS)} and the URL "
                "starts with http:// or https://"
            )
        result.append((name, kind, url.rstrip("/")))
    return tuple(result)
