"""The `[engines]` and `[templates.NAME]` tables of nvpair.toml (docs/engines.md).

    [engines]
    port_range = "18000-18999"          # each replica's port comes from here
    stop_grace_s = 30.0                 # SIGTERM, then SIGKILL after this long
    ready_timeout_s = { vllm = 1200 }   # per template; built-ins 600 s, mock 30 s
    trusted_network = false             # engines' own traffic (NCCL, Ray) may cross it

    [templates.mine]
    argv = ["my-server", "--model", "{model}", "--port", "{port}", "--tp", "{tp}"]
    env = { MY_FLAG = "1" }
    ready = "/v1/models"                # GET answering 200 means ready (asked without a key)
    ready_timeout_s = 900
    api_key_env = "MY_API_KEY"          # a replica's API key reaches it here (or api_key_flag)

A bad table is refused when the configuration loads (`TemplateError`, which `load_config`
turns into a `ConfigError` naming the file), never when a replica is launched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from agent.engines.templates import (
    BUILTIN_TEMPLATES,
    REAL_ENGINE_READY_S,
    LaunchTemplate,
    custom_template,
)
from agent.engines.templates import TemplateError as TemplateError

__all__ = [
    "EngineSpec",
    "EnginesTable",
    "LaunchSettings",
    "TemplateTable",
    "launch_settings",
    "parse_port_range",
]

_Name = Annotated[str, Meta(min_length=1, max_length=64)]
_Seconds = Annotated[float, Meta(gt=0, le=86_400)]


class EnginesTable(Struct, forbid_unknown_fields=True, frozen=True):
    """`[engines]` as written."""

    port_range: Annotated[str, Meta(max_length=32)] = "18000-18999"
    stop_grace_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    ready_timeout_s: Annotated[dict[_Name, _Seconds], Meta(max_length=256)] = {}
    # A replica across members whose engine talks over the network itself (SGLang's and
    # vLLM's NCCL, Ray) runs only where the owner says that network is theirs (issue 32).
    trusted_network: bool = False


class TemplateTable(Struct, forbid_unknown_fields=True, frozen=True):
    """One `[templates.NAME]` as written."""

    argv: Annotated[list[str], Meta(max_length=256)]
    env: Annotated[dict[str, str], Meta(max_length=64)] = {}
    ready: Annotated[str, Meta(max_length=1024)] = "/v1/models"
    ready_timeout_s: _Seconds | None = None
    api_key_env: Annotated[str, Meta(max_length=128)] = ""  # how a replica's key reaches it
    api_key_flag: Annotated[str, Meta(max_length=66)] = ""


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """What the engine supervisor needs from the configuration, checked."""

    templates: tuple[LaunchTemplate, ...] = tuple(BUILTIN_TEMPLATES.values())
    port_range: tuple[int, int] = (18000, 18999)
    stop_grace_s: float = 30.0
    trusted_network: bool = False

    def template_map(self) -> dict[str, LaunchTemplate]:
        """Templates by name, as `EngineSupervisor` takes them."""
        return {t.name: t for t in self.templates}


def launch_settings(engines: EnginesTable, tables: Mapping[str, object]) -> LaunchSettings:
    """Built-ins, then `[templates.NAME]`, then the `ready_timeout_s` overrides."""
    result = dict(BUILTIN_TEMPLATES)
    for name, raw in tables.items():
        table = _template_table(name, raw)
        timeout = table.ready_timeout_s or REAL_ENGINE_READY_S
        result[name] = custom_template(
            name,
            table.argv,
            table.env,
            table.ready,
            timeout,
            key_env=table.api_key_env,
            key_flag=table.api_key_flag,
        )
    for name, seconds in engines.ready_timeout_s.items():
        if name not in result:
            raise TemplateError(f"engines.ready_timeout_s.{name}: there is no template {name!r}")
        result[name] = dataclasses.replace(result[name], ready_timeout_s=float(seconds))
    return LaunchSettings(
        templates=tuple(result.values()),
        port_range=parse_port_range(engines.port_range),
        stop_grace_s=float(engines.stop_grace_s),
        trusted_network=engines.trusted_network,
    )


def _template_table(name: str, raw: object) -> TemplateTable:
    # One table at a time, so a mistake is reported as [templates.NAME], not templates[...].
    try:
        return msgspec.convert(raw, TemplateTable)
    except msgspec.ValidationError as exc:
        what, _, where = str(exc).partition(" - at `$")
        key = where.strip("`.")
        if what.startswith("Object contains unknown field"):
            what, key = "unknown setting", what.rpartition(" ")[2].strip("`")
        raise TemplateError(f"[templates.{name}]: {key + ': ' if key else ''}{what}") from None


def parse_port_range(text: str) -> tuple[int, int]:
    """`engines.port_range`: "LOW-HIGH" with 1024 <= LOW <= HIGH <= 65535."""
    low, dash, high = text.strip().partition("-")
    low, high = low.strip(), high.strip()
    if dash and low.isdigit() and high.isdigit() and 1024 <= int(low) <= int(high) <= 65535:
        return int(low), int(high)
    raise TemplateError(
        f'engines.port_range is "LOW-HIGH" with 1024 <= LOW <= HIGH <= 65535, not {text[:80]!r}'
    )


class EngineSpec(Struct, frozen=True):
    """A model server this node routes to: `(name, kind, url)`."""

    name: str
    kind: str
    url: str
