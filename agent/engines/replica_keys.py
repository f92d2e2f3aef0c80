"""The API key of a managed replica's engine, from its deployment's `engineKey`.

`generate`: a fresh key per replica; `file:PATH`: the key in PATH (relative to NVPAIR_HOME
on the node that runs the replica, readable by its owner only). The key is kept with the
replica's allocation and process record (`allocations.json`, `proc.json`: 0600, under the
0700 home), handed to the engine as its template says (templates.py), and added to every
call this node makes to it (`EngineAuth`); it is never in a record, an event or a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, Protocol

from agent.engines.auth import credentials_from, new_engine_key
from agent.engines.proc_state import ReplicaStatus
from facts.deployments import MAX_DEPLOYMENTS, Deployment

__all__ = ["engine_key", "managed_keys"]

log = logging.getLogger(__name__)
_said: Final[dict[str, str]] = {}  # deployment -> the key problem last logged (log once)


class _Keyed(Protocol):
    @property
    def replica(self) -> str: ...
    @property
    def apiKey(self) -> str: ...  # the allocation's field, as stored


def engine_key(deployment: Deployment, home: Path) -> str | None:
    """The key a new replica of `deployment` starts with ("" none); None when its key file
    cannot be used (said once in the log for each reason, not every round)."""
    reference = deployment.engineKey
    if not reference:
        return ""
    if reference == "generate":
        return new_engine_key()
    try:
        found = credentials_from(home, reference.removeprefix("file:"), {})
    except ValueError as exc:
        if _said.get(deployment.name) != str(exc):
            log.warning("cannot start a replica of %s: %s", deployment.name, exc)
            if len(_said) >= MAX_DEPLOYMENTS:
                _said.clear()
            _said[deployment.name] = str(exc)
        return None
    _said.pop(deployment.name, None)
    return found.api_key if found is not None else ""


def managed_keys(
    allocations: Iterable[_Keyed], running: Iterable[ReplicaStatus]
) -> Mapping[str, str]:
    """Engine URL -> key of every replica that runs here with one."""
    urls = {s.replica_id: s.url for s in running if s.port}
    return {urls[a.replica]: a.apiKey for a in allocations if a.apiKey and a.replica in urls}
