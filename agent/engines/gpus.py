"""GPU discovery through NVML (the `pynvml` module of `nvidia-ml-py`), and simulated GPUs.

`discover()` reports, per device: UUID, name, a device class such as `h100-80gb-sxm`, memory
total / used / free, utilisation, temperature, power, ECC state and a health verdict; and
the topology domains the devices fall into -- an NVLink fabric clique where NVML reports
`clusterUuid` / `cliqueId`, else groups of devices joined by active NVLinks, else one PCIe
domain per NUMA node. A machine without NVML or without a GPU reports zero devices and one
clear reason; a device that errors is reported as failed, and the others still are.

Ids are stable: `dev_` / `tpd_` + 26 lowercase Crockford base32 characters derived from the
node id and the device UUID (or the domain's members), so the same GPU keeps its id across
restarts and the ids have the shape of every other Wingsmith id.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import logging
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import msgspec

from facts.inventory import Device, GpuInventory, TopologyDomain

__all__ = [
    "Device",
    "GpuInventory",
    "TopologyDomain",
    "device_class",
    "discover",
    "node_inventory",
    "parse_simulation",
    "simulate",
]

log = logging.getLogger(__name__)

_CROCKFORD: Final = "0123456789abcdefghjkmnpqrstvwxyz"
_GIB: Final = 1024**3


def stable_id(prefix: str, *parts: str) -> str:
    """`prefix_` + 26 Crockford base32 characters from a hash of `parts`."""
    digest = int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:17], "big")
    chars = []
    for _ in range(26):
        digest, value = divmod(digest, 32)
        chars.append(_CROCKFORD[value])
    return f"{prefix}_{''.join(chars)}"


_MODEL: Final = re.compile(
    r"\b(gb200|b200|b100|h200|h100|h800|h20|gh200|a100|a800|a40|a30|a10g?|l40s?|l4|t4|v100|"
    r"rtx\s?pro\s?\d{4}|rtx\s?\d{4}\w*|rtx\s?a\d{4})\b",
    re.IGNORECASE,
)


def device_class(name: str, memory_total: int) -> str:
    """A class like `h100-80gb-sxm` from NVML's name and the memory size."""
    match = _MODEL.search(name)
    model = re.sub(r"\s+", "", match.group(1)).lower() if match else _slug(name)
    gib = round(memory_total / _GIB)
    # Marketed sizes: 80 GB shows as ~79.6 GiB, 141 GB as ~139.8 GiB.
    sizes = (8, 12, 16, 24, 32, 40, 48, 80, 94, 96, 141, 180, 192)
    marketed = min(sizes, key=lambda size: abs(size - gib)) if gib else 0
    parts = [model, f"{marketed}gb"] if marketed else [model]
    lowered = name.lower()
    if "pcie" in lowered:
        parts.append("pcie")
    elif "nvl" in lowered.split():
        parts.append("nvl")
    elif "sxm" in lowered or "hbm" in lowered:
        parts.append("sxm")
    return "-".join(parts)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"


def discover(node_id: str, *, load: Callable[[], ModuleType] | None = None) -> GpuInventory:
    """Ask NVML; never raises. Zero devices with a `reason` when there is no NVML or GPU."""
    try:
        nvml = (load or (lambda: importlib.import_module("pynvml")))()
    except ImportError as exc:
        return GpuInventory(reason=f"pynvml is not installed ({exc})")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return GpuInventory(reason=f"NVML unavailable: {_describe(exc)}")
    try:
        return _inventory(nvml, node_id)
    except Exception as exc:
        return GpuInventory(reason=f"NVML failed: {_describe(exc)}")
    finally:
        with contextlib.suppress(Exception):  # shutting down a library that may have failed
            nvml.nvmlShutdown()


def node_inventory(node_id: str, simulation: str | None) -> GpuInventory:
    """This node's GPUs at start: simulated ones, else NVML's. A node without any still
    starts, and serves what needs no GPU (`--engine` engines, deployments with `gpus: 0`)."""
    gpus = simulate(simulation, node_id) if simulation else discover(node_id)
    if not gpus.devices:
        log.info("no GPU on this node (%s): it serves work that needs none", gpus.reason)
    return gpus


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _inventory(nvml: Any, node_id: str) -> GpuInventory:
    driver = _try(lambda: _text(nvml.nvmlSystemGetDriverVersion()))
    count = nvml.nvmlDeviceGetCount()
    probes = [_probe(nvml, node_id, index) for index in range(count)]
    domains = _domains(nvml, node_id, probes)
    membership = {dev: domain.id for domain in domains for dev in domain.devices}
    devices = [
        msgspec.structs.replace(probe.device, domainId=membership.get(probe.device.id))
        for probe in probes
    ]
    reason = None if devices else "NVML reports no GPU"
    return GpuInventory(devices=devices, domains=domains, driver=driver, reason=reason)


class _Probe(msgspec.Struct):
    device: Device
    handle: Any
    bus_id: str | None
    numa: int | None


def _probe(nvml: Any, node_id: str, index: int) -> _Probe:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        name = _text(nvml.nvmlDeviceGetName(handle))
    except Exception as exc:
        dev = Device(
            id=stable_id("dev", node_id, f"index-{index}"),
            uuid=f"unknown-{index}",
            index=index,
            name="unknown",
            deviceClass="unknown",
            memoryTotal=0,
            memoryUsed=0,
            memoryFree=0,
            utilization=None,
            temperatureC=None,
            powerW=None,
            eccUncorrected=None,
            health="failed",
            problem=_describe(exc),
        )
        return _Probe(dev, None, None, None)
    problems: list[str] = []
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        total, used, free = int(memory.total), int(memory.used), int(memory.free)
    except Exception as exc:
        problems.append(f"memory: {_describe(exc)}")
        total = used = free = 0
    utilization = _try(lambda: int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    temperature = _try(
        lambda: int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    )
    power = _try(lambda: round(nvml.nvmlDeviceGetPowerUsage(handle) / 1000, 1))
    ecc = _try(
        lambda: int(
            nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
        )
    )
    pending_retire = _try(lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)))
    health = "ok"
    if problems:
        health = "failed"
    elif ecc or pending_retire:
        health = "degraded"
        problems.append(
            f"{ecc} uncorrected ECC errors" if ecc else "retired memory pages pending a reset"
        )
    dev = Device(
        id=stable_id("dev", node_id, uuid),
        uuid=uuid,
        index=index,
        name=name,
        deviceClass=device_class(name, total),
        memoryTotal=total,
        memoryUsed=used,
        memoryFree=free,
        utilization=utilization,
        temperatureC=temperature,
        powerW=power,
        eccUncorrected=ecc,
        health=health,
        problem="; ".join(problems) or None,
    )
    bus_id = _try(lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId).lower())
    numa = _try(lambda: int(nvml.nvmlDeviceGetNumaNodeId(handle)))
    return _Probe(dev, handle, bus_id, numa)


def _domains(nvml: Any, node_id: str, probes: list[_Probe]) -> list[TopologyDomain]:
    usable = [p for p in probes if p.handle is not None]
    cliques: dict[str, list[str]] = {}
    for probe in usable:
        clique = _fabric_clique(nvml, probe.handle)
        if clique is None:
            break
        cliques.setdefault(clique, []).append(probe.device.id)
    else:
        if cliques:
            return [
                TopologyDomain(
                    id=stable_id("tpd", node_id, *devs),
                    kind="nvlink-fabric",
                    devices=devs,
                    label=f"clique {clique}",
                )
                for clique, devs in sorted(cliques.items())
            ]
    groups = _nvlink_groups(nvml, usable)
    if any(len(group) > 1 for group in groups):
        return [
            TopologyDomain(
                id=stable_id("tpd", node_id, *group),
                kind="nvlink",
                devices=group,
                label=f"nvlink group {n}",
            )
            for n, group in enumerate(groups)
        ]
    by_numa: dict[int | None, list[str]] = {}
    for probe in usable:
        by_numa.setdefault(probe.numa, []).append(probe.device.id)
    return [
        TopologyDomain(
            id=stable_id("tpd", node_id, *devs),
            kind="pcie",
            devices=devs,
            label=f"numa {numa}" if numa is not None else "pcie",
        )
        for numa, devs in sorted(by_numa.items(), key=lambda item: (item[0] is None, item[0] or 0))
    ]


def _fabric_clique(nvml: Any, handle: Any) -> str | None:
    try:
        info = nvml.c_nvmlGpuFabricInfo_t()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except Exception:
        return None
    if info.state != nvml.NVML_GPU_FABRIC_STATE_COMPLETED:
        return None
    cluster = bytes(info.clusterUuid).hex()
    if not any(bytes(info.clusterUuid)):
        return None
    return f"{cluster}/{info.cliqueId}"


def _nvlink_groups(nvml: Any, probes: list[_Probe]) -> list[list[str]]:
    # Union-find over active NVLinks, matching each link's remote PCI bus id to a device.
    by_bus = {p.bus_id: p.device.id for p in probes if p.bus_id}
    parent = {p.device.id: p.device.id for p in probes}

    def root(dev: str) -> str:
        while parent[dev] != dev:
            parent[dev] = parent[parent[dev]]
            dev = parent[dev]
        return dev

    links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for probe in probes:
        for link in range(links):
            try:
                if not nvml.nvmlDeviceGetNvLinkState(probe.handle, link):
                    continue
                remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(probe.handle, link).busId)
            except Exception:
                continue  # no such link, or NVLink not supported
            peer = by_bus.get(remote.lower())
            if peer is not None:
                parent[root(peer)] = root(probe.device.id)
    groups: dict[str, list[str]] = {}
    for probe in probes:
        groups.setdefault(root(probe.device.id), []).append(probe.device.id)
    return list(groups.values())


def _try(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- simulation ------------------------------------------------------------------------------

_SIMULATED_MEMORY: Final = {
    "h100-80gb-sxm": 80,
    "h200-141gb-sxm": 141,
    "a100-80gb-sxm": 80,
    "l4": 24,
    "l40s": 48,
    "a10g": 24,
    "rtx-4090": 24,
}


def known_device_class(cls: str) -> bool:
    """Whether `cls` is a class `device_class()` produces (`h100-80gb-sxm`, `l4`) or a
    simulated one."""
    if cls in _SIMULATED_MEMORY:
        return True
    match = _MODEL.match(cls)
    rest = cls[match.end() :] if match else ""
    return match is not None and re.fullmatch(r"(-\d{1,3}gb)?(-(pcie|nvl|sxm))?", rest) is not None


def parse_simulation(spec: str) -> list[tuple[str, int]]:
    """`"h100-80gb-sxm:8,l4:2"` -> `[("h100-80gb-sxm", 8), ("l4", 2)]`; ValueError if bad."""
    result: list[tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        cls, sep, count = part.partition(":")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", cls) or (sep and not count.isdigit()):
            raise ValueError(f"not CLASS[:COUNT]: {part!r} (for example h100-80gb-sxm:8,l4:2)")
        number = int(count) if sep else 1
        if not 1 <= number <= 64:
            raise ValueError(f"between 1 and 64 devices per class: {part!r}")
        result.append((cls, number))
    return result


def simulate(spec: str, node_id: str) -> GpuInventory:
    """Pretend devices for demos and tests; SXM classes share one NVLink domain."""
    devices: list[Device] = []
    domains: list[TopologyDomain] = []
    index = 0
    for cls, count in parse_simulation(spec):
        gib = _SIMULATED_MEMORY.get(cls) or _size_in(cls) or 16
        ids = []
        for _ in range(count):
            uuid = f"GPU-sim-{node_id}-{index}"
            dev_id = stable_id("dev", node_id, uuid)
            ids.append(dev_id)
            devices.append(
                Device(
                    id=dev_id,
                    uuid=uuid,
                    index=index,
                    name=f"Simulated {cls}",
                    deviceClass=cls,
                    memoryTotal=gib * _GIB,
                    memoryUsed=0,
                    memoryFree=gib * _GIB,
                    utilization=0,
                    temperatureC=35,
                    powerW=60.0,
                    eccUncorrected=0,
                    health="ok",
                )
            )
            index += 1
        kind = "nvlink" if cls.endswith("-sxm") else "pcie"
        domains.append(
            TopologyDomain(
                id=stable_id("tpd", node_id, *ids), kind=kind, devices=ids, label=f"simulated {cls}"
            )
        )
    membership = {dev: d.id for d in domains for dev in d.devices}
    devices = [msgspec.structs.replace(d, domainId=membership[d.id]) for d in devices]
    return GpuInventory(
        devices=devices,
        domains=domains,
        simulated=True,
        reason=None if devices else "no simulated GPU",
    )


def _size_in(cls: str) -> int | None:
    match = re.search(r"(\d+)gb", cls)
    return int(match.group(1)) if match else None
