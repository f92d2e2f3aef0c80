"""GPU inventory types: what a node record says about a node's devices and domains.

They live in `broker` (node records are the broker's) and are filled by `agent.engines.gpus`
(discovery is the agent's), so the dependency points agent -> broker as DESIGN.md says.
"""

from __future__ import annotations

import msgspec

__all__ = ["Device", "GpuInventory", "TopologyDomain"]


class Device(msgspec.Struct, kw_only=True, frozen=True):
    """One GPU as the node record carries it."""

    id: str
    uuid: str
    index: int
    name: str
    deviceClass: str
    memoryTotal: int  # bytes
    memoryUsed: int
    memoryFree: int
    utilization: int | None  # percent, None when NVML cannot say
    temperatureC: int | None
    powerW: float | None
    eccUncorrected: int | None
    health: str  # "ok", "degraded" or "failed"
    problem: str | None = None
    domainId: str | None = None


class TopologyDomain(msgspec.Struct, kw_only=True, frozen=True):
    """A set of devices that can form one tensor-parallel group."""

    id: str
    kind: str  # "nvlink-fabric", "nvlink" or "pcie"
    devices: list[str]  # device ids
    label: str  # the clique, the NVLink group or the NUMA node, for people


class GpuInventory(msgspec.Struct, kw_only=True, frozen=True):
    """What a node has: devices, domains, and why there are none when there are none."""

    devices: list[Device] = []
    domains: list[TopologyDomain] = []
    driver: str | None = None
    simulated: bool = False
    reason: str | None = None  # set when devices is empty or NVML failed
