"""The replicas this node runs (or watches), and its facade's address, added to each plane
sync batch (`SyncBatch.replicas`, `SyncBatch.facadeUrl`): a `plane_reports.Reporter`.

The replicas come from the node's own record, as the members see them -- the whole current
set, so a replica missing from it is gone in the plane too -- with each one's devices and
allocation, and for an observed replica the drift its watcher saw (`agent.engines.observed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from facts.records import NodeRecord
from plane.desired.state import ReplicaReport

__all__ = ["ReplicaReporter", "facade_url"]

log = logging.getLogger(__name__)


def facade_url(record: NodeRecord) -> str:
    """`http://<first address>:<facadePort>`, or "" with no address."""
    if not record.addresses or not record.facadePort:
        return ""
    host = record.addresses[0]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{record.facadePort}"


class ReplicaReporter:
    """`replicas` and `facadeUrl` for each batch; `drifts` gives the observed replicas'."""

    def __init__(self, drifts: Callable[[], dict[str, str]] = dict) -> None:
        self._drifts = drifts

    def fields(self, record: NodeRecord) -> dict[str, Any]:
        """The batch's `replicas` and `facadeUrl` from this node's own record."""
        drifts = self._drifts()
        replicas = []
        for r in record.replicas:
            try:
                replicas.append(
                    msgspec.convert(
                        {
                            "id": r.id,
                            "deploymentId": r.deploymentId,
                            "deployment": r.deployment,
                            "state": r.state,
                            "engineVersion": r.engineVersion,
                            "devices": r.devices,
                            "allocation": r.allocation,
                            "drift": drifts.get(r.id, "")[:256],
                        },
                        ReplicaReport,
                    )
                )
            except msgspec.ValidationError as exc:  # one odd replica must not stop the sync
                log.warning("replica %s not reported to the plane: %s", r.id, exc)
        return {"replicas": replicas, "facadeUrl": facade_url(record)}

    def sent(self) -> None:
        """Nothing to drop: every batch says the whole current set."""
