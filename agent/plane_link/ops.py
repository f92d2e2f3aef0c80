"""Plane operations carried out by this node (docs/plane-operations.md).

The plane lists, in each cluster's desired state, the drains, cordons and uncordons of that
cluster's nodes until each is final. The node an operation targets starts it, once, with
its own `Operations` machinery -- under the plane's id, requester `plane:<requester>`, the
reason, force and timeout -- so it shows in `nvpair ops` like any other; every other node
leaves it alone. The ids started are kept (bounded) in `$NVPAIR_HOME/plane-operations.json`
with the last phase seen, so an agent that restarts does not run one twice; one that was
still running when the agent stopped is reported failed ("interrupted").

As a sync reporter, `PlaneOps` sends each operation's phase and result whenever it changed,
until a batch carrying the final one was accepted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from agent.cluster.operations import KINDS, OperationRefused, Operations
from certs import write_atomic
from facts.records import NodeRecord
from plane.desired.state import DesiredState, OperationReport

__all__ = ["MAX_KEPT", "STATE_FILE", "PlaneOps"]

log = logging.getLogger(__name__)

STATE_FILE: Final = "plane-operations.json"
MAX_KEPT: Final = 256  # ids remembered; the oldest reported-final ones are forgotten first
_FINAL: Final = ("succeeded", "failed")
INTERRUPTED: Final = "interrupted: the agent stopped while it ran"


@dataclass
class _Seen:
    phase: str
    result: str
    acked: bool = False  # the plane accepted a batch carrying this phase and result


class PlaneOps:
    """The `on_desired` handler that starts this node's plane operations, and the reporter
    of their phases."""

    def __init__(self, operations: Operations, *, self_id: str, home: Path) -> None:
        self._operations = operations
        self._self_id = self_id
        self._path = home / STATE_FILE
        self._seen = self._load()
        self._in_flight: dict[str, tuple[str, str]] = {}

    def _load(self) -> dict[str, _Seen]:
        try:
            held = json.loads(self._path.read_bytes())
            if held.get("node") != self._self_id:
                return {}  # a home that was another node's: its operations are not ours
            rows = held["operations"]
            return {str(r[0]): _Seen(str(r[1]), str(r[2]), bool(r[3])) for r in rows}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            log.warning("%s unreadable (%s): plane operations start afresh", self._path, exc)
            return {}

    def _save(self) -> None:
        while len(self._seen) > MAX_KEPT:
            done = [k for k, s in self._seen.items() if s.acked and s.phase in _FINAL]
            del self._seen[done[0] if done else next(iter(self._seen))]
        rows = [[k, s.phase, s.result, s.acked] for k, s in self._seen.items()]
        held = {"node": self._self_id, "operations": rows}
        try:
            write_atomic(self._path, json.dumps(held).encode())
        except OSError as exc:  # the operation still runs; only a restart could repeat it
            log.warning("could not write %s: %s", self._path, exc)

    async def on_desired(self, state: DesiredState) -> None:
        """Start each operation that targets this node and was never started here."""
        started = False
        for op in state.operations:
            if op.kind not in KINDS or op.target != self._self_id or op.id in self._seen:
                continue
            if self._operations.get(op.id) is not None:
                continue  # running still, though forgotten here (past MAX_KEPT)
            try:
                self._operations.start(
                    op.kind,
                    op.target,
                    reason=op.reason,
                    timeout_s=op.timeoutS,
                    force=op.force,
                    requester=f"plane:{op.requester}"[:256],
                    op_id=op.id,
                )
                self._seen[op.id] = _Seen("pending", "")
            except OperationRefused as exc:
                self._seen[op.id] = _Seen("failed", str(exc)[:256])
            log.info("plane operation %s: %s of %s", op.id, op.kind, op.target)
            started = True
        if started:
            self._save()  # before it can finish: a restart from here on never repeats it

    def _now(self, op_id: str, seen: _Seen) -> tuple[str, str]:
        op = self._operations.get(op_id)
        if op is not None:
            return op.phase.value, (op.result or "")[:256]
        if seen.phase in _FINAL:
            return seen.phase, seen.result
        return "failed", INTERRUPTED  # started by an agent that stopped before it ended

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """Each operation whose phase or result the plane has not accepted yet."""
        changed = False
        reports = []
        for op_id, seen in self._seen.items():
            phase, result = self._now(op_id, seen)
            if (phase, result) != (seen.phase, seen.result):
                seen.phase, seen.result, seen.acked = phase, result, False
                changed = True
            if not seen.acked and phase != "pending":
                reports.append(OperationReport(id=op_id, phase=phase, result=result))  # type: ignore[arg-type]
        if changed:
            self._save()
        self._in_flight = {r.id: (r.phase, r.result) for r in reports[:1024]}
        return {"operations": reports[:1024]} if reports else {}

    def sent(self) -> None:
        """The plane has what the last batch carried."""
        acked = False
        for op_id, sent in self._in_flight.items():
            seen = self._seen.get(op_id)
            if seen is not None and (seen.phase, seen.result) == sent:
                seen.acked = acked = True
        self._in_flight = {}
        if acked:
            self._save()
